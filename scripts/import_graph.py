#!/usr/bin/env python3
"""The first-party import graph of the repository, checked against a declared layer order.

Standard library only: every ``.py`` file under the package roots (``ROOTS``) is parsed with ``ast``
(nothing is imported or run). Each ``import`` / ``from ... import`` that names a first-party module
becomes an edge ``importer -> imported``, marked ``module`` (runs at import time: module body, class
bodies, ``if`` / ``try`` blocks) or ``function`` (inside a ``def``: runs when the function is called).
Imports under ``if TYPE_CHECKING:`` are marked ``typing`` and left out of the checks. An edge goes to the
module the statement names (``from a.b import c`` goes to ``a.b.c`` when that is a module, else to
``a.b``); the implicit imports of parent packages' ``__init__`` are not edges.

Printed:
  (a) import cycles: strongly connected components of the graph (module and function edges), each with
      its edges and their file:line;
  (b) upward edges: a module importing a module of a higher layer of ``LAYERS``;
  (c) function-level first-party imports (the usual way a cycle is dodged);
  (d) a one-line summary.

Usage: ``python scripts/import_graph.py [--root DIR] [--check]``; ``--check`` exits 1 when there is a
cycle or an upward edge.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# Import name of a package root -> its directory, relative to the repository root. A file belongs to the
# root with the longest matching directory, so kernels/ddtree_kernels/x.py is `ddtree_kernels.x`.
ROOTS = {
    "ddtree_jax": "ddtree_jax",
    "kernels": "kernels",
    "ddtree_kernels": "kernels/ddtree_kernels",
    "benchmarks": "benchmarks",
    "experiments": "experiments",
}

# The layer order, bottom first. A module may import modules of its own layer or of a lower one. A
# module's layer is that of the longest prefix matching it (`p` matches `p` and `p.*`); a prefix
# written `=p` matches `p` alone (a package's __init__, without its submodules).
LAYERS = [
    ("kernels", ["kernels", "ddtree_kernels"]),  # Pallas kernels + references + quant; jax only
    ("config", ["ddtree_jax.config"]),  # frozen configs
    ("dispatch", ["ddtree_jax.dispatch", "ddtree_jax.options"]),  # "auto" rules, DecodeOptions
    (
        "parallel",
        [
            "ddtree_jax.sharding.rules",
            "ddtree_jax.sharding.mesh",
            "ddtree_jax.sharding.regions",
            "=ddtree_jax.sharding",
        ],
    ),  # mesh axes, rule tables, shard_map regions
    ("tree+sampling", ["ddtree_jax.tree", "ddtree_jax.sampling"]),
    ("verify", ["ddtree_jax.verify", "=ddtree_jax"]),  # the package re-exports tree..verify
    ("models", ["ddtree_jax.models"]),
    ("checkpoint", ["ddtree_jax.checkpoint"]),  # HF configs / weights, tokenizers
    ("presets", ["ddtree_jax.presets"]),  # named configs (read through checkpoint)
    ("analysis", ["ddtree_jax.analysis", "ddtree_jax.roofline", "ddtree_jax.sharding.memory"]),  # planner, roofline
    ("engine", ["ddtree_jax.engine"]),
    ("train", ["ddtree_jax.train"]),
    ("cli", ["ddtree_jax.__main__"]),
    ("apps", ["benchmarks", "experiments"]),
]


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: str  # "module", "function" or "typing"
    file: str
    line: int


def discover(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py file under the package roots."""
    dirs = sorted(ROOTS.items(), key=lambda kv: -len(kv[1]))
    modules: dict[str, Path] = {}
    for name, rel in ROOTS.items():
        base = root / rel
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            relpath = path.relative_to(root).as_posix()
            owner, owner_dir = next((n, d) for n, d in dirs if relpath.startswith(d + "/"))
            if owner != name:
                continue
            parts = list(Path(relpath[len(owner_dir) + 1 :]).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(not p.isidentifier() for p in parts):
                continue
            modules[".".join([owner, *parts])] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest first-party module that `name` or one of its prefixes names."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, modules: dict[str, Path], file: str):
        self.module, self.modules, self.file = module, modules, file
        self.package = module if is_package else module.rpartition(".")[0]
        self.depth = 0
        self.typing = 0
        self.edges: list[Edge] = []

    def _kind(self) -> str:
        return "typing" if self.typing else ("function" if self.depth else "module")

    def _add(self, target: str | None, node: ast.stmt) -> None:
        if target is not None and target != self.module:
            self.edges.append(Edge(self.module, target, self._kind(), self.file, node.lineno))

    def visit_FunctionDef(self, node):  # noqa: N802
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_If(self, node):  # noqa: N802
        if _is_type_checking(node.test):
            self.typing += 1
            for child in node.body:
                self.visit(child)
            self.typing -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node):  # noqa: N802
        for alias in node.names:
            self._add(_resolve(alias.name, self.modules), node)

    def visit_ImportFrom(self, node):  # noqa: N802
        if node.level:
            base_parts = self.package.split(".") if self.package else []
            if node.level > 1:
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        seen = set()
        for alias in node.names:
            full = f"{base}.{alias.name}" if base else alias.name
            target = full if full in self.modules else _resolve(base, self.modules)
            if target not in seen:
                seen.add(target)
                self._add(target, node)


