"""Mixing and routing kernel cost.

On CPU the library's "auto" backend is the torch reference (the Triton interpreter is far
slower and never used implicitly), so on CPU the figures are the torch reference's time.
On CUDA the Triton kernels are timed with CUDA events and their achieved bandwidth is
compared with the device's peak.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from jagg_autograd.mix import anchor_slots, mix_slots
from jagg_autograd.router import cosine_route

# Peak HBM bandwidth (bytes/s) by device name, for the bandwidth fraction.
PEAK_BW = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12, "L40": 0.864e12, "A10": 0.6e12}


def peak_bandwidth(device: torch.device) -> float | None:
    """Nominal peak memory bandwidth of a CUDA device, or None when unknown."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_properties(device).name
    for key, bw in PEAK_BW.items():
        if key in name:
            return bw
    return None


def _time(fn: Any, device: torch.device, iters: int) -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        if device.type == "cuda":
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


def kernel_times(
    T: int,
    B: int,
    N: int,
    anchors: list[int],
    dtype: torch.dtype,
    device: torch.device,
    iters: int = 20,
) -> dict[str, Any]:
    """Time the mixing op and the routing score on (T, B, N) tensors with the "auto" backend.

    Returns seconds, bytes moved (the minimum: every input element read once, every
    output written once) and, on CUDA, achieved bandwidth and its fraction of the peak.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    grad = torch.randn(T, B, N, generator=g).to(device, dtype)
    vel = torch.randn(T, B, N, generator=g).to(device, dtype)
    a = torch.tensor(anchors, device=device)
    alpha = torch.zeros(T, B, dtype=torch.float64, device=device)
    w_cur = torch.zeros(T, B, dtype=torch.float64, device=device)
    w_nxt = torch.zeros_like(w_cur)
    w_cur[anchors] = 1.0
    for lo, hi in zip(anchors[:-1], anchors[1:]):
        for k in range(lo + 1, hi):
            alpha[k] = (k - lo) / (hi - lo)
            w_cur[k] = 1 - alpha[k]
            w_nxt[k] = alpha[k]
    left, right = anchors[:-1], anchors[1:]
    backend = "auto"
    resolved = "triton" if device.type == "cuda" else "torch"
    # The slot table is part of the plan, built once in the forward: not timed.
    slots, n_out = anchor_slots(a, T, B)
    t_mix = _time(lambda: mix_slots(grad, w_cur, w_nxt, slots, n_out, backend), device, iters)
    t_route = _time(lambda: cosine_route(vel, alpha, left, right, backend=backend), device, iters)
    esize = grad.element_size()
    mix_bytes = (T + len(anchors)) * B * N * esize
    route_bytes = T * B * N * esize
    out: dict[str, Any] = {
        "T": T,
        "B": B,
        "N": N,
        "anchors": anchors,
        "dtype": str(dtype).replace("torch.", ""),
        "backend": resolved,
        "mix_s": t_mix,
        "route_s": t_route,
        "mix_bytes": mix_bytes,
        "route_bytes": route_bytes,
        "mix_GBps": mix_bytes / t_mix / 1e9,
        "route_GBps": route_bytes / t_route / 1e9,
    }
    peak = peak_bandwidth(device)
    if peak:
        out["peak_GBps"] = peak / 1e9
        out["mix_frac_peak"] = mix_bytes / t_mix / peak
        out["route_frac_peak"] = route_bytes / t_route / peak
    return out
