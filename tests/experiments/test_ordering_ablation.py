"""The sibling-order ablation: the statistics on synthetic counts (they accept equal laws and reject different
ones), then the small grid on the tiny trained pair: exact thresholds show no order effect and fit the target's
law; the wrong-temperature control is rejected by the same tests."""

import collections
import json

import numpy as np
import pytest

from experiments import ordering_ablation as ab
from tests.experiments.refusal import assert_refused, refuse_to_run
from tests.stats_helpers import ALPHA


def _draw(rng, probs, n, prompt=0):
    """n outputs (prompt, t1, t2) from a joint law probs [V, V]."""
    flat = rng.choice(probs.size, size=n, p=probs.ravel())
    return collections.Counter((prompt, int(i // probs.shape[1]), int(i % probs.shape[1])) for i in flat)


def test_homogeneity_accepts_equal_laws_and_rejects_different_ones():
    rng = np.random.default_rng(0)
    law = rng.dirichlet(np.full(36, 0.3)).reshape(6, 6)
    groups = [_draw(rng, law, 3000) for _ in range(3)]
    assert ab.homogeneity_test(groups)["p"] > ALPHA
    tilted = law.copy()
    tilted[0, :] *= 1.5
    tilted /= tilted.sum()
    assert ab.homogeneity_test(groups[:2] + [_draw(rng, tilted, 3000)])["p"] < ALPHA


def test_coarsen_pools_rare_outputs_the_same_way_for_every_group():
    groups = [
        collections.Counter({(0, 1, 1): 50, (0, 1, 2): 1, (0, 3, 2): 2, (0, 4, 4): 1}),
        collections.Counter({(0, 1, 1): 40, (0, 2, 2): 3, (0, 3, 2): 5, (1, 5, 5): 2}),
    ]
    m = ab.coarsen(groups, min_expected=5)
    assert m[(0, 1, 1)] == (0, 1, 1)  # frequent: its own cell
    assert m[(0, 1, 2)] == m[(0, 2, 2)] == m[(0, 3, 2)] == (0, ab.WILD, 2)  # pooled over t1: 11 x 50 / 104 >= 5
    assert m[(0, 4, 4)] == () and m[(1, 5, 5)] == ()  # too rare at every level: the rest cell


def test_fit_test_on_an_exactly_known_law():
    rng = np.random.default_rng(1)
    law = rng.dirichlet(np.full(25, 0.5)).reshape(5, 5)
    n = 4000
    cells = {(a, b): float(law[a, b]) for a in range(5) for b in range(5) if n * law[a, b] >= 5}
    cells[()] = 1.0 - sum(cells.values())
    assert ab.fit_test(_draw(rng, law, n), [cells], n)["p"] > ALPHA
    other = rng.dirichlet(np.full(25, 0.5)).reshape(5, 5)
    assert ab.fit_test(_draw(rng, 0.8 * law + 0.2 * other, n), [cells], n)["p"] < ALPHA


@pytest.fixture(scope="module")
def ablation(ordering_ablation_small):
    """The SMALL grid on the tiny pair, `ab.ablation(target, drafter, small=True)` (tests/conftest.py: run once per
    test run, the ordering_ablation notebook shows the same run): the tests using it are slow."""
    return ordering_ablation_small.result


@pytest.mark.slow
def test_grid_rows_are_well_formed(ablation):
    s = ab.SMALL
    assert len(ablation["rows"]) == len(ab.ORDERS) * len(ab.THRESHOLDS) * len(ab.TEMPERATURES)
    for r in ablation["rows"]:
        assert 1.0 <= r["mean_tau"] <= 16 and r["se_tau"] >= 0 and r["step_expected_mean"] >= 1
        assert r["law_draws"] == s["num_prompts"] * s["law_samples"]
        assert 0.0 <= r["fit_p"] <= 1.0
    json.dumps(ablation, default=float)
    table = ab.format_table(ablation)
    assert "Order homogeneity" in table and "Controls" in table


@pytest.mark.slow
def test_exact_thresholds_show_no_order_effect_and_fit_the_target_law(ablation):
    exact = [t for t in ablation["tests"] if t["thresholds"] == "exact"]
    assert len(exact) == len(ab.TEMPERATURES)
    for t in exact:
        assert t["orders"] == list(ab.ORDERS) and t["categories"] > 10
    family = ablation["exact_family"]
    n_fit = sum(r["thresholds"] == "exact" for r in ablation["rows"])
    assert family["tests"] == len(exact) + n_fit and family["alpha_per_test"] == ALPHA / family["tests"]
    # the exact-threshold tests (order homogeneity per temperature, fit per configuration) as one family at a
    # family-wise false-positive rate of ALPHA: none rejects
    assert not family["reject"], family
    assert all(t["p"] >= family["alpha_per_test"] for t in exact)
    for r in ablation["rows"]:
        if r["thresholds"] == "exact":
            assert r["fit_p"] >= family["alpha_per_test"], r
            # exact verification: the mean tau matches the exact expectation of the steps taken
            assert abs(r["mean_tau"] - r["step_expected_mean"]) < 4.5 * max(r["se_tau"], 1e-3) + 0.05


@pytest.mark.slow
def test_the_controls_reject(ablation):
    """The same tests can fail: samples at the wrong temperature are rejected by both (a must), and the lossy mode's
    bias is visible against exact verification on this pair."""
    must = [c for c in ablation["controls"] if c["must_reject"]]
    assert {c["test"] for c in must} == {"homogeneity", "fit"}
    assert all(c["reject"] and c["p"] < ALPHA for c in must), must
    lossy = [r for r in ablation["rows"] if r["thresholds"] == "lossy"]
    assert any(r["fit_reject"] for r in lossy)
    exact_vs_lossy = next(c for c in ablation["controls"] if not c["must_reject"])
    assert exact_vs_lossy["reject"]


@pytest.mark.parametrize(
    "argv, message",
    [
        # a repeated order overwrote the first run's counts: the homogeneity test compared draft with itself
        (["--orders", "draft,draft"], "only once"),
        (["--orders", "draft,bogus"], "'bogus'"),
        (["--law-tokens", "0"], "--law-tokens 0"),
        (["--budget", "-1"], "--budget -1"),
        (["--lossy", "0.5"], "THRESHOLD_ACC,THRESHOLD_SINGLE"),
        (["--lossy", "a,b"], "THRESHOLD_ACC,THRESHOLD_SINGLE"),
        (["--temperatures", "1,1"], "distinct"),
        (["--temperatures", "hot"], "--temperatures"),
        (["--lossy", "0.5,1.5"], "both thresholds must be in (0, 1]"),
        (["--lossy", "0,0.3"], "both thresholds must be in (0, 1]"),  # was refused only after the exact runs
        (["--temperatures", "1,inf"], "finite"),
        (["--temperatures", "nan"], "finite"),
        (["--law-tokens", "3", "--tau-max-new", "2"], "--law-tokens 3: at most --tau-max-new (2)"),
        (["--law-tokens", "25"], "--law-tokens 25: at most --tau-max-new (24)"),  # SMALL's 24 new tokens
        (["--out", "."], "is a directory"),
    ],
)
def test_bad_arguments_are_refused_before_any_run(argv, message, monkeypatch, tmp_path, capsys):
    refuse_to_run(monkeypatch, ab, "ablation")
    out = [] if "--out" in argv else ["--out", str(tmp_path / "out.json")]
    assert_refused(ab.main, [*argv, "--small", *out], message, capsys)
