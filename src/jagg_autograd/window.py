"""Public entry points: :func:`jagg_window` and :func:`jagg_trajectory`.

Notation.  Steps k = 0..T-1 of a rollout carry constant latents z_k (B, *S), timesteps
t_k and velocities v_k = f_theta(z_k, t_k, c).  Anchors a_0 = 0 < ... < a_{n-1} = T-1
split the steps into windows [a_j, a_{j+1}]; an interior step k of window j has

    alpha_k = (t_k - t_{a_j}) / (t_{a_{j+1}} - t_{a_j})
    J_k ~= (1 - alpha_k) J_{a_j} + alpha_k J_{a_{j+1}}

so the parameter gradient sum_k J_k^T g_k becomes sum_j J_{a_j}^T G_j with the composite
gradients G_j of ``jagg_autograd.mix``: one backward through one batched forward of the
anchors.  Forward values are exact: every v_k is computed, interior ones under no_grad.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from jagg_autograd._backend import check_backend
from jagg_autograd.function import JaggFunction
from jagg_autograd.router import CosineRouter, cosine_route

MODES = ("jagg", "exact")
BATCHINGS = ("stacked", "per_step")


@dataclass
class JaggStats:
    """What a call did.

    scores: (B,) for a window, (n_windows, B) for a trajectory: the router's score
        (1.0 for a window with no interior step).  Computed whenever stats are asked for.
    exact: bool, same shape: True where that sample's window got the exact gradient
        (mode="exact": everywhere; mode="jagg": where the router sent it).
    grad_samples: samples the model was run on with grad.
    backward_calls: model forward calls whose graph the backward goes through.
    windows: (first, last) step of each window; anchors: the anchor steps (jagg layout).
    """

    scores: torch.Tensor
    exact: torch.Tensor
    grad_samples: int
    backward_calls: int
    windows: list[tuple[int, int]] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- validation


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def _check_latents(latents: object, name: str) -> torch.Tensor:
    if not isinstance(latents, torch.Tensor):
        raise TypeError(f"latents must be a torch.Tensor, got {type(latents).__name__}")
    if latents.dim() < 2:
        raise ValueError(
            f"latents must be ({name}, B, *S) with at least 2 dims, got {latents.dim()}"
        )
    if not latents.is_floating_point():
        raise TypeError(f"latents must be a floating tensor, got {latents.dtype}")
    if latents.requires_grad:
        raise ValueError(
            "latents must not require grad: JAGG approximates parameter gradients and the "
            "rollout latents are constants (pass latents.detach())"
        )
    if latents.shape[1] == 0 or latents.numel() == 0:
        raise ValueError(f"latents must be non-empty, got shape {tuple(latents.shape)}")
    return latents


def _check_timesteps(timesteps: object, latents: torch.Tensor) -> torch.Tensor:
    """Return (T, B) float64 timesteps after checking them at their given precision."""
    if not isinstance(timesteps, torch.Tensor):
        if isinstance(timesteps, (list, tuple)):
            timesteps = torch.as_tensor(timesteps, device=latents.device)
        else:
            raise TypeError(f"timesteps must be a tensor, got {type(timesteps).__name__}")
    t = timesteps
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"timesteps must be real numbers, got {t.dtype}")
    if t.device != latents.device:
        raise ValueError(f"timesteps are on {t.device} but latents on {latents.device}")
    T, B = latents.shape[:2]
    if tuple(t.shape) not in ((T,), (T, B)):
        raise ValueError(
            f"timesteps must have shape ({T},) or ({T}, {B}) to match latents "
            f"{tuple(latents.shape)}, got {tuple(t.shape)}"
        )
    t = t.detach()
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError("timesteps must be finite")
    # Differences at the given precision: a schedule that is strictly monotone as given is
    # accepted even if the copy cast for the model repeats values.
    d = t[1:] - t[:-1]
    if t.dim() == 1:
        d = d.unsqueeze(1)
    inc = (d > 0).all(0)
    dec = (d < 0).all(0)
    if not bool((inc | dec).all()):
        raise ValueError(
            "timesteps must be strictly monotone (increasing or decreasing, no repeats) "
            "along dim 0 for every sample"
        )
    t64 = t.to(torch.float64)
    return t64.unsqueeze(1).expand(T, B) if t64.dim() == 1 else t64


def _check_cond(
    cond: object, B: int, device: torch.device, batched_cond: object
) -> tuple[dict[str, Any], frozenset[str]]:
    if cond is None:
        cond = {}
    if not isinstance(cond, Mapping):
        raise TypeError(f"cond must be a mapping of keyword arguments, got {type(cond).__name__}")
    cond = dict(cond)
    for key, val in cond.items():
        if not isinstance(key, str):
            raise TypeError(f"cond keys must be str, got {key!r}")
        if isinstance(val, torch.Tensor) and val.device != device:
            raise ValueError(f"cond[{key!r}] is on {val.device} but latents on {device}")
    if batched_cond is None:
        keys = frozenset(
            k
            for k, v in cond.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == B
        )
    else:
        if isinstance(batched_cond, str) or not isinstance(batched_cond, Collection):
            raise TypeError("batched_cond must be a collection of cond key names")
        keys = frozenset(batched_cond)
        for k in keys:
            if k not in cond:
                raise ValueError(f"batched_cond names {k!r}, which is not a key of cond")
            v = cond[k]
            if not isinstance(v, torch.Tensor) or v.dim() == 0 or v.shape[0] != B:
                raise ValueError(f"batched_cond key {k!r} must be a tensor with dim 0 == B={B}")
    return cond, keys


def _check_model(model: object, device: torch.device) -> None:
    if not callable(model):
        raise TypeError(
            f"model must be callable as model(z, t, **cond), got {type(model).__name__}"
        )
    if isinstance(model, torch.nn.Module):
        p = next(iter(model.parameters()), None)
        if p is not None and p.device.type != device.type:
            raise ValueError(f"model parameters are on {p.device} but latents on {device}")


def _check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    return chunk_size


def _check_router(router: object) -> CosineRouter | None:
    if router is not None and not isinstance(router, CosineRouter):
        raise TypeError(f"router must be None or a CosineRouter, got {type(router).__name__}")
    return router


# ------------------------------------------------------------------------------ layout


def trajectory_layout(
    T: int, window: int, shared_anchors: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Anchor steps and windows (first, last) of a T-step trajectory.

    shared_anchors=True: anchors 0, W-1, 2(W-1), ..., and T-1; adjacent windows share
    their boundary step, ceil((T-1)/(W-1)) + 1 anchors in all.  False (the paper):
    disjoint windows [0..W-1], [W..2W-1], ...; a shorter last window; a last single step
    is its own anchor (exact).
    """
    if shared_anchors:
        anchors = list(range(0, T, window - 1))
        if anchors[-1] != T - 1:
            anchors.append(T - 1)
        return anchors, list(zip(anchors[:-1], anchors[1:]))
    windows = [(s, min(s + window - 1, T - 1)) for s in range(0, T, window)]
    anchors = sorted({a for w in windows for a in w})
    return anchors, windows


