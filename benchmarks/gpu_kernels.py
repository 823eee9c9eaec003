"""Kernel correctness and bandwidth on a real device (``python -m benchmarks.gpu_kernels``).

On CUDA the Triton kernels run compiled (TRITON_INTERPRET must be unset or 0) and are
checked against the torch references on odd sizes, every dtype and non-contiguous input,
then timed at benchmark sizes with their achieved bandwidth vs the device's peak.  With
``--cpu`` the same checks run on CPU tensors under the interpreter (small sizes only), the
way this script is exercised without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info
from benchmarks.kernels import kernel_times

TOL = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def check_kernels(device: torch.device) -> list[dict[str, Any]]:
    """Triton vs torch reference for both ops; one record per (op, dtype, shape, layout)."""
    from jagg_autograd.mix import jagg_mix, jagg_mix_ref
    from jagg_autograd.router import cosine_route, cosine_route_ref

    out = []
    g = torch.Generator().manual_seed(0)
    cases = [
        (2, [0, 1], 1, 1),
        (7, [0, 6], 3, 63),
        (10, [0, 3, 6, 9], 2, 1025),
        (11, [0, 3, 4, 7, 8, 10], 5, 4097),
    ]
    for dtype, tol in TOL.items():
        for T, anchors, B, N in cases:
            for layout in ("contiguous", "permuted"):
                if layout == "permuted":
                    x = torch.randn(B, N, T, generator=g).to(device, dtype).permute(2, 0, 1)
                else:
                    x = torch.randn(T, B, N, generator=g).to(device, dtype)
                a = torch.tensor(anchors, device=device)
                wc = torch.rand(T, B, generator=g, dtype=torch.float64).to(device)
                wn = torch.rand(T, B, generator=g, dtype=torch.float64).to(device)
                wc[anchors] = 1.0
                wn[anchors] = 0.0
                got = jagg_mix(x, wc, wn, a, backend="triton").float()
                want = jagg_mix_ref(x, wc, wn, a).float()
                err_mix = float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))
                # Per-sample anchors (adaptive placement): a random (T, B) mask.
                mask = (torch.rand(T, B, generator=g) < 0.4).to(device)
                mask[0] = True
                mask[-1] = True
                wm_c, wm_n = wc.clone(), wn.clone()
                wm_c[mask] = 1.0
                wm_n[mask] = 0.0
                got_m = jagg_mix(x, wm_c, wm_n, mask, backend="triton").float()
                want_m = jagg_mix_ref(x, wm_c, wm_n, mask).float()
                err_mix = max(
                    err_mix,
                    float((got_m - want_m).abs().max() / want_m.abs().max().clamp_min(1e-12)),
                )
                left, right = anchors[:-1], anchors[1:]
                alpha = torch.rand(T, B, generator=g, dtype=torch.float64).to(device)
                s_got = cosine_route(x, alpha, left, right, backend="triton").float()
                s_want = cosine_route_ref(x, alpha, left, right).float()
                err_route = float((s_got - s_want).abs().max())
                out.append(
                    {
                        "dtype": str(dtype).replace("torch.", ""),
                        "T": T,
                        "B": B,
                        "N": N,
                        "layout": layout,
                        "mix_rel_err": err_mix,
                        "route_abs_err": err_route,
                        "ok": err_mix <= tol and err_route <= 10 * tol,
                    }
                )
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the checks and the bandwidth microbenchmark; write ``gpu_kernels.json``."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cpu", action="store_true", help="interpreted CPU run (small sizes)")
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.cpu else "cuda")
    if args.cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        print("--cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    checks = check_kernels(device)
    sizes = [
        (4, 2, 16 * 64 * 64, [0, 3]),
        (10, 2, 16 * 64 * 64, [0, 3, 6, 9]),
        (16, 8, 16 * 128 * 128, [0, 3, 6, 9, 12, 15]),
    ]
    if args.cpu:
        sizes = [(4, 2, 1024, [0, 3])]
    bench = []
    for T, B, N, anchors in sizes:
        for dtype in (torch.bfloat16, torch.float32):
            bench.append(kernel_times(T, B, N, anchors, dtype, device, iters=5 if args.cpu else 50))
    # kernel_times uses backend "auto", which is the reference on CPU: under --cpu time the
    # interpreted kernels' correctness only.
    res = {
        "machine": machine_info(device),
        "checks": checks,
        "all_ok": all(c["ok"] for c in checks),
        "bandwidth": bench,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(res, indent=1))
    print(f"kernel checks: {sum(c['ok'] for c in checks)}/{len(checks)} ok")
    for b in bench:
        frac = (
            f" ({b['mix_frac_peak']:.0%} / {b['route_frac_peak']:.0%} of peak)"
            if "mix_frac_peak" in b
            else ""
        )
        print(
            f"T={b['T']} B={b['B']} N={b['N']} {b['dtype']} [{b['backend']}]: mix "
            f"{b['mix_s'] * 1e6:.1f} us {b['mix_GBps']:.0f} GB/s, "
            f"route {b['route_s'] * 1e6:.1f} us "
            f"{b['route_GBps']:.0f} GB/s{frac}"
        )
    return 0 if res["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
