"""Training-phase time of each GRPO estimator against Flow-GRPO's per-step loop, in isolation.

    python -m benchmarks.train_phase            # about two minutes on one CPU thread
    python -m benchmarks.train_phase --quick    # the test configuration (seconds)

The quality study (``benchmarks/quality.py``) times the training phase inside 60-step runs
that share a process with the other variants and the gradient probes (lockstep), so its
ratios carry that contention.  This measures ONE on-policy minibatch of the digits DiT
(8 prompts x 4 samples, T = 10 SDE steps, every step trained) per variant: the estimator's
``loss`` with its own backward, the trainer's code path, repetitions interleaved in a
rotating order on the same rollout and the same trained steps, medians; the ratio is the
median over repetitions of variant / ``exact`` (the per-step loop) in the same repetition.
Floors with a backward costing two forwards and the rollout's velocities reused as the
values: uniform (4 anchors of 10 steps) 0.40; adaptive at budget b, b / 10.

Outputs (``--out``, default ``benchmarks/results/train_phase``): ``train_phase.json`` and
``TRAIN_PHASE.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/train_phase.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import interleaved_times, machine_info, write_report
from benchmarks.quality import VARIANTS as STUDY_VARIANTS
from jagg_autograd.estimators import Minibatch
from jagg_autograd.grpo import group_advantages
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

#: The study's variants that train on the GRPO loss (the settings spelt out there).
NAMES = ("exact", "uniform", "uniform_causal", "router", "adaptive_b3", "adaptive_b4",
         "adaptive_b5")  # fmt: skip
FLOORS = {"uniform": 0.40, "uniform_causal": 0.40, "router": 0.40, "adaptive_b3": 0.30,
          "adaptive_b4": 0.40, "adaptive_b5": 0.50}  # fmt: skip
CONFIGS = {"quick": {"reps": 2, "prompts_per_step": 2}, "full": {"reps": 21, "prompts_per_step": 8}}


def trainers(prompts: int) -> dict[str, GRPOTrainer]:
    """One trainer per variant (the quality study's settings), all with exact's weights."""
    base = dict(task="digits", prompts_per_step=prompts, group_size=4, num_steps=10,
                eval_per_digit=0, progress=False, threads=1, seed=0)  # fmt: skip
    out = {}
    for n in NAMES:
        kw = {k: v for k, v in STUDY_VARIANTS[n].items() if k != "probe_every"}
        out[n] = GRPOTrainer(GRPOConfig(**base, **kw))
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


def study(trs: dict[str, GRPOTrainer], reps: int) -> dict[str, Any]:
    ex = trs["exact"]
    g = torch.Generator().manual_seed(1)
    prompts, groups = ex._group(ex.task.sample_prompts(ex.config.prompts_per_step, g))
    traj = ex._sample(prompts, g)
    adv = group_advantages(ex.task.reward(traj.latents[-1], prompts), groups)
    mb = Minibatch(traj, adv, ex.estimator.train_steps(traj.batch_size, g))
    fns = {n: (lambda seed, tr=tr: one_minibatch(tr, mb, seed)) for n, tr in trs.items()}
    res = interleaved_times(fns, reps, ref="exact")
    res["ratio_to_exact"] = res.pop("ratio")
    res["times"] = res.pop("all_s")
    return res


def markdown(res: dict[str, Any]) -> str:
    tm = res["time"]
    lines = [
        "# GRPO training phase vs the per-step loop, one minibatch in isolation (digits DiT)",
        "",
        f"`{res['command']}` at {res['date']} (commit {res['machine'].get('git_commit', '?')});"
        f" {res['config']['prompts_per_step']} x 4 samples, T = 10, on-policy, one torch "
        f"thread: {tm['reps']} interleaved repetitions, medians.",
        "",
        "| variant | median s | ratio to exact | floor |",
        "|---|---|---|---|",
    ]
    for n, r in tm["ratio_to_exact"].items():
        lines.append(f"| {n} | {tm['median_s'][n]:.4f} | {r:.3f} | {FLOORS.get(n, '')} |")
    lines += ["", "The quality study's ratios (`train time / ref`) are larger by the contention "
              "of its lockstep runs and probes; this is the estimator's own cost.", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the test configuration")
    ap.add_argument("--out", default="benchmarks/results/train_phase")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    torch.set_num_threads(1)
    res: dict[str, Any] = {
        "command": "python -m benchmarks.train_phase" + (" --quick" if args.quick else ""),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(torch.device("cpu")),
        "config": cfg,
    }
    res["time"] = study(trainers(cfg["prompts_per_step"]), cfg["reps"])
    write_report(args.out, "train_phase", res, markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
