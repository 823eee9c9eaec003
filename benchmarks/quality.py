"""End-to-end quality study: does GRPO with JAGG learn as well as exact GRPO?

    python -m benchmarks.quality            # the study: ~30 min on 2 CPU cores
    python -m benchmarks.quality --quick    # < 1 min: every variant, 3 steps, 1 seed (CI)

Online Flow-GRPO on the embedded digits DiT (:mod:`jagg_autograd.trainer`), the same
prompts, rollout noise, rollout budget (8 prompts x 4 samples, T = 10 SDE steps) and
AdamW settings for every variant:

* ``exact``: every step with grad (T backward passes of B samples per step);
* ``jagg_W{3,4,5}`` with shared anchors and ``..._disjoint`` (the paper's layout);
* ``router_*``: JAGG W = 4 (shared) + :class:`~jagg_autograd.CosineRouter` at several
  thresholds / ``jagg_frac`` values (each spelt out, not taken from the defaults);
* ``subsample_4``: DanceGRPO's timestep subsampling, 4 random steps per sample: the
  backward budget of JAGG W = 4 with shared anchors (4 anchors);
* ``mixgrpo_W4``: MixGRPO's sliding window of 4 SDE steps (ODE elsewhere), the window
  moving from the first step to the last over the run; the same budget.

Every variant of a seed runs in ONE process in lockstep (step i of every variant, in an
order rotated every step), so machine noise hits all of them alike and their wall-clock
ratios are side by side; seeds run in ``--workers`` processes of one thread each.  Along
the run: a held-out evaluation (ODE sampler, 50 samples per digit from noise never used
in training, identical for every variant and seed) every ``--eval-every`` steps, and a
gradient probe (cosine / relative error of the variant's gradient to the exact gradient
on a fresh full-SDE batch of its current policy) every ``--probe-every`` steps.  Neither
enters the timings.

Outputs (``--out``, default ``benchmarks/results/quality``): ``quality.json`` (settings,
per-seed curves and the aggregates), ``QUALITY.md`` (tables, targets, the calibration)
and ``reward_vs_step.png``, ``reward_vs_wallclock.png``, ``cosine_vs_step.png``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import multiprocessing as mp
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/quality.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.common import machine_info

VARIANTS: dict[str, dict[str, Any]] = {
    "exact": {"mode": "exact"},
    "jagg_W3": {"mode": "jagg", "window": 3},
    "jagg_W4": {"mode": "jagg", "window": 4},
    "jagg_W5": {"mode": "jagg", "window": 5},
    "jagg_W3_disjoint": {"mode": "jagg", "window": 3, "shared_anchors": False},
    "jagg_W4_disjoint": {"mode": "jagg", "window": 4, "shared_anchors": False},
    "jagg_W5_disjoint": {"mode": "jagg", "window": 5, "shared_anchors": False},
    "router_t0.70": {"mode": "router", "window": 4, "threshold": 0.7, "jagg_frac": None},
    "router_t0.80": {"mode": "router", "window": 4, "threshold": 0.8, "jagg_frac": None},
    "router_t0.85": {"mode": "router", "window": 4, "threshold": 0.85, "jagg_frac": None},
    "router_t0.90": {"mode": "router", "window": 4, "threshold": 0.9, "jagg_frac": None},
    "router_f0.75": {"mode": "router", "window": 4, "threshold": -1.0, "jagg_frac": 0.75},
    "router_f0.50": {"mode": "router", "window": 4, "threshold": -1.0, "jagg_frac": 0.5},
    "subsample_4": {"mode": "subsample", "window": 4, "subsample_steps": 4},
    "mixgrpo_W4": {"mode": "mixgrpo", "window": 4},
}

GROUPS = {
    "JAGG window and anchor layout": [
        "exact", "jagg_W3", "jagg_W4", "jagg_W5",
        "jagg_W3_disjoint", "jagg_W4_disjoint", "jagg_W5_disjoint",
    ],
    "JAGG W=4 + CosineRouter": [
        "exact", "jagg_W4", "router_t0.70", "router_t0.80", "router_t0.85", "router_t0.90",
        "router_f0.75", "router_f0.50",
    ],
    "equal backward budget (4 x B)": ["exact", "jagg_W4", "subsample_4", "mixgrpo_W4"],
}  # fmt: skip

STUDIES: dict[str, dict[str, Any]] = {
    "full": {
        "seeds": [0, 1, 2, 3],
        "steps": 100,
        "eval_every": 10,
        "probe_every": 10,
        "eval_per_digit": 50,
        "prompts_per_step": 8,
        "group_size": 4,
        "workers": 2,
    },
    "quick": {
        "seeds": [0],
        "steps": 3,
        "eval_every": 1,
        "probe_every": 1,
        "eval_per_digit": 2,
        "prompts_per_step": 4,
        "group_size": 2,
        "workers": 1,
    },
}

EVAL_SEED = 424_242  # one held-out noise set for every variant and seed
REL_TOLERANCE = 0.02  # the "within 2 % of exact"


# ------------------------------------------------------------------------------------ runs


def variant_config(name: str, seed: int, study: dict[str, Any]) -> Any:
    """The :class:`GRPOConfig` of variant ``name`` at ``seed`` under ``study``'s settings."""
    from jagg_autograd.trainer import GRPOConfig

    return GRPOConfig(
        steps=study["steps"],
        prompts_per_step=study["prompts_per_step"],
        group_size=study["group_size"],
        eval_per_digit=study["eval_per_digit"],
        eval_every=study["eval_every"],
        eval_sampler="ode",
        eval_seed=EVAL_SEED,
        probe_every=study["probe_every"],
        seed=seed,
        threads=1,
        progress=False,
        **VARIANTS[name],
    )


