"""A figure of `bench_e2e`'s results: decode tokens/s and tokens per step against the DDTree budget, AR and the
DFlash chain as horizontal lines, one column per temperature setting (one JSON each).

    python -m benchmarks.plot_e2e benchmarks/results_archive/e2e_embedded_T0_ef5aa8e.json \\
        benchmarks/results_archive/e2e_embedded_T1_ef5aa8e.json --out e2e.png
"""

from __future__ import annotations

import argparse
import json


def _setting_label(result: dict) -> str:
    s = result["settings"]
    label = f"T = {s['temperature']:g}" + (f", top-p {s['top_p']:g}" if s.get("top_p", 1.0) < 1.0 else "")
    return f"{label} ({s.get('dtype', '?')}, {s['num_prompts']} prompts x {s['max_new_tokens']} tokens)"


def plot_e2e(results: list[dict], path: str | None = None):
    """Two rows (tokens/s; decoded tokens per step) x one column per result. Saves to `path` when given;
    returns the figure. A result needs an "ar" row; "chain" is drawn when present."""
    import matplotlib

    if path:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6.5 * len(results), 7.5), squeeze=False, sharex=True)
    for col, result in enumerate(results):
        rows = result["results"]
        by_method = {r["method"]: r for r in rows if r["method"] != "ddtree"}
        if "ar" not in by_method:
            raise ValueError(f"result {col} has no AR row: {[r['method'] for r in rows]}")
        tree = sorted((r for r in rows if r["method"] == "ddtree"), key=lambda r: r["budget"])
        budgets = [r["budget"] for r in tree]

        def per_step(r):
            steps = sum(p["steps"] for p in r["per_prompt"])
            return sum(p["num_tokens"] - 1 for p in r["per_prompt"]) / steps

        for row, (value, ylabel) in enumerate(
            ((lambda r: r["tokens_per_s"], "decode tokens/s"), (per_step, "decoded tokens per step"))
        ):
            ax = axes[row][col]
            ax.plot(budgets, [value(r) for r in tree], marker="o", label="DDTree")
            for method, style in (("chain", "--"), ("ar", ":")):
                if method in by_method:
                    ax.axhline(value(by_method[method]), linestyle=style, color="grey" if method == "ar" else "C1")
                    ax.annotate(
                        "AR" if method == "ar" else "DFlash chain",
                        (budgets[0] if budgets else 1, value(by_method[method])),
                        textcoords="offset points",
                        xytext=(2, 3),
                        fontsize=8,
                    )
            if row == 0 and tree:
                best = max(tree, key=lambda r: r["tokens_per_s"])
                ax.annotate(
                    f"{best['tokens_per_s'] / by_method['ar']['tokens_per_s']:.2f}x AR",
                    (best["budget"], best["tokens_per_s"]),
                    textcoords="offset points",
                    xytext=(4, -12),
                    fontsize=8,
                )
                ax.set_title(_setting_label(result), fontsize=9)
            ax.set_xscale("log", base=2)
            if budgets:
                ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.set_ylabel(ylabel)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("DDTree budget (tree nodes)")
    fig.suptitle(f"{results[0]['device']['description']} · commit {results[0]['commit']}", fontsize=9)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="bench_e2e JSON files, one per temperature setting")
    parser.add_argument("--out", required=True, help="the PNG to write")
    args = parser.parse_args()
    results = []
    for name in args.results:
        with open(name) as f:
            results.append(json.load(f))
    plot_e2e(results, args.out)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
