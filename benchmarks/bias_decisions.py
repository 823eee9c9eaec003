"""Do the estimators' other per-sample decisions bias the GRPO gradient?  (issue 18, item 4)

    python -m benchmarks.bias_decisions [--train-steps 0 15] [--batches 24] [--out DIR]

Digits task at the quality study's settings (8 prompts x 4, T = 10 SDE steps at eta = 0.7,
the full DiT, AdamW lr 1e-4, seed 0).  The policy is trained with exact GRPO for each of
``--train-steps`` (cumulative); at each point every variant below is measured with the
trainer's own probe (:meth:`jagg_autograd.trainer.GRPOTrainer.probe`, ``--batches`` fresh
full-SDE batches, the same prompts and noise for every variant, the estimator's loss and
the batched exact one on each): systematic share, bias to signal, cos(E est, E exact),
per-batch cosine, plain and in the metric of the trained AdamW state.

Variants (each a ``GRPOConfig`` change from the study's ``uniform``):

* ``uniform`` (reference, linear fold) and ``adaptive_b4`` (group-fair placement);
* ``router`` at its defaults (threshold 0.7, no jagg_frac), ``router_t0.95`` (a threshold
  that routes a sizeable share), ``router_jf0.5`` (jagg_frac 0.5: half of each window's
  samples, the lowest scores, routed to exact: a per-sample decision ranked in the batch);
* ``jagg_random_t0.5`` / ``exact_random_t0.5``: per-sample random timestep selection
  (``timestep_selection="random"``, ``timestep_fraction=0.5``), JAGG and exact;
* ``subsample_4`` (DanceGRPO: 4 random steps per sample) and ``mixgrpo_W4`` (MixGRPO's
  window at the probe's step).

For the routers, also the Spearman correlation over (window, sample) pairs of the
routing decision with |A| and with A (the leak the issue asks about: a decision that
tracks the advantage).  Writes ``bias_decisions.json`` and ``BIAS_DECISIONS.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from jagg_autograd.grpo import group_advantages
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

BASE = dict(mode="jagg", window=4, shared_anchors=True, reuse_values=True, deferred=True,
            placement="uniform", budget=None, fold="linear")  # fmt: skip
VARIANTS: dict[str, dict[str, Any]] = {
    "uniform": {},
    "adaptive_b4": {"placement": "adaptive", "budget": 4.0},
    "router": {"mode": "router", "threshold": 0.7, "jagg_frac": None},
    "router_t0.95": {"mode": "router", "threshold": 0.95, "jagg_frac": None},
    "router_jf0.5": {"mode": "router", "threshold": 0.7, "jagg_frac": 0.5},
    "jagg_random_t0.5": {"timestep_selection": "random", "timestep_fraction": 0.5},
    "exact_random_t0.5": {"mode": "exact", "exact_loop": True, "timestep_selection": "random",
                          "timestep_fraction": 0.5},
    "subsample_4": {"mode": "subsample", "subsample_steps": 4},
    "mixgrpo_W4": {"mode": "mixgrpo"},
}  # fmt: skip
KEYS = ("probe_systematic_share", "probe_systematic_share_floor_sd", "probe_bias_to_signal",
        "probe_expected_cosine", "probe_mean_cosine", "probe_min_cosine",
        "probe_signal_fraction", "probe_systematic_share_adam", "probe_bias_to_signal_adam",
        "probe_routed_frac")  # fmt: skip


def _spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    def rank(v: torch.Tensor) -> torch.Tensor:
        # average ranks of ties
        v = v.double()
        order = v.argsort()
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for u in v.unique():
            m = v == u
            r[m] = r[m].mean()
        return r

    rx, ry = rank(x), rank(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    den = float(rx.norm() * ry.norm())
    return float((rx @ ry) / den) if den > 0 else float("nan")


def routing_vs_advantage(tr: GRPOTrainer, n_batches: int) -> dict[str, float]:
    """Spearman of the router's per-(window, sample) decision with |A| and A over the probe's
    batches (the same batches the probe draws)."""
    c = tr.config
    routed, absa, adv = [], [], []
    for b in range(n_batches):
        g = torch.Generator().manual_seed(tr.probe_seed(b))
        prompts, groups = tr._group(tr.task.sample_prompts(c.prompts_per_step, g))
        traj = tr._sample(prompts, g)
        a = group_advantages(tr.task.reward(traj.latents[-1], prompts), groups)
        from jagg_autograd.estimators import Minibatch

        mb = Minibatch(traj, a, tr.estimator.train_steps(traj.batch_size, g))
        with torch.no_grad():
            res = tr.estimator.loss(tr, mb, generator=g, on_policy=True)
        ex = res.stats.exact  # (n_windows, B)
        has = torch.tensor([hi - lo >= 2 for lo, hi in res.stats.windows])
        ex = ex[has]
        routed.append(ex.float().reshape(-1))
        absa.append(a.abs().expand_as(ex).reshape(-1))
        adv.append(a.expand_as(ex).reshape(-1))
    r, aa, a = torch.cat(routed), torch.cat(absa), torch.cat(adv)
    return {
        "routed_frac": float(r.mean()),
        "spearman_routed_absA": _spearman(r, aa),
        "spearman_routed_A": _spearman(r, a),
    }


def measure(
    tr: GRPOTrainer, n_batches: int, variants: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Every variant's probe on ``tr``'s current weights and AdamW state."""
    base_cfg, base_est = tr.config, tr.estimator
    out: dict[str, Any] = {}
    for name, over in variants.items():
        cfg = dataclasses.replace(base_cfg, **{**BASE, **over}, probe_batches=n_batches)
        cfg.validate()
        tr.config, tr.estimator = cfg, cfg.estimator()
        t0 = time.perf_counter()
        pr = tr.probe()
        row = {k: pr.get(k) for k in KEYS}
        if cfg.mode == "router":
            row.update(routing_vs_advantage(tr, n_batches))
        row["seconds"] = time.perf_counter() - t0
        out[name] = row
        print(f"[bias_decisions] step {tr.step_index} {name}: share "
              f"{row['probe_systematic_share']:+.4f} (floor sd "
              f"{row['probe_systematic_share_floor_sd']:.4f}), bias/signal "
              f"{row['probe_bias_to_signal']:.3f}, cos {row['probe_mean_cosine']:.4f} "
              f"({row['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    tr.config, tr.estimator = base_cfg, base_est
    return out


def _f(x: Any, spec: str) -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def render(res: dict[str, Any]) -> str:
    lines = [
        "# Per-sample decisions and the GRPO gradient's bias (issue 18, item 4)",
        "",
        f"`{res['command']}` — {res['date']}, {res['seconds'] / 60:.1f} min, "
        f"{res['batches']} batches per probe, digits at the quality study's settings "
        "(8 prompts x 4, T = 10, eta 0.7, full DiT, AdamW lr 1e-4, seed 0), the policy "
        "trained with exact GRPO for the given steps.  Figures from the trainer's probe "
        "(`GRPOTrainer.probe`, `jagg_autograd.bias.bias_statistics`): systematic share "
        "(floor 0 ± the SD shown), bias/signal = ||E err|| / ||E exact||, cos(E est, E "
        "exact), mean per-batch cosine; `adam`: in the trained AdamW state's metric (none "
        "before the first optimizer step).  Routers: Spearman of the per-(window, sample) "
        "routing decision with |A| and A.",
        "",
    ]
    for step, rows in res["results"].items():
        lines += [
            f"## after {step} exact GRPO steps",
            "",
            "| variant | systematic share (floor SD) | bias / signal | cos(E est, E exact) "
            "| per-batch cosine (min) | share (AdamW) | bias / signal (AdamW) | routed frac "
            "| ρ(routed, abs A) | ρ(routed, A) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for n, r in rows.items():
            lines.append(
                f"| {n} | {_f(r['probe_systematic_share'], '+.4f')} "
                f"({_f(r['probe_systematic_share_floor_sd'], '.4f')}) "
                f"| {_f(r['probe_bias_to_signal'], '.3f')} "
                f"| {_f(r['probe_expected_cosine'], '+.3f')} "
                f"| {_f(r['probe_mean_cosine'], '.4f')} ({_f(r['probe_min_cosine'], '.3f')}) "
                f"| {_f(r.get('probe_systematic_share_adam'), '+.4f')} "
                f"| {_f(r.get('probe_bias_to_signal_adam'), '.3f')} "
                f"| {_f(r.get('routed_frac', r.get('probe_routed_frac')), '.3f')} "
                f"| {_f(r.get('spearman_routed_absA'), '+.3f')} "
                f"| {_f(r.get('spearman_routed_A'), '+.3f')} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train-steps", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/bias_decisions")
    args = ap.parse_args(argv)
    chosen = {n: VARIANTS[n] for n in args.variants}
    t0 = time.perf_counter()
    cfg = GRPOConfig(mode="exact", exact_loop=False, eval_per_digit=0, grid_samples=0,
                     progress=False, seed=args.seed, threads=1, eval_seed=424_242)  # fmt: skip
    tr = GRPOTrainer(cfg)
    results: dict[str, Any] = {}
    for target in args.train_steps:
        while tr.step_index < target:
            tr.step()
        results[str(tr.step_index)] = measure(tr, args.batches, chosen)
    res = {
        "command": "python -m benchmarks.bias_decisions " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": time.perf_counter() - t0,
        "batches": args.batches,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "variants": {n: {**BASE, **o} for n, o in chosen.items()},
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bias_decisions.json").write_text(json.dumps(res, indent=1), encoding="utf-8")
    (out / "BIAS_DECISIONS.md").write_text(render(res), encoding="utf-8")
    print(render(res))
    return res


if __name__ == "__main__":
    main()