# ------------------------------------------------------------------------- model calls


class _Caller:
    """Runs the model on (step, sample) index pairs, tiling cond step-major."""

    def __init__(
        self,
        model: Callable[..., torch.Tensor],
        latents: torch.Tensor,
        t_model: torch.Tensor,
        cond: dict[str, Any],
        batched: frozenset[str],
    ) -> None:
        self.model = model
        self.latents = latents
        self.t_model = t_model
        self.cond = cond
        self.batched = batched
        self.B = latents.shape[1]
        self.S = tuple(latents.shape[2:])
        self.grad_samples = 0
        self.grad_calls = 0
        self.out_dtype: torch.dtype | None = None

    def steps(self, steps: list[int], grad: bool) -> torch.Tensor:
        """Whole steps stacked: (len(steps) * B, *S), step-major."""
        idx = torch.tensor(steps, dtype=torch.long, device=self.latents.device)
        z = self.latents.index_select(0, idx).reshape(len(steps) * self.B, *self.S)
        t = self.t_model.index_select(0, idx).reshape(-1)
        cond = {
            k: (v.repeat(len(steps), *([1] * (v.dim() - 1))) if k in self.batched else v)
            for k, v in self.cond.items()
        }
        return self._call(z, t, cond, grad)

    def pairs(self, ks: torch.Tensor, bs: torch.Tensor, grad: bool) -> torch.Tensor:
        """Arbitrary (step, sample) pairs: (len(ks), *S)."""
        z = self.latents[ks, bs]
        t = self.t_model[ks, bs]
        cond = {k: (v[bs] if k in self.batched else v) for k, v in self.cond.items()}
        return self._call(z, t, cond, grad)

    def _call(
        self, z: torch.Tensor, t: torch.Tensor, cond: dict[str, Any], grad: bool
    ) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            v = self.model(z, t, **cond)
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"model must return a torch.Tensor, got {type(v).__name__}")
        if v.shape != z.shape:
            raise ValueError(
                f"model returned shape {tuple(v.shape)} for input {tuple(z.shape)}; the "
                "velocity must have the latents' shape"
            )
        if not v.is_floating_point():
            raise TypeError(f"model must return a floating tensor, got {v.dtype}")
        if self.out_dtype is None:
            self.out_dtype = v.dtype
        elif v.dtype != self.out_dtype:
            raise TypeError(f"model returned {v.dtype} after {self.out_dtype} in an earlier call")
        if grad and v.requires_grad:
            self.grad_samples += v.shape[0]
            self.grad_calls += 1
        return v


