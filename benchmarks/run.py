"""Run the jagg-autograd benchmarks and write JSON, markdown and PNG plots.

    python -m benchmarks.run --quick        # < 5 min on 2 CPU cores
    python -m benchmarks.run                # full: W = 2..8, T = 10 and 16
    python -m benchmarks.run --tiny         # seconds: the test configuration
    python -m benchmarks.run --preset gpu --device cuda   # SD3.5-medium-like, bf16

Outputs (``--out``, default ``benchmarks/results``): ``results.json``, ``RESULTS.md`` and
the plots ``time_ratio_vs_W.png``, ``saved_bytes_vs_W.png``, ``grad_cosine_vs_W.png``.
No timing is asserted anywhere; the figures are reported against the targets.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/run.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info
from benchmarks.fidelity import run_fidelity
from benchmarks.kernels import kernel_times
from benchmarks.models import PRESETS, build_sd3, rollout_inputs
from benchmarks.report import markdown, plots, target_rows
from benchmarks.timing import run_timing

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "preset": "tiny",
        "batch": 2,
        "windows": [4],
        "trajectories": [(5, 3)],
        "reps": 1,
        "warmup": 0,
        "fid": {"T": 4, "windows": [2, 4], "batch": 2, "rollouts": 1, "draws": 2},
    },
    "quick": {
        "preset": "cpu",
        "batch": 2,
        "windows": [2, 4, 8],
        "trajectories": [(10, 4)],
        "reps": 5,
        "warmup": 1,
        "fid": {"T": 10, "windows": [2, 4, 8], "batch": 4, "rollouts": 1, "draws": 16},
    },
    "full": {
        "preset": "cpu",
        "batch": 2,
        "windows": [2, 3, 4, 5, 6, 7, 8],
        "trajectories": [(10, 4), (10, 6), (16, 4), (16, 8)],
        "reps": 5,
        "warmup": 1,
        "fid": {"T": 16, "windows": [2, 3, 4, 6, 8], "batch": 4, "rollouts": 3, "draws": 32},
    },
    "gpu": {
        "preset": "gpu",
        "batch": 1,
        "windows": [2, 4],
        "trajectories": [(10, 4)],
        "reps": 5,
        "warmup": 2,
        "fid": None,
        # Activations of all T steps of the 2.5B model at 4096 tokens do not fit at once:
        # skip exact batched (and the router's possible exact recomputation) for the
        # trajectory; the window figures carry the targets.
        "skip_traj": ("exact_batched", "jagg_router"),
    },
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="small grid, < 5 min on 2 CPU cores")
    g.add_argument("--tiny", action="store_true", help="seconds-long smoke configuration")
    g.add_argument("--gpu", action="store_true", help="the GPU preset (SD3.5-medium-like, bf16)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda for --gpu)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--reps", type=int, default=None, help="override the repetitions")
    p.add_argument("--windows", default=None, help="override the window sizes, e.g. 4,8")
    p.add_argument("--trajectories", default=None, help="override (T:W) pairs, e.g. 10:4,16:4")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--no-fidelity", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the configured benchmarks; return the results dict (also written to ``--out``)."""
    args = parse(argv)
    name = "tiny" if args.tiny else "quick" if args.quick else "gpu" if args.gpu else "full"
    cfg = dict(CONFIGS[name])
    if args.windows is not None:
        cfg["windows"] = [int(w) for w in args.windows.split(",") if w]
    if args.trajectories is not None:
        cfg["trajectories"] = [
            tuple(int(x) for x in tw.split(":")) for tw in args.trajectories.split(",") if tw
        ]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if args.gpu else "cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    reps = args.reps or cfg["reps"]
    preset = PRESETS[cfg["preset"]]
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "config": name,
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_info(device),
        "preset": preset.to_dict(),
        "batch": cfg["batch"],
        "reps": reps,
        "warmup": cfg["warmup"],
        "timing": [],
    }
    if not args.no_timing:
        B = cfg["batch"]
        model, cond = build_sd3(preset, B, device)
        params = [p for p in model.parameters() if p.requires_grad]
        res["n_params"] = sum(p.numel() for p in params)
        res["timing"] = run_timing(
            model,
            params,
            cond,
            lambda n: rollout_inputs(preset, n, B, device),
            device,
            windows=cfg["windows"],
            trajectories=cfg["trajectories"],
            reps=reps,
            warmup=cfg["warmup"],
            skip_traj=cfg.get("skip_traj", ()),
            progress=progress,
        )
        N = preset.channels * preset.latent**2
        dtype = getattr(torch, preset.dtype)
        res["kernels"] = {}
        for rec in res["timing"]:
            T, W = rec["T"], rec["W"]
            if rec["kind"] == "window":
                anchors, key = [0, W - 1], f"W{W}"
            else:
                anchors = list(range(0, T, W - 1))
                if anchors[-1] != T - 1:
                    anchors.append(T - 1)
                key = f"T{T}W{W}"
            k = kernel_times(T, B, N, anchors, dtype, device)
            bwd = rec["times"]["jagg_shared" if rec["kind"] == "trajectory" else "jagg"]["bwd"]
            k["frac_of_jagg_bwd"] = (k["mix_s"] + k["route_s"]) / bwd
            res["kernels"][key] = k
    if not args.no_fidelity and cfg["fid"]:
        res["fidelity"] = run_fidelity(**cfg["fid"], progress=progress)
    res["wall_s"] = time.perf_counter() - t_start
    res["plots"] = plots(res, out)
    res["targets"] = [
        {"target": n, "limit": lim, "measured": got, "floor": fl}
        for n, lim, got, fl in target_rows(res)
    ]
    (out / "results.json").write_text(json.dumps(res, indent=1, default=_json_default))
    (out / "RESULTS.md").write_text(markdown(res))
    return res


def _json_default(x: object) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, torch.Tensor):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    r = main()
    for row in r["targets"]:
        print(f"{row['target']}: measured {row['measured']} (limit {row['limit']})")
    print(f"wall {r['wall_s']:.0f} s")
