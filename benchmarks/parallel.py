"""Issue 22's figures: checkpoint write time as a share of a GRPO step, and the steps per
second of 2 processes (torchrun, gloo) against 1 process on the digits task.

    python -m benchmarks.parallel                 # the digits demo's size (8 x 4, T = 10)
    python -m benchmarks.parallel --quick         # a tiny smoke run (what the test runs)
    python -m benchmarks.parallel --reps 5 --json benchmarks/results/parallel/results.json

**Checkpoints** (one process, in-process ``GRPOTrainer``, the digits defaults, no eval):
per round, a plain step, a synchronous :func:`~jagg_autograd.checkpoint.save_checkpoint`
(snapshot + files + fsync + rename, all on the training thread), then
``trainer.save_checkpoint()`` (the trainer's :class:`~jagg_autograd.checkpoint.AsyncCheckpointer`:
only the snapshot blocks) followed by the next step, which runs while the writer works.
Async share = (blocking call + the step's slowdown next to the writer) / plain step.

**Steps per second**: the digits demo's training (``train()`` with the demo's flags, no
evaluation) in 1 process and under ``torchrun --nproc-per-node 2`` (gloo), both with
``--threads 1`` and ``OMP_NUM_THREADS=1``, interleaved (1, 2, 1, 2, ...).  Each process
records after every step the wall clock and its own CPU time: the per-step wall time is
the median interval on rank 0 (everything a step does: rollout, collectives, training,
the log write), the per-step CPU time that of the busiest rank (what each process must
compute, whatever the machine's load).  ``uptime`` is recorded before and after: the
machine may be shared, and then only the CPU figures mean much.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

FAILURES: list[str] = []
TINY = ["--prompts-per-step", "2", "--group-size", "2", "--num-steps", "4", "--window", "2"]


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "n/a"


def checkpoint_share(rounds: int, quick: bool) -> dict[str, Any]:
    """Medians of a plain step, a synchronous save and the async save's cost."""
    import torch

    from jagg_autograd.checkpoint import save_checkpoint
    from jagg_autograd.demo import parse_config
    from jagg_autograd.trainer import GRPOTrainer

    with tempfile.TemporaryDirectory() as tmp:
        argv = [*(TINY if quick else []), "--steps", "100000", "--eval-per-digit", "0",
                "--no-progress", "--threads", "1", "--out", tmp,
                "--save-every", "100000"]  # fmt: skip
        tr = GRPOTrainer(parse_config(argv))
        tr.step()  # warm-up
        plain, sync, async_call, after_async = [], [], [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            tr.step()
            plain.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            save_checkpoint(Path(tmp) / "sync", tr.step_index, trainable=tr.named_trainable(),
                            optimizer=tr.optimizer, generators={"train": tr.generator},
                            config=tr.resume_config(), log=tr.log)  # fmt: skip
            sync.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tr.save_checkpoint()
            async_call.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            tr.step()  # next to the background writer
            after_async.append(time.perf_counter() - t0)
            tr.wait_for_checkpoint()
        one = Path(tmp) / "sync" / f"checkpoint-{tr.step_index - 1}"
        size = sum(f.stat().st_size for f in one.rglob("*") if f.is_file())
        tr.finish()
    med = statistics.median
    step, s_sync, s_call, s_after = med(plain), med(sync), med(async_call), med(after_async)
    return {
        "rounds": rounds,
        "parameters": sum(p.numel() for p in tr.params),
        "checkpoint_bytes": size,
        "threads": torch.get_num_threads(),
        "step_s": step,
        "sync_save_s": s_sync,
        "async_blocking_s": s_call,
        "step_next_to_writer_s": s_after,
        "sync_share": s_sync / step,
        "async_share": (s_call + max(0.0, s_after - step)) / step,
        "async_blocking_share": s_call / step,
    }


def worker(argv: list[str]) -> None:
    """One process of a timed run: ``train()`` with the demo's flags, recording after every
    step the wall clock and this process's CPU time; rank r writes ``<out>/times-r.json``."""
    from jagg_autograd.demo import parse_config
    from jagg_autograd.trainer import train

    cfg = parse_config(argv)
    rank = int(os.environ.get("RANK", "0"))
    stamps = [(time.perf_counter(), time.process_time())]
    train(cfg, on_step=lambda row: stamps.append((time.perf_counter(), time.process_time())))
    Path(cfg.out, f"times-{rank}.json").write_text(json.dumps(stamps))


def _run(nproc: int, steps: int, out: Path, quick: bool) -> tuple[float, float]:
    """Median per-step wall seconds (rank 0) and CPU seconds (the busiest rank) of a run,
    the first step left out."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    flags = [*(TINY if quick else []), "--steps", str(steps), "--eval-per-digit", "0",
             "--no-progress", "--threads", "1", "--out", str(out)]  # fmt: skip
    me = ["-m", "benchmarks.parallel", "--worker", *flags]
    cmd = [sys.executable, *me] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(nproc), *me]  # fmt: skip
    for _attempt in range(2):  # one retry: a failed launch is reported, not timed
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800,
                             cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
        if res.returncode == 0:
            break
        FAILURES.append(f"{' '.join(cmd[1:])}: exit {res.returncode}: {res.stderr[-600:]}")
    else:
        raise RuntimeError(f"{' '.join(cmd)} failed twice:\n{res.stderr[-3000:]}")
    med = statistics.median
    walls, cpus = [], []
    for r in range(nproc):
        st = json.loads((out / f"times-{r}.json").read_text())
        d = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(st, st[1:])]
        d = d[1:] or d  # the first step warms up
        walls.append(med([w for w, _ in d]))
        cpus.append(med([c for _, c in d]))
    return walls[0], max(cpus)


def scaling(reps: int, steps: int, quick: bool) -> dict[str, Any]:
    """1 vs 2 processes, interleaved (1, 2, 1, 2, ...)."""
    wall: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for n in (1, 2):
                w, c = _run(n, steps, Path(tmp) / f"r{n}-{rep}", quick)
                wall[n].append(w)
                cpu[n].append(c)
    med = statistics.median
    return {
        "reps": reps,
        "steps": steps,
        # Median seconds between two steps' ends (everything a step does: rollout,
        # collectives, training, log writes), per run.
        "per_step_wall_s": {str(n): v for n, v in wall.items()},
        # Median CPU seconds per step of the busiest process: what a step costs each
        # process whatever the machine's load (threads = 1).
        "per_step_cpu_s": {str(n): v for n, v in cpu.items()},
        "speedup_wall": med(wall[1]) / med(wall[2]),
        "speedup_cpu": med(cpu[1]) / med(cpu[2]),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, one round (a smoke run)")
    p.add_argument("--reps", type=int, default=3, help="interleaved 1/2-process repetitions")
    p.add_argument("--rounds", type=int, default=8, help="checkpoint rounds")
    p.add_argument("--steps", type=int, default=12, help="steps of each timed run")
    p.add_argument("--skip-scaling", action="store_true")
    p.add_argument("--json", default=None, help="also write the results to this file")
    a = p.parse_args(argv)
    if a.quick:
        a.reps, a.rounds, a.steps = 1, 1, 2
    os.environ.setdefault("TRITON_INTERPRET", "1")
    res: dict[str, Any] = {"quick": a.quick, "uptime_before": _uptime()}
    res["checkpoint"] = checkpoint_share(a.rounds, a.quick)
    if not a.skip_scaling:
        res["scaling"] = scaling(a.reps, a.steps, a.quick)
    res["uptime_after"] = _uptime()
    res["failed_launches"] = FAILURES
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
