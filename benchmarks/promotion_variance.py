"""Draw variance of the stochastic estimator: uniform against proxy promotion (shapes).

    python -m benchmarks.promotion_variance               # 2 x 16 samples, 3 batches, 10 draws
    python -m benchmarks.promotion_variance --quick       # the test configuration (seconds)

``placement="stochastic"`` at budget 2.4 has the 3-anchor causal fold F3 as its expectation
over the draw whichever way its promotions are spread (``promotion="uniform"``: every
sample with probability 0.4; ``"proxy"``: more often where the planner's proxy of the
promoted term is large, re-weighted by 1/pi_b).  What the spreading changes is the
variance around F3.  Per batch (a rollout of the shapes study's settings at the shipped
weights, the trained prefix of 5 steps, group advantages) this computes the exact GRPO
gradient, F3 (the study's ``uniform_causal_w4``), and ``--draws`` gradients of each
promotion from independent generators, and reports

* ``var / |F3|^2`` = mean over draws of ||g - F3||^2 / ||F3||^2 (the draw variance);
* ``|mean - F3| / |F3|``: the draws' mean against F3 (~ sqrt(var / draws) if unbiased);
* ``cos to exact``: the mean per-draw cosine with the exact gradient (what the study's
  probe reports along a run), beside F3's own;
* ``grad samples``: with-grad (step, sample) evaluations per draw.

Outputs (``--out``, default ``benchmarks/results/promotion_variance``):
``promotion_variance.json`` and ``PROMOTION_VARIANCE.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/promotion_variance.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info, write_report
from benchmarks.train_phase import rollout_minibatch, trainers
from jagg_autograd.estimators import Minibatch
from jagg_autograd.trainer import GRPOTrainer
from jagg_autograd.trainer_measure import _flat

PROMOTIONS = {"uniform": "stochastic_causal_b2_4", "proxy": "stochastic_proxy_causal_b2_4"}
MEAN = "uniform_causal_w4"  # the 3-anchor causal fold: both promotions' expectation
CONFIGS = {
    "quick": {"prompts_per_step": 1, "group_size": 4, "batches": 1, "draws": 2},
    "full": {"prompts_per_step": 2, "group_size": 16, "batches": 3, "draws": 10},
}


def flat_grad(tr: GRPOTrainer, mb: Minibatch, seed: int) -> tuple[torch.Tensor, int]:
    """The estimator's flattened parameter gradient on ``mb`` (its draw from ``seed``) and
    its with-grad samples."""
    res = tr.estimator.loss(tr, mb, generator=torch.Generator().manual_seed(seed),
                            on_policy=True)  # fmt: skip
    flat = _flat(torch.autograd.grad(res.loss, tr.params, allow_unused=True), tr.params)
    n = int(res.stats.grad_samples) if res.stats is not None else -1
    return flat.double(), n


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def one_batch(trs: dict[str, GRPOTrainer], seed: int, draws: int) -> dict[str, Any]:
    mb = rollout_minibatch(trs["exact"], seed)
    exact, _ = flat_grad(trs["exact"], mb, 0)
    f3, n3 = flat_grad(trs[MEAN], mb, 0)
    f3n = float(f3.norm()) ** 2
    row: dict[str, Any] = {"seed": seed, "cos_f3_exact": _cos(f3, exact), "f3_grad_samples": n3}
    for name, variant in PROMOTIONS.items():
        gs, ns = zip(*(flat_grad(trs[variant], mb, 1000 * seed + d) for d in range(draws)))
        G = torch.stack(gs)
        row[name] = {
            "var_rel": float(((G - f3) ** 2).sum(1).mean()) / f3n,
            "mean_err_rel": float((G.mean(0) - f3).norm()) / f3n**0.5,
            "cos_exact": statistics.fmean(_cos(g, exact) for g in G),
            "grad_samples": statistics.fmean(ns),
        }
    return row


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        "# Stochastic promotion: draw variance around the 3-anchor fold (shapes)",
        "",
        f"`{res['command']}` at {res['date']} (commit {res['machine'].get('git_commit', '?')});"
        f" {cfg['prompts_per_step']} x {cfg['group_size']} samples per batch, the study's "
        f"5 trained steps at the shipped weights, {cfg['draws']} draws per promotion, budget "
        "2.4 (F3: the 3-anchor causal fold, both promotions' expectation).",
        "",
        "| batch | promotion | var / \\|F3\\|² | \\|mean − F3\\| / \\|F3\\| | cos to exact "
        "(F3's) | grad samples |",
        "|---|---|---|---|---|---|",
    ]
    for row in res["batches"]:
        for name in PROMOTIONS:
            r = row[name]
            lines.append(
                f"| {row['seed']} | {name} | {r['var_rel']:.3f} | {r['mean_err_rel']:.3f} | "
                f"{r['cos_exact']:.3f} ({row['cos_f3_exact']:.3f}) | {r['grad_samples']:.1f} |"
            )
    s = res["summary"]
    lines += [
        "",
        f"Mean over batches: draw variance uniform {s['uniform_var']:.3f}, proxy "
        f"{s['proxy_var']:.3f} (ratio {s['var_ratio']:.2f}); cosine to exact uniform "
        f"{s['uniform_cos']:.3f}, proxy {s['proxy_cos']:.3f}, F3 {s['f3_cos']:.3f}.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the test configuration")
    ap.add_argument("--batches", type=int, help="rollouts (override)")
    ap.add_argument("--draws", type=int, help="draws per promotion and batch (override)")
    ap.add_argument("--out", default="benchmarks/results/promotion_variance")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg: dict[str, Any] = dict(CONFIGS["quick" if args.quick else "full"])
    for k in ("batches", "draws"):
        v = getattr(args, k)
        if v is not None:
            if v < 1 or (k == "draws" and v < 2):
                ap.error(f"--{k} must be >= {2 if k == 'draws' else 1}, got {v}")
            cfg[k] = v
    torch.set_num_threads(1)
    trs = trainers("shapes", cfg["prompts_per_step"], cfg["group_size"],
                   [MEAN, *PROMOTIONS.values()])  # fmt: skip
    flags = ["--quick"] * args.quick + [f"--{k} {getattr(args, k)}" for k in ("batches", "draws")
                                        if getattr(args, k) is not None]  # fmt: skip
    res: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.promotion_variance", *flags]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch.device("cpu")),
        "config": cfg,
        "batches": [],
    }
    for b in range(cfg["batches"]):
        res["batches"].append(one_batch(trs, 1 + b, cfg["draws"]))
        if not args.no_progress:
            print(f"batch {b + 1}/{cfg['batches']} done", flush=True)
    rows = res["batches"]
    res["summary"] = {
        **{f"{n}_var": statistics.fmean(r[n]["var_rel"] for r in rows) for n in PROMOTIONS},
        **{f"{n}_cos": statistics.fmean(r[n]["cos_exact"] for r in rows) for n in PROMOTIONS},
        "f3_cos": statistics.fmean(r["cos_f3_exact"] for r in rows),
    }
    s = res["summary"]
    s["var_ratio"] = s["proxy_var"] / s["uniform_var"]
    write_report(args.out, "promotion_variance", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
