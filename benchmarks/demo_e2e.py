"""End to end from the README's main command: the demo at its defaults against ``--mode exact``.

    python -m benchmarks.demo_e2e                 # seeds 0-2, the demo's default step count
    python -m benchmarks.demo_e2e --quick         # CI: 2 steps, 1 seed, tiny evaluation

Runs ``python -m jagg_autograd.demo --task digits --seed s`` (the defaults, whatever they
are) and the same command with ``--mode exact`` (Flow-GRPO's per-step loop) for each seed,
in one process, the two runs of a seed back to back in an order that alternates with the
seed (so a slow stretch of the shared machine hits both alike).  Reports per seed and on
average the final held-out reward (``evals[-1].mean_reward`` of ``log.json``) and the
training seconds (``train_seconds``: the GRPO training phase, rollouts excluded) of each,
and the ratios default / exact.  The issue's targets: final reward >= 97 % of exact's and
training seconds <= 0.55 of exact's.

Outputs (``--out``, default ``benchmarks/results/quality2``): ``demo_e2e.json`` and
``DEMO_E2E.md``; the runs' own folders under ``<out>/demo_e2e_runs/``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/demo_e2e.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import git_commit

TARGET_REWARD = 0.97
TARGET_TIME = 0.55
QUICK_ARGS = ["--steps", "2", "--eval-per-digit", "1", "--prompts-per-step", "2"]


def run_demo(argv: list[str]) -> dict[str, Any]:
    """Run the demo's CLI in this process; return its ``log.json``."""
    from jagg_autograd.demo import main

    out = Path(argv[argv.index("--out") + 1])
    rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"the demo exited with {rc}: {' '.join(argv)}")
    return json.loads((out / "log.json").read_text())


def row(log: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of one run."""
    return {
        "final_reward": log["evals"][-1]["mean_reward"],
        "initial_reward": log["evals"][0]["mean_reward"],
        "train_seconds": log["train_seconds"],
        "rollout_seconds": log["rollout_seconds"],
        "steps": len(log["steps"]),
        "paths": sorted({p for r in log["steps"] for p in r["paths"]}),
        "method": log["summary"].split(")", 1)[0] + ")",
    }


def summarize(per_seed: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per-seed ratios default / exact and their means (reward ratio of the seed means)."""
    seeds = sorted(per_seed)
    d = [per_seed[s]["default"] for s in seeds]
    e = [per_seed[s]["exact"] for s in seeds]
    mean = statistics.fmean
    reward_ratio = mean(x["final_reward"] for x in d) / mean(x["final_reward"] for x in e)
    time_ratio = mean(x["train_seconds"] for x in d) / mean(x["train_seconds"] for x in e)
    return {
        "seeds": seeds,
        "final_reward": {
            "default": mean(x["final_reward"] for x in d),
            "exact": mean(x["final_reward"] for x in e),
        },
        "initial_reward": mean(x["initial_reward"] for x in e),
        "train_seconds": {
            "default": mean(x["train_seconds"] for x in d),
            "exact": mean(x["train_seconds"] for x in e),
        },
        "reward_ratio": reward_ratio,
        "train_time_ratio": time_ratio,
        "per_seed_reward_ratio": [a["final_reward"] / b["final_reward"] for a, b in zip(d, e)],
        "per_seed_time_ratio": [a["train_seconds"] / b["train_seconds"] for a, b in zip(d, e)],
        "reward_target_met": reward_ratio >= TARGET_REWARD,
        "time_target_met": time_ratio <= TARGET_TIME,
    }


def markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    lines = [
        "# The README's main command at its defaults vs `--mode exact`",
        "",
        f"`{res['command']}` — {res['date']}, commit {res['commit']}.",
        "",
        f"Default: {res['per_seed'][str(s['seeds'][0])]['default']['method']}; "
        f"exact: {res['per_seed'][str(s['seeds'][0])]['exact']['method']}.",
        "",
        "| seed | default final | exact final | reward ratio | default train s | "
        "exact train s | time ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, seed in enumerate(s["seeds"]):
        r = res["per_seed"][str(seed)]
        lines.append(
            f"| {seed} | {r['default']['final_reward']:.3f} | {r['exact']['final_reward']:.3f} "
            f"| {s['per_seed_reward_ratio'][i]:.3f} | {r['default']['train_seconds']:.1f} | "
            f"{r['exact']['train_seconds']:.1f} | {s['per_seed_time_ratio'][i]:.3f} |"
        )
    lines += [
        f"| mean | {s['final_reward']['default']:.3f} | {s['final_reward']['exact']:.3f} | "
        f"**{s['reward_ratio']:.3f}** | {s['train_seconds']['default']:.1f} | "
        f"{s['train_seconds']['exact']:.1f} | **{s['train_time_ratio']:.3f}** |",
        "",
        f"Initial held-out reward {s['initial_reward']:.3f}. Targets: reward ratio >= "
        f"{TARGET_REWARD} ({'met' if s['reward_target_met'] else 'MISSED'}), training-time "
        f"ratio <= {TARGET_TIME} ({'met' if s['time_target_met'] else 'MISSED'}).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--quick", action="store_true", help="2 steps, 1 seed, tiny eval (CI)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    seeds = [0] if args.quick else args.seeds
    out = args.out or Path(
        "benchmarks/results/quality2_quick" if args.quick else "benchmarks/results/quality2"
    )
    runs = out / "demo_e2e_runs"
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for i, seed in enumerate(seeds):
        variants = [("default", []), ("exact", ["--mode", "exact"])]
        if i % 2:
            variants.reverse()
        per_seed[seed] = {}
        for name, extra in variants:
            argv_run = ["--task", "digits", "--seed", str(seed), *extra, "--no-progress",
                        "--out", str(runs / f"{name}_seed{seed}")]  # fmt: skip
            if args.quick:
                argv_run += QUICK_ARGS
            per_seed[seed][name] = row(run_demo(argv_run))
            print(f"[demo_e2e] seed {seed} {name}: {per_seed[seed][name]}", flush=True)
    res = {
        "command": "python -m benchmarks.demo_e2e" + (" --quick" if args.quick else ""),
        "date": _dt.date.today().isoformat(),
        "commit": git_commit(),
        "per_seed": {str(k): v for k, v in per_seed.items()},
        "summary": summarize(per_seed),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo_e2e.json").write_text(json.dumps(res, indent=1))
    (out / "DEMO_E2E.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
