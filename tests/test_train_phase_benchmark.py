"""benchmarks/train_phase.py --quick runs end to end and writes its table.

Timing is not asserted (a shared machine); what does not depend on it is checked: every
variant is timed on every repetition, exact's ratio is 1, and the file names the floors.
"""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("task", ["digits", "shapes"])
def test_train_phase_benchmark_quick(run_benchmark, task: str) -> None:
    from benchmarks.train_phase import NAMES

    out = run_benchmark("benchmarks.train_phase", "--quick", "--task", task)
    res = json.loads((out / "train_phase.json").read_text())
    assert res["config"]["task"] == task
    # shapes trains the study's prefix: the first 5 of 10 steps
    assert res["config"]["trained_steps"] == {"digits": 10, "shapes": 5}[task]
    tm = res["time"]
    assert set(tm["ratio_to_exact"]) == set(NAMES[task])
    assert tm["ratio_to_exact"]["exact"] == 1.0
    assert all(len(v) == tm["reps"] == 2 for v in tm["times"].values())
    assert all(t > 0 for t in tm["median_s"].values())
    md = (out / "TRAIN_PHASE.md").read_text()
    assert "| uniform |" in md and "| 0.4 |" in md


def test_train_phase_benchmark_variants_subset(run_benchmark) -> None:
    """--variants times the named variants and exact, nothing else; an unknown name is
    refused before any trainer is built."""
    out = run_benchmark("benchmarks.train_phase", "--quick", "--task", "shapes",
                        "--variants", "adaptive_causal_b2")  # fmt: skip
    res = json.loads((out / "train_phase.json").read_text())
    assert set(res["time"]["ratio_to_exact"]) == {"exact", "adaptive_causal_b2"}
    assert "--variants adaptive_causal_b2" in res["command"]


def test_train_phase_benchmark_rejects_unknown_variant() -> None:
    from benchmarks.train_phase import main

    with pytest.raises(SystemExit):
        main(["--quick", "--task", "shapes", "--variants", "nope"])
