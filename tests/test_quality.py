"""The quality study (third edition): its statistics on hand-made logs and curves, the
paired aggregation and the targets, lockstep == standalone runs, the plan, --resume, and
``--quick`` end to end on both tasks (JSON, markdown, plots).  No timing is asserted."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.quality import (
    DEFAULT,
    TASKS,
    VARIANTS,
    _job_file,
    _run_job,
    aggregate,
    auc,
    finished_job,
    finished_runs,
    mean_std,
    per_seed_summary,
    plan,
    run_seed,
    run_study,
    studies_for,
    target_rows,
    variant_config,
    wallclock_margin,
)
from jagg_autograd.trainer import train

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_auc_and_mean_std():
    assert auc([0, 10], [0.2, 0.4]) == pytest.approx(0.3)
    assert auc([0, 1, 3], [0.0, 1.0, 1.0]) == pytest.approx((0.5 + 2.0) / 3)
    assert auc([5], [0.7]) == 0.7
    ms = mean_std([1.0, 2.0, 3.0, float("nan"), None])
    assert ms == {"mean": 2.0, "std": 1.0, "n": 3}
    assert mean_std([4.0])["std"] == 0.0 and math.isnan(mean_std([])["mean"])


def _log(rewards, walls, train_s, probes=(0.98, 0.96), plan=None, cats=None,
         shares=None) -> dict:  # fmt: skip
    """A hand-made trainer log: 4 steps, evaluations at steps 0, 2, 4."""
    steps = []
    for i in range(4):
        r = {
            "step": i,
            "reward_mean": 0.5,
            "train_seconds": train_s / 4,
            "rollout_seconds": 0.25,
            "forward_samples": 40 + i,
            "grad_samples": 16,
            "anchor_frac": 0.4,
            "routed_frac": 0.1 * i,
        }
        if i % 2 == 0:
            r["probe_cosine"] = probes[i // 2]
            if shares is not None:
                r["probe_systematic_share"] = shares[i // 2]
                r["probe_systematic_share_floor_sd"] = 0.005
        if plan is not None:
            r["plan_seconds"] = plan
        steps.append(r)
    evals = [
        {"step": s, "mean_reward": y, "wall_seconds": t, **((cats or {}).get(s, {}))}
        for s, y, t in zip((0, 2, 4), rewards, walls)
    ]
    return {"steps": steps, "evals": evals, "train_seconds": train_s, "rollout_seconds": 1.0}


def test_per_seed_summary_of_a_hand_made_log():
    cats = {0: {"counting": 0.2, "position": 0.1}, 4: {"counting": 0.5, "position": 0.3}}
    s = per_seed_summary(_log([0.5, 0.7, 0.8], [0, 2, 4], 4.0, plan=0.1, cats=cats))
    assert s["initial_reward"] == 0.5 and s["final_reward"] == 0.8
    assert s["auc_reward"] == pytest.approx(((0.5 + 0.7) + (0.7 + 0.8)) / 2 / 2)
    assert s["step_seconds"] == 5.0 and s["train_seconds"] == 4.0
    assert s["forward_samples_per_step"] == pytest.approx(41.5)
    assert s["grad_samples_per_step"] == 16
    assert s["probe_cosine"] == pytest.approx(0.97) and s["probe_cosine_min"] == 0.96
    assert s["routed_frac"] == pytest.approx(0.15) and s["anchor_frac"] == pytest.approx(0.4)
    assert s["plan_frac"] == pytest.approx(0.4 / 4.0)
    assert s["categories"] == {"initial": cats[0], "final": cats[4]}
    assert math.isnan(s["final_strict_accuracy"]) and s["categories_strict"]["final"] == {}
    strict = {
        0: {"strict_accuracy": 0.1, "counting_strict_accuracy": 0.0},
        4: {"strict_accuracy": 0.3, "counting_strict_accuracy": 0.5},
    }
    s = per_seed_summary(_log([0.5, 0.7, 0.8], [0, 2, 4], 4.0, cats=strict))
    assert s["initial_strict_accuracy"] == 0.1 and s["final_strict_accuracy"] == 0.3
    assert s["categories_strict"] == {"initial": {"counting": 0.0}, "final": {"counting": 0.5}}
    assert s["curves"]["probe_step"] == [0, 2]
    assert math.isnan(per_seed_summary(_log([0.5, 0.7, 0.8], [0, 2, 4], 4.0))["plan_frac"])
    assert s["guard"] == []  # no runaway-guard switch logged


def test_the_runaway_guards_switches_reach_the_report():
    from benchmarks.quality import _guard_words

    log = _log([0.5, 0.7, 0.8], [0, 2, 4], 4.0)
    log["guard"] = [{"step": 98, "ratio": 1.6, "to": "jagg, causal fold", "from": "jagg"}]
    switched = per_seed_summary(log)
    assert switched["guard"] == [[98, "jagg, causal fold"]]
    a = {"seeds": [0, 1], "guard": [switched["guard"], []]}
    assert _guard_words("uniform_guard", a) == (
        "uniform_guard (seed 0: after step 98 to jagg, causal fold, seed 1: no switch)"
    )


def _runs(final, walls, train_s, cos=(0.98, 0.98), shares=None) -> dict:
    return per_seed_summary(
        _log([0.5, (0.5 + final) / 2, final], walls, train_s, cos, shares=shares)
    )


def test_wallclock_margin_sign():
    ex = _runs(0.8, [0, 10, 20], 20.0)  # curve 0.5, 0.65, 0.8
    fast = _runs(0.8, [0, 5, 10], 10.0)  # the same curve in half the time
    slow = _runs(0.8, [0, 20, 40], 40.0)
    m = wallclock_margin([fast], [ex])
    # exact at t=5 interpolates to 0.575, at t=10 to 0.65: margins 0.075 and 0.15
    assert m["points"] == 2 and m["frac_above"] == 1.0
    assert m["min"] == pytest.approx(0.075) and m["mean"] == pytest.approx(0.1125)
    s = wallclock_margin([slow], [ex])
    assert s["points"] == 1 and s["min"] == pytest.approx(0.65 - 0.8)  # t=40 is outside


def test_aggregate_pairs_per_seed_and_targets_follow_the_numbers():
    per_seed = {}
    for seed, shift in ((0, 0.0), (1, 0.02)):
        e = 0.80 + shift
        per_seed[seed] = {
            "exact": _runs(e, [0, 10, 20], 20.0, (1.0, 1.0)),
            DEFAULT: _runs(e - 0.004, [0, 4, 8], 8.0, (0.99, 0.975), (0.01, 0.02)),
            "adaptive_b3": _runs(e - 0.002, [0, 4, 8], 8.0, (0.95, 0.95), (0.0, 0.01)),
            "adaptive_b4": _runs(e - 0.001, [0, 4, 8], 8.0, (0.99, 0.99), (0.0, 0.01)),
            "adaptive_b5": _runs(e - 0.010, [0, 4, 8], 8.0, (0.995, 0.995), (0.1, 0.2)),
            "eager": _runs(e - 0.04, [0, 6, 12], 12.0, (0.94, 0.94)),  # -5 %
            "nft": _runs(0.70, [0, 10, 20], 20.0),  # as fast as exact, lower
            "exact_fg2": _runs(e, [0, 15, 30], 30.0, (1.0, 1.0)),
            "adaptive_b4_fg2": _runs(e, [0, 15, 30], 15.0, (0.99, 0.99)),
            "exact_anchors": _runs(e - 0.008, [0, 10, 20], 20.0, (1.0, 1.0)),  # -1 %
        }
    memory = {"exact": 100, DEFAULT: 110, "eager": 400, "nft": 90, "exact_fg2": 50}
    agg = aggregate(per_seed, {**memory, "adaptive_b4_fg2": None})
    d = agg[DEFAULT]
    want = [-0.004 / 0.80, -0.004 / 0.82]
    assert (
        d["final_rel_diff"]["mean"] == pytest.approx(sum(want) / 2)
        and d["final_rel_diff"]["n"] == 2
    )
    assert d["final_diff"]["mean"] == pytest.approx(-0.004)
    # AUC of the evenly spaced curve (0.5, (0.5 + f) / 2, f) is (1 + 2 f) / 4: half of -0.004
    assert d["auc_diff"]["mean"] == pytest.approx(-0.002)
    assert d["train_seconds_ratio"]["mean"] == pytest.approx(0.4)
    assert d["step_seconds_ratio"]["mean"] == pytest.approx(9 / 21)
    assert d["peak_saved_rel"] == pytest.approx(1.1) and agg["eager"]["peak_saved_rel"] == 4.0
    assert agg["exact"]["final_rel_diff"]["mean"] == 0.0 and agg["exact"]["ref"] == "exact"
    f2 = agg["adaptive_b4_fg2"]
    assert f2["ref"] == "exact_fg2" and f2["train_seconds_ratio"]["mean"] == pytest.approx(0.5)
    assert f2["train_seconds_ratio_vs_exact"]["mean"] == pytest.approx(0.75)
    assert f2["peak_saved_rel"] is None
    assert agg["nft"]["wallclock_margin_vs_exact"]["points"] == 2
    assert agg["nft"]["wallclock_margin_vs_exact"]["mean"] < 0  # 0.6, 0.7 vs 0.65, 0.8 (seed 0)

    rows = {r["target"]: r for r in target_rows("digits", agg, per_seed)}
    assert all(r["task"] == "digits" for r in rows.values())
    assert rows[f"{DEFAULT}: final held-out reward within 1 % of exact"]["met"] is True
    tr = rows[f"{DEFAULT}: training phase <= 0.45 of exact (on-policy minibatches)"]
    assert tr["met"] is True and tr["measured"] == pytest.approx(0.4)
    assert rows[f"{DEFAULT}: whole GRPO step <= 0.64 of exact"]["met"] is True
    sh = rows[f"{DEFAULT}: systematic share <= 0.03 along the run"]
    assert sh["met"] is True and sh["measured"] == pytest.approx(0.02)
    b5 = rows["adaptive_b5: systematic share <= 0.03 along the run"]
    assert b5["met"] is False and b5["measured"] == pytest.approx(0.2)
    assert rows["adaptive_b4: per-batch cosine above uniform's at the same cost"]["met"] is True
    b4 = rows["adaptive_b4: final reward >= uniform's (paired over seeds)"]
    assert b4["met"] is True and b4["measured"] == pytest.approx(0.003)
    assert rows["adaptive_b4 does not lose reward to adaptive_b3"]["met"] is True
    lose = rows["adaptive_b5 does not lose reward to adaptive_b4"]
    assert lose["met"] is False and lose["measured"] == pytest.approx(-0.009)
    wc = rows[f"{DEFAULT}: reward vs wall-clock above exact at every evaluation after the initial"]
    assert wc["met"] is True and wc["measured"] > 0
    gain = rows["exact GRPO raises the held-out reward by > 0"]
    assert gain["measured"] == pytest.approx(0.31) and gain["met"] is True
    # Shapes has issue 21's bars: exact gains >= 0.08, the default within 2 % at <= 0.5.
    sh_rows = {r["target"]: r for r in target_rows("shapes", agg, per_seed)}
    assert sh_rows["exact GRPO raises the held-out reward by > 0.08"]["met"] is True
    assert sh_rows[f"{DEFAULT}: final held-out reward within 2 % of exact"]["met"] is True
    assert sh_rows[f"{DEFAULT}: training phase <= 0.5 of exact (on-policy minibatches)"]["met"]
    # Exact against itself: stated (never judged), the resolution of the rows above.
    self_ = sh_rows["exact against itself (exact_anchors, rounding apart): the resolution "
                    "of 'within x % of exact'"]  # fmt: skip
    assert self_["met"] is None
    assert self_["measured"] == pytest.approx((-0.008 / 0.80 - 0.008 / 0.82) / 2)
    assert "AUC -0.61 %" in self_["detail"] and "drift" in self_["detail"]
    nft = rows["nft vs exact: reward vs wall-clock (stated)"]
    assert nft["met"] is None and "exact ahead" in nft["detail"]

    # A default 5 % below exact, and a share above 0.03 at one probe, fail.
    for s in per_seed:
        e = per_seed[s]["exact"]["final_reward"]
        per_seed[s][DEFAULT] = _runs(0.95 * e, [0, 4, 8], 8.0, (0.99, 0.96), (0.01, 0.05))
    rows = {r["target"]: r for r in target_rows("digits", aggregate(per_seed), per_seed)}
    assert rows[f"{DEFAULT}: final held-out reward within 1 % of exact"]["met"] is False
    assert rows[f"{DEFAULT}: systematic share <= 0.03 along the run"]["met"] is False


def test_time_ratios_of_runs_timed_apart_are_flagged():
    """A variant added later with --resume divides its time by exact's from another
    process: its training-phase target is not judged and its ratios carry a dagger."""

    def at(run: dict, start: str, seconds: float) -> dict:
        return {**run, "started_at": f"2026-12-04T{start}+00:00", "total_seconds": seconds}

    per_seed = {
        s: {
            "exact": at(_runs(0.8, [0, 10, 20], 20.0), "10:00:00", 600.0),
            DEFAULT: at(_runs(0.8, [0, 4, 8], 8.0), "10:00:40", 590.0),  # lockstep
            "adaptive_b4": at(_runs(0.8, [0, 4, 8], 8.0), "10:11:00", 500.0),  # after exact
        }
        for s in (0, 1)
    }
    agg = aggregate(per_seed)
    assert agg[DEFAULT]["timed_with_ref"] is True
    assert agg["adaptive_b4"]["timed_with_ref"] is False
    assert agg["adaptive_b4"]["train_seconds_ratio"]["mean"] == pytest.approx(0.4)  # still shown
    rows = {r["target"]: r for r in target_rows("shapes", agg, per_seed)}
    tr = "training phase <= 0.5 of exact (on-policy minibatches)"
    assert rows[f"{DEFAULT}: {tr}"]["met"] is True
    apart = rows[f"adaptive_b4: {tr}"]
    assert apart["met"] is None and "NOT timed with exact" in apart["detail"]
    step = rows["adaptive_b4: whole GRPO step <= 0.64 of exact"]
    wall = rows["adaptive_b4: reward vs wall-clock above exact at every evaluation after the initial"]
    assert step["met"] is None and wall["met"] is None and "NOT timed" in wall["detail"]
    assert rows[f"{DEFAULT}: whole GRPO step <= 0.64 of exact"]["met"] is True
    # One seed timed together and one apart still counts as apart.
    per_seed[1]["adaptive_b4"] = at(per_seed[1]["adaptive_b4"], "10:05:00", 500.0)
    assert aggregate(per_seed)["adaptive_b4"]["timed_with_ref"] is False
    # Logs without the times (older raw files) are not flagged.
    for s in per_seed:
        for r in per_seed[s].values():
            r.pop("started_at")
    assert aggregate(per_seed)["adaptive_b4"]["timed_with_ref"] is True


def test_every_task_runs_exact_and_the_default_and_the_plan_fits():
    for t, st in TASKS.items():
        assert "exact" in st["variants"] and DEFAULT in st["variants"], t
        assert set(st["variants"]) <= set(VARIANTS)
    assert len(TASKS["digits"]["seeds"]) >= 4 and len(TASKS["shapes"]["seeds"]) >= 3
    assert "adaptive_b3" not in TASKS["shapes"]["variants"]
    studies = studies_for(["digits", "shapes"], quick=False)
    p2, p1 = plan(studies, 2), plan(studies, 1)
    assert p2["runs"] == sum(len(s["seeds"]) * len(s["variants"]) for s in studies.values())
    assert p1["minutes"] == pytest.approx(p1["worker_seconds"] / 60)
    assert p1["minutes"] / 2 <= p2["minutes"] < p1["minutes"]
    assert p2["minutes"] <= 120  # the budget on 2 cores
    assert studies_for(["shapes"], quick=True, steps=5)["shapes"]["steps"] == 5


def test_a_larger_group_reaches_every_run_and_scales_the_plan():
    # --group-size / --prompts-per-step (issue 21's levers): every variant's config gets the
    # group, and the plan's step costs scale with the samples per step (evaluations do not).
    base = studies_for(["shapes"], quick=False)["shapes"]
    big = studies_for(["shapes"], quick=False, group_size=8, prompts_per_step=None)["shapes"]
    assert big["group_size"] == 8 and big["prompts_per_step"] == base["prompts_per_step"]
    for name in big["variants"]:
        cfg = variant_config(name, 0, "shapes", big)
        assert (cfg.group_size, cfg.prompts_per_step) == (8, base["prompts_per_step"])
    no_eval = {"eval_every": 0, "probe_every": 0}
    one = plan({"shapes": {**base, **no_eval, "seeds": [0]}}, 1)["worker_seconds"]
    two = plan({"shapes": {**big, **no_eval, "seeds": [0]}}, 1)["worker_seconds"]
    fixed = plan({"shapes": {**base, **no_eval, "seeds": [0], "steps": 0}}, 1)["worker_seconds"]
    assert two - fixed == pytest.approx(2 * (one - fixed))


def test_lockstep_equals_standalone_runs_and_shares_prompts():
    """Interleaving the variants' steps in one process changes nothing in any run, and
    every variant of a seed trains on the same prompts (reseeded per step)."""
    study = studies_for(["digits"], quick=True, steps=3)["digits"]
    names = ["exact", DEFAULT, "subsample_4", "mixgrpo_W4", "nft"]
    logs = run_seed("digits", 3, names, study, progress=False)
    for n in names:
        alone = run_seed("digits", 3, [n], study, progress=False)[n]
        for key in ("steps", "evals"):
            a = [{k: v for k, v in r.items() if "seconds" not in k} for r in alone[key]]
            b = [{k: v for k, v in r.items() if "seconds" not in k} for r in logs[n][key]]
            assert a == b, (n, key)
    prompts = {n: [r["prompts"] for r in logs[n]["steps"]] for n in names}
    assert all(p == prompts["exact"] for p in prompts.values()), prompts
    assert len({str(p) for p in prompts["exact"]}) > 1  # fresh prompts every step
    # Without the reseeding, subsample_4's step draws shift the trainer's stream.
    plain = train(variant_config("subsample_4", 3, "digits", study))
    assert [r["prompts"] for r in plain["steps"]] != prompts["subsample_4"]


@pytest.fixture(scope="module")
def quick_run(run_benchmark) -> Path:
    return run_benchmark("benchmarks.quality", "--quick")


def test_quick_json(quick_run: Path):
    res = json.loads((quick_run / "quality.json").read_text())
    assert set(res["tasks"]) == {"digits", "shapes"}
    for task, t in res["tasks"].items():
        agg = t["aggregate"]
        assert set(agg) == set(TASKS[task]["variants"])
        assert t["study"]["steps"] == 2 and t["study"]["seeds"] == [0]
        B = t["study"]["prompts_per_step"] * t["study"]["group_size"]
        grad = {n: a["grad_samples_per_step"]["mean"] for n, a in agg.items()}
        fwd = {n: a["forward_samples_per_step"]["mean"] for n, a in agg.items()}
        # digits trains all T = 10 steps (window 4: 4 anchors), shapes the first 5
        # (window 5: 2 anchors); exact runs every trained step with grad.
        trained, anchors = (10, 4) if task == "digits" else (5, 2)
        assert grad["exact"] == fwd["exact"] == trained * B
        if "subsample_4" in agg:
            assert grad["subsample_4"] == grad["mixgrpo_W4"] == 4 * B
        assert fwd["uniform"] == grad["uniform"] == anchors * B
        assert agg["exact"]["peak_saved_rel"] == pytest.approx(1.0)
        if "eager" in agg:
            assert grad["eager"] == 4 * B and fwd["eager"] == 10 * B
            # The eager path keeps every window's graph; the deferred one the per-step loop's.
            assert agg["uniform"]["peak_saved_rel"] < agg["eager"]["peak_saved_rel"]
        # exact is not probed (its error is 0); every estimator of the GRPO gradient is.
        assert math.isnan(agg["exact"]["probe_cosine"]["mean"])
        for n, a in agg.items():
            if not n.startswith("nft") and n != "exact":  # NFT: no GRPO probe; exact: error 0
                assert -1.0 <= a["probe_cosine"]["mean"] <= 1.0
            if task == "digits" and n != "exact":  # 3 batches per probe: the bias metric
                assert math.isfinite(a["probe_share"]["mean"]), n
            assert a["train_seconds_ratio"]["mean"] > 0
            assert a["ref"] == ("exact_fg2" if n.endswith("_fg2") else "exact")
        curves = t["per_seed"]["0"][DEFAULT]["curves"]
        assert curves["eval_step"] == ([0, 1, 2] if task == "digits" else [0, 2])
        assert t["prompts_differ"] == []
    cats = res["tasks"]["shapes"]["aggregate"]["exact"]["categories"]["final"]
    assert {"counting", "position", "color_attr"} <= set(cats)
    ex = res["tasks"]["shapes"]["aggregate"]["exact"]
    assert 0.0 <= ex["final_strict_accuracy"]["mean"] <= 1.0
    assert {"counting", "position", "color_attr"} <= set(ex["categories_strict"]["final"])
    targets = {(r["task"], r["target"].split(":")[0]) for r in res["targets"]}
    assert ("shapes", DEFAULT) in targets and ("digits", DEFAULT) in targets


def test_quick_markdown_and_plots(quick_run: Path):
    md = (quick_run / "QUALITY.md").read_text()
    for s in ("## Targets", "## digits", "## shapes", f"| {DEFAULT} |", "| single_object |"):
        assert s in md
    shapes_md = md[md.index("## shapes") :]
    assert "| final strict accuracy |" in shapes_md and "Held-out strict accuracy" in shapes_md
    assert "strict accuracy" not in md[md.index("## digits") : md.index("## shapes")]
    assert "systematic share" in md
    assert "†" not in md  # lockstep: every variant timed with its reference
    assert (quick_run / "bias_vs_step_digits.png").read_bytes()[:8] == PNG_MAGIC
    for task in ("digits", "shapes"):
        for name in ("reward_vs_step", "reward_vs_wallclock", "cosine_vs_step"):
            data = (quick_run / f"{name}_{task}.png").read_bytes()
            assert data[:8] == PNG_MAGIC and len(data) > 5000


def test_raw_logs_kept_and_resumable(tmp_path: Path):
    """Each finished job's raw log is written atomically and recognised by --resume; a
    changed setting or a truncated file runs again."""
    study = studies_for(["digits"], quick=True, steps=1, probe_every=0)["digits"]
    names = ["exact", DEFAULT]
    _run_job(("digits", 5, names, study, str(tmp_path), False))
    _run_job(("digits", None, names, study, str(tmp_path), False))
    raw = _job_file(tmp_path, "digits", 5)
    assert finished_job(raw, "digits", 5, names, study)
    assert finished_job(_job_file(tmp_path, "digits", None), "digits", None, names, study)
    assert not finished_job(raw, "digits", 5, names, dict(study, steps=2))
    assert not finished_job(raw, "digits", 5, ["exact"], study)
    assert not finished_job(raw, "digits", 6, names, study)  # another seed's settings
    raw.write_text(raw.read_text()[:100])
    assert not finished_job(raw, "digits", 5, names, study)
    assert finished_runs(raw, "digits", 5, names, study) == {}
    assert not list(tmp_path.glob(".*.tmp"))  # no temporary file left behind


def test_resume_trains_only_the_added_variant(tmp_path: Path):
    """--resume with a variant added keeps the finished runs as they are (their timings
    too) and trains only the new one, which equals its run in the full lockstep job."""
    study = studies_for(["digits"], quick=True, steps=2, probe_every=0)["digits"]
    _run_job(("digits", 2, ["exact"], study, str(tmp_path), False))
    raw = _job_file(tmp_path, "digits", 2)
    first = json.loads(raw.read_text())["exact"]
    names = ["exact", "uniform_causal"]
    keep = finished_runs(raw, "digits", 2, names, study)
    assert list(keep) == ["exact"] and not finished_job(raw, "digits", 2, names, study)
    _run_job(("digits", 2, names, study, str(tmp_path), False, keep))
    logs = json.loads(raw.read_text())
    assert list(logs) == names and logs["exact"] == first
    assert finished_job(raw, "digits", 2, names, study)
    both = run_seed("digits", 2, names, study, progress=False)["uniform_causal"]
    for key in ("steps", "evals"):
        a = [{k: v for k, v in r.items() if "seconds" not in k} for r in both[key]]
        b = [{k: v for k, v in r.items() if "seconds" not in k}
             for r in logs["uniform_causal"][key]]  # fmt: skip
        assert a == b, key
    # A changed setting does not keep the run.
    assert finished_runs(raw, "digits", 2, names, dict(study, lr=3e-4)) == {}
    # A config field added after the run (absent from its log) keeps it when the study
    # wants the field's default, not when it wants another value.
    logs = json.loads(raw.read_text())
    for log in logs.values():
        del log["config"]["warmup_steps"]
    raw.write_text(json.dumps(logs))
    assert list(finished_runs(raw, "digits", 2, names, study)) == names
    warm = dict(study, settings={**study.get("settings", {}), "warmup_steps": 1})
    assert finished_runs(raw, "digits", 2, names, warm) == {}
    # A study that no longer names a variant reports only its own, though the raw file
    # keeps the other run (nothing is trained: the memory step only).
    out = tmp_path / "study"
    (out / "raw").mkdir(parents=True)
    kept = _job_file(out / "raw", "digits", 2)
    kept.write_text(raw.read_text())
    res = run_study({"digits": dict(study, seeds=[2], variants=["exact"])}, out,
                    workers=1, progress=False, resume=True)  # fmt: skip
    assert list(json.loads(kept.read_text())) == names
    t = res["tasks"]["digits"]
    assert t["variants"] == ["exact"] and list(t["aggregate"]) == ["exact"]
    assert t["per_seed"]["2"]["exact"]["train_seconds"] == first["train_seconds"]
    # --report-only --variants: the report of every run the raw file holds, trained nothing.
    res = run_study({}, out, progress=False, report_only=True, variants=names)
    t = res["tasks"]["digits"]
    assert t["variants"] == names and list(t["aggregate"]) == names
    assert t["study"]["variants"] == names
    assert t["per_seed"]["2"]["exact"]["train_seconds"] == first["train_seconds"]
    assert "uniform_causal" in (out / "QUALITY.md").read_text()


def test_pinned_variant_settings_survive_the_study_settings():
    """A variant's "pin" (the shapes study's 3-anchor causal run) is applied after the
    study's settings; the other variants take the study's window."""
    study = studies_for(["shapes"], quick=True)["shapes"]
    assert variant_config("uniform_causal", 0, "shapes", study).window == 5
    assert variant_config("uniform_causal_w4", 0, "shapes", study).window == 4
    assert "pin" not in variant_config("uniform_causal_w4", 0, "shapes", study).resolved()


@pytest.mark.parametrize("task", ["digits", "shapes"])
def test_exact_anchors_is_exact_up_to_rounding(task: str):
    """The calibration variant computes exact GRPO's gradient through the deferred anchor
    path (every step an anchor, the shapes study's window overridden): the probe finds it
    equal to exact's up to float32 rounding, where the default's fold is visibly not."""
    from jagg_autograd.trainer import GRPOTrainer

    study = studies_for([task], quick=True)[task]
    cfg = variant_config("exact_anchors", 0, task, study, eval_per_digit=0, probe_every=1)
    assert (cfg.mode, cfg.window, cfg.deferred) == ("jagg", 2, True)
    probe = GRPOTrainer(cfg).probe()
    assert probe["probe_rel_error"] < 1e-4 and probe["probe_cosine"] > 1 - 1e-8
    folded = variant_config(DEFAULT, 0, task, study, eval_per_digit=0, probe_every=1)
    assert GRPOTrainer(folded).probe()["probe_rel_error"] > 1e-2


def test_runs_logged_before_the_runaway_guard_keep_their_meaning():
    """A run logged before ``guard_ratio`` existed ran unguarded: it still counts as the
    unguarded "uniform" run, never as "uniform_guard" (the trainer's default since)."""
    from benchmarks.quality import _same_config

    study = studies_for(["shapes"], quick=True)["shapes"]
    plain = variant_config("uniform", 0, "shapes", study).resolved()
    guarded = variant_config("uniform_guard", 0, "shapes", study).resolved()
    assert plain["guard_ratio"] is None and guarded["guard_ratio"] == 1.5
    old = {k: v for k, v in plain.items() if k not in ("guard_ratio", "guard_window")}
    assert _same_config(old, plain)
    assert not _same_config(old, guarded)
    assert not _same_config({**old, "guard_ratio": 1.5, "guard_window": 10}, plain)


def test_ratios_to_an_unresolved_signal_are_marked():
    """bias / signal and cos(E est, E exact) divide by the probes' estimate of the GRPO
    signal; where that is within 2 of its own floor SDs the cell says so."""
    from benchmarks.quality import _to_signal

    def agg(sig: float, floor: float) -> dict:
        return {"probe_bias_to_signal": {"mean": 1.39}, "probe_expected_cosine": {"mean": -0.11},
                "probe_signal_fraction": {"mean": sig}, "probe_signal_floor_sd": {"mean": floor}}  # fmt: skip

    low = agg(0.00035, 0.0003)  # the groups-of-16 probe over 40 batches: 1.2 floor SDs
    assert _to_signal(low, "probe_bias_to_signal", ".3f") == "1.390 (signal not resolved)"
    assert _to_signal(low, "probe_expected_cosine", "+.3f") == "-0.110 (signal not resolved)"
    assert _to_signal(agg(0.04, 0.005), "probe_bias_to_signal", ".3f") == "1.390"
    # Older probes kept no floor: shown as they are.
    assert _to_signal(agg(0.04, math.nan), "probe_bias_to_signal", ".3f") == "1.390"
    nan_ratio = {**low, "probe_bias_to_signal": {"mean": math.nan}}
    assert _to_signal(nan_ratio, "probe_bias_to_signal", ".3f") == "n/a"


_ORPHAN_SCRIPT = """
import multiprocessing as mp
import time

from benchmarks.quality import workers_die_with_study


def _sleep(x):
    time.sleep(120)


if __name__ == "__main__":
    with workers_die_with_study(), mp.get_context("spawn").Pool(2) as pool:
        res = pool.map_async(_sleep, range(2))
        print(" ".join(str(p.pid) for p in pool._pool), flush=True)
        res.get()
"""


def test_a_killed_study_takes_its_workers_with_it(tmp_path: Path):
    """SIGTERM to the study's process (``pkill -f``) terminates its pool's workers; with
    the default handler they went on running as orphans."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "study.py"
    script.write_text(_ORPHAN_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                            text=True)  # fmt: skip
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        for p in pids:
            os.kill(p, 0)  # alive
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in alive if _alive(p)]
            time.sleep(0.2)
        assert not alive, f"workers {alive} outlived the study"
    finally:
        proc.kill()


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
