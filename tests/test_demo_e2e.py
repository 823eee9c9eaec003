"""benchmarks/demo_e2e.py: the ratios it reports, and its --quick mode end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks import demo_e2e


def _r(final, secs):
    return {"final_reward": final, "initial_reward": 0.5, "train_seconds": secs}


def test_summary_ratios_are_of_seed_means():
    per = {
        0: {"default": _r(0.80, 10.0), "exact": _r(0.80, 20.0)},
        1: {"default": _r(0.70, 12.0), "exact": _r(0.90, 20.0)},
    }
    s = demo_e2e.summarize(per)
    assert s["reward_ratio"] == pytest.approx(0.75 / 0.85)
    assert s["train_time_ratio"] == pytest.approx(11.0 / 20.0)
    assert s["per_seed_reward_ratio"] == pytest.approx([1.0, 0.7 / 0.9])
    assert s["per_seed_time_ratio"] == pytest.approx([0.5, 0.6])
    assert not s["reward_target_met"]  # 0.882 < 0.97
    assert s["time_target_met"]  # 0.55 <= 0.55


def test_quick_run_writes_both_runs_per_seed(tmp_path):
    assert demo_e2e.main(["--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "demo_e2e.json").read_text())
    seed0 = res["per_seed"]["0"]
    assert seed0["exact"]["paths"] == ["exact"]
    assert "exact" not in seed0["default"]["paths"]
    assert seed0["default"]["steps"] == seed0["exact"]["steps"] == 2
    assert "reward ratio" in (tmp_path / "DEMO_E2E.md").read_text()