def _chunks(items: list[int], per: int) -> list[list[int]]:
    return [items[i : i + per] for i in range(0, len(items), per)]


def _run_steps(
    caller: _Caller, steps: list[int], grad: bool, batching: str, chunk_size: int | None
) -> list[tuple[list[int], torch.Tensor]]:
    """Forward whole steps; per_step: one call of B each; stacked: as few as chunk_size allows."""
    if not steps:
        return []
    if batching == "per_step":
        groups = [[k] for k in steps]
    elif chunk_size is not None and chunk_size < caller.B:
        # A chunk smaller than one step's batch: split every step's samples.
        return _run_step_pieces(caller, steps, grad, chunk_size)
    else:
        per = len(steps) if chunk_size is None else chunk_size // caller.B
        groups = _chunks(steps, per)
    return [(g, caller.steps(g, grad)) for g in groups]


def _run_step_pieces(
    caller: _Caller, steps: list[int], grad: bool, chunk_size: int
) -> list[tuple[list[int], torch.Tensor]]:
    B = caller.B
    out = []
    for k in steps:
        parts = []
        for lo in range(0, B, chunk_size):
            bs = torch.arange(lo, min(lo + chunk_size, B), device=caller.latents.device)
            parts.append(caller.pairs(torch.full_like(bs, k), bs, grad))
        out.append(([k], torch.cat(parts)))
    return out


# --------------------------------------------------------------------------------- core


def _alpha_weights(
    t64: torch.Tensor, windows: list[tuple[int, int]], anchors: list[int]
) -> torch.Tensor:
    """alpha (T, B) float64: 0 at anchors, interpolation coordinate inside windows."""
    alpha = torch.zeros_like(t64)
    for lo, hi in windows:
        if hi - lo >= 2:
            alpha[lo + 1 : hi] = (t64[lo + 1 : hi] - t64[lo]) / (t64[hi] - t64[lo])
    return alpha


