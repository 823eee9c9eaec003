"""Argument checks of a JAGG call, and the facts a call records about its inputs.

Every check raises a ``TypeError`` / ``ValueError`` naming the argument, before any model
call; :func:`jagg_autograd.call.parse_call` runs them in the order a mistake is best
explained (the latents' and timesteps' ``(T, B, ...)`` layout before the window, the
options, the model and the cond).  Also here: the tolerance of caller-given ``values``
and the error for stale ones, the trainable tensors of a deferred call, the recorded
tensor versions and autocast state its backward re-checks.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import torch

from jagg_autograd.distributed import BUFFER_SYNC_WITH_ROUTER, ddp_syncs_buffers
from jagg_autograd.planner import PROMOTE_TO, PROMOTIONS
from jagg_autograd.router import CosineRouter

MODES = ("jagg", "exact")
BATCHINGS = ("stacked", "per_step")
PLACEMENTS = ("uniform", "adaptive", "stochastic")

# Default staleness tolerance of recomputed anchors vs ``values``, relative to
# (1 + max|values|): a few ulp of round-off between a rollout's batch and the anchors'
# batch must pass; one optimizer step (lr 1e-4 on the digits DiT moves velocities by
# ~1e-3) must not.  float32: 1e-5 (about 100 ulp).
VALUES_RTOL = {
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.float16: 4e-3,
    torch.bfloat16: 3e-2,
}


# ----------------------------------------------------------------------------- arguments


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_latents(latents: object, name: str) -> torch.Tensor:
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


def check_timesteps(timesteps: object, latents: torch.Tensor) -> torch.Tensor:
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


def check_cond(
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


def check_model(model: object, device: torch.device, router: object = None) -> None:
    if not callable(model):
        raise TypeError(
            f"model must be callable as model(z, t, **cond), got {type(model).__name__}"
        )
    if isinstance(model, torch.nn.Module):
        p = next(iter(model.parameters()), None)
        if p is not None and p.device.type != device.type:
            raise ValueError(f"model parameters are on {p.device} but latents on {device}")
        check_no_batch_statistics(model)
        if router is not None and ddp_syncs_buffers(model):
            raise ValueError(BUFFER_SYNC_WITH_ROUTER)


def check_no_batch_statistics(model: torch.nn.Module) -> None:
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


def check_chunk_size(chunk_size: object) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size}")
    return chunk_size


def check_router(router: object) -> CosineRouter | None:
    if router is not None and not isinstance(router, CosineRouter):
        raise TypeError(f"router must be None or a CosineRouter, got {type(router).__name__}")
    return router


def check_values(values: object, latents: torch.Tensor) -> torch.Tensor | None:
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


def check_budget(
    budget: object, placement: str, T: int, default: float, fold: str = "causal"
) -> float:
    """Mean anchors per sample of a planned placement (``default``, the layout's count,
    when None); refused for the uniform layout, which has no budget.  Adaptive needs 2
    (a sample's first and last active step); stochastic 1 with the causal fold (it needs
    the first only) and 2 with the linear fold (``promote_to="exact"``'s base: the ends)."""
    if budget is None:
        return default
    if placement == "uniform":
        raise ValueError("budget applies to placement='adaptive' or 'stochastic' only")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise TypeError(f"budget must be None or a number of anchors per sample, got {budget!r}")
    if placement == "stochastic":
        # L = floor(budget) base anchors: the causal fold needs the first active step only,
        # the linear fold both ends (one anchor would drop every later step's g).
        lo = 1 if fold == "causal" else 2
        if not lo <= float(budget) <= T:  # NaN fails too
            raise ValueError(
                f"budget (mean anchors per sample) must be in [{lo}, T={T}] for "
                f"placement='stochastic' with fold={fold!r}, got {budget!r}"
            )
        if not promotion_fraction_ok(float(budget)):
            raise ValueError(
                f"budget - floor(budget) must be 0 or >= {MIN_PROMOTION_FRAC} for "
                f"placement='stochastic', got {budget!r}: the draw's float32 uniforms "
                "cannot realise smaller promotion probabilities, and 1/pi would explode"
            )
        return float(budget)
    if not 2.0 <= float(budget) <= T:  # NaN fails too
        raise ValueError(
            f"budget (mean anchors per sample) must be in [2, T={T}], got {budget!r}: a "
            "sample needs its first and last step as anchors"
        )
    return float(budget)


def check_generator(generator: object, placement: str) -> torch.Generator | None:
    """The stochastic placement's generator (None: torch's default one); refused for
    other placements, where nothing would draw from it."""
    if generator is None:
        return None
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be None or a torch.Generator, got {type(generator).__name__}"
        )
    if placement != "stochastic":
        raise ValueError("generator applies to placement='stochastic' only (nothing else draws)")
    return generator


