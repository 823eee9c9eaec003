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
import numbers
import operator
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from jagg_autograd._backend import check_backend_runnable
from jagg_autograd.deferred import (
    DeferredJaggFunction,
    DeferredSpec,
    autocast_state,
    record_versions,
    resolve_params,
    stale_error,
    values_tolerance,
)
from jagg_autograd.distributed import BUFFER_SYNC_WITH_ROUTER, ddp_syncs_buffers
from jagg_autograd.function import JaggFunction
from jagg_autograd.planner import check_fold, exact_mask, make_plan, uniform_mask
from jagg_autograd.router import CosineRouter, cosine_route

MODES = ("jagg", "exact")
BATCHINGS = ("stacked", "per_step")
PLACEMENTS = ("uniform", "adaptive")


@dataclass
class JaggStats:
    """What a call did.

    scores: (B,) for a window, (n_windows, B) for a trajectory: the router's score
        (1.0 for a window with no interior step).  Computed whenever stats are asked for.
    exact: bool, same shape: True where that sample's window got the exact gradient
        (mode="exact": everywhere, but nowhere under ``torch.no_grad()`` where no gradient
        exists; mode="jagg": where the router sent it -- also computed under no_grad, as a
        preview of what a call with grad would route; placement="adaptive": all False).
    grad_samples: samples the model was run on with grad.
    grad_forward_calls: model calls made with grad (their graphs are what the backward
        goes through); ``backward_calls`` is its former name, kept as an alias.
    windows: (first, last) step of each window of the uniform layout.
    anchors: the anchor steps (placement="adaptive": the union over samples).
    anchor_mask: (T, B) bool, the (step, sample) pairs run with grad.
    plan_seconds: time the backward spent choosing the adaptive placement.

    For ``deferred=True`` the with-grad work happens in the backward, which completes
    ``grad_samples``, ``grad_forward_calls``, ``plan_seconds`` and, for adaptive
    placement, ``anchors`` and ``anchor_mask`` (in place); until then the counts are 0.
    """

    scores: torch.Tensor
    exact: torch.Tensor
    grad_samples: int
    grad_forward_calls: int
    windows: list[tuple[int, int]] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    anchor_mask: torch.Tensor | None = None
    plan_seconds: float = 0.0

    @property
    def backward_calls(self) -> int:
        """Deprecated alias of ``grad_forward_calls`` (it counted forward calls with grad)."""
        return self.grad_forward_calls

    @backward_calls.setter
    def backward_calls(self, value: int) -> None:
        self.grad_forward_calls = value


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


