"""Training-phase time of each GRPO estimator against Flow-GRPO's per-step loop, in isolation.

    python -m benchmarks.train_phase                 # about two minutes on one CPU thread
    python -m benchmarks.train_phase --task shapes   # the shapes study's settings
    python -m benchmarks.train_phase --quick         # the test configuration (seconds)

The quality study (``benchmarks/quality.py``) times the training phase inside 60-step runs
that share a process with the other variants and the gradient probes (lockstep), so its
ratios carry that contention (and, where a variant was added with ``--resume``, a second
process).  This measures ONE on-policy minibatch per variant at the study's settings of
the task (digits: 8 prompts x 4 samples, T = 10 SDE steps, every step trained; shapes: the
first 5 of 10 steps, ``--group-size`` as the study's lever): the estimator's ``loss`` with
its own backward, the trainer's code path, repetitions interleaved in a rotating order on
the same rollout and the same trained steps, medians; the ratio is the median over
repetitions of variant / ``exact`` (the per-step loop) in the same repetition.  Floors with
a backward costing two forwards and the rollout's velocities reused as the values: the
anchors' share of the trained steps (digits uniform: 4 of 10, 0.40; adaptive at budget b,
b / 10; shapes: 2 of 5, 0.40; window 4, 3 of 5, 0.60).

Outputs (``--out``, default ``benchmarks/results/train_phase``, ``..._shapes`` for shapes):
``train_phase.json`` and ``TRAIN_PHASE.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/train_phase.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import interleaved_times, machine_info, write_report
from benchmarks.quality import studies_for, variant_config
from jagg_autograd.estimators import Minibatch
from jagg_autograd.grpo import group_advantages
from jagg_autograd.trainer import GRPOTrainer

#: Per task, the study's variants that train on the GRPO loss (settings spelt out there).
NAMES = {
    "digits": ("exact", "uniform", "uniform_causal", "router", "adaptive_b3", "adaptive_b4",
               "adaptive_b5"),
    "shapes": ("exact", "uniform", "uniform_causal", "uniform_causal_w4", "adaptive_b2",
               "adaptive_causal_b2", "adaptive_causal_b2_5", "stochastic_causal_b2_5",
               "stochastic_causal_b2_4", "stochastic_proxy_causal_b2_4",
               "stochastic_exact_causal_b2_4", "stochastic_exact_proxy_causal_b2_4",
               "stochastic_exact_causal_b2_9", "stochastic_exact_proxy_causal_b2_9",
               "stochastic_exact_linear_b2_4",
               "stochastic_exact_proxy_linear_b2_4"),
}  # fmt: skip
FLOORS = {
    "digits": {"uniform": 0.40, "uniform_causal": 0.40, "router": 0.40, "adaptive_b3": 0.30,
               "adaptive_b4": 0.40, "adaptive_b5": 0.50},
    "shapes": {"uniform": 0.40, "uniform_causal": 0.40, "uniform_causal_w4": 0.60,
               "adaptive_b2": 0.40, "adaptive_causal_b2": 0.40, "adaptive_causal_b2_5": 0.50,
               "stochastic_causal_b2_5": 0.50, "stochastic_causal_b2_4": 0.48,
               "stochastic_proxy_causal_b2_4": 0.48, "stochastic_exact_causal_b2_4": 0.48,
               "stochastic_exact_proxy_causal_b2_4": 0.48,
               "stochastic_exact_causal_b2_9": 0.58, "stochastic_exact_proxy_causal_b2_9": 0.58,
               "stochastic_exact_linear_b2_4": 0.48,
               "stochastic_exact_proxy_linear_b2_4": 0.48},
}  # fmt: skip
CONFIGS = {"quick": {"reps": 2, "prompts_per_step": 2}, "full": {"reps": 21, "prompts_per_step": 8}}


def trainers(
    task: str, prompts: int, group_size: int | None = None, names: Sequence[str] | None = None
) -> dict[str, GRPOTrainer]:
    """One trainer per variant of ``task`` (``names``: those of them, with ``exact``; None:
    all), the quality study's settings without its evaluations and probes, all with
    exact's weights."""
    study = studies_for([task], False, prompts_per_step=prompts, group_size=group_size)[task]
    keep = set(NAMES[task] if names is None else (*names, "exact"))
    out = {n: GRPOTrainer(variant_config(n, 0, task, study, eval_per_digit=0, probe_every=0))
           for n in NAMES[task] if n in keep}  # fmt: skip
    for tr in out.values():
        tr.policy.load_state_dict(out["exact"].policy.state_dict())
    return out


