"""The research view of one tree: indented text, summary numbers, and a plot."""

from __future__ import annotations

import math

import numpy as np

from ddtree_jax.tree.draft_tree import DraftTree


def _row(tree: DraftTree, b: int) -> dict:
    rows = tree.tokens.shape[0]
    if not -rows <= b < rows:  # past the end, indexing would clamp: the last row's tree under another row's name
        raise ValueError(f"row {b} is out of range for a tree of {rows} rows")
    n = int(tree.num_nodes[b])
    return {name: np.asarray(getattr(tree, name)[b])[:n] for name in ("tokens", "parents", "depths", "ranks", "logw")}


def surrogate_tau(tree: DraftTree) -> np.ndarray:
    """float64 [B]: 1 + sum over non-root nodes of q(u) = exp(logw): the expected acceptance length under
    the drafter's own (independent) marginals, the quantity the best-first tree maximises."""
    w = np.exp(np.asarray(tree.logw[:, 1:], np.float64))  # padding: exp(-inf) = 0
    return 1.0 + w.sum(axis=1)


def depth_counts(tree: DraftTree) -> np.ndarray:
    """int [B, max_depth]: number of real nodes at each depth 1..L."""
    depths = np.asarray(tree.depths)
    real = np.arange(tree.num_slots)[None, :] < np.asarray(tree.num_nodes)[:, None]
    return np.stack([((depths == d) & real).sum(axis=1) for d in range(1, tree.max_depth + 1)], axis=1)


def format_tree(tree: DraftTree, b: int = 0, decode=None, max_nodes: int | None = None) -> str:
    """Indented text: one line per node, `token  rank  q` (q = cumulative draft probability)."""
    row = _row(tree, b)
    n = len(row["tokens"])
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(int(row["parents"][i]), []).append(i)
    label = (lambda t: f"{t} {decode(int(t))!r}") if decode else str
    lines = [f"root  token {label(row['tokens'][0])}"]
    shown = 0

    def visit(node: int, prefix: str) -> None:
        nonlocal shown
        kids = children.get(node, [])
        for pos, child in enumerate(kids):
            if max_nodes is not None and shown >= max_nodes:
                lines.append(prefix + "`-- ...")
                return
            last = pos == len(kids) - 1
            q = math.exp(float(row["logw"][child]))
            lines.append(
                f"{prefix}{'`-- ' if last else '|-- '}{label(row['tokens'][child])}"
                f"  r{int(row['ranks'][child])}  q={q:.4f}"
            )
            shown += 1
            visit(child, prefix + ("    " if last else "|   "))

    visit(0, "")
    return "\n".join(lines)


def plot_tree(tree: DraftTree, path: str, b: int = 0, decode=None, title: str | None = None) -> None:
    """Draws the tree left to right (depth on x), node colour and size by cumulative probability."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    row = _row(tree, b)
    n = len(row["tokens"])
    children: dict[int, list[int]] = {}
    for i in range(1, n):
        children.setdefault(int(row["parents"][i]), []).append(i)
    y = np.zeros(n)
    next_leaf = [0.0]

    def place(node: int) -> float:
        kids = children.get(node, [])
        if not kids:
            y[node] = next_leaf[0]
            next_leaf[0] += 1
        else:
            y[node] = np.mean([place(k) for k in kids])
        return y[node]

    place(0)
    q = np.exp(row["logw"].astype(np.float64))
    fig, ax = plt.subplots(figsize=(2.0 + 1.6 * (row["depths"].max() + 1), 1.0 + 0.28 * max(next_leaf[0], 4)))
    for i in range(1, n):
        p = row["parents"][i]
        ax.plot([row["depths"][p], row["depths"][i]], [y[p], y[i]], color="0.7", lw=0.5 + 2.5 * q[i], zorder=1)
    sc = ax.scatter(row["depths"], y, c=q, cmap="viridis", vmin=0, vmax=1, s=20 + 180 * q, zorder=2)
    for i in range(n):
        text = "root" if i == 0 else (decode(int(row["tokens"][i])) if decode else str(row["tokens"][i]))
        ax.annotate(text, (row["depths"][i], y[i]), xytext=(4, 3), textcoords="offset points", fontsize=7)
    fig.colorbar(sc, ax=ax, label="cumulative draft probability q(u)")
    ax.set_xlabel("depth")
    ax.set_yticks([])
    ax.invert_yaxis()
    ax.set_title(title or f"DDTree: {n - 1} nodes, surrogate tau = {surrogate_tau(tree)[b]:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
