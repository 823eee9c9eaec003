"""The main job: online Flow-GRPO on the embedded digits DiT, gradients through JAGG.

Run ``python -m jagg_autograd.demo`` (or ``jagg-demo``) with no arguments for the default
run (a few minutes on a 2-core CPU); ``--help`` lists the options. The run writes
``log.json`` and ``reward.png`` to ``--out`` and prints a one-paragraph summary. The
training loop itself is :func:`jagg_autograd.trainer.train`; this module is only its CLI.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from jagg_autograd.trainer import MODES, SAMPLERS, SCHEDULES, TUNING, GRPOConfig, train
from jagg_autograd.window import BATCHINGS

__all__ = ["build_parser", "config_from_args", "main"]

_DEFAULTS = GRPOConfig()


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (defaults are :class:`GRPOConfig`'s)."""
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="jagg-demo",
        description=(
            "Online Flow-GRPO on the embedded 8x8-digits DiT: reward = the classifier's "
            "probability of the prompted digit; gradients through jagg_trajectory."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("gradient")
    g.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help="exact, JAGG, JAGG + router, or the baselines subsample (DanceGRPO) / mixgrpo",
    )
    g.add_argument("--window", type=int, default=d.window, help="JAGG window W (>= 2)")
    g.add_argument(
        "--shared-anchors",
        action=argparse.BooleanOptionalAction,
        default=d.shared_anchors,
        help="adjacent windows share their boundary anchor",
    )
    g.add_argument("--threshold", type=float, default=d.threshold, help="router threshold")
    g.add_argument(
        "--jagg-frac", type=float, default=d.jagg_frac, help="router jagg_frac (default: off)"
    )
    g.add_argument(
        "--subsample-steps",
        type=int,
        default=d.subsample_steps,
        help="--mode subsample: steps per sample (default: the JAGG anchor count)",
    )
    g.add_argument("--batching", choices=BATCHINGS, default=d.batching)
    r = p.add_argument_group("rollout")
    r.add_argument("--steps", type=int, default=d.steps, help="GRPO steps")
    r.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step)
    r.add_argument("--group-size", type=int, default=d.group_size)
    r.add_argument("--num-steps", type=int, default=d.num_steps, help="sampler steps T")
    r.add_argument("--noise-level", type=float, default=d.noise_level, help="SDE eta")
    r.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    r.add_argument("--shift", type=float, default=d.shift, help="shift of --schedule shifted")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=d.lr)
    o.add_argument("--weight-decay", type=float, default=d.weight_decay)
    o.add_argument("--clip-range", type=float, default=d.clip_range)
    o.add_argument("--adv-clip-max", type=float, default=d.adv_clip_max)
    o.add_argument(
        "--max-grad-norm", type=float, default=d.max_grad_norm, help="<= 0 turns clipping off"
    )
    o.add_argument(
        "--minibatches", type=int, default=d.minibatches, help="optimizer steps per rollout"
    )
    o.add_argument("--tuning", choices=TUNING, default=d.tuning)
    o.add_argument("--lora-rank", type=int, default=d.lora_rank)
    m = p.add_argument_group("run")
    m.add_argument("--eval-per-digit", type=int, default=d.eval_per_digit, help="0: no eval")
    m.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="also evaluate every N steps"
    )
    m.add_argument("--eval-sampler", choices=SAMPLERS, default=d.eval_sampler)
    m.add_argument(
        "--probe-every",
        type=int,
        default=d.probe_every,
        help="gradient cosine to exact every N steps (0: off)",
    )
    m.add_argument("--seed", type=int, default=d.seed)
    m.add_argument("--out", default="jagg_demo_out", help="folder for log.json and reward.png")
    m.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads")
    m.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """A validated :class:`GRPOConfig` from parsed arguments (``ValueError`` if bad)."""
    mgn = args.max_grad_norm
    if mgn is not None and math.isfinite(mgn) and mgn <= 0:
        mgn = None
    cfg = GRPOConfig(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        num_steps=args.num_steps,
        noise_level=args.noise_level,
        schedule=args.schedule,
        shift=args.shift,
        mode=args.mode,
        window=args.window,
        shared_anchors=args.shared_anchors,
        threshold=args.threshold,
        jagg_frac=args.jagg_frac,
        subsample_steps=args.subsample_steps,
        batching=args.batching,
        lr=args.lr,
        weight_decay=args.weight_decay,
        clip_range=args.clip_range,
        adv_clip_max=args.adv_clip_max,
        max_grad_norm=mgn,
        minibatches=args.minibatches,
        tuning=args.tuning,
        lora_rank=args.lora_rank,
        eval_per_digit=args.eval_per_digit,
        eval_every=args.eval_every,
        eval_sampler=args.eval_sampler,
        probe_every=args.probe_every,
        seed=args.seed,
        out=args.out,
        threads=args.threads,
        progress=not args.no_progress,
    )
    cfg.validate()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (bad arguments exit with status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        # argparse's error(): usage + message on stderr, exit status 2, like a type error.
        parser.error(str(exc))
    log = train(cfg)
    print(log["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
