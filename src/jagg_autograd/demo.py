"""The main job: online Flow-GRPO on a task (default: the digits DiT), gradients through JAGG.

Run ``python -m jagg_autograd.demo`` (or ``jagg-demo``) with no arguments for the default
run (a few minutes on a 2-core CPU); ``--help`` lists the options. The run writes
``log.json``, ``reward.png`` and ``grid.png`` (held-out samples before and after training)
to ``--out`` and prints a one-paragraph summary. The
training loop itself is :func:`jagg_autograd.trainer.train`; this module is only its CLI.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Sequence
from typing import Any

from jagg_autograd.tasks import task_factory, task_names
from jagg_autograd.trainer import (
    MODES,
    PLACEMENTS,
    PRECISIONS,
    SAMPLERS,
    SCHEDULES,
    SDE_TYPES,
    STEP_SELECTIONS,
    TUNING,
    GRPOConfig,
    TrainingDivergedError,
    train,
)
from jagg_autograd.window import BATCHINGS

__all__ = ["build_parser", "config_from_args", "main"]

_DEFAULTS = GRPOConfig()


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser (defaults are :class:`GRPOConfig`'s, shown by ``--help``)."""
    d = _DEFAULTS
    p = argparse.ArgumentParser(
        prog="jagg-demo",
        description=(
            "Online Flow-GRPO on a task (default: the embedded 8x8-digits DiT, reward = the "
            "classifier's probability of the prompted digit); gradients through "
            "jagg_trajectory. Writes log.json (after every step) and reward.png to --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--task", choices=task_names(), default=d.task, help="the GRPO task")
    g = p.add_argument_group("gradient")
    g.add_argument(
        "--mode",
        choices=MODES,
        default=d.mode,
        help="exact, JAGG, JAGG + router, or the baselines subsample (DanceGRPO) / mixgrpo",
    )
    g.add_argument(
        "--window", type=int, default=d.window, help="JAGG window W (>= 2); mixgrpo: its window"
    )
    g.add_argument(
        "--shared-anchors",
        action=argparse.BooleanOptionalAction,
        default=d.shared_anchors,
        help="adjacent windows share their boundary anchor",
    )
    g.add_argument("--threshold", type=float, default=d.threshold, help="router threshold")
    g.add_argument(
        "--jagg-frac", type=float, default=d.jagg_frac, help="router jagg_frac (None: off)"
    )
    g.add_argument(
        "--subsample-steps",
        type=int,
        default=d.subsample_steps,
        help="--mode subsample: steps per sample (None: the JAGG anchor count)",
    )
    g.add_argument(
        "--mix-shift-interval",
        type=int,
        default=d.mix_shift_interval,
        help="--mode mixgrpo: GRPO steps per window move (None: one sweep of the run)",
    )
    g.add_argument(
        "--batching",
        choices=BATCHINGS,
        default=d.batching,
        help="stacked: fewest model calls; per_step: bit-identical to the rollout",
    )
    g.add_argument(
        "--reuse-values",
        action=argparse.BooleanOptionalAction,
        default=d.reuse_values,
        help="on-policy minibatches reuse the rollout's velocities (values=, deferred)",
    )
    g.add_argument(
        "--deferred",
        action=argparse.BooleanOptionalAction,
        default=d.deferred,
        help="anchors run with grad in the backward, chunk by chunk (every minibatch)",
    )
    g.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=d.placement,
        help="anchor placement (adaptive runs every minibatch deferred; router: uniform)",
    )
    g.add_argument(
        "--budget",
        type=float,
        default=d.budget,
        help="adaptive placement: mean anchors per sample (None: the uniform count)",
    )
    g.add_argument(
        "--chunk-size", type=int, default=d.chunk_size, help="samples per anchor / no-grad call"
    )
    r = p.add_argument_group("rollout")
    r.add_argument("--steps", type=int, default=d.steps, help="GRPO steps")
    r.add_argument(
        "--prompts-per-step", type=int, default=d.prompts_per_step, help="prompts per rollout"
    )
    r.add_argument("--group-size", type=int, default=d.group_size, help="samples per prompt")
    r.add_argument("--num-steps", type=int, default=d.num_steps, help="sampler steps T")
    r.add_argument("--noise-level", type=float, default=d.noise_level, help="SDE eta")
    r.add_argument("--sde-type", choices=SDE_TYPES, default=d.sde_type, help="SDE step")
    r.add_argument("--schedule", choices=SCHEDULES, default=d.schedule, help="sigma schedule")
    r.add_argument("--shift", type=float, default=d.shift, help="shift of --schedule shifted")
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate")
    o.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay")
    o.add_argument("--clip-range", type=float, default=d.clip_range, help="PPO ratio clip")
    o.add_argument("--adv-clip-max", type=float, default=d.adv_clip_max, help="advantage clip")
    o.add_argument("--beta", type=float, default=d.beta, help="KL weight (0: no reference)")
    o.add_argument(
        "--max-grad-norm", type=float, default=d.max_grad_norm, help="<= 0 turns clipping off"
    )
    o.add_argument(
        "--optimizer-steps-per-rollout",
        "--minibatches",
        dest="optimizer_steps_per_rollout",
        type=int,
        default=d.optimizer_steps_per_rollout,
        help="optimizer steps per rollout and epoch (--minibatches: the old name)",
    )
    o.add_argument(
        "--gradient-accumulation-steps",
        type=int,
        default=d.gradient_accumulation_steps,
        help="minibatches per optimizer step",
    )
    o.add_argument(
        "--num-inner-epochs", type=int, default=d.num_inner_epochs, help="passes per rollout"
    )
    o.add_argument(
        "--timestep-fraction",
        type=float,
        default=d.timestep_fraction,
        help="fraction of the steps trained per sample",
    )
    o.add_argument(
        "--timestep-selection",
        choices=STEP_SELECTIONS,
        default=d.timestep_selection,
        help="prefix (Flow-GRPO) or random per sample (DanceGRPO)",
    )
    o.add_argument(
        "--tuning",
        choices=TUNING,
        default=d.tuning,
        help="full fine-tuning or LoRA adapters (needs peft)",
    )
    o.add_argument("--lora-rank", type=int, default=d.lora_rank, help="LoRA rank")
    m = p.add_argument_group("run")
    m.add_argument(
        "--eval-per-digit",
        type=int,
        default=d.eval_per_digit,
        help="held-out samples per digit (0: no evaluation)",
    )
    m.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="also evaluate every N steps"
    )
    m.add_argument(
        "--eval-sampler", choices=SAMPLERS, default=d.eval_sampler, help="evaluation sampler"
    )
    m.add_argument(
        "--eval-seed", type=int, default=d.eval_seed, help="evaluation noise (None: seed+10000)"
    )
    m.add_argument(
        "--grid-samples",
        type=int,
        default=d.grid_samples,
        help="held-out pictures before/after training in grid.png (0: no grid)",
    )
    m.add_argument(
        "--probe-every",
        type=int,
        default=d.probe_every,
        help="gradient cosine to exact every N steps (0: off)",
    )
    m.add_argument("--seed", type=int, default=d.seed, help="prompts and noise")
    m.add_argument("--device", default=d.device, help="cpu or cuda (cuda:N)")
    m.add_argument(
        "--precision", choices=PRECISIONS, default=d.precision, help="bf16: autocast model"
    )
    m.add_argument("--out", default="jagg_demo_out", help="folder for log.json and reward.png")
    m.add_argument("--threads", type=int, default=d.threads, help="torch intra-op threads")
    m.add_argument(
        "--no-progress", action="store_true", default=False, help="hide the progress bar"
    )
    return p


