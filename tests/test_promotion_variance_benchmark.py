"""benchmarks/promotion_variance.py --quick runs end to end; what does not depend on the
draws is checked: both promotions spend floor or ceil of the same expected with-grad
samples per draw, and the summary is the rows' figures."""

from __future__ import annotations

import json
import statistics

import pytest


def test_promotion_variance_quick(run_benchmark) -> None:
    out = run_benchmark("benchmarks.promotion_variance", "--quick")
    res = json.loads((out / "promotion_variance.json").read_text())
    (row,) = res["batches"]
    # 4 samples x 5 trained steps: 2 anchors each, sum(pi) = 1.6 promotions -> 1 or 2
    for name in ("uniform", "proxy"):
        assert 8 + 1 <= row[name]["grad_samples"] <= 8 + 2
        assert row[name]["var_rel"] > 0 and -1 <= row[name]["cos_exact"] <= 1
    s = res["summary"]
    assert s["var_ratio"] == pytest.approx(s["proxy_var"] / s["uniform_var"])
    assert s["f3_cos"] == pytest.approx(statistics.fmean([row["cos_f3_exact"]]))
    assert "| proxy |" in (out / "PROMOTION_VARIANCE.md").read_text()


def test_promotion_variance_rejects_one_draw() -> None:
    from benchmarks.promotion_variance import main

    with pytest.raises(SystemExit):
        main(["--quick", "--draws", "1"])