def collect(root: Path) -> tuple[dict[str, Path], list[Edge]]:
    modules = discover(root)
    edges: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        visitor = _Visitor(name, path.name == "__init__.py", modules, path.relative_to(root).as_posix())
        visitor.visit(tree)
        edges.extend(visitor.edges)
    return modules, edges


def layer_of(module: str) -> tuple[int, str] | None:
    """(rank, layer name) of a module, by its longest matching prefix; None when no layer matches."""
    best = None
    for rank, (layer, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            exact = prefix.startswith("=")
            p = prefix.lstrip("=")
            if module == p or (not exact and module.startswith(p + ".")):
                if best is None or len(p) > best[0]:
                    best = (len(p), rank, layer)
    return None if best is None else (best[1], best[2])


def cycles(modules: dict[str, Path], edges: list[Edge]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative), over module and
    function edges."""
    graph: dict[str, list[str]] = {m: [] for m in modules}
    for e in edges:
        if e.kind != "typing" and e.dst not in graph[e.src]:
            graph[e.src].append(e.dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def upward_edges(edges: list[Edge]) -> list[tuple[Edge, str, str]]:
    out = []
    for e in edges:
        if e.kind == "typing":
            continue
        src, dst = layer_of(e.src), layer_of(e.dst)
        if src is not None and dst is not None and dst[0] > src[0]:
            out.append((e, src[1], dst[1]))
    return out


@dataclass
class Report:
    modules: dict[str, Path]
    edges: list[Edge]
    cycles: list[list[str]]
    upward: list[tuple[Edge, str, str]]
    function_level: list[Edge]
    unlayered: list[str]

    @property
    def failed(self) -> bool:
        return bool(self.cycles or self.upward)

    def summary(self) -> str:
        return (
            f"summary: {len(self.modules)} modules, {len(self.edges)} edges, {len(self.cycles)} cycles, "
            f"{len(self.upward)} upward edges, {len(self.function_level)} function-level first-party imports"
        )


def analyse(root: Path) -> Report:
    modules, edges = collect(root)
    edges = sorted(set(edges), key=lambda e: (e.src, e.dst, e.line, e.kind))
    return Report(
        modules=modules,
        edges=edges,
        cycles=cycles(modules, edges),
        upward=upward_edges(edges),
        function_level=[e for e in edges if e.kind == "function"],
        unlayered=sorted(m for m in modules if layer_of(m) is None),
    )


def _fmt(e: Edge) -> str:
    return f"{e.src} -> {e.dst}  [{e.kind}]  {e.file}:{e.line}"


def render(report: Report) -> str:
    lines = [
        f"# import graph of {', '.join(ROOTS)} (layers bottom first: " + " < ".join(name for name, _ in LAYERS) + ")",
        "",
    ]
    lines.append(f"## (a) import cycles: {len(report.cycles)}")
    for i, component in enumerate(report.cycles, 1):
        members = set(component)
        lines.append(f"cycle {i}: {', '.join(component)}")
        lines += [
            "    " + _fmt(e) for e in report.edges if e.kind != "typing" and e.src in members and e.dst in members
        ]
    lines += ["", f"## (b) upward edges: {len(report.upward)}"]
    lines += [f"{_fmt(e)}  ({lo} imports {hi})" for e, lo, hi in report.upward]
    lines += ["", f"## (c) function-level first-party imports: {len(report.function_level)}"]
    lines += [_fmt(e) for e in report.function_level]
    if report.unlayered:
        lines += ["", f"## modules in no layer (not checked): {len(report.unlayered)}"]
        lines += report.unlayered
    lines += ["", report.summary()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="repository root (default: this script's repository)",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 on any cycle or upward edge")
    args = parser.parse_args(argv)
    report = analyse(args.root)
    sys.stdout.write(render(report))
    return 1 if args.check and report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
