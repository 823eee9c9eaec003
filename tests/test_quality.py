"""The quality study: its statistics on hand-made curves, lockstep == standalone runs,
and the ``--quick`` mode end to end (JSON, markdown, plots).  No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.quality import (
    STUDIES,
    VARIANTS,
    _run_seed_job,
    aggregate,
    auc,
    calibrate,
    finished_seed,
    mean_std,
    run_seed,
    target_rows,
    variant_config,
    wallclock_margin,
)
from jagg_autograd.trainer import train

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_auc_and_mean_std():
    assert auc([0, 10], [0.2, 0.4]) == pytest.approx(0.3)
    assert auc([0, 1, 3], [0.0, 1.0, 1.0]) == pytest.approx((0.5 + 2.0) / 3)
    assert auc([5], [0.7]) == 0.7
    ms = mean_std([1.0, 2.0, 3.0, float("nan")])
    assert ms == {"mean": 2.0, "std": 1.0, "n": 3}
    assert mean_std([4.0])["std"] == 0.0 and math.isnan(mean_std([])["mean"])


def _run(final: float, curve_t: list[float], curve_r: list[float], train_s: float) -> dict:
    return {
        "initial_reward": curve_r[0],
        "final_reward": final,
        "auc_reward": auc(range(len(curve_r)), curve_r),
        "train_seconds": train_s,
        "step_seconds": train_s + 1.0,
        "median_train_step_seconds": train_s / 10,
        "median_step_seconds": (train_s + 1) / 10,
        "backward_passes_per_step": 4.0,
        "backward_calls_per_step": 1.0,
        "probe_cosine": 0.9,
        "probe_rel_error": 0.3,
        "routed_frac": 0.0,
        "rollout_reward_last10": final,
        "curves": {"eval_wall_seconds": curve_t, "eval_reward": curve_r},
    }


def test_wallclock_margin_sign():
    ex = _run(0.8, [0, 10, 20], [0.5, 0.7, 0.8], 20.0)
    fast = _run(0.8, [0, 5, 10], [0.5, 0.7, 0.8], 10.0)  # same curve in half the time
    slow = _run(0.8, [0, 20, 40], [0.5, 0.7, 0.8], 40.0)
    m = wallclock_margin([fast], [ex])
    assert m["points"] == 2 and m["min"] > 0 and m["frac_above"] == 1.0
    # exact at t=5 interpolates to 0.6, at t=10 to 0.7: margins 0.1 and 0.1
    assert m["min"] == pytest.approx(0.1) and m["mean"] == pytest.approx(0.1)
    s = wallclock_margin([slow], [ex])
    assert s["points"] == 1 and s["min"] < 0  # t=20: 0.7 vs exact's 0.8; t=40 is outside


def test_aggregate_targets_and_calibration_follow_the_numbers():
    per_seed = {}
    for seed, shift in ((0, 0.0), (1, 0.01)):
        per_seed[seed] = {
            "exact": _run(0.80 + shift, [0, 10, 20], [0.5, 0.7, 0.80 + shift], 20.0),
            "jagg_W4": _run(0.79 + shift, [0, 6, 12], [0.5, 0.69, 0.79 + shift], 12.0),
            "router_t0.80": _run(0.70, [0, 8, 16], [0.5, 0.6, 0.70], 16.0),  # -12 %: fails
            "router_t0.70": _run(0.80 + shift, [0, 7, 14], [0.5, 0.7, 0.80 + shift], 14.0),
            "subsample_4": _run(0.75, [0, 5, 10], [0.5, 0.6, 0.75], 10.0),
        }
        per_seed[seed]["subsample_4"]["probe_cosine"] = 0.5
    agg = aggregate(per_seed)
    d = agg["jagg_W4"]["final_rel_diff"]
    expect = [(0.79 - 0.80) / 0.80, (0.80 - 0.81) / 0.81]
    assert d["mean"] == pytest.approx(sum(expect) / 2) and d["n"] == 2
    assert agg["jagg_W4"]["train_seconds_ratio"]["mean"] == pytest.approx(0.6)
    assert agg["exact"]["final_rel_diff"]["mean"] == 0.0
    rows = {r["target"]: r for r in target_rows(agg)}
    assert rows["final held-out reward of jagg_W4 within 2 % of exact"]["met"] is True
    assert rows["final held-out reward of router_t0.80 within 2 % of exact"]["met"] is False
    best = rows["training-phase wall-clock of the best JAGG variant <= 0.65 of exact"]
    assert best["met"] is True and best["measured"] == pytest.approx(0.6)
    cos = rows["gradient cosine to exact at equal budget: jagg_W4 above subsample_4"]
    assert cos["met"] is True and cos["measured"] == pytest.approx(0.4)
    cal = calibrate(agg)
    assert cal["chosen"] == "router_t0.70" and "router_t0.80" not in cal["candidates"]
    assert cal["jagg_W4_passes"] is True


def test_lockstep_equals_standalone_runs():
    """Interleaving the variants' steps in one process changes nothing in any run."""
    study = dict(STUDIES["quick"], steps=2)
    names = ["exact", "subsample_4", "mixgrpo_W4", "router_f0.50"]
    logs = run_seed(3, names, study, progress=False)
    for n in names:
        alone = train(variant_config(n, 3, study))
        for key in ("steps", "evals"):
            a = [{k: v for k, v in r.items() if "seconds" not in k} for r in alone[key]]
            b = [{k: v for k, v in r.items() if "seconds" not in k} for r in logs[n][key]]
            assert a == b, (n, key)


