"""The `ddtree-jax` command line: the tree tool and generate (random tiny pair)."""

import re

import jax
import numpy as np

from ddtree_jax.__main__ import main
from ddtree_jax.tree import build_tree
from ddtree_jax.tree.render import surrogate_tau
from ddtree_jax.tree.synthetic import synthetic_draft_logits


def test_tree_tool_prints_the_tree_and_plots(tmp_path, capsys):
    plot = tmp_path / "tree.png"
    assert main(["tree", "--budget", "12", "--depth", "4", "--vocab", "300", "--seed", "3", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    tree = build_tree(synthetic_draft_logits(jax.random.key(3), 1, 4, 300), 12)
    expected = f"{surrogate_tau(tree)[0]:.4f}"
    assert f"surrogate expected acceptance tau = 1 + sum_u q(u) = {expected}" in out
    assert len(re.findall(r"  r\d+  q=", out)) == 12  # one line per node
    assert "nodes per depth: d1:" in out
    assert plot.exists() and plot.stat().st_size > 1000


def test_tree_tool_reads_logits_and_reports_bad_input(tmp_path, capsys):
    logits = np.random.default_rng(0).standard_normal((3, 50)).astype(np.float32)
    np.save(tmp_path / "l.npy", logits)
    assert main(["tree", "--logits", str(tmp_path / "l.npy"), "--budget", "5"]) == 0
    assert "vocab V = 50" in capsys.readouterr().out
    assert main(["tree", "--logits", str(tmp_path / "l.npy"), "--budget", "0"]) == 2
    assert "error: budget must be an integer >= 1, got 0" in capsys.readouterr().err


def test_generate_random_tiny_methods_agree_greedily(capsys):
    assert main(["generate", "--random-tiny", "--method", "all", "--max-new", "6", "--budget", "4", "--repeats", "1",
                 "--compilation-cache", ""]) == 0
    out = capsys.readouterr().out
    texts = re.findall(r"^\[[\d, ]+\]$", out, flags=re.M)
    assert len(texts) == 3 and len(set(texts)) == 1  # AR, chain and DDTree emit the same greedy text
    assert "speedup over AR (ddtree)" in out and "compile" in out