def _check_promotion_option(
    name: str, value: object, choices: tuple[str, ...], placement: str
) -> str:
    # One of ``choices`` (the first is the default); anything but the default is refused
    # for placements other than stochastic, which promote nothing.
    value = check_choice(name, value, choices)
    if value != choices[0] and placement != "stochastic":
        raise ValueError(
            f"{name}={value!r} applies to placement='stochastic' only, got "
            f"placement={placement!r}"
        )
    return value


def check_promotion(promotion: object, placement: str) -> str:
    """How the stochastic placement spreads its promotions (:data:`PROMOTIONS`); anything
    but the default is refused for other placements, which promote nothing."""
    return _check_promotion_option("promotion", promotion, PROMOTIONS, placement)


def check_promote_to(promote_to: object, placement: str) -> str:
    """What the stochastic placement promotes to (:data:`PROMOTE_TO`); anything but the
    default is refused for other placements, which promote nothing."""
    return _check_promotion_option("promote_to", promote_to, PROMOTE_TO, placement)


#: The smallest fractional part of a stochastic budget (0 aside): the promotion
#: probabilities scale with it, the draw's float32 uniforms resolve 2^-24 (a pi of 1e-9
#: would be realised as ~7e-9) and the 1/pi weights grow without bound.
MIN_PROMOTION_FRAC = 0.01


def promotion_fraction_ok(budget: float) -> bool:
    """Whether budget - floor(budget) is 0 or at least :data:`MIN_PROMOTION_FRAC`."""
    frac = budget % 1.0
    # The tolerance keeps 2.01 (whose float fraction is 0.00999...) on the right side.
    return frac == 0.0 or frac >= MIN_PROMOTION_FRAC - 1e-9


def promotes_to_exact(budget: float | None, T: int) -> bool:
    """Whether ``promote_to="exact"`` at this budget (None: the layout's integer count) is
    the exact gradient in expectation: a fractional budget promotes, one >= T makes every
    step an anchor; an integer budget below T is the deterministic base layout (its fold's
    error kept, the linear fold's noise-driven one included)."""
    return budget is not None and (float(budget) >= T or float(budget) % 1.0 != 0.0)


def check_promoting_budget(budget: float, promote_to: str, T: int) -> None:
    """Refuses ``promote_to="exact"`` at a budget that promotes nothing: the caller asked for
    the exact gradient in expectation and would get the base layout's fold."""
    if promote_to == "exact" and not promotes_to_exact(budget, T):
        raise ValueError(
            f"budget must be fractional (say 2.4: 2 base anchors, 0.4 / c of the samples "
            f"promoted) or >= T={T} with promote_to='exact', got {budget!r}: an integer "
            "budget promotes nothing (the deterministic base layout, biased)"
        )


