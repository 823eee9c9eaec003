"""Sigma schedules of flow-matching samplers: SD3's shift, FLUX / DanceGRPO's shifted
schedule, diffusers' ``FlowMatchEulerDiscreteScheduler`` sigmas and any scheduler's.

The sampler runs from ``sigma = 1`` (pure noise) to ``sigma = 0`` (data); every schedule
here is a decreasing sequence of ``num_steps + 1`` sigmas ending at 0.  (Also importable
from :mod:`jagg_autograd.grpo`.)
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from jagg_autograd._validate import _is_real_number

__all__ = [
    "flow_match_sigmas",
    "scheduler_sigmas",
    "shift_sigmas",
    "shifted_sigma_schedule",
]

SigmaLike = float | torch.Tensor


def _check_shift(shift: object) -> float:
    if not _is_real_number(shift):
        raise TypeError(f"shift must be a float, got {type(shift).__name__}")
    s = float(shift)
    if not (math.isfinite(s) and s > 0.0):
        raise ValueError(f"shift must be a finite number > 0, got {shift}")
    return s


def shift_sigmas(sigmas: SigmaLike, shift: float) -> SigmaLike:
    """SD3's timestep shift ``sigma <- shift * sigma / (1 + (shift - 1) * sigma)``.

    Shapes: ``sigmas`` is a float or a tensor of any shape; the result has the same type and
    shape. It maps [0, 1] onto itself monotonically, fixing 0 and 1; ``shift > 1`` spends
    more steps at high noise.
    """
    s = _check_shift(shift)
    if isinstance(sigmas, torch.Tensor):
        if not sigmas.is_floating_point():
            raise TypeError(f"sigmas must be a floating-point tensor, got dtype {sigmas.dtype}")
    elif not _is_real_number(sigmas):
        raise TypeError(f"sigmas must be a float or a torch.Tensor, got {type(sigmas).__name__}")
    return s * sigmas / (1.0 + (s - 1.0) * sigmas)


def shifted_sigma_schedule(
    num_steps: int,
    shift: float = 3.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """A shifted sigma schedule for ``num_steps`` steps from 1 to 0 (FLUX / DanceGRPO style).

    Returns ``sigmas``: ``(num_steps + 1,)``, strictly decreasing, ``sigmas[0] == 1`` and
    ``sigmas[-1] == 0`` exactly; step ``i`` goes ``sigmas[i] -> sigmas[i + 1]`` and
    ``sigmas[1]`` is the ``sigma_max`` of :func:`sde_step_with_logprob`.

    Math: ``u_i = 1 - i / num_steps`` (the ``linspace(1, 1/N, N)`` that ``FluxPipeline``
    passes as ``sigmas=``, plus the trailing 0), then ``sigma_i = shift * u_i / (1 + (shift -
    1) * u_i)`` -- one shift.  This is DanceGRPO's and FLUX's schedule, NOT the one
    Flow-GRPO's SD3 pipeline samples with: ``FlowMatchEulerDiscreteScheduler(shift=3)``
    spaces its timesteps between the *shifted* ``sigma_max`` and ``sigma_min`` and shifts
    again, which differs from this by up to 0.24 (``num_steps=10``, ``shift=3``); use
    :func:`flow_match_sigmas` (or :func:`scheduler_sigmas` with the scheduler itself) for
    that.  Computed in float64; the endpoints are pinned because the ``sigma == 1`` branch
    of the SDE step relies on an exact 1.

    Raises ``ValueError`` when ``dtype`` is too coarse to keep the steps distinct (e.g.
    bfloat16, 8 significant bits, at ``num_steps=100``: adjacent sigmas near 1 round to
    the same value): compute the schedule in float32/float64 and cast where needed.
    """
    if not isinstance(num_steps, numbers.Integral) or isinstance(num_steps, bool):
        raise TypeError(f"num_steps must be an int, got {type(num_steps).__name__}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    s = _check_shift(shift)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    u = torch.linspace(1.0, 0.0, int(num_steps) + 1, dtype=torch.float64)
    sig = shift_sigmas(u, s)
    sig[0] = 1.0
    sig[-1] = 0.0
    out = sig.to(dtype=dtype)
    # The documented contract is "strictly decreasing"; a coarse dtype can round adjacent
    # steps together (a zero-length step), which the SDE step and JAGG's timestep check
    # would then meet much later.  Refuse here, where the cause is obvious.
    if not bool((out[1:] < out[:-1]).all()):
        k = int((out[1:] >= out[:-1]).nonzero()[0])
        raise ValueError(
            f"dtype {dtype} cannot hold {num_steps} distinct steps of this schedule "
            f"(shift={s}): sigmas[{k}] and sigmas[{k + 1}] both round to {float(out[k])}; "
            "use dtype=torch.float32 or torch.float64"
        )
    return out.to(device=device)


def flow_match_sigmas(
    num_steps: int,
    shift: float = 3.0,
    *,
    num_train_timesteps: int = 1000,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The sigmas of diffusers' ``FlowMatchEulerDiscreteScheduler(shift=shift)`` (SD3, Flow-GRPO).

    Returns ``(num_steps + 1,)``: exactly ``scheduler.sigmas`` after
    ``scheduler.set_timesteps(num_steps)`` (float32 values, returned in ``dtype``), without
    diffusers.  Step ``i`` goes ``sigmas[i] -> sigmas[i + 1]``; the model's ``t`` is the
    sigma itself (the scheduler's ``timesteps`` are ``1000 * sigma``: the adapters in
    :mod:`jagg_autograd.integrations.diffusers` apply that factor).

    Math, with ``s(x) = shift * x / (1 + (shift - 1) * x)`` and ``N = num_train_timesteps``::

        sigma_min = s(1 / N)                       (in float32, as the scheduler's __init__)
        u_i = linspace(1, sigma_min, num_steps)    (float64)
        sigma_i = s(u_i) for i < num_steps,  sigma_num_steps = 0

    i.e. the shift is applied twice to the low end (the scheduler spaces its steps between
    the shifted bounds and shifts again); :func:`shifted_sigma_schedule` shifts once.
    """
    if not isinstance(num_steps, numbers.Integral) or isinstance(num_steps, bool):
        raise TypeError(f"num_steps must be an int, got {type(num_steps).__name__}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if not isinstance(num_train_timesteps, numbers.Integral) or num_train_timesteps < 1:
        raise ValueError(f"num_train_timesteps must be an int >= 1, got {num_train_timesteps!r}")
    s = _check_shift(shift)
    n = int(num_train_timesteps)
    # The scheduler's __init__ computes its bounds in float32; reproduce its rounding.
    lo = torch.tensor(1.0, dtype=torch.float32) / n
    sigma_min = float(s * lo / (1 + (s - 1) * lo))
    u = np.linspace(1.0 * n, sigma_min * n, int(num_steps)) / n
    sig = torch.from_numpy(s * u / (1 + (s - 1) * u)).to(torch.float32)
    sig = torch.cat([sig, sig.new_zeros(1)])
    return sig.to(dtype=dtype, device=device)


def scheduler_sigmas(
    scheduler: object, num_steps: int, **set_timesteps_kwargs: object
) -> torch.Tensor:
    """``(num_steps + 1,)`` float64 sigmas of a diffusers flow-matching scheduler.

    Calls ``scheduler.set_timesteps(num_steps, **set_timesteps_kwargs)`` (which changes the
    scheduler's state, as a pipeline call does; e.g. ``mu=`` for FLUX's dynamic shifting)
    and returns its ``sigmas`` (noise levels in [0, 1], the trailing 0 included), the
    schedule to pass to :func:`jagg_autograd.rollout.sample_trajectories` and, without
    the last entry, as ``jagg_trajectory``'s timesteps.
    """
    if not hasattr(scheduler, "set_timesteps"):
        raise TypeError(
            f"scheduler must be a diffusers scheduler with set_timesteps, got "
            f"{type(scheduler).__name__}"
        )
    scheduler.set_timesteps(num_steps, **set_timesteps_kwargs)  # type: ignore[attr-defined]
    sig = getattr(scheduler, "sigmas", None)
    if not isinstance(sig, torch.Tensor) or sig.dim() != 1 or sig.numel() != num_steps + 1:
        raise ValueError(
            f"scheduler.sigmas must be a ({num_steps + 1},) tensor after set_timesteps "
            "(a flow-matching scheduler such as FlowMatchEulerDiscreteScheduler)"
        )
    out = sig.detach().to("cpu", torch.float64)
    if not bool(((out >= 0) & (out <= 1)).all() and (out[1:] < out[:-1]).all()):
        raise ValueError("scheduler.sigmas must be strictly decreasing noise levels in [0, 1]")
    return out