def one_minibatch(tr: GRPOTrainer, mb: Minibatch, seed: int) -> None:
    """One on-policy minibatch's loss + backward through ``tr``'s estimator."""
    tr.optimizer.zero_grad(set_to_none=True)
    res = tr.estimator.loss(tr, mb, generator=torch.Generator().manual_seed(seed),
                            on_policy=True, inline_backward=True)  # fmt: skip
    if not res.backward_done:
        res.loss.backward()


def rollout_minibatch(tr: GRPOTrainer, seed: int) -> Minibatch:
    """One on-policy minibatch of ``tr``'s settings: a rollout of its prompts per step from
    generator ``seed``, group advantages, its trained steps."""
    g = torch.Generator().manual_seed(seed)
    prompts, groups = tr._group(tr.task.sample_prompts(tr.config.prompts_per_step, g))
    traj = tr._sample(prompts, g)
    adv = group_advantages(tr.task.reward(traj.latents[-1], prompts), groups)
    return Minibatch(traj, adv, tr.estimator.train_steps(traj.batch_size, g))


def study(trs: dict[str, GRPOTrainer], reps: int) -> dict[str, Any]:
    mb = rollout_minibatch(trs["exact"], 1)
    fns = {n: (lambda seed, tr=tr: one_minibatch(tr, mb, seed)) for n, tr in trs.items()}
    res = interleaved_times(fns, reps, ref="exact")
    res["ratio_to_exact"] = res.pop("ratio")
    res["times"] = res.pop("all_s")
    return res


def markdown(res: dict[str, Any]) -> str:
    tm, cfg = res["time"], res["config"]
    floors = FLOORS[cfg["task"]]
    lines = [
        f"# GRPO training phase vs the per-step loop, one minibatch in isolation ({cfg['task']})",
        "",
        f"`{res['command']}` at {res['date']} (commit {res['machine'].get('git_commit', '?')});"
        f" {cfg['prompts_per_step']} x {cfg['group_size']} samples, T = {cfg['T']}, "
        f"{cfg['trained_steps']} trained steps, on-policy, one torch thread: {tm['reps']} "
        "interleaved repetitions, medians.",
        "",
        "| variant | median s | ratio to exact | floor |",
        "|---|---|---|---|",
    ]
    for n, r in tm["ratio_to_exact"].items():
        lines.append(f"| {n} | {tm['median_s'][n]:.4f} | {r:.3f} | {floors.get(n, '')} |")
    lines += ["", "The quality study's ratios (`train time / ref`) also carry the contention of "
              "its lockstep runs and probes, and, for a variant added with `--resume`, a "
              "second process (another load, or another machine); this is the estimator's "
              "own cost.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the test configuration")
    ap.add_argument(
        "--task",
        choices=list(NAMES),
        default="digits",
        help="the quality study's settings and variants of this task",
    )
    ap.add_argument("--group-size", type=int, help="override the study's samples per prompt")
    ap.add_argument("--variants", nargs="+", metavar="NAME",
                    help="time only these of the task's variants (exact is always timed)")
    ap.add_argument("--out", help="output folder (default benchmarks/results/train_phase, "
                    "with _<task> for a task other than digits)")  # fmt: skip
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.group_size is not None and args.group_size < 2:
        ap.error(f"--group-size must be >= 2 (a group needs a baseline), got {args.group_size}")
    unknown = sorted(set(args.variants or ()) - set(NAMES[args.task]))
    if unknown:
        ap.error(f"--variants: {unknown} are not variants of {args.task}; expected some of "
                 f"{list(NAMES[args.task])}")
    cfg: dict[str, Any] = dict(CONFIGS["quick" if args.quick else "full"], task=args.task)
    torch.set_num_threads(1)
    trs = trainers(args.task, cfg["prompts_per_step"], args.group_size, args.variants)
    ex = trs["exact"].config
    cfg.update(
        group_size=ex.group_size,
        T=ex.num_steps,
        trained_steps=trs["exact"].estimator.num_train_steps(),
    )
    out = args.out or "benchmarks/results/train_phase" + (
        "" if args.task == "digits" else f"_{args.task}"
    )
    flags = ["--quick"] * args.quick + [f"--task {args.task}"] * (args.task != "digits")
    flags += [f"--group-size {args.group_size}"] * (args.group_size is not None)
    if args.variants:
        flags.append(" ".join(["--variants", *args.variants]))
    res: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.train_phase", *flags]),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch.device("cpu")),
        "config": cfg,
    }
    res["time"] = study(trs, cfg["reps"])
    write_report(out, "train_phase", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
