"""Timing and saved-memory of every training variant on one model, data and upstream grads.

Variants (``n`` steps = a window of W or a trajectory of T; B samples per step):

- ``exact_per_step``: Flow-GRPO's loop, per step a forward with grad at batch B and its
  backward (n backward passes of B, one step's activations alive at a time);
- ``exact_batched``: ``jagg_window`` / ``jagg_trajectory`` with ``mode="exact"``;
- ``jagg``: the paper's layout (2 anchors per window: ``jagg_window``, or
  ``jagg_trajectory(shared_anchors=False)``);
- ``jagg_shared``: ``jagg_trajectory(shared_anchors=True)`` (trajectories only);
- ``jagg_router``: ``jagg`` (shared anchors for trajectories) + ``CosineRouter()``;
- ``subsample``: DanceGRPO's timestep_fraction at the same backward budget: the budget's
  number of random steps forwarded with grad in one batched call and backpropagated with
  the gradient rescaled by n / m.  A MixGRPO window (m consecutive steps) costs the same.

Each repetition runs every variant once in a shuffled order (interleaved), after warm-up.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import SavedBytes, Stopwatch, median, param_storages, sync, zero_grad
from jagg_autograd import CosineRouter, jagg_trajectory, jagg_window


@dataclass
class Case:
    """One model and its inputs: n steps of latents/timesteps/upstream gradients."""

    model: Callable[..., torch.Tensor]
    params: list[torch.nn.Parameter]
    latents: torch.Tensor  # (n, B, *S)
    timesteps: torch.Tensor  # (n,)
    grads: torch.Tensor  # (n, B, *S)
    cond: dict[str, torch.Tensor]
    window: int  # W (== n for a window case)
    trajectory: bool
    device: torch.device


def budget(case: Case) -> int:
    """Steps (of B samples) in the JAGG variant's one backward: the subsampling budget."""
    n, W = case.latents.shape[0], case.window
    if not case.trajectory:
        return 2
    return math.ceil((n - 1) / (W - 1)) + 1


def _per_step(case: Case, sw: Stopwatch) -> None:
    n, B = case.latents.shape[:2]
    for k in range(n):
        with sw.phase("fwd"):
            t = case.timesteps[k].expand(B)
            v = case.model(case.latents[k], t, **case.cond)
        with sw.phase("bwd"):
            v.backward(case.grads[k])


def _batched(case: Case, sw: Stopwatch, **kw: Any) -> None:
    with sw.phase("fwd"):
        if case.trajectory:
            v = jagg_trajectory(
                case.model, case.latents, case.timesteps, window=case.window, cond=case.cond, **kw
            )
        else:
            v = jagg_window(case.model, case.latents, case.timesteps, cond=case.cond, **kw)
    with sw.phase("bwd"):
        v.backward(case.grads)


def _subsample(case: Case, sw: Stopwatch, rng: random.Random) -> None:
    n, B = case.latents.shape[:2]
    m = budget(case)
    steps = sorted(rng.sample(range(n), m))
    idx = torch.tensor(steps, device=case.device)
    with sw.phase("fwd"):
        z = case.latents.index_select(0, idx).flatten(0, 1)
        t = case.timesteps.index_select(0, idx).repeat_interleave(B)
        cond = {k: v.repeat(m, *([1] * (v.dim() - 1))) for k, v in case.cond.items()}
        v = case.model(z, t, **cond)
    with sw.phase("bwd"):
        v.backward(case.grads.index_select(0, idx).flatten(0, 1) * (n / m))


def variants(case: Case, rng: random.Random) -> dict[str, Callable[[Stopwatch], None]]:
    """The variants to run on ``case`` (name -> callable timing its fwd/bwd phases)."""
    out: dict[str, Callable[[Stopwatch], None]] = {
        "exact_per_step": lambda sw: _per_step(case, sw),
        "exact_batched": lambda sw: _batched(case, sw, mode="exact"),
    }
    if case.trajectory:
        out["jagg"] = lambda sw: _batched(case, sw, shared_anchors=False)
        out["jagg_shared"] = lambda sw: _batched(case, sw, shared_anchors=True)
    else:
        out["jagg"] = lambda sw: _batched(case, sw)
    out["jagg_router"] = lambda sw: _batched(case, sw, router=CosineRouter())
    out["subsample"] = lambda sw: _subsample(case, sw, rng)
    return out


