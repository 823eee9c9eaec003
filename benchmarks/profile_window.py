"""torch.profiler view of one W-step window: JAGG vs exact per-step backward.

    python -m benchmarks.profile_window [--W 4] [--preset cpu] [--out DIR]

Prints the top operators by self CPU time of each variant's forward+backward and writes
``profile_W{W}.txt`` into ``--out``: where a time ratio misses its floor, this shows
which ops (e.g. batch-size-independent work, the mixing op, cond tiling) make the gap.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import Stopwatch, zero_grad
from benchmarks.models import PRESETS, build_sd3, rollout_inputs
from benchmarks.timing import Case, variants


def main(argv: list[str] | None = None) -> None:
    """Profile the variants of one window and print/write the tables."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--W", type=int, default=4)
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--preset", default="cpu")
    p.add_argument("--rows", type=int, default=15)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    dev = torch.device("cpu")
    preset = PRESETS[args.preset]
    model, cond = build_sd3(preset, args.B, dev)
    params = [q for q in model.parameters() if q.requires_grad]
    lat, ts, gr = rollout_inputs(preset, args.W, args.B, dev)
    case = Case(model, params, lat, ts, gr, cond, args.W, False, dev)
    import random

    vs = variants(case, random.Random(0))
    text = []
    for name in ("exact_per_step", "exact_batched", "jagg"):
        vs[name](Stopwatch(dev))  # warm-up
        zero_grad(params)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            sw = Stopwatch(dev)
            vs[name](sw)
        zero_grad(params)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows)
        head = f"== {name}: fwd {sw.times['fwd']:.3f} s, bwd {sw.times['bwd']:.3f} s"
        text += [head, table]
        print(head)
        print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_W{args.W}.txt").write_text("\n".join(text))


if __name__ == "__main__":
    main()
