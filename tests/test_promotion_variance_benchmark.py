"""benchmarks/promotion_variance.py --quick runs end to end; what does not depend on the
draws is checked: every stochastic estimator spends floor or ceil of the same expected
with-grad samples per draw, the deterministic folds their fixed counts, and the summary is
the rows' figures."""

from __future__ import annotations

import json

import pytest


def test_promotion_variance_quick(run_benchmark) -> None:
    out = run_benchmark("benchmarks.promotion_variance", "--quick")
    res = json.loads((out / "promotion_variance.json").read_text())
    (row,) = res["batches"]
    assert row["exact_grad_samples"] == 4 * 5
    folds = row["folds"]
    assert folds["F3 (3-anchor causal)"]["grad_samples"] == 4 * 3
    assert folds["F2 (2-anchor causal)"]["grad_samples"] == 4 * 2
    for label, r in row["stochastic"].items():
        # 4 samples x 5 trained steps, 2 anchors each, 0.4 x 4 = 1.6 more expected:
        # 1 or 2 promotions of 1 anchor (to anchor), 0 or 1 of 3 (to exact, sum pi 0.53);
        # at budget 2.9, 3.6 more expected: 1 or 2 promotions of 3 (sum pi 1.2)
        if label.startswith("anchor"):
            assert r["mean"] == "F3" and 8 + 1 <= r["grad_samples"] <= 8 + 2
        elif label.endswith("budget 2.9"):
            assert r["mean"] == "E" and r["grad_samples"] in (11.0, 12.5, 14.0)
        else:
            assert r["mean"] == "E" and r["grad_samples"] in (8.0, 9.5, 11.0)
        assert r["var_rel"] >= 0 and -1 <= r["cos_exact"] <= 1
    s = res["summary"]
    assert s["anchor, proxy"]["var_rel"] == pytest.approx(row["stochastic"]["anchor, proxy"]["var_rel"])
    assert s["linear fold (the default's)"]["cos_exact"] == pytest.approx(
        folds["linear fold (the default's)"]["cos_exact"]
    )
    md = (out / "PROMOTION_VARIANCE.md").read_text()
    assert "| exact from linear, proxy |" in md and "| F3 (3-anchor causal) |" in md
    assert "| exact from causal, proxy, budget 2.9 |" in md


def test_promotion_variance_rejects_one_draw() -> None:
    from benchmarks.promotion_variance import main

    with pytest.raises(SystemExit):
        main(["--quick", "--draws", "1"])