def time_case(
    case: Case, reps: int, warmup: int, seed: int = 0, skip: tuple[str, ...] = ()
) -> dict[str, dict[str, float]]:
    """Median fwd / bwd / step seconds of every variant over ``reps`` interleaved rounds."""
    rng = random.Random(seed)
    vs = {k: f for k, f in variants(case, rng).items() if k not in skip}
    samples: dict[str, list[dict[str, float]]] = {k: [] for k in vs}
    for r in range(warmup + reps):
        order = list(vs)
        rng.shuffle(order)
        for name in order:
            sw = Stopwatch(case.device)
            vs[name](sw)
            zero_grad(case.params)
            if r >= warmup:
                t = dict(sw.times)
                t["step"] = t.get("fwd", 0.0) + t.get("bwd", 0.0)
                samples[name].append(t)
    return {
        name: {key: median(s[key] for s in ss) for key in ("fwd", "bwd", "step")}
        for name, ss in samples.items()
    }


def memory_case(case: Case, skip: tuple[str, ...] = ()) -> dict[str, dict[str, float]]:
    """Bytes saved for backward per variant (saved_tensors_hooks, storages deduplicated,
    parameters excluded) and, on CUDA, the peak allocated memory above the baseline.

    For exact_per_step the figure is the largest single step's (only one step's graph is
    alive at a time); ``total_bytes`` includes parameter storages.
    """
    out: dict[str, dict[str, float]] = {}
    excl = param_storages(case.params)
    rng = random.Random(0)
    for name, fn in variants(case, rng).items():
        if name in skip:
            continue
        cuda = case.device.type == "cuda"
        if cuda:
            sync(case.device)
            torch.cuda.reset_peak_memory_stats(case.device)
            base = torch.cuda.memory_allocated(case.device)
        if name == "exact_per_step":
            best, best_total = 0, 0
            n, B = case.latents.shape[:2]
            for k in range(n):
                sb = SavedBytes(excl)
                with sb.hooks():
                    v = case.model(case.latents[k], case.timesteps[k].expand(B), **case.cond)
                best, best_total = max(best, sb.activations), max(best_total, sb.total)
                v.backward(case.grads[k])
            rec = {"saved_bytes": best, "total_bytes": best_total}
        else:
            sb = SavedBytes(excl)
            with sb.hooks():
                fn(Stopwatch(case.device))
            rec = {"saved_bytes": sb.activations, "total_bytes": sb.total}
        if cuda:
            sync(case.device)
            rec["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(case.device) - base
        zero_grad(case.params)
        out[name] = rec
    return out


def run_timing(
    model: Callable[..., torch.Tensor],
    params: list[torch.nn.Parameter],
    cond: dict[str, torch.Tensor],
    make_inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    device: torch.device,
    *,
    windows: list[int],
    trajectories: list[tuple[int, int]],
    reps: int,
    warmup: int,
    skip_traj: tuple[str, ...] = (),
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time and measure memory for every window W and trajectory (T, W); one record each."""
    cases: list[tuple[str, int, int]] = [("window", W, W) for W in windows]
    cases += [("trajectory", T, W) for T, W in trajectories]
    records = []
    for kind, n, W in tqdm(cases, desc="timing", disable=not progress):
        lat, ts, gr = make_inputs(n)
        case = Case(model, params, lat, ts, gr, cond, W, kind == "trajectory", device)
        skip = skip_traj if case.trajectory else ()
        mem = memory_case(case, skip)
        times = time_case(case, reps, warmup, seed=n * 100 + W, skip=skip)
        records.append(
            {
                "kind": kind,
                "T": n,
                "W": W,
                "budget_steps": budget(case),
                "times": times,
                "memory": mem,
            }
        )
    return records


def floors(kind: str, T: int, W: int) -> dict[str, float]:
    """FLOP floors of the JAGG variants relative to exact per-step (backward passes)."""
    if kind == "window":
        return {"jagg": 2 / W}
    shared = (math.ceil((T - 1) / (W - 1)) + 1) / T
    disjoint = sum(min(2, len(range(s, min(s + W, T)))) for s in range(0, T, W)) / T
    return {"jagg": disjoint, "jagg_shared": shared}