_FIELDS = (
    "task", "steps", "prompts_per_step", "group_size", "num_steps", "noise_level", "sde_type",
    "schedule", "shift", "mode", "window", "shared_anchors", "threshold", "jagg_frac",
    "subsample_steps", "mix_shift_interval", "timestep_fraction", "timestep_selection",
    "batching", "reuse_values", "deferred", "placement", "budget", "chunk_size", "lr",
    "weight_decay", "clip_range", "adv_clip_max", "beta", "optimizer_steps_per_rollout",
    "gradient_accumulation_steps", "num_inner_epochs", "tuning", "lora_rank",
    "eval_per_digit", "eval_every", "eval_sampler", "eval_seed", "grid_samples",
    "probe_every", "seed",
    "device", "precision", "out", "threads",
)  # fmt: skip


def _task_demo_defaults(name: str) -> dict[str, Any]:
    """``demo_defaults`` of the registered task ``name`` (its class attribute, read without
    building the task), restricted to the demo's flags."""
    factory = task_factory(name)
    defaults = dict(getattr(factory, "demo_defaults", {}) or {})
    unknown = sorted(set(defaults) - set(_FIELDS))
    if unknown:
        raise ValueError(f"task {name!r}: demo_defaults has no demo flag(s) {unknown}")
    return defaults


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """A validated :class:`GRPOConfig` from parsed arguments (``ValueError`` if bad)."""
    mgn = args.max_grad_norm
    if mgn is not None and math.isfinite(mgn) and mgn <= 0:
        mgn = None
    cfg = GRPOConfig(
        **{k: getattr(args, k) for k in _FIELDS},
        max_grad_norm=mgn,
        progress=not args.no_progress,
    )
    cfg.validate()
    if cfg.tuning == "lora" and importlib.util.find_spec("peft") is None:
        raise ValueError("tuning='lora' needs peft: pip install peft (or use --tuning full)")
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status.

    0: finished; 2: bad arguments (argparse's convention); 1: the run stopped on an error
    (e.g. a non-finite loss); 130: Ctrl-C.  Every stopped run keeps a valid partial
    ``log.json`` with its finished steps in ``--out``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    # The task's own demo defaults (e.g. the shapes task's lr and steps) replace the
    # GRPOConfig defaults, never a flag given on the command line: parse again with them.
    task_defaults = _task_demo_defaults(args.task)
    if task_defaults:
        parser.set_defaults(**task_defaults)
        args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        # argparse's error(): usage + message on stderr, exit status 2, like a type error.
        parser.error(str(exc))
    done: list[int] = []
    try:
        log = train(cfg, on_step=lambda row: done.append(row["step"]))
    except KeyboardInterrupt:
        print(
            f"\njagg-demo: interrupted after {len(done)} of {cfg.steps} steps; the partial log "
            f"(status 'interrupted', every finished step) is in {cfg.out}/log.json",
            file=sys.stderr,
        )
        return 130
    except (TrainingDivergedError, ValueError) as exc:
        print(
            f"jagg-demo: {exc}\n(stopped after {len(done)} finished steps; log in "
            f"{cfg.out}/log.json)",
            file=sys.stderr,
        )
        return 1
    print(log["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