_TRANSPOSE_HINT = (
    "; the latents / timesteps look transposed: the layout is (T, B, ...) (steps first). "
    "A (B, T, ...) buffer such as Flow-GRPO's must be passed as latents.transpose(0, 1) "
    "and timesteps.T (a view, no copy)"
)


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
        # (B,) or (B, T) timesteps: the caller's buffers are most likely (B, T, ...).
        hint = _TRANSPOSE_HINT if tuple(t.shape) in ((B,), (B, T)) else ""
        raise ValueError(
            f"timesteps must have shape ({T},) or ({T}, {B}) to match latents "
            f"{tuple(latents.shape)}, got {tuple(t.shape)}{hint}"
        )
    t = t.detach()
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError("timesteps must be finite")
    # Compare neighbours instead of subtracting them: a difference in the timesteps' own
    # dtype wraps around for integers (uint8 200 - 100 ... 50 - 200 = 106 > 0) and would let
    # a non-monotone schedule through.  Comparisons are exact at the given precision, so a
    # schedule strictly monotone as given is accepted even if the copy cast for the model
    # repeats values.
    tc = t.unsqueeze(1) if t.dim() == 1 else t
    inc = (tc[1:] > tc[:-1]).all(0)
    dec = (tc[1:] < tc[:-1]).all(0)
    if not bool((inc | dec).all()):
        # Monotone along dim 1 instead: a (B, T) table passed for a (T, B) one.
        rows = tc.T
        looks_transposed = (
            t.dim() == 2
            and T >= 2
            and B >= 2
            and bool(((rows[1:] > rows[:-1]).all(0) | (rows[1:] < rows[:-1]).all(0)).all())
        )
        raise ValueError(
            "timesteps must be strictly monotone (increasing or decreasing, no repeats) "
            "along dim 0 for every sample"
            + ("; they are monotone along dim 1" + _TRANSPOSE_HINT if looks_transposed else "")
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
        # A tensor with B in another dim as well (a (B, B) table, (B, L, B) ...) may just as
        # well be a shared table whose dim 0 equals B by coincidence; tiling and slicing it
        # would silently change the model's input.  (B,), (B, L, D) with L, D != B, and B = 1
        # (tiling a (1, ...) tensor repeats identical rows) are unambiguous.
        ambiguous = sorted(k for k in keys if B > 1 and B in cond[k].shape[1:])
        if ambiguous:
            warnings.warn(
                f"cond keys {ambiguous} have dim 0 == B={B} and another dim of size B, so "
                "they are treated as per-sample (tiled per stacked step, sliced for routed "
                "samples) although they may be shared tables; pass batched_cond= naming "
                "exactly the per-sample keys (batched_cond=() if none) to decide explicitly",
                UserWarning,
                stacklevel=4,
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


def _check_model(model: object, device: torch.device, router: object = None) -> None:
    if not callable(model):
        raise TypeError(
            f"model must be callable as model(z, t, **cond), got {type(model).__name__}"
        )
    if isinstance(model, torch.nn.Module):
        p = next(iter(model.parameters()), None)
        if p is not None and p.device.type != device.type:
            raise ValueError(f"model parameters are on {p.device} but latents on {device}")
        _check_no_batch_statistics(model)
        if router is not None and ddp_syncs_buffers(model):
            raise ValueError(BUFFER_SYNC_WITH_ROUTER)


def _check_no_batch_statistics(model: torch.nn.Module) -> None:
    """Refuse layers whose output for one sample depends on the other samples of the call.

    JAGG stacks several steps (and, when routing, arbitrary subsets of samples) into one
    call, so a BatchNorm that normalises with the statistics of the current batch gives
    values that differ by O(1) between batchings -- in ``mode="exact"``, the oracle of
    ``gradient_fidelity``, too -- and its running statistics would be updated with batches
    a rollout never forms.  A refusal rather than a warning: nothing downstream can tell
    such values from correct ones.  Instance/Group/LayerNorm are per sample and fine.
    """
    for name, m in model.named_modules():
        # _BatchNorm covers BatchNorm1d/2d/3d, their Lazy variants and SyncBatchNorm; without
        # running statistics they use batch statistics in eval mode as well.
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and (
            m.training or not m.track_running_stats
        ):
            raise ValueError(
                f"model contains {type(m).__name__} {name or '(the model itself)'!r} using batch "
                "statistics (training mode or track_running_stats=False): its values would "
                "depend on how JAGG stacks steps and samples into a call; put those layers in "
                "eval mode (module.eval()) with running statistics, or use GroupNorm/LayerNorm"
            )


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


def _as_int(name: str, value: object, expected: str) -> int:
    """``value`` as a Python int: ints and numpy/torch integer scalars, never bool or float."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {value!r}") from None


def _check_layout_args(T: object, window: object, shared_anchors: object) -> tuple[int, int]:
    T = _as_int("T", T, "an int >= 1 (steps of the trajectory)")
    if T < 1:
        raise ValueError(f"T must be an int >= 1 (steps of the trajectory), got {T}")
    window = _as_int("window", window, "an int >= 2")
    if window < 2:
        raise ValueError(f"window must be an int >= 2 (two anchor steps), got {window}")
    if not isinstance(shared_anchors, bool):
        raise TypeError(f"shared_anchors must be a bool, got {shared_anchors!r}")
    return T, window


def trajectory_layout(
    T: int, window: int, shared_anchors: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Anchor steps and windows (first, last) of a T-step trajectory.

    shared_anchors=True: anchors 0, W-1, 2(W-1), ..., and T-1; adjacent windows share
    their boundary step, ceil((T-1)/(W-1)) + 1 anchors in all.  False (the paper):
    disjoint windows [0..W-1], [W..2W-1], ...; a shorter last window; a last single step
    is its own anchor (exact).  T >= 1 and window >= 2 are ints (numpy/torch integer
    scalars accepted); a window longer than T is one window over all T steps.
    """
    T, window = _check_layout_args(T, window, shared_anchors)
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
        # Checked before the values are copied anywhere: a velocity on another device (meta
        # included) would otherwise be copied into, or left as, uninitialised memory.
        if v.device != z.device:
            raise ValueError(
                f"model returned a tensor on {v.device} for latents on {z.device}; the velocity "
                "must be on the latents' device"
            )
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


def _check_values(values: object, latents: torch.Tensor) -> torch.Tensor | None:
    """Caller-given velocities: (T, B, *S) like the latents, floating, finite, no grad."""
    if values is None:
        return None
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"values must be None or a torch.Tensor, got {type(values).__name__}")
    if not values.is_floating_point():
        raise TypeError(f"values must be a floating tensor, got {values.dtype}")
    # The model's output dtype: the latents' (or autocast's); values stored in another
    # dtype would blind the staleness check (its tolerance follows the dtype).
    allowed = {latents.dtype}
    ac = autocast_state(latents.device)
    if ac is not None and ac[0]:
        allowed.add(ac[1])
    if values.dtype not in allowed:
        raise TypeError(
            f"values must have the model's output dtype ({sorted(map(str, allowed))}), got "
            f"{values.dtype}: store the rollout's velocities as the model returns them"
        )
    if values.shape != latents.shape:
        raise ValueError(
            f"values must have the latents' shape {tuple(latents.shape)} (T, B, ...), got "
            f"{tuple(values.shape)}"
        )
    if values.device != latents.device:
        raise ValueError(f"values are on {values.device} but latents on {latents.device}")
    if values.requires_grad:
        raise ValueError(
            "values must not require grad: they are the rollout's velocities (constants); "
            "pass values.detach()"
        )
    if not bool(torch.isfinite(values).all()):
        raise ValueError("values must be finite")
    return values


def _check_budget(budget: object, placement: str, T: int, default: float) -> float:
    if budget is None:
        return default
    if placement != "adaptive":
        raise ValueError("budget applies to placement='adaptive' only")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"budget must be None or a number of anchors per sample, got {budget!r}")
    if not 2.0 <= float(budget) <= T:  # NaN fails too
        raise ValueError(
            f"budget (mean anchors per sample) must be in [2, T={T}], got {budget!r}: a "
            "sample needs its first and last step as anchors"
        )
    return float(budget)


