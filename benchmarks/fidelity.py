"""Gradient fidelity on real GRPO upstream gradients from the pretrained digits DiT.

Rollouts: Flow-GRPO SDE sampling (``sde_step_with_logprob``, eta = 0.7) of the pretrained
digits DiT from sigma = 1 to 0 in T uniform steps, random labels.  Loss: the on-policy GRPO
surrogate ``-mean_b A_b * mean_k log p(x_{k+1} | x_k)`` with random advantages A ~ N(0, 1)
(at ratio 1 its gradient is the clipped loss's); the upstream gradients g_k = dL/dv_k come
from autograd through the SDE log-prob.  Exact gradients are sum_k J_k^T g_k from per-step
backward passes; every variant's parameter gradient is compared with it by cosine and
relative error ||g - g*|| / ||g*||.

Subsampling baselines at the same backward budget (m steps of B): DanceGRPO's
timestep_fraction (m random steps, gradient rescaled by n / m so it is unbiased) and a
MixGRPO-style window (m consecutive steps from a random start, same rescaling; MixGRPO
itself does not rescale, which changes the relative error but not the cosine).  Their
figures are averaged over ``draws`` random draws per rollout.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import flat_grad, zero_grad
from jagg_autograd import CosineRouter, jagg_trajectory, jagg_window
from jagg_autograd.grpo import sde_step_with_logprob
from jagg_autograd.models import load_digits_dit


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def sde_rollout(
    model: Any,
    cond: dict[str, torch.Tensor],
    shape: tuple[int, ...],
    T: int,
    gen: torch.Generator,
    noise_level: float = 0.7,
) -> dict[str, torch.Tensor]:
    """One SDE rollout of any velocity model ``model(z, t, **cond)`` from x ~ N(0, I) of
    ``shape`` (B, *S): latents (T, B, *S), sigmas (T + 1,) and the upstream gradients g
    (T, B, *S) of the on-policy GRPO surrogate with random advantages (noise, then the
    advantages, drawn from ``gen``)."""
    B = shape[0]
    sig = torch.linspace(1.0, 0.0, T + 1, dtype=torch.float64)
    x = torch.randn(shape, generator=gen)
    lat, nxt, vel = [], [], []
    with torch.no_grad():
        for k in range(T):
            v = model(x, torch.full((B,), float(sig[k])), **cond)
            x_next, _, _, _ = sde_step_with_logprob(
                v, x, float(sig[k]), float(sig[k + 1]), noise_level=noise_level, generator=gen
            )
            lat.append(x)
            vel.append(v.float())
            nxt.append(x_next.float())
            x = x_next.float()
    adv = torch.randn(B, generator=gen)
    grads = []
    for k in range(T):
        v = vel[k].detach().requires_grad_(True)
        _, logp, _, _ = sde_step_with_logprob(
            v,
            lat[k],
            float(sig[k]),
            float(sig[k + 1]),
            noise_level=noise_level,
            prev_sample=nxt[k],
        )
        loss = -(adv * logp).mean() / T
        (g,) = torch.autograd.grad(loss, v)
        grads.append(g.float())
    return {
        "latents": torch.stack(lat),
        "sigmas": sig,
        "velocities": torch.stack(vel),
        "grads": torch.stack(grads),
    }


def rollout(
    model: torch.nn.Module, T: int, B: int, seed: int, noise_level: float = 0.7
) -> dict[str, torch.Tensor]:
    """One SDE rollout of the digits DiT with random labels (see :func:`sde_rollout`):
    latents (T, B, 1, 8, 8), sigmas (T + 1,), labels (B,), velocities and upstream g."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (B,), generator=gen)
    ro = sde_rollout(model, {"labels": labels}, (B, 1, 8, 8), T, gen, noise_level)
    ro["labels"] = labels
    return ro


def per_step_grads(
    model: torch.nn.Module, params: list[torch.nn.Parameter], ro: dict[str, torch.Tensor]
) -> torch.Tensor:
    """(T, P) float64: J_k^T g_k of every step (one backward each)."""
    T, B = ro["latents"].shape[:2]
    out = []
    for k in range(T):
        zero_grad(params)
        t = torch.full((B,), float(ro["sigmas"][k]))
        model(ro["latents"][k], t, labels=ro["labels"]).backward(ro["grads"][k])
        out.append(flat_grad(params))
    zero_grad(params)
    return torch.stack(out)