@pytest.fixture(scope="module")
def quick_run(run_benchmark) -> Path:
    return run_benchmark("benchmarks.quality", "--quick")


def test_quick_json(quick_run: Path):
    res = json.loads((quick_run / "quality.json").read_text())
    agg = res["aggregate"]
    assert set(agg) == set(VARIANTS)
    assert res["study"]["steps"] == 3 and res["study"]["seeds"] == [0]
    passes = {n: a["backward_passes_per_step"]["mean"] for n, a in agg.items()}
    assert passes["exact"] == 10
    # Equal backward budget: 4 anchors (T=10, W=4 shared) = 4 subsampled steps = 4 window steps.
    assert passes["jagg_W4"] == passes["subsample_4"] == passes["mixgrpo_W4"] == 4
    assert passes["jagg_W4_disjoint"] == 6 and passes["jagg_W3_disjoint"] == 7
    assert agg["exact"]["probe_cosine"]["mean"] == pytest.approx(1.0, abs=1e-9)
    assert agg["exact"]["probe_rel_error"]["mean"] < 1e-12
    for n, a in agg.items():
        assert -1.0 <= a["probe_cosine"]["mean"] <= 1.0
        assert 0.0 <= a["routed_frac"]["mean"] <= 1.0
        if not n.startswith("router_"):
            assert a["routed_frac"]["mean"] == 0.0 or n == "exact"
        assert a["train_seconds_ratio"]["mean"] > 0
    # every seed-variant has its ODE evaluation curve at every step (eval_every=1) + final
    curves = res["per_seed"]["0"]["jagg_W4"]["curves"]
    assert curves["eval_step"] == [0, 1, 2, 3] and len(curves["probe_cosine"]) == 3
    assert {r["target"].split(" ")[0] for r in res["targets"]} >= {"final", "reward", "gradient"}
    assert res["calibration"]["rule"]


def test_quick_markdown_and_plots(quick_run: Path):
    md = (quick_run / "QUALITY.md").read_text()
    for s in ("## Targets", "## Router calibration", "| jagg_W4 |", "| subsample_4 |"):
        assert s in md
    for name in ("reward_vs_step.png", "reward_vs_wallclock.png", "cosine_vs_step.png"):
        data = (quick_run / name).read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_raw_logs_kept_and_resumable(tmp_path: Path):
    """Each finished seed's raw log is written atomically and recognised by --resume; a
    changed setting or a truncated file runs again."""
    study = dict(STUDIES["quick"], steps=1, eval_every=1, probe_every=0)
    names = ["exact", "jagg_W4"]
    _run_seed_job((5, names, study, str(tmp_path), False))
    raw = tmp_path / "seed5.json"
    assert finished_seed(raw, 5, names, study)
    assert not finished_seed(raw, 5, names, dict(study, steps=2))
    assert not finished_seed(raw, 5, ["exact"], study)
    assert not finished_seed(raw, 6, names, study)  # another seed's settings
    raw.write_text(raw.read_text()[:100])
    assert not finished_seed(raw, 5, names, study)
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind
