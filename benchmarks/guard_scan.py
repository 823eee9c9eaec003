"""Replay the runaway guard on every logged run: which runs would it have switched, when?

``python -m benchmarks.guard_scan [--root benchmarks/results] [--ratio 1.5] [--window 10]``

Every train log under ``--root`` (a ``log.json``, a study's raw file of several runs, any
JSON holding ``steps`` rows with ``grad_norm``) of at least ``2 * window`` steps is fed,
step by step, to :class:`~jagg_autograd.runaway_guard.RunawayGuard` -- the trainer's own
rule -- and grouped by (task, mode, fold).  The table says how many runs of each group the
guard would have tripped on, the steps it tripped at and each group's largest ratio of
the rolling median to the baseline: the evidence for ``guard_ratio``'s default (a
threshold every run that did not collapse stays under).

The guard is replayed over whole runs and never reset, so a run that in fact switched
estimators (a log with ``guard`` events) is scanned as if it had not; the scan marks them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/guard_scan.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jagg_autograd.runaway_guard import RunawayGuard


def train_logs(obj: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, log)`` of every train log nested in a JSON value."""
    if isinstance(obj, dict):
        rows = obj.get("steps")
        if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "grad_norm" in rows[0]:
            yield where, obj
            return
        for k, v in obj.items():
            yield from train_logs(v, f"{where}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from train_logs(v, f"{where}[{i}]")


def replay(norms: list[float], ratio: float, window: int) -> tuple[float, int | None]:
    """The largest ratio the guard saw over a run and the step it first tripped (None)."""
    guard, worst, trip = RunawayGuard(ratio, window), 0.0, None
    for step, g in enumerate(norms):
        r = guard.observe(g)
        worst = max(worst, r or 0.0)
        if guard.tripped and trip is None:
            trip = step
    return worst, trip


def scan(root: Path, ratio: float, window: int) -> dict[tuple[str, str, str], list[dict]]:
    """(task, mode, fold) -> one record per run: where, steps, max ratio, trip step."""
    groups: dict[tuple[str, str, str], list[dict]] = defaultdict(list)
    for path in sorted(root.rglob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        for where, log in train_logs(data, str(path.relative_to(root))):
            norms = [float(r["grad_norm"]) for r in log["steps"]]
            if len(norms) < 2 * window:
                continue
            cfg = log.get("config") or {}
            key = (str(cfg.get("task", "digits")), str(cfg.get("mode", "?")),
                   str(cfg.get("fold", "linear")))  # fmt: skip
            worst, trip = replay(norms, ratio, window)
            groups[key].append({"where": where, "steps": len(norms), "max_ratio": worst,
                                "trip": trip, "switched": bool(log.get("guard"))})  # fmt: skip
    return dict(groups)


def report(groups: dict[tuple[str, str, str], list[dict]], ratio: float, window: int) -> str:
    lines = [
        f"Runaway guard replayed (ratio {ratio:g}, window {window}) on every train log:",
        "",
        "| task | mode | fold | runs | tripped | trip steps | max ratio (largest 3) |",
        "|---|---|---|---|---|---|---|",
    ]
    for (task, mode, fold), runs in sorted(groups.items()):
        trips = sorted(r["trip"] for r in runs if r["trip"] is not None)
        worst = sorted((r["max_ratio"] for r in runs), reverse=True)[:3]
        span = f"{trips[0]}-{trips[-1]}" if trips else "-"
        lines.append(
            f"| {task} | {mode} | {fold} | {len(runs)} | {len(trips)} | {span} | "
            + ", ".join(f"{w:.2f}" for w in worst)
            + " |"
        )
    switched = [r["where"] for runs in groups.values() for r in runs if r["switched"]]
    if switched:
        lines += ["", "Logs whose run did switch (scanned as unguarded): " + ", ".join(switched)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path("benchmarks/results"),
                   help="folder searched for train logs (*.json)")  # fmt: skip
    p.add_argument("--ratio", type=float, default=1.5, help="the guard's guard_ratio")
    p.add_argument("--window", type=int, default=10, help="the guard's guard_window")
    p.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = p.parse_args(argv)
    if not args.root.is_dir():
        raise SystemExit(f"--root {str(args.root)!r} is not a folder")
    RunawayGuard(args.ratio, args.window)  # bad --ratio / --window: its ValueError, now
    text = report(scan(args.root, args.ratio, args.window), args.ratio, args.window)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