def _jagg_grad(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    ro: dict[str, torch.Tensor],
    lo: int,
    hi: int,
    **kw: Any,
) -> tuple[torch.Tensor, float]:
    """JAGG gradient over steps lo..hi-1 (a window, or a trajectory when ``window`` is in
    ``kw``) and the fraction of (window, sample) pairs the router sent to exact."""
    zero_grad(params)
    lat = ro["latents"][lo:hi]
    ts = ro["sigmas"][lo:hi].float()
    cond = {"labels": ro["labels"]}
    if "window" in kw:
        v, st = jagg_trajectory(model, lat, ts, cond=cond, return_stats=True, **kw)
    else:
        v, st = jagg_window(model, lat, ts, cond=cond, return_stats=True, **kw)
    v.backward(ro["grads"][lo:hi])
    g = flat_grad(params)
    zero_grad(params)
    return g, float(st.exact.float().mean())


def _subsample_stats(
    step_grads: torch.Tensor, m: int, draws: int, rng: random.Random, consecutive: bool
) -> tuple[list[float], list[float]]:
    n = step_grads.shape[0]
    exact = step_grads.sum(0)
    cos, rel = [], []
    for _ in range(draws):
        if consecutive:
            s = rng.randrange(0, n - m + 1)
            idx = list(range(s, s + m))
        else:
            idx = rng.sample(range(n), m)
        g = step_grads[idx].sum(0) * (n / m)
        cos.append(_cos(g, exact))
        rel.append(_rel(g, exact))
    return cos, rel


def _summ(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=np.float64)
    return {
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
        "n": len(xs),
    }


def run_fidelity(
    *,
    T: int,
    windows: list[int],
    batch: int,
    rollouts: int,
    draws: int,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Cosine / relative error of every variant vs exact, per W, per window position and for
    whole trajectories, aggregated over ``rollouts`` rollouts (and ``draws`` subsample draws).
    """
    torch.manual_seed(seed)
    model = load_digits_dit()
    params = [p for p in model.parameters() if p.requires_grad]
    rng = random.Random(seed)
    acc: dict[str, dict[str, list[float]]] = {}

    def add(key: str, metric: str, vals: list[float] | float) -> None:
        acc.setdefault(key, {}).setdefault(metric, [])
        acc[key][metric].extend(vals if isinstance(vals, list) else [vals])

    for r in tqdm(range(rollouts), desc="fidelity", disable=not progress):
        ro = rollout(model, T, batch, seed=1000 * seed + r)
        sg = per_step_grads(model, params, ro)
        exact_traj = sg.sum(0)
        for W in windows:
            # Windows: disjoint full windows [s, s+W) at every position s = 0, W, 2W, ...
            for s in range(0, T - W + 1, W):
                ex = sg[s : s + W].sum(0)
                for name, kw in (("jagg", {}), ("jagg_router", {"router": CosineRouter()})):
                    g, frac = _jagg_grad(model, params, ro, s, s + W, **kw)
                    for key in (f"window/W{W}/{name}", f"window/W{W}/pos{s}/{name}"):
                        add(key, "cos", _cos(g, ex))
                        add(key, "rel", _rel(g, ex))
                        add(key, "exact_frac", frac)
                for name, consec in (("subsample", False), ("mixgrpo", True)):
                    c, e = _subsample_stats(sg[s : s + W], 2, draws, rng, consec)
                    for key in (f"window/W{W}/{name}", f"window/W{W}/pos{s}/{name}"):
                        add(key, "cos", c)
                        add(key, "rel", e)
            # Trajectories.
            m = math.ceil((T - 1) / (W - 1)) + 1
            for name, kw in (
                ("jagg", {"shared_anchors": False}),
                ("jagg_shared", {"shared_anchors": True}),
                ("jagg_router", {"shared_anchors": True, "router": CosineRouter()}),
            ):
                g, frac = _jagg_grad(model, params, ro, 0, T, window=W, **kw)
                add(f"traj/W{W}/{name}", "cos", _cos(g, exact_traj))
                add(f"traj/W{W}/{name}", "rel", _rel(g, exact_traj))
                add(f"traj/W{W}/{name}", "exact_frac", frac)
            for name, consec in (("subsample", False), ("mixgrpo", True)):
                c, e = _subsample_stats(sg, min(m, T), draws, rng, consec)
                add(f"traj/W{W}/{name}", "cos", c)
                add(f"traj/W{W}/{name}", "rel", e)
    summary = {key: {mt: _summ(v) for mt, v in d.items()} for key, d in acc.items()}
    return {
        "model": "pretrained digits DiT (jagg_autograd.models.load_digits_dit)",
        "T": T,
        "windows": windows,
        "batch": batch,
        "rollouts": rollouts,
        "draws": draws,
        "noise_level": 0.7,
        "router": repr(CosineRouter()),
        "results": summary,
    }
