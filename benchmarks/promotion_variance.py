"""Draw variance of the stochastic estimators: which promotion, to what (shapes).

    python -m benchmarks.promotion_variance               # 2 x 16 samples, 3 batches, 10 draws
    python -m benchmarks.promotion_variance --quick       # the test configuration (seconds)

``placement="stochastic"`` at budget 2.4 (and 2.9: the budget lever) promotes a random
subset of the samples and re-weights it by 1/pi_b, so its expectation over the draw is
fixed for every batch:

* ``promote_to="anchor"``: the 3-anchor causal fold F3 (the study's ``uniform_causal_w4``);
* ``promote_to="exact"``: the exact GRPO gradient E, from the causal base {0, 3} or JAGG's
  linear fold's {0, 4};

each with ``promotion="uniform"`` (the same pi_b for every sample) or ``"proxy"`` (pi_b
growing with the planner's proxy of the promoted term).  What they differ in is the
variance around that expectation.  Per batch (a rollout of the shapes study's settings at
the shipped weights, the trained prefix of 5 steps, group advantages) this computes E, the
deterministic folds (F3; the 2-anchor causal fold F2 at {0, 3}; the default's linear fold
at {0, 4}) and ``--draws`` gradients of each stochastic estimator from independent
generators, and reports

* ``var / |mean|^2`` = mean over draws of ||g - mean||^2 / ||mean||^2, mean its
  expectation (F3 or E): the draw variance;
* ``mse / |E|^2`` = mean over draws of ||g - E||^2 / ||E||^2: the error against the exact
  gradient, variance and the expectation's own error together (for a deterministic fold
  its error);
* ``|draws' mean - mean| / |mean|`` (~ sqrt(var / draws) if unbiased);
* ``cos to exact``: the mean per-draw cosine with E (what the study's probe reports);
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

#: The stochastic estimators: label -> (the study's variant, its expectation).
STOCHASTIC = {
    "anchor, uniform": ("stochastic_causal_b2_4", "F3"),
    "anchor, proxy": ("stochastic_proxy_causal_b2_4", "F3"),
    "exact from causal, uniform": ("stochastic_exact_causal_b2_4", "E"),
    "exact from causal, proxy": ("stochastic_exact_proxy_causal_b2_4", "E"),
    # The budget lever: pi = 0.3 instead of 0.133 (sixteenth session).
    "exact from causal, uniform, budget 2.9": ("stochastic_exact_causal_b2_9", "E"),
    "exact from causal, proxy, budget 2.9": ("stochastic_exact_proxy_causal_b2_9", "E"),
    "exact from linear, uniform": ("stochastic_exact_linear_b2_4", "E"),
    "exact from linear, proxy": ("stochastic_exact_proxy_linear_b2_4", "E"),
}
#: The deterministic folds: label -> the study's variant.
FOLDS = {"F3 (3-anchor causal)": "uniform_causal_w4", "F2 (2-anchor causal)": "uniform_causal",
         "linear fold (the default's)": "uniform"}  # fmt: skip
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


def _sq(x: torch.Tensor) -> float:
    return float(x.norm()) ** 2


def one_batch(trs: dict[str, GRPOTrainer], seed: int, draws: int) -> dict[str, Any]:
    mb = rollout_minibatch(trs["exact"], seed)
    exact, n_e = flat_grad(trs["exact"], mb, 0)
    means = {"E": exact}
    row: dict[str, Any] = {"seed": seed, "exact_grad_samples": n_e, "folds": {},
                           "stochastic": {}}  # fmt: skip
    for label, variant in FOLDS.items():
        f, n = flat_grad(trs[variant], mb, 0)
        if variant == "uniform_causal_w4":
            means["F3"] = f
        row["folds"][label] = {"mse_exact_rel": _sq(f - exact) / _sq(exact),
                               "cos_exact": _cos(f, exact), "grad_samples": n}  # fmt: skip
    for label, (variant, mean_name) in STOCHASTIC.items():
        mean = means[mean_name]
        gs, ns = zip(*(flat_grad(trs[variant], mb, 1000 * seed + d) for d in range(draws)))
        G = torch.stack(gs)
        row["stochastic"][label] = {
            "mean": mean_name,
            "var_rel": float(((G - mean) ** 2).sum(1).mean()) / _sq(mean),
            "mse_exact_rel": float(((G - exact) ** 2).sum(1).mean()) / _sq(exact),
            "mean_err_rel": float((G.mean(0) - mean).norm()) / _sq(mean) ** 0.5,
            "cos_exact": statistics.fmean(_cos(g, exact) for g in G),
            "grad_samples": statistics.fmean(ns),
        }
    return row


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per estimator (stochastic and deterministic), the mean over batches of each figure."""
    out: dict[str, dict[str, float]] = {}
    for kind in ("folds", "stochastic"):
        for label in rows[0][kind]:
            keys = [k for k, v in rows[0][kind][label].items() if isinstance(v, float | int)]
            out[label] = {k: statistics.fmean(r[kind][label][k] for r in rows) for k in keys}
    return out


def markdown(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        "# Stochastic promotion: draw variance, and the error against the exact gradient "
        "(shapes)",
        "",
        f"`{res['command']}` at {res['date']} (commit {res['machine'].get('git_commit', '?')});"
        f" {cfg['prompts_per_step']} x {cfg['group_size']} samples per batch, the study's "
        f"5 trained steps at the shipped weights, {cfg['draws']} draws per stochastic "
        "estimator, budget 2.4 unless the label names another.  E: the exact gradient; "
        "F3: the 3-anchor causal fold; mean: the estimator's expectation over the draw (F3 or E).",
        "",
        "| batch | estimator | mean | var / \\|mean\\|² | mse / \\|E\\|² | "
        "\\|draws' mean − mean\\| / \\|mean\\| | cos to exact | grad samples |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in res["batches"]:
        for label, r in row["folds"].items():
            lines.append(f"| {row['seed']} | {label} | – | 0 | {r['mse_exact_rel']:.3f} | – | "
                         f"{r['cos_exact']:.3f} | {r['grad_samples']} |")  # fmt: skip
        for label, r in row["stochastic"].items():
            lines.append(
                f"| {row['seed']} | {label} | {r['mean']} | {r['var_rel']:.3f} | "
                f"{r['mse_exact_rel']:.3f} | {r['mean_err_rel']:.3f} | {r['cos_exact']:.3f} | "
                f"{r['grad_samples']:.1f} |"
            )
    lines += ["", "Mean over batches:", "",
              "| estimator | var / \\|mean\\|² | mse / \\|E\\|² | cos to exact | grad samples |",
              "|---|---|---|---|---|"]  # fmt: skip
    for label, r in res["summary"].items():
        var = f"{r['var_rel']:.3f}" if "var_rel" in r else "0"
        lines.append(f"| {label} | {var} | {r['mse_exact_rel']:.3f} | {r['cos_exact']:.3f} | "
                     f"{r['grad_samples']:.1f} |")  # fmt: skip
    lines.append("")
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
                   [*FOLDS.values(), *(v for v, _ in STOCHASTIC.values())])  # fmt: skip
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
    res["summary"] = summarise(res["batches"])
    write_report(args.out, "promotion_variance", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