def _jagg_core(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: object,
    anchors: list[int],
    windows: list[tuple[int, int]],
    *,
    cond: object,
    mode: object,
    router: object,
    backend: object,
    batching: object,
    chunk_size: object,
    batched_cond: object,
    return_stats: bool,
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    mode = _check_choice("mode", mode, MODES)
    backend = check_backend(backend)
    batching = _check_choice("batching", batching, BATCHINGS)
    chunk_size = _check_chunk_size(chunk_size)
    router = _check_router(router)
    device = latents.device
    _check_model(model, device)
    t64 = _check_timesteps(timesteps, latents)
    T, B = latents.shape[:2]
    cond_d, batched = _check_cond(cond, B, device, batched_cond)

    t_model = (
        t64.to(latents.dtype)
        if not isinstance(timesteps, torch.Tensor)
        else (timesteps.detach().to(latents.dtype))
    )
    t_model = t_model.unsqueeze(1).expand(T, B) if t_model.dim() == 1 else t_model
    caller = _Caller(model, latents, t_model, cond_d, batched)
    grad_on = torch.is_grad_enabled()
    anchor_set = set(anchors)
    interior = [k for k in range(T) if k not in anchor_set]
    alpha = _alpha_weights(t64, windows, anchors)
    left = [w[0] for w in windows]
    right = [w[1] for w in windows]
    has_interior = torch.tensor([hi - lo >= 2 for lo, hi in windows], device=device)

    def scores_of(values: torch.Tensor) -> torch.Tensor:
        return cosine_route(values.detach().reshape(T, B, -1), alpha, left, right, backend=backend)

    if mode == "exact" or not grad_on:
        grad = mode == "exact" and grad_on
        parts = _run_steps(caller, list(range(T)), grad, batching, chunk_size)
        out = torch.cat([v for _, v in parts]).view(T, B, *caller.S)
        stats = None
        if return_stats:
            scores = scores_of(out)
            if mode == "exact":
                exact = torch.ones_like(scores, dtype=torch.bool)
            elif router is not None:
                exact = router.route(scores, has_interior)
            else:
                exact = torch.zeros_like(scores, dtype=torch.bool)
            stats = JaggStats(
                scores, exact, caller.grad_samples, caller.grad_calls, windows, anchors
            )
        return out if stats is None else (out, stats)

    # mode == "jagg" with grad: one forward with grad over all anchors (per_step: one
    # call per anchor), the interior under no_grad.
    if batching == "per_step":
        anchor_parts = [caller.steps([a], True) for a in anchors]
        anchor_v = torch.cat(anchor_parts) if len(anchor_parts) > 1 else anchor_parts[0]
    else:
        anchor_v = caller.steps(anchors, True)
    inner = _run_steps(caller, interior, False, batching, chunk_size)

    dtype = caller.out_dtype
    values = torch.empty((T, B, *caller.S), dtype=dtype, device=device)
    values[anchors] = anchor_v.detach().view(len(anchors), B, *caller.S)
    for steps, v in inner:
        values[steps] = v.view(len(steps), B, *caller.S)

    scores = scores_of(values) if (router is not None or return_stats) else None
    if router is not None:
        exact = router.route(scores, has_interior)
    else:
        exact = torch.zeros((len(windows), B), dtype=torch.bool, device=device)

    w_dtype = torch.float64
    w_cur = torch.zeros((T, B), dtype=w_dtype, device=device)
    w_nxt = torch.zeros((T, B), dtype=w_dtype, device=device)
    w_cur[anchors] = 1.0
    step_exact = torch.zeros((T, B), dtype=torch.bool, device=device)
    for i, (lo, hi) in enumerate(windows):
        if hi - lo >= 2:
            step_exact[lo + 1 : hi] = exact[i]
    inner_idx = torch.tensor(interior, dtype=torch.long, device=device)
    if interior:
        keep = (~step_exact[inner_idx]).to(w_dtype)
        w_cur[inner_idx] = (1.0 - alpha[inner_idx]) * keep
        w_nxt[inner_idx] = alpha[inner_idx] * keep

    exact_v = None
    ks, bs = step_exact.nonzero(as_tuple=True)  # step-major order
    if ks.numel() > 0:
        exact_v = _run_pairs_grad(caller, ks, bs, batching, chunk_size)

    anchors_t = torch.tensor(anchors, dtype=torch.long, device=device)
    out = JaggFunction.apply(anchor_v, exact_v, values, w_cur, w_nxt, anchors_t, ks, bs, backend)
    stats = None
    if return_stats:
        stats = JaggStats(scores, exact, caller.grad_samples, caller.grad_calls, windows, anchors)
    return out if stats is None else (out, stats)


def _run_pairs_grad(
    caller: _Caller, ks: torch.Tensor, bs: torch.Tensor, batching: str, chunk_size: int | None
) -> torch.Tensor:
    """With-grad recomputation of the routed-out (step, sample) pairs, step-major."""
    n = ks.numel()
    if batching == "per_step":
        bounds = torch.nonzero(ks[1:] != ks[:-1]).flatten().add(1).tolist()
        cuts = [0, *bounds, n]
    else:
        per = n if chunk_size is None else chunk_size
        cuts = [*range(0, n, per), n]
    parts = [caller.pairs(ks[lo:hi], bs[lo:hi], True) for lo, hi in zip(cuts[:-1], cuts[1:])]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


# ------------------------------------------------------------------------------ public


def jagg_window(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    cond: Mapping[str, Any] | None = None,
    mode: str = "jagg",
    router: CosineRouter | None = None,
    backend: str = "auto",
    batching: str = "stacked",
    chunk_size: int | None = None,
    return_stats: bool = False,
    batched_cond: Collection[str] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    """Velocities of one window of W >= 2 sampling steps, with the JAGG gradient.

    Args:
        model: ``model(z, t, **cond) -> v``; z (n*B, *S), t (n*B,) in the latents' dtype,
            v shaped like z.  Called with several steps stacked along dim 0.
        latents: (W, B, *S) rollout latents z_k (constants; must not require grad).
        timesteps: (W,) or (W, B), strictly monotone along dim 0 (either direction).
        cond: keyword arguments for the model; every tensor whose dim 0 is B (or, when
            ``batched_cond`` is given, exactly the keys it names) is tiled step-major to
            n*B and sliced for routed-out subsets; anything else passes unchanged.
            Tensors that require grad get the same interpolated gradient as parameters.
        mode: "jagg" (two anchors, one backward) or "exact" (every step with grad).
        router: a :class:`CosineRouter` that sends non-linear samples to the exact
            gradient for their interior steps (recomputed with grad in the forward pass).
        backend: "auto", "torch" or "triton" for the mixing and routing ops.
        batching: "stacked" (anchors in ONE model call of 2B samples, interior steps in
            as few no-grad calls as ``chunk_size`` allows) or "per_step" (every call has
            the rollout's batch B, so values are bit-identical to a step-by-step rollout;
            a routed-out recomputation runs only the routed samples of a step).
        chunk_size: max samples per model call for the no-grad interior steps and the
            exact recomputation (the anchor call is never split; in mode="exact" it
            bounds every call).
        return_stats: also return a :class:`JaggStats`.

    Returns:
        velocities (W, B, *S) whose values equal ``model(latents[k], timesteps[k], **cond)``
        step by step (bit for bit with batching="per_step"; with "stacked" up to the
        model's batch-size-dependent round-off, typically a few ulp of its dtype).
        Backward gives sum_k J_k^T g_k with J_k ~= (1-alpha_k) J_0 + alpha_k J_{W-1},
        alpha_k = (t_k - t_0) / (t_{W-1} - t_0), i.e. J_0^T G_0 + J_{W-1}^T G_{W-1} with
        G_0 = sum_k (1-alpha_k) g_k and G_{W-1} = sum_k alpha_k g_k: exact whenever the
        Jacobian is affine in t on the window's points.
    """
    latents = _check_latents(latents, "W")
    W = latents.shape[0]
    if W < 2:
        raise ValueError(f"a window needs W >= 2 steps, got latents with W={W}")
    # A window is the one-window trajectory: anchors [0, W-1], no shared boundary.
    out = jagg_trajectory(
        model,
        latents,
        timesteps,
        window=W,
        cond=cond,
        mode=mode,
        router=router,
        backend=backend,
        batching=batching,
        chunk_size=chunk_size,
        return_stats=return_stats,
        batched_cond=batched_cond,
    )
    if not return_stats:
        return out
    v, stats = out
    stats.scores = stats.scores[0]
    stats.exact = stats.exact[0]
    return v, stats


def jagg_trajectory(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    window: int,
    shared_anchors: bool = True,
    cond: Mapping[str, Any] | None = None,
    mode: str = "jagg",
    router: CosineRouter | None = None,
    backend: str = "auto",
    batching: str = "stacked",
    chunk_size: int | None = None,
    return_stats: bool = False,
    batched_cond: Collection[str] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    """Velocities of a whole T-step trajectory cut into JAGG windows of ``window`` steps.

    latents: (T, B, *S); timesteps: (T,) or (T, B).  With ``shared_anchors=True`` adjacent
    windows share their boundary step: anchors 0, W-1, 2(W-1), ..., T-1, i.e.
    ceil((T-1)/(W-1)) + 1 anchors in ONE batched backward; each anchor's composite
    gradient is its own g plus sum alpha_k g_k of the window on its left plus
    sum (1-alpha_k) g_k of the window on its right.  ``shared_anchors=False`` is the
    paper's layout of disjoint windows (2 anchors each; a last single step is exact).
    Routing is per sample and per window.  Other arguments as in :func:`jagg_window`;
    stats.scores / stats.exact are (n_windows, B).
    """
    latents = _check_latents(latents, "T")
    T = latents.shape[0]
    if isinstance(window, bool) or not isinstance(window, int):
        raise TypeError(f"window must be an int in [2, T={T}], got {window!r}")
    if not 2 <= window <= T:
        raise ValueError(f"window must be an int in [2, T={T}], got {window}")
    if not isinstance(shared_anchors, bool):
        raise TypeError(f"shared_anchors must be a bool, got {shared_anchors!r}")
    anchors, windows = trajectory_layout(T, window, shared_anchors)
    return _jagg_core(
        model,
        latents,
        timesteps,
        anchors,
        windows,
        cond=cond,
        mode=mode,
        router=router,
        backend=backend,
        batching=batching,
        chunk_size=chunk_size,
        batched_cond=batched_cond,
        return_stats=return_stats,
    )


def expected_anchor_count(T: int, window: int, shared_anchors: bool = True) -> int:
    """Anchors (= samples per B in the one backward) of a T-step trajectory."""
    if shared_anchors:
        return math.ceil((T - 1) / (window - 1)) + 1
    return len(trajectory_layout(T, window, False)[0])