def check_tol(values_tol: object) -> float | None:
    if values_tol is None:
        return None
    if isinstance(values_tol, bool) or not isinstance(values_tol, (int, float)):
        raise TypeError(f"values_tol must be None or a number >= 0, got {values_tol!r}")
    if not float(values_tol) >= 0.0:
        raise ValueError(f"values_tol must be >= 0, got {values_tol!r}")
    return float(values_tol)


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def check_placement(
    placement: object,
    deferred: bool,
    router: object,
    mode: str,
    fold: str = "linear",
    promote_to: object = "anchor",
) -> str:
    """placement as a string, refusing the combinations the planned placements cannot run
    (``fold``: the checked fold; ``promote_to``: the stochastic placement's target)."""
    placement = check_choice("placement", placement, PLACEMENTS)
    if placement == "stochastic" and fold != "causal" and promote_to != "exact":
        raise ValueError(
            f"placement='stochastic' needs fold='causal' (its rows nest by segment) unless "
            f"promote_to='exact', got fold={fold!r}, promote_to={promote_to!r}"
        )
    if placement != "uniform":
        if not deferred:
            raise ValueError(
                f"placement={placement!r} needs deferred=True: the anchors are chosen from "
                "the upstream gradients, which exist only in the backward"
            )
        if router is not None:
            raise ValueError(
                f"router and placement={placement!r} do not combine: the budget already "
                "decides every sample's anchors; pass router=None"
            )
        if mode == "exact":
            raise ValueError(f"placement={placement!r} approximates; mode='exact' runs every step")
    return placement


# -------------------------------------------------------------------------------- values


def values_tolerance(values: torch.Tensor, tol: float | None) -> torch.Tensor:
    """Absolute tolerance (a 0-d tensor) of anchors recomputed against ``values``."""
    if tol is not None:
        return torch.tensor(float(tol), device=values.device)
    rtol = VALUES_RTOL.get(values.dtype, 1e-5)
    return rtol * (1.0 + values.detach().abs().amax().to(torch.float64))


def stale_error(worst: float, tol: float) -> RuntimeError:
    """The error for recomputed anchors that differ from the caller's ``values``."""
    return RuntimeError(
        f"values look stale: an anchor recomputed with grad differs from the given values by "
        f"{worst:.3g} (tolerance {tol:.3g}); values= must be the velocities of these latents "
        "at the CURRENT parameters (was there an optimizer step since the rollout?). No "
        "gradient was applied."
    )


def check_fresh(got: torch.Tensor, want: torch.Tensor, limit: torch.Tensor) -> None:
    """Raise the stale-values error when recomputed velocities differ from ``values``
    by more than ``limit`` (a 0-d tensor, :func:`values_tolerance`)."""
    worst = float((got.detach().to(torch.float64) - want.to(torch.float64)).abs().max())
    if worst > float(limit):
        raise stale_error(worst, float(limit))


# ----------------------------------------------------------------------- deferred inputs


def resolve_params(model: object, params: object, *, who: str, require: bool) -> list[torch.Tensor]:
    """The trainable tensors: ``params`` as given (deduplicated), else the model's.

    who: the feature that needs them (for the message); require: an empty result is a
    ValueError (a comparison needs a gradient; a deferred call does not).
    """
    if params is None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"params must be given for {who} when model is not a torch.nn.Module "
                f"(got a {type(model).__name__}): pass params=[the trainable tensors]"
            )
        found = [p for p in model.parameters() if p.requires_grad]
        if require and not found:
            raise ValueError("params: the model has no parameter that requires grad")
        ps: list[torch.Tensor] = found
    else:
        # A bare tensor is iterable (its rows), which would silently use the wrong thing.
        if isinstance(params, (torch.Tensor, str, bytes)) or not isinstance(params, Iterable):
            raise TypeError(
                f"params must be a sequence of tensors (e.g. a list), got {type(params).__name__}"
            )
        ps = list(params)
        if not ps:
            raise ValueError("params must not be empty")
        for i, p in enumerate(ps):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if not p.requires_grad:
                raise ValueError(f"params[{i}] does not require grad: it has no gradient")
    # A tensor listed twice would get its gradient twice.
    unique: dict[int, torch.Tensor] = {}
    for p in ps:
        unique.setdefault(id(p), p)
    return list(unique.values())


def record_versions(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor, int]]:
    """(name, tensor, version) of each tensor, for :func:`_check_versions`."""
    return [(name, t, t._version) for name, t in named]


def autocast_state(device: torch.device) -> tuple[bool, torch.dtype] | None:
    """The current autocast state for ``device`` (None when autocast does not apply)."""
    try:
        return torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    except (RuntimeError, AttributeError):  # device types without autocast
        return None