def run_seed(
    seed: int, names: Sequence[str], study: dict[str, Any], progress: bool = True
) -> dict[str, dict[str, Any]]:
    """Train every variant of ``names`` at ``seed`` in lockstep; returns name -> train log."""
    from jagg_autograd.trainer import GRPOTrainer

    t0 = time.perf_counter()
    trainers = {n: GRPOTrainer(variant_config(n, seed, study)) for n in names}
    order = list(names)
    for i in range(study["steps"]):
        # Rotating the order spreads any drift in machine speed over all variants alike.
        rot = i % len(order)
        for n in order[rot:] + order[:rot]:
            trainers[n].step()
        if progress and (i + 1) % max(1, study["steps"] // 10) == 0:
            print(
                f"[quality] seed {seed}: step {i + 1}/{study['steps']} "
                f"({time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
    return {n: t.finish() for n, t in trainers.items()}


def _run_seed_job(args: tuple[int, list[str], dict[str, Any], str | None, bool]) -> int:
    seed, names, study, raw_dir, progress = args
    logs = run_seed(seed, names, study, progress)
    if raw_dir is not None:
        from jagg_autograd.trainer import _write_json_atomic

        # Atomic (temporary file + rename): an interrupted study never leaves half a seed,
        # and every seed written before the interruption is kept.
        _write_json_atomic(Path(raw_dir) / f"seed{seed}.json", logs)
    return seed


def finished_seed(path: Path, seed: int, names: Sequence[str], study: dict[str, Any]) -> bool:
    """True when ``path`` holds finished runs of exactly these variants and settings.

    What ``--resume`` skips: every variant's log finished and its logged (resolved) config
    equals what this study would run now (so changed settings or code defaults re-run).
    """
    try:
        logs = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(logs, dict) or set(logs) != set(names):
        return False
    for n in names:
        want = json.loads(json.dumps(variant_config(n, seed, study).resolved()))
        log = logs[n]
        if log.get("status", "finished") != "finished" or log.get("config") != want:
            return False
    return True


# ------------------------------------------------------------------------------ statistics


def auc(steps: Sequence[float], values: Sequence[float]) -> float:
    """Mean of the curve over ``[steps[0], steps[-1]]`` (trapezoids; one point: itself)."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    if x.size == 1:
        return float(y[0])
    return float(np.sum((y[1:] + y[:-1]) * np.diff(x)) / 2 / (x[-1] - x[0]))


def mean_std(xs: Sequence[float]) -> dict[str, float]:
    """Mean and sample standard deviation (0 for one value) of finite ``xs``."""
    a = np.asarray([x for x in xs if x is not None and math.isfinite(x)], dtype=np.float64)
    if a.size == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {
        "mean": float(a.mean()),
        "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
        "n": int(a.size),
    }


def per_seed_summary(log: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run that the study aggregates, and its curves."""
    rows = log["steps"]
    evals = log["evals"]
    B = log["config"]["prompts_per_step"] * log["config"]["group_size"]
    probes = [r for r in rows if "probe_cosine" in r]
    ev_steps = [e["step"] for e in evals]
    ev_reward = [e["mean_reward"] for e in evals]
    return {
        "initial_reward": ev_reward[0],
        "final_reward": ev_reward[-1],
        "auc_reward": auc(ev_steps, ev_reward),
        "train_seconds": log["train_seconds"],
        "step_seconds": log["train_seconds"] + log["rollout_seconds"],
        "median_train_step_seconds": float(np.median([r["train_seconds"] for r in rows])),
        "median_step_seconds": float(
            np.median([r["train_seconds"] + r["rollout_seconds"] for r in rows])
        ),
        "backward_passes_per_step": float(np.mean([r["grad_samples"] / B for r in rows])),
        "backward_calls_per_step": float(np.mean([r["backward_calls"] for r in rows])),
        "probe_cosine": float(np.mean([r["probe_cosine"] for r in probes])),
        "probe_rel_error": float(np.mean([r["probe_rel_error"] for r in probes])),
        "routed_frac": float(np.mean([r["routed_frac"] for r in rows])),
        "rollout_reward_last10": float(np.mean([r["reward_mean"] for r in rows[-10:]])),
        "curves": {
            "eval_step": ev_steps,
            "eval_reward": ev_reward,
            "eval_wall_seconds": [e["wall_seconds"] for e in evals],
            "probe_step": [r["step"] for r in probes],
            "probe_cosine": [r["probe_cosine"] for r in probes],
            "probe_rel_error": [r["probe_rel_error"] for r in probes],
            "routed_frac": [r["routed_frac"] for r in rows],
            "rollout_reward": [r["reward_mean"] for r in rows],
        },
    }


SCALARS = (
    "initial_reward", "final_reward", "auc_reward", "train_seconds", "step_seconds",
    "median_train_step_seconds", "median_step_seconds", "backward_passes_per_step",
    "backward_calls_per_step", "probe_cosine", "probe_rel_error", "routed_frac",
    "rollout_reward_last10",
)  # fmt: skip


def aggregate(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Mean +- std over seeds of every figure, plus the per-seed paired ratios to exact."""
    seeds = sorted(per_seed)
    names = list(per_seed[seeds[0]])
    out: dict[str, dict[str, Any]] = {}
    for n in names:
        runs = [per_seed[s][n] for s in seeds]
        ex = [per_seed[s]["exact"] for s in seeds] if "exact" in names else None
        agg: dict[str, Any] = {k: mean_std([r[k] for r in runs]) for k in SCALARS}
        if ex is not None:
            # Paired per seed: same prompts, rollout noise and evaluation noise as exact.
            for k in ("final_reward", "auc_reward"):
                agg[k.replace("reward", "rel_diff")] = mean_std(
                    [(r[k] - e[k]) / e[k] for r, e in zip(runs, ex)]
                )
            for k in ("train_seconds", "step_seconds"):
                agg[f"{k}_ratio"] = mean_std([r[k] / e[k] for r, e in zip(runs, ex)])
            agg["wallclock_margin"] = wallclock_margin(runs, ex)
        agg["seeds"] = seeds
        out[n] = agg
    return out


def wallclock_margin(runs: Sequence[dict[str, Any]], exact: Sequence[dict[str, Any]]) -> dict:
    """Reward of the variant minus exact's at the same wall-clock time, over the run.

    For every seed and every evaluation of the variant after step 0 at wall-clock ``t``
    inside exact's time range, exact's reward is interpolated at ``t``; the margins are
    averaged over seeds per evaluation point.  ``min`` > 0 means above exact everywhere.
    """
    margins = []
    for r, e in zip(runs, exact):
        c, ce = r["curves"], e["curves"]
        m = []
        for t, y in zip(c["eval_wall_seconds"][1:], c["eval_reward"][1:]):
            if t <= ce["eval_wall_seconds"][-1]:
                m.append(y - float(np.interp(t, ce["eval_wall_seconds"], ce["eval_reward"])))
        margins.append(m)
    n = min((len(m) for m in margins), default=0)
    if n == 0:
        return {"min": math.nan, "mean": math.nan, "frac_above": math.nan, "points": 0}
    avg = np.mean([m[:n] for m in margins], axis=0)
    return {
        "min": float(avg.min()),
        "mean": float(avg.mean()),
        "frac_above": float((avg > 0).mean()),
        "points": int(n),
    }


# --------------------------------------------------------------------------------- targets


def _m(agg: dict[str, Any], name: str, key: str) -> float:
    return agg[name][key]["mean"] if name in agg and key in agg[name] else math.nan


def target_rows(agg: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets with the measured value of each (``met`` None: no data)."""
    rows: list[dict[str, Any]] = []

    def add(target: str, measured: float, met: bool | None, detail: str) -> None:
        rows.append({"target": target, "measured": measured, "met": met, "detail": detail})

    routers = [n for n in agg if n.startswith("router_")]
    for n in ["jagg_W4", *routers]:
        d = _m(agg, n, "final_rel_diff")
        if math.isfinite(d):
            add(
                f"final held-out reward of {n} within 2 % of exact",
                d,
                d >= -REL_TOLERANCE,
                f"paired relative difference {100 * d:+.2f} % "
                f"(std over seeds {100 * agg[n]['final_rel_diff']['std']:.2f} %)",
            )
    jaggs = [n for n in agg if n.startswith(("jagg_", "router_"))]
    ratios = {n: _m(agg, n, "train_seconds_ratio") for n in jaggs}
    ratios = {n: r for n, r in ratios.items() if math.isfinite(r)}
    if ratios:
        best = min(ratios, key=ratios.get)
        add(
            "training-phase wall-clock of the best JAGG variant <= 0.65 of exact",
            ratios[best],
            ratios[best] <= 0.65,
            f"best: {best}; jagg_W4 (shared, floor ~0.60) {ratios.get('jagg_W4', math.nan):.3f}, "
            f"jagg_W4_disjoint (floor ~0.67) {ratios.get('jagg_W4_disjoint', math.nan):.3f}",
        )
    for n in ["jagg_W4", *routers]:
        if n in agg and "wallclock_margin" in agg[n]:
            w = agg[n]["wallclock_margin"]
            if w["points"]:
                add(
                    f"reward vs wall-clock of {n} above exact's over the whole run",
                    w["min"],
                    w["min"] > 0,
                    f"min margin {w['min']:+.4f}, mean {w['mean']:+.4f}, above at "
                    f"{100 * w['frac_above']:.0f} % of {w['points']} evaluation points",
                )
    cj = _m(agg, "jagg_W4", "probe_cosine")
    for base in ("subsample_4", "mixgrpo_W4"):
        cb = _m(agg, base, "probe_cosine")
        if math.isfinite(cj) and math.isfinite(cb):
            add(
                f"gradient cosine to exact at equal budget: jagg_W4 above {base}",
                cj - cb,
                cj > cb,
                f"jagg_W4 {cj:.3f} vs {base} {cb:.3f}",
            )
    return rows


def calibrate(agg: dict[str, Any]) -> dict[str, Any]:
    """The router setting that keeps the final reward within the tolerance at least cost.

    Candidates: every ``router_*`` variant whose paired final-reward difference to exact is
    >= -2 %; the cheapest by training-phase wall-clock wins.  ``jagg_W4`` (no router) is
    reported beside it: when it passes too, routing buys no reward on this model.
    """
    cand = {}
    for n in agg:
        if n.startswith("router_") or n == "jagg_W4":
            d = _m(agg, n, "final_rel_diff")
            if math.isfinite(d) and d >= -REL_TOLERANCE:
                cand[n] = _m(agg, n, "train_seconds_ratio")
    routers = {n: r for n, r in cand.items() if n.startswith("router_")}
    best = min(routers, key=routers.get) if routers else None
    return {
        "rule": "cheapest router_* (training wall-clock) with final reward >= -2 % of exact",
        "candidates": cand,
        "chosen": best,
        "chosen_settings": VARIANTS[best] if best else None,
        "jagg_W4_passes": "jagg_W4" in cand,
    }


# ---------------------------------------------------------------------------------- report


def _fmt(ms: dict[str, float], scale: float = 1.0, digits: int = 3, pct: bool = False) -> str:
    if ms is None or not math.isfinite(ms["mean"]):
        return "n/a"
    m, s = ms["mean"] * scale, ms["std"] * scale
    if pct:
        return f"{m:+.{digits}f} ± {s:.{digits}f} %"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def markdown(res: dict[str, Any]) -> str:
    agg = res["aggregate"]
    st = res["study"]
    ex = agg.get("exact")
    lines = [
        "# Quality study: GRPO with JAGG vs exact GRPO on the digits DiT",
        "",
        f"`{res['command']}` — {res['date']}, {res['wall_seconds'] / 60:.1f} min on "
        f"{res['machine']['cpu_count']} CPU cores ({st['workers']} worker processes, 1 thread "
        f"each), commit `{res['machine']['git_commit']}`.",
        "",
        f"Settings: {st['steps']} GRPO steps of {st['prompts_per_step']} prompts x "
        f"{st['group_size']} samples, T = 10 SDE steps (eta 0.7), full fine-tuning with AdamW "
        f"lr 1e-4, seeds {st['seeds']}; held-out evaluation every {st['eval_every']} steps "
        f"with the ODE sampler on {10 * st['eval_per_digit']} samples (fixed noise, never "
        f"trained on); gradient probe every {st['probe_every']} steps.  Mean ± std over seeds; "
        "differences and ratios to exact are paired per seed.",
        "",
    ]
    if ex:
        gain = ex["final_reward"]["mean"] - ex["initial_reward"]["mean"]
        lines += [
            f"Exact GRPO raises the held-out reward from {ex['initial_reward']['mean']:.3f} to "
            f"{ex['final_reward']['mean']:.3f} ± {ex['final_reward']['std']:.3f} "
            f"({gain:+.3f}).",
            "",
        ]
    lines += [
        "| variant | final reward | Δ final vs exact | AUC reward | Δ AUC | train time / exact "
        "| step time / exact | reward − exact's at equal wall-clock (mean / min) "
        "| bwd passes / step | grad cosine | grad rel. err | routed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, a in agg.items():
        w = a.get("wallclock_margin", {})
        wm = f"{w['mean']:+.3f} / {w['min']:+.3f}" if w.get("points") and n != "exact" else "–"
        lines.append(
            f"| {n} | {_fmt(a['final_reward'])} | {_fmt(a.get('final_rel_diff'), 100, 2, True)} "
            f"| {_fmt(a['auc_reward'])} | {_fmt(a.get('auc_rel_diff'), 100, 2, True)} "
            f"| {_fmt(a.get('train_seconds_ratio'))} | {_fmt(a.get('step_seconds_ratio'))} "
            f"| {wm} | {a['backward_passes_per_step']['mean']:.2f} | {_fmt(a['probe_cosine'])} "
            f"| {_fmt(a['probe_rel_error'])} | {a['routed_frac']['mean']:.3f} |"
        )
    if ex:
        lines += [
            "",
            f"Exact: training phase {ex['train_seconds']['mean']:.1f} s, whole steps "
            f"{ex['step_seconds']['mean']:.1f} s per run (medians per step "
            f"{ex['median_train_step_seconds']['mean']:.3f} s / "
            f"{ex['median_step_seconds']['mean']:.3f} s).",
        ]
    lines += ["", "## Targets", "", "| target | measured | met | detail |", "|---|---|---|---|"]
    for r in res["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[r["met"]]
        lines.append(f"| {r['target']} | {r['measured']:+.4f} | {met} | {r['detail']} |")
    cal = res["calibration"]
    lines += [
        "",
        "## Router calibration",
        "",
        f"Rule: {cal['rule']}.  Candidates (train-time ratio): "
        + (", ".join(f"{n} {r:.3f}" for n, r in cal["candidates"].items()) or "none")
        + f".  Chosen: **{cal['chosen']}** {cal['chosen_settings']}.",
        "",
        "![reward vs step](reward_vs_step.png)",
        "",
        "![reward vs wall-clock](reward_vs_wallclock.png)",
        "",
        "![gradient cosine vs step](cosine_vs_step.png)",
        "",
    ]
    return "\n".join(lines)


def _band(ax: Any, x: np.ndarray, ys: np.ndarray, label: str, **kw: Any) -> None:
    m = ys.mean(0)
    ax.plot(x, m, label=label, **kw)
    if ys.shape[0] > 1:
        s = ys.std(0, ddof=1)
        ax.fill_between(x, m - s, m + s, alpha=0.12, color=ax.lines[-1].get_color())


def plots(res: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    per_seed = res["per_seed"]
    seeds = sorted(per_seed, key=int)

    def curves(name: str, key: str) -> np.ndarray:
        c = [per_seed[s][name]["curves"][key] for s in seeds]
        n = min(len(x) for x in c)
        return np.asarray([x[:n] for x in c], dtype=np.float64)

    names = list(per_seed[seeds[0]])
    groups = {g: [n for n in ns if n in names] for g, ns in GROUPS.items()}
    for fname, xkey, xlabel in (
        ("reward_vs_step.png", "eval_step", "GRPO step"),
        ("reward_vs_wallclock.png", "eval_wall_seconds", "wall-clock of rollouts + training (s)"),
    ):
        fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4.5), dpi=100)
        for ax, (title, ns) in zip(np.atleast_1d(axes), groups.items()):
            for n in ns:
                x = curves(n, xkey).mean(0)
                style = {"color": "black", "lw": 2.2} if n == "exact" else {"lw": 1.4}
                _band(ax, x, curves(n, "eval_reward"), n, **style)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel("held-out reward (ODE sampler)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5), dpi=100)
    cos_groups = [
        ("JAGG layouts", [n for n in groups[next(iter(GROUPS))] if n != "exact"]),
        ("equal backward budget + routers", [
            n for n in names if n.startswith(("router_", "subsample", "mixgrpo")) or n == "jagg_W4"
        ]),
    ]  # fmt: skip
    for ax, (title, ns) in zip(axes[:2], cos_groups):
        for n in ns:
            _band(ax, curves(n, "probe_step").mean(0), curves(n, "probe_cosine"), n, lw=1.4)
        ax.set_title(f"gradient cosine to exact: {title}", fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("cosine")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")
    ax = axes[2]
    for n in names:
        if n.startswith("router_"):
            y = curves(n, "routed_frac")
            _band(ax, np.arange(y.shape[1]), y, n, lw=1.2)
    ax.set_title("fraction of (window, sample) pairs routed to exact", fontsize=10)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("routed fraction")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "cosine_vs_step.png")
    plt.close(fig)


# ------------------------------------------------------------------------------------ main


def run_study(
    study: dict[str, Any],
    names: Sequence[str],
    out: Path,
    progress: bool = True,
    report_only: bool = False,
    resume: bool = False,
) -> dict[str, Any]:
    """Run every seed (``study['workers']`` processes), aggregate, write the outputs.

    ``report_only``: train nothing; rebuild the outputs from ``out/raw/seed*.json`` of an
    earlier run (its command, date, duration and machine are kept from its quality.json).
    ``resume``: skip the seeds whose raw log already holds these finished runs
    (:func:`finished_seed`), e.g. after an interrupted study.
    """
    t0 = time.perf_counter()
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    run = {
        "command": "python -m benchmarks.quality " + " ".join(sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch.device("cpu")),
    }
    if report_only:
        old = json.loads((out / "quality.json").read_text(encoding="utf-8"))
        run = {k: old[k] for k in ("command", "date", "machine", "wall_seconds")}
        study = old["study"]
    else:
        todo = [
            s
            for s in study["seeds"]
            if not (resume and finished_seed(raw / f"seed{s}.json", s, names, study))
        ]
        if progress and len(todo) < len(study["seeds"]):
            print(f"[quality] resuming: seeds {todo} to run", file=sys.stderr, flush=True)
        jobs = [(s, list(names), study, str(raw), progress) for s in todo]
        if study["workers"] > 1 and len(jobs) > 1:
            # spawn: a fresh interpreter per worker, no forked torch thread pools.
            with mp.get_context("spawn").Pool(min(study["workers"], len(jobs))) as pool:
                list(pool.imap_unordered(_run_seed_job, jobs))
        else:
            for j in jobs:
                _run_seed_job(j)
        run["wall_seconds"] = time.perf_counter() - t0
    logs = {s: json.loads((raw / f"seed{s}.json").read_text()) for s in study["seeds"]}
    names = list(logs[study["seeds"][0]])
    per_seed = {s: {n: per_seed_summary(lg) for n, lg in logs[s].items()} for s in logs}
    agg = aggregate(per_seed)
    res: dict[str, Any] = {
        **run,
        "study": study,
        "variants": {n: VARIANTS[n] for n in names},
        # As the runs logged it (the defaults of today's code may differ).
        "config": logs[study["seeds"][0]][names[0]]["config"],
        "aggregate": agg,
        "targets": target_rows(agg),
        "calibration": calibrate(agg),
        "per_seed": {str(s): v for s, v in per_seed.items()},
    }
    with open(out / "quality.json", "w", encoding="utf-8") as fh:
        json.dump(res, fh, indent=1)
    (out / "QUALITY.md").write_text(markdown(res), encoding="utf-8")
    plots(res, out)
    return res


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.quality", description=__doc__.split("\n")[0]
    )
    p.add_argument("--quick", action="store_true", help="CI mode: 3 steps, 1 seed, tiny batches")
    p.add_argument("--seeds", type=int, nargs="+", help="override the seeds")
    p.add_argument("--steps", type=int, help="override the GRPO steps")
    p.add_argument("--workers", type=int, help="processes (one thread each)")
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="subset (exact is added)")
    p.add_argument("--out", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild quality.json / QUALITY.md / plots from --out's raw logs, train nothing",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the seeds whose raw log already holds these finished runs",
    )
    args = p.parse_args(argv)
    study = dict(STUDIES["quick" if args.quick else "full"])
    for k in ("seeds", "steps", "workers"):
        if getattr(args, k) is not None:
            study[k] = getattr(args, k)
    if study["steps"] < 1 or study["workers"] < 1 or not study["seeds"]:
        p.error("--steps and --workers must be >= 1 and --seeds non-empty")
    names = list(VARIANTS) if args.variants is None else ["exact", *[
        n for n in args.variants if n != "exact"
    ]]  # fmt: skip
    default_out = "benchmarks/results/quality" + ("_quick" if args.quick else "")
    out = Path(args.out or default_out)
    res = run_study(
        study,
        names,
        out,
        progress=not args.no_progress,
        report_only=args.report_only,
        resume=args.resume,
    )
    print((out / "QUALITY.md").read_text(encoding="utf-8").split("## Router calibration")[0])
    print(f"[quality] {res['wall_seconds']:.0f} s; outputs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