def _check_tol(values_tol: object) -> float | None:
    if values_tol is None:
        return None
    if isinstance(values_tol, bool) or not isinstance(values_tol, (int, float)):
        raise TypeError(f"values_tol must be None or a number >= 0, got {values_tol!r}")
    if not float(values_tol) >= 0.0:
        raise ValueError(f"values_tol must be >= 0, got {values_tol!r}")
    return float(values_tol)


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_reuse_args(
    latents: torch.Tensor,
    values: object,
    deferred: object,
    placement: object,
    budget: object,
    values_tol: object,
    router: object,
    mode: str,
    default_budget: float,
) -> tuple[torch.Tensor | None, bool, str, float, float | None]:
    """Validate the reuse / deferred / placement arguments (before any model call)."""
    deferred = _check_bool("deferred", deferred)
    placement = _check_choice("placement", placement, PLACEMENTS)
    if placement == "adaptive":
        if not deferred:
            raise ValueError(
                "placement='adaptive' needs deferred=True: the anchors are chosen from the "
                "upstream gradients, which exist only in the backward"
            )
        if router is not None:
            raise ValueError(
                "router and placement='adaptive' do not combine: the adaptive budget already "
                "gives non-linear samples more anchors; pass router=None"
            )
        if mode == "exact":
            raise ValueError("placement='adaptive' approximates; mode='exact' runs every step")
    budget = _check_budget(budget, placement, latents.shape[0], float(default_budget))
    return (
        _check_values(values, latents),
        deferred,
        placement,
        budget,
        _check_tol(values_tol),
    )


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
    values: object = None,
    deferred: object = False,
    placement: object = "uniform",
    budget: object = None,
    params: object = None,
    values_tol: object = None,
    fold: object = "linear",
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    # ---- validation: everything before the first model call
    fold = check_fold(fold)  # issue 18: the plan's interpolation weights
    mode = _check_choice("mode", mode, MODES)
    backend = check_backend_runnable(backend, latents.device, latents.dtype)
    batching = _check_choice("batching", batching, BATCHINGS)
    chunk_size = _check_chunk_size(chunk_size)
    router = _check_router(router)
    T, B = latents.shape[:2]
    values, deferred, placement, budget, values_tol = check_reuse_args(
        latents, values, deferred, placement, budget, values_tol, router, mode, len(anchors)
    )
    device = latents.device
    _check_model(model, device, router)
    t64 = _check_timesteps(timesteps, latents)
    cond_d, batched = _check_cond(cond, B, device, batched_cond)
    grad_on = torch.is_grad_enabled()
    targets: list[torch.Tensor] = []
    if deferred:
        targets = resolve_params(model, params, who="deferred=True", require=False)
        # Cond tensors that require grad get their gradient as inputs of the Function too.
        cond_keys = [
            k for k, v in cond_d.items() if isinstance(v, torch.Tensor) and v.requires_grad
        ]
        targets += [cond_d[k] for k in cond_keys]
    elif params is not None:
        raise ValueError("params is used by deferred=True only (the eager path uses autograd)")

    t_model = (
        t64.to(latents.dtype)
        if not isinstance(timesteps, torch.Tensor)
        else (timesteps.detach().to(latents.dtype))
    )
    t_model = t_model.unsqueeze(1).expand(T, B) if t_model.dim() == 1 else t_model
    caller = _Caller(model, latents, t_model, cond_d, batched)
    alpha = _alpha_weights(t64, windows, anchors)
    left = [w[0] for w in windows]
    right = [w[1] for w in windows]
    has_interior = torch.tensor([hi - lo >= 2 for lo, hi in windows], device=device)
    n_w = len(windows)

    def scores_of(v: torch.Tensor) -> torch.Tensor:
        return cosine_route(v.detach().reshape(T, B, -1), alpha, left, right, backend=backend)

    def routed_of(scores: torch.Tensor | None) -> torch.Tensor:
        if router is None or scores is None:
            return torch.zeros((n_w, B), dtype=torch.bool, device=device)
        return router.route(scores, has_interior)

    def new_stats(scores, exact, mask) -> JaggStats:
        return JaggStats(
            scores, exact, caller.grad_samples, caller.grad_calls, windows, list(anchors), mask
        )

    # ---- the plan's mask for the uniform layout (routing needs the values first)
    def all_values(grad: bool) -> torch.Tensor:
        parts = _run_steps(caller, list(range(T)), grad, batching, chunk_size)
        return torch.cat([v for _, v in parts]).view(T, B, *caller.S)

    needs_grad = grad_on and (bool(targets) or not deferred)

    # ---- values only (no_grad, or nothing to differentiate in deferred mode)
    if not needs_grad or (mode == "exact" and not deferred):
        if mode == "exact" and needs_grad:
            out = all_values(True)
            if values is not None:
                _compare_values(out, values, values_tol)
        else:
            out = values.detach() if values is not None else all_values(False)
        stats = None
        if return_stats:
            scores = scores_of(out)
            if mode == "exact":
                # Under no_grad no step has a gradient, exact or not: all False.
                exact = torch.full_like(scores, needs_grad, dtype=torch.bool)
                mask = exact_mask(T, B, device) & needs_grad
            else:
                exact = routed_of(scores) if placement == "uniform" else routed_of(None)
                mask = uniform_mask(T, B, anchors, windows, exact, device)
            stats = new_stats(scores, exact, mask)
        return out if stats is None else (out, stats)

    # ---- deferred: no with-grad call now; the backward plans and runs the anchors
    if deferred:
        ddp = _ddp_for_deferred(model)
        if ddp is not None:
            # The chunks run on ddp.module inside the backward; DDP's own forward
            # bookkeeping (its pre-hooks -- accumulate_windows' sync switch -- and the
            # reducer's preparation) happens here, once, as a forward of ddp would do it.
            caller.model = ddp.module
            for hook in list(ddp._forward_pre_hooks.values()):
                hook(ddp, ())
            ddp._pre_forward()
        vals = values if values is not None else all_values(False)
        scores = scores_of(vals) if (router is not None or return_stats) else None
        exact = routed_of(scores)
        if mode == "exact":
            plan = make_plan(exact_mask(T, B, device), t64)
            exact = torch.ones((n_w, B), dtype=torch.bool, device=device)
        elif placement == "uniform":
            plan = make_plan(uniform_mask(T, B, anchors, windows, exact, device), t64, fold=fold)
        else:
            plan = None
        stats = None
        if return_stats:
            mask = plan.anchor_mask.clone() if plan is not None else torch.zeros(
                (T, B), dtype=torch.bool, device=device
            )
            stats = new_stats(scores, exact, mask)
            stats.anchors = [] if plan is None else mask.any(1).nonzero().flatten().tolist()
        spec = DeferredSpec(
            caller=caller,
            plan=plan,
            t64=t64,
            budget_total=round(budget * B),
            chunk_size=chunk_size,
            batching=batching,
            backend=backend,
            check_values=values is not None,
            tol=values_tolerance(vals, values_tol) if values is not None else None,
            targets=targets,
            cond_keys=cond_keys,
            versions=record_versions(
                [("latents", latents)]
                + ([("timesteps", timesteps)] if isinstance(timesteps, torch.Tensor) else [])
                + [(f"cond[{k!r}]", v) for k, v in cond_d.items() if isinstance(v, torch.Tensor)]
                + [(f"parameter {i} of the deferred call", p) for i, p in enumerate(targets)]
            ),
            stats=stats,
            autocast=autocast_state(device),
            fold=fold,
        )
        out = DeferredJaggFunction.apply(spec, vals, *targets)
        if ddp is not None and out.requires_grad:
            # What DDP's forward does around its module call: with sync on, the reducer
            # expects this iteration's gradients, which reach the parameters when the
            # Function returns them (the chunks run on ddp.module, outside the reducer).
            out = ddp._post_forward(out)
        return out if stats is None else (out, stats)

    # ---- eager: the anchor steps with grad now (one stacked call; per_step: one per
    # anchor), the interior under no_grad (or from ``values``), routed pairs with grad.
    if batching == "per_step":
        anchor_parts = [caller.steps([a], True) for a in anchors]
        anchor_v = torch.cat(anchor_parts) if len(anchor_parts) > 1 else anchor_parts[0]
    else:
        anchor_v = caller.steps(anchors, True)
    dtype = caller.out_dtype
    if values is not None:
        _compare_values(anchor_v.view(len(anchors), B, *caller.S), values[anchors], values_tol,
                        scale=values)
        vals = values.clone()
    else:
        anchor_set = set(anchors)
        interior = [k for k in range(T) if k not in anchor_set]
        inner = _run_steps(caller, interior, False, batching, chunk_size)
        vals = torch.empty((T, B, *caller.S), dtype=dtype, device=device)
        vals[anchors] = anchor_v.detach().view(len(anchors), B, *caller.S)
        for steps, v in inner:
            vals[steps] = v.view(len(steps), B, *caller.S)
    scores = scores_of(vals) if (router is not None or return_stats) else None
    exact = routed_of(scores)
    plan = make_plan(
        uniform_mask(T, B, anchors, windows, exact, device), t64, anchors, fold=fold
    )
    rows = [anchor_v]
    if plan.pair_k.numel() > 0 or _collective(model):
        extra = _run_pairs_grad(
            caller, plan.pair_k, plan.pair_b, batching, chunk_size, _collective(model)
        )
        if extra is not None:
            rows.append(extra)
    grad_v = torch.cat(rows) if len(rows) > 1 else anchor_v
    out = JaggFunction.apply(
        grad_v, vals, plan.w_cur, plan.w_nxt, plan.slots, plan.n_rows, backend
    )
    stats = new_stats(scores, exact, plan.anchor_mask) if return_stats else None
    return out if stats is None else (out, stats)


