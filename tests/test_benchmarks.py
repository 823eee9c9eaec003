"""The benchmark harness runs end to end on a tiny configuration and writes well-formed
JSON, markdown and PNGs.  No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("diffusers")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_run(run_benchmark) -> Path:
    return run_benchmark("benchmarks.run", "--tiny")


def test_json_is_well_formed(tiny_run: Path) -> None:
    res = json.loads((tiny_run / "results.json").read_text())
    for key in ("torch", "triton", "git_commit", "platform", "device"):
        assert key in res["machine"]
    kinds = {r["kind"] for r in res["timing"]}
    assert kinds == {"window", "trajectory"}
    for rec in res["timing"]:
        for name, t in rec["times"].items():
            assert set(t) == {"fwd", "bwd", "step"}, name
            assert all(v > 0 for v in t.values()), name
        assert rec["memory"]["jagg"]["saved_bytes"] > 0
        assert {"exact_per_step", "exact_batched", "jagg", "jagg_router", "subsample"} <= set(
            rec["times"]
        )
    traj = next(r for r in res["timing"] if r["kind"] == "trajectory")
    assert "jagg_shared" in traj["times"]
    fid = res["fidelity"]["results"]
    # W = 2 windows have no interior step: JAGG is exact there.
    assert fid["window/W2/jagg"]["cos"]["mean"] == pytest.approx(1.0, abs=1e-6)
    for key, d in fid.items():
        assert -1.0 - 1e-9 <= d["cos"]["mean"] <= 1.0 + 1e-9, key
    assert {t["target"] for t in res["targets"]}
    assert res["kernels"]


def test_saved_bytes_follow_the_anchor_count(tiny_run: Path) -> None:
    """Exact, not timing: JAGG keeps 2 of W steps' activations (up to small extras)."""
    res = json.loads((tiny_run / "results.json").read_text())
    w = next(r for r in res["timing"] if r["kind"] == "window")
    ratio = w["memory"]["jagg"]["saved_bytes"] / w["memory"]["exact_batched"]["saved_bytes"]
    assert ratio == pytest.approx(2 / w["W"], abs=0.05)


def test_markdown_and_plots(tiny_run: Path) -> None:
    md = (tiny_run / "RESULTS.md").read_text()
    assert md.startswith("## Results")
    assert "| target | limit | measured | floor | met |" in md
    for name in ("time_ratio_vs_W.png", "saved_bytes_vs_W.png", "grad_cosine_vs_W.png"):
        data = (tiny_run / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, name
        assert name in md


@pytest.fixture(scope="module")
def floor_run(run_benchmark) -> Path:
    return run_benchmark("benchmarks.floor", "--tiny")


def test_floor_benchmark_writes_its_tables(floor_run: Path) -> None:
    res = json.loads((floor_run / "floor.json").read_text())
    variants = {"per_step", "eager", "deferred", "values_deferred", "values_deferred_adaptive"}
    for rec in res["time"]:
        assert set(rec["ratio_to_per_step"]) == variants
        assert rec["ratio_to_per_step"]["per_step"] == 1.0
        assert all(t > 0 for t in rec["median_s"].values())
    for rec in res["memory"]:
        rat = rec["ratio_to_per_step"]
        # Not timing: saved bytes are deterministic.  Deferred holds one chunk at a time.
        assert rat["eager"] > 1.15 and max(rat[v] for v in variants - {"eager"}) <= 1.15
    for rec in res["planner"]:
        assert 0 < rec["planner_s"] < rec["step_s"]
    fid = res["fidelity"]["digits"]
    for key in ("prefix9", "all10"):
        assert all(-1.0 <= c <= 1.0 for c in fid[key].values())
    md = (floor_run / "FLOOR.md").read_text()
    assert md.startswith("## JAGG at its floor") and "| 9-step prefix of 10 |" in md