def _ddp_for_deferred(model: object) -> Any:
    """The DDP wrapper (None for other models); FSDP is refused for deferred=True."""
    from jagg_autograd.distributed import _is_ddp, _is_fsdp1, _is_fsdp2

    if _is_fsdp2(model) or _is_fsdp1(model):
        raise ValueError(
            "deferred=True does not support FSDP-sharded models yet (their parameters are "
            "gathered and reduced by hooks the deferred backward bypasses): use "
            "deferred=False with FSDP, or DDP"
        )
    return model if _is_ddp(model) else None


def _compare_values(
    got: torch.Tensor, want: torch.Tensor, tol: float | None, scale: torch.Tensor | None = None
) -> None:
    """Raise the stale-values error when recomputed velocities differ from ``values``."""
    limit = float(values_tolerance(want if scale is None else scale, tol))
    worst = float((got.detach().to(torch.float64) - want.to(torch.float64)).abs().max())
    if worst > limit:
        raise stale_error(worst, limit)


def _collective(model: object) -> bool:
    """FSDP in a multi-rank group: every rank must make the same sequence of model calls
    (each call all-gathers parameters, each backward through it reduce-scatters)."""
    import torch.distributed as dist

    from jagg_autograd.distributed import _is_fsdp1, _is_fsdp2

    return (
        (_is_fsdp2(model) or _is_fsdp1(model))
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def _run_pairs_grad(
    caller: _Caller,
    ks: torch.Tensor,
    bs: torch.Tensor,
    batching: str,
    chunk_size: int | None,
    collective: bool = False,
) -> torch.Tensor | None:
    """With-grad recomputation of the routed-out (step, sample) pairs, step-major.

    ``collective``: the ranks route differently but must call the model equally often
    (FSDP).  They agree on the largest number of calls with one all-reduce, and a rank
    with fewer pads with one-sample calls of pair (0, 0) whose rows come after the real
    ones and get a zero gradient (``JaggFunction`` gives rows past the plan's none).
    """
    n = ks.numel()
    if batching == "per_step":
        bounds = torch.nonzero(ks[1:] != ks[:-1]).flatten().add(1).tolist() if n else []
        cuts = [0, *bounds, n] if n else [0]
    else:
        per = max(n, 1) if chunk_size is None else chunk_size
        cuts = [*range(0, n, per), n] if n else [0]
    n_calls = len(cuts) - 1
    if collective:
        import torch.distributed as dist

        # Stacked without chunk_size: every rank pads to the largest pair count, so the
        # call count (one) agrees; otherwise pad the count of calls.
        agree = torch.tensor([n_calls], dtype=torch.long)
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)
        pad = int(agree) - n_calls
    else:
        pad = 0
    parts = [caller.pairs(ks[lo:hi], bs[lo:hi], True) for lo, hi in zip(cuts[:-1], cuts[1:])]
    zero = torch.zeros(1, dtype=torch.long, device=ks.device)
    parts += [caller.pairs(zero, zero, True) for _ in range(pad)]
    if not parts:  # no rank routed anything
        return None
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
    values: torch.Tensor | None = None,
    deferred: bool = False,
    placement: str = "uniform",
    budget: float | None = None,
    params: Sequence[torch.Tensor] | None = None,
    values_tol: float | None = None,
    fold: str = "linear",
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    """Velocities of one window of W >= 2 sampling steps, with the JAGG gradient.

    Args:
        model: ``model(z, t, **cond) -> v``; z (n*B, *S), t (n*B,) in the latents' dtype,
            v shaped like z, on z's device.  Called with several steps stacked along dim 0,
            so one sample's velocity must not depend on the other samples of the call: an
            ``nn.Module`` containing a BatchNorm that uses batch statistics (training mode,
            or ``track_running_stats=False``) is refused with a ``ValueError``; put such
            layers in eval mode.
        latents: (W, B, *S) rollout latents z_k (constants; must not require grad).
        timesteps: (W,) or (W, B), strictly monotone along dim 0 (either direction).
        cond: keyword arguments for the model; every tensor whose dim 0 is B (or, when
            ``batched_cond`` is given, exactly the keys it names) is tiled step-major to
            n*B and sliced for routed-out subsets; anything else passes unchanged.
            Tensors that require grad get the same interpolated gradient as parameters.
            Auto-detection cannot tell a shared table whose dim 0 equals B by coincidence
            from per-sample data; it warns (``UserWarning``) when a detected tensor also
            has B in another dim (e.g. a (B, B) table).  Name the per-sample keys
            explicitly in such cases, e.g. with B = 8 and a shared (8, 8) ``table``::

                jagg_window(model, lat, ts, cond={"y": labels, "table": table},
                            batched_cond=["y"])   # y tiled/sliced, table passed as is
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
            bounds every call).  With ``deferred=True`` it bounds the with-grad anchor
            calls of the backward (None: B, one step's batch: the per-step loop's memory).
        return_stats: also return a :class:`JaggStats`.
        values: (W, B, *S) velocities of these latents at the CURRENT parameters (the
            rollout's, when no optimizer step happened since: on-policy minibatches).  No
            model call is made for non-anchor steps and the output's values are exactly
            ``values`` (with ``deferred=True`` the output shares their storage: do not
            modify it in place).  Their dtype must be the model's output dtype.  The
            anchors, recomputed with grad, are compared with them: a deviation beyond
            ``values_tol`` raises a ``RuntimeError`` ("values look stale") and no gradient
            reaches any parameter.  May be a non-contiguous view.  With ``deferred=True``
            the latents, timesteps, cond and parameters must not change in place before
            the backward (an optimizer step in between is a ``RuntimeError``).
        deferred: run the anchors with grad in the backward, ``chunk_size`` samples at a
            time (None: B), back-propagating and freeing each chunk before the next: peak
            activation memory is one chunk's, Flow-GRPO's per-step loop for
            ``chunk_size=None``.  The forward makes no with-grad call (with ``values``: no
            call at all).  Gradients reach parameters and cond tensors through autograd
            (``backward()``, ``autograd.grad``, hooks, accumulation, GradScaler).
        placement: "uniform" (the layout above; a router's routed-out samples get every
            step of the window as anchors) or "adaptive" (deferred only, no router):
            per-sample anchors chosen in the backward from the velocities and the upstream
            gradients, minimising sum_k ||g_k|| ||v_k - v_hat_k|| (v_hat_k: the t-linear
            interpolation between the step's neighbouring anchors) per sample by dynamic
            programming, with round(budget * B) anchors shared group-fairly: every sample
            the same count, the remainder one more each by scale-free proxy gain, nothing
            depending on |g|'s scale (``planner.adaptive_choice``).  Every sample gets
            its first and last step with a non-zero upstream gradient (2 anchors; 1 if
            only one step is non-zero, 0 if none); steps outside that span need none.
        budget: mean anchors per sample for placement="adaptive" (default: the uniform
            layout's anchor count, 2 for a window).
        params: the trainable tensors, needed by ``deferred=True`` when ``model`` is not an
            ``nn.Module`` (default: the module's parameters that require grad).
        values_tol: absolute tolerance of the ``values`` check (default
            ``rtol * (1 + max|values|)``, rtol 1e-5 in float32, 1e-9 in float64, 4e-3 in
            float16, 3e-2 in bfloat16: anchors recomputed in another batch than the
            rollout's differ by round-off only).
        fold: how each step's g folds onto its anchors (``planner.FOLDS``): "linear"
            (the t-linear weights below; unbiased for GRPO only with zero-mean advantages
            and per-sample decisions that do not depend on them) or "causal" (onto the
            anchor at or before the step only: unbiased for any advantages, less accurate
            per batch); see :func:`jagg_autograd.planner.interpolation_weights`.

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
        values=values,
        deferred=deferred,
        placement=placement,
        budget=budget,
        params=params,
        values_tol=values_tol,
        fold=fold,
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
    values: torch.Tensor | None = None,
    deferred: bool = False,
    placement: str = "uniform",
    budget: float | None = None,
    params: Sequence[torch.Tensor] | None = None,
    values_tol: float | None = None,
    fold: str = "linear",
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

    Which path when (T = 10, W = 4 measured in ``benchmarks/floor.py``):

    * on-policy minibatches (no optimizer step since the rollout): ``values=`` the
      rollout's velocities and ``deferred=True`` -- no forward but the anchors', peak
      memory of the per-step loop; ``placement="adaptive"`` puts the anchors where g needs
      them at the same cost;
    * off-policy minibatches: the eager path (``deferred=False``), or ``deferred=True``
      without ``values`` when memory-bound (one more forward per anchor).

    Example (an on-policy GRPO minibatch)::

        v = jagg_trajectory(model, ro.latents[:-1], ro.sigmas[:-1], window=4,
                            cond=cond, values=ro.velocities, deferred=True,
                            placement="adaptive", budget=4)
        loss = grpo_loss_from(v)   # log-probs of the stored transitions, advantages
        loss.backward()            # anchors run here, B samples at a time
    """
    latents = _check_latents(latents, "T")
    T = latents.shape[0]
    if T < 2:
        raise ValueError(
            f"a trajectory needs T >= 2 steps, got latents with T={T}: a single step has no "
            "window to approximate, call the model directly (its gradient is exact)"
        )
    window = _as_int("window", window, f"an int in [2, T={T}]")
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
        values=values,
        deferred=deferred,
        placement=placement,
        budget=budget,
        params=params,
        values_tol=values_tol,
        fold=fold,
    )


def expected_anchor_count(T: int, window: int, shared_anchors: bool = True) -> int:
    """Anchors (= samples per B in the one backward) of a T-step trajectory.

    Arguments as in :func:`trajectory_layout`.
    """
    T, window = _check_layout_args(T, window, shared_anchors)
    if shared_anchors:
        return math.ceil((T - 1) / (window - 1)) + 1
    return len(trajectory_layout(T, window, False)[0])
