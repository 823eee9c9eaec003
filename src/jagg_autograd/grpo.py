"""GRPO pieces for flow-matching samplers, written from the Flow-GRPO / DanceGRPO formulas.

Conventions used throughout this module:

* ``B`` is the batch size and ``S`` the per-sample shape (e.g. ``(C, H, W)``); a sample is
  ``(B, *S)``. The sampler runs from ``sigma = 1`` (pure noise) to ``sigma = 0`` (data), and
  one step goes ``sigma -> sigma_next`` with ``dt = sigma_next - sigma < 0``.
* The velocity ``v`` is the rectified-flow velocity ``noise - data`` (SD3/FLUX convention),
  so the ODE step is ``x' = x + dt * v``.

**Dtype policy.** The step functions compute in float32 whatever the input dtype
(bfloat16/float16 latents would overflow or lose the log-prob entirely), *except* that a
float64 ``velocity`` or ``sample`` keeps the whole step in float64 so that float64 tests and
``torch.autograd.gradcheck`` are meaningful. Outputs are in that compute dtype.

**Noise-level policy.** ``noise_level = 0`` makes the transition a Dirac delta (the ODE
limit), whose log-density is undefined; the SDE steps reject it with a ``ValueError`` that
points to :func:`ode_step`. A positive ``noise_level`` with valid sigmas guarantees a strictly
positive transition std, so no NaN or inf can come from the step itself.

**NaN policy.** :func:`group_advantages` raises ``ValueError`` on non-finite rewards (naming
the offending indices) rather than skipping groups; :func:`grpo_loss` raises on non-finite
log-probs or advantages. Step inputs (velocity/sample) are not scanned, because that would
cost a device sync per model call; a NaN there surfaces as a ``ValueError`` from
:func:`grpo_loss`, so it never becomes a silent NaN loss.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch

from jagg_autograd._validate import _check_float_tensor, _check_nonneg, _is_real_number
from jagg_autograd.advantages import group_advantages
from jagg_autograd.fold_guard import note_advantages
from jagg_autograd.schedules import (
    SigmaLike,
    flow_match_sigmas,
    scheduler_sigmas,
    shift_sigmas,
    shifted_sigma_schedule,
)

__all__ = [
    "dance_sde_step_with_logprob",
    "flow_match_sigmas",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "ode_step",
    "scheduler_sigmas",
    "sde_step_with_logprob",
    "shift_sigmas",
    "shifted_sigma_schedule",
]


_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# --------------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------------


def _check_step_tensors(
    velocity: object, sample: object, prev_sample: object | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    velocity = _check_float_tensor("velocity", velocity)
    sample = _check_float_tensor("sample", sample)
    if velocity.ndim < 1 or velocity.shape[0] < 1:
        raise ValueError(
            f"velocity must have shape (B, *S) with B >= 1, got {tuple(velocity.shape)}"
        )
    _check_like_velocity("sample", sample, velocity)
    if prev_sample is not None:
        _check_like_velocity(
            "prev_sample", _check_float_tensor("prev_sample", prev_sample), velocity
        )
    return velocity, sample


def _check_like_velocity(name: str, x: torch.Tensor, velocity: torch.Tensor) -> None:
    if x.shape != velocity.shape:
        raise ValueError(
            f"{name} must have the same shape as velocity {tuple(velocity.shape)}, "
            f"got {tuple(x.shape)}"
        )
    if x.device != velocity.device:
        raise ValueError(
            f"{name} is on {x.device} but velocity is on {velocity.device}; "
            "they must be on the same device"
        )


def _sigma_values(name: str, sigma: object, batch: int) -> np.ndarray:
    """Host copy of a float / 0-d / (B,) sigma as float64, for validation only."""
    if _is_real_number(sigma):
        return np.asarray([float(sigma)], dtype=np.float64)
    if isinstance(sigma, torch.Tensor):
        if not (sigma.is_floating_point() or sigma.dtype in _INT_DTYPES):
            raise TypeError(f"{name} must be a real tensor, got dtype {sigma.dtype}")
        if sigma.ndim == 0:
            return np.asarray([float(sigma.item())], dtype=np.float64)
        if sigma.ndim == 1:
            if sigma.shape[0] != batch:
                raise ValueError(
                    f"{name} has {sigma.shape[0]} entries but the batch size is {batch}; "
                    f"expected a float, a 0-d tensor or a ({batch},) tensor"
                )
            return sigma.detach().to("cpu", torch.float64).numpy()
        raise ValueError(
            f"{name} must be a float, a 0-d tensor or a (B,) tensor, got shape {tuple(sigma.shape)}"
        )
    raise TypeError(f"{name} must be a float or a torch.Tensor, got {type(sigma).__name__}")


def _check_sigmas(sigma: object, sigma_next: object, batch: int, dtype: torch.dtype) -> None:
    # Checked after rounding to the compute dtype: two distinct float64 sigmas can round to
    # the same float32 value, which would make dt = 0 and the std 0.
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    s = _sigma_values("sigma", sigma, batch).astype(np_dtype)
    sn = _sigma_values("sigma_next", sigma_next, batch).astype(np_dtype)
    # Negated comparisons so that NaN fails too.
    bad = ~((s > 0.0) & (s <= 1.0))
    if bad.any():
        raise ValueError(
            f"sigma must satisfy 0 < sigma <= 1 (in {dtype}), got {s[bad].tolist()} "
            f"(at index {np.flatnonzero(bad).tolist()})"
        )
    bad = ~((sn >= 0.0) & (sn < s))
    if bad.any():
        raise ValueError(
            "sigma_next must satisfy 0 <= sigma_next < sigma (the sampler runs from 1 to 0; "
            f"compared in {dtype}), "
            f"got sigma_next={np.broadcast_to(sn, bad.shape)[bad].tolist()} for "
            f"sigma={np.broadcast_to(s, bad.shape)[bad].tolist()}"
        )


def _check_noise_level(noise_level: object) -> float:
    if not _is_real_number(noise_level):
        raise TypeError(f"noise_level must be a float, got {type(noise_level).__name__}")
    eta = float(noise_level)
    if not math.isfinite(eta) or eta < 0.0:
        raise ValueError(f"noise_level must be a finite number > 0, got {eta}")
    if eta == 0.0:
        raise ValueError(
            "noise_level=0 makes the step deterministic (the ODE limit), where the "
            "transition has no density and log_prob is undefined; use ode_step() for "
            "deterministic steps, or a noise_level > 0"
        )
    return eta


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def _as_batch_view(
    sigma: SigmaLike, batch: int, ndim: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """sigma as a (B, 1, ..., 1) tensor that broadcasts against a (B, *S) sample."""
    t = torch.as_tensor(sigma, dtype=dtype, device=device)
    return t.reshape(-1).expand(batch).reshape(batch, *([1] * (ndim - 1)))


def _draw_noise(
    shape: torch.Size,
    generator: object,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    # Like diffusers' randn_tensor: a CPU generator drives a GPU sample reproducibly.  A
    # ShardedGenerator (data_parallel) gives this rank's rows of the global draw.
    from jagg_autograd.data_parallel import draw_randn

    return draw_randn(shape, generator, dtype=dtype, device=device)


def _gaussian_log_prob(
    prev_sample: torch.Tensor, prev_mean: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    # The sample is detached so the gradient is the score-function one: d log p / d mean.
    x = prev_sample.detach()
    lp = -((x - prev_mean) ** 2) / (2.0 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return lp.reshape(lp.shape[0], -1).mean(dim=1)


def _step_inputs(
    velocity: object, sample: object, sigma: SigmaLike, sigma_next: SigmaLike
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(v, x, sig, sig_next)`` of a validated ODE step, in the compute dtype."""
    velocity, sample = _check_step_tensors(velocity, sample)
    dtype = _compute_dtype(velocity, sample)
    _check_sigmas(sigma, sigma_next, velocity.shape[0], dtype)
    return _step_views(velocity, sample, sigma, sigma_next, dtype)


def _sde_step_inputs(
    velocity: object,
    sample: object,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    noise_level: object,
    sigma_max: object | None,
    prev_sample: object | None,
    generator: object | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``(v, x, sig, sig_next, eta)`` of a validated SDE step, in the compute dtype.

    ``sigma_max`` is checked only when not None (the dance step passes None).
    """
    velocity, sample = _check_step_tensors(velocity, sample, prev_sample)
    dtype = _compute_dtype(velocity, sample)
    _check_sigmas(sigma, sigma_next, velocity.shape[0], dtype)
    eta = _check_noise_level(noise_level)
    if sigma_max is not None:
        if not _is_real_number(sigma_max):
            raise TypeError(f"sigma_max must be a float or None, got {type(sigma_max).__name__}")
        if not (0.0 <= float(sigma_max) < 1.0):
            raise ValueError(
                f"sigma_max must satisfy 0 <= sigma_max < 1 (it is the schedule's second "
                f"entry, sigmas[1]), got {sigma_max}"
            )
    if generator is not None:
        from jagg_autograd.data_parallel import is_generator

        if not is_generator(generator):
            raise TypeError(
                f"generator must be a torch.Generator, got {type(generator).__name__}"
            )
    return (*_step_views(velocity, sample, sigma, sigma_next, dtype), eta)


def _step_views(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``v``, ``x`` ``(B, *S)`` and ``sig``, ``sig_next`` ``(B, 1, ..., 1)`` in ``dtype``."""
    batch, ndim, device = velocity.shape[0], velocity.ndim, velocity.device
    v = velocity.to(dtype)
    x = sample.to(dtype)
    sig = _as_batch_view(sigma, batch, ndim, dtype, device)
    sig_next = _as_batch_view(sigma_next, batch, ndim, dtype, device)
    return v, x, sig, sig_next


def _sde_result(
    v: torch.Tensor,
    prev_mean: torch.Tensor,
    std: torch.Tensor,
    std_dev_t: torch.Tensor,
    prev_sample: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample ``x' = mu + s * xi`` (or take the given one, detached) and its log-prob."""
    if prev_sample is None:
        prev_sample = prev_mean + std * _draw_noise(v.shape, generator, v.dtype, v.device)
    else:
        prev_sample = prev_sample.detach().to(v.dtype)

    log_prob = _gaussian_log_prob(prev_sample, prev_mean, std)
    return prev_sample, log_prob, prev_mean, std_dev_t


# --------------------------------------------------------------------------------------------
# sampler steps
# --------------------------------------------------------------------------------------------


def sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    *,
    noise_level: float = 0.7,
    sigma_max: float | None = None,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    sde_type: Literal["flow", "dance"] = "flow",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Flow-GRPO SDE step ``sigma -> sigma_next`` and the Gaussian log-prob of its result.

    Shapes: ``velocity``, ``sample``, ``prev_sample``: ``(B, *S)``; ``sigma``, ``sigma_next``:
    a float, a 0-d tensor or a ``(B,)`` tensor (per-sample sigmas). Returns
    ``(prev_sample (B, *S), log_prob (B,), prev_mean (B, *S), std_dev_t (B, 1, ..., 1))``.

    Math (Flow-GRPO, Liu et al. 2025), with ``dt = sigma_next - sigma < 0``, ``eta =
    noise_level`` and ``sigma~ = sigma_max`` where ``sigma == 1`` else ``sigma``::

        eps_t = eta * sqrt(sigma / (1 - sigma~))
        mu    = x * (1 + eps_t**2 / (2 sigma) * dt)
                + v * (1 + eps_t**2 (1 - sigma) / (2 sigma)) * dt
        s     = eps_t * sqrt(-dt)
        x'    = mu + s * xi,   xi ~ N(0, I) drawn from ``generator``   (if prev_sample is None)
        log_prob = mean over the elements of S of
                   -(sg(x') - mu)**2 / (2 s**2) - log s - log sqrt(2 pi)

    ``std_dev_t`` is ``eps_t`` (without the ``sqrt(-dt)``), as in Flow-GRPO, shaped
    ``(B, 1, ..., 1)`` so that it broadcasts against the sample.

    Args:
        velocity: the model's velocity prediction ``v``, ``(B, *S)``.
        sample: the current latent ``x`` at ``sigma``, ``(B, *S)``.
        sigma: current noise level, ``0 < sigma <= 1``.
        sigma_next: next noise level, ``0 <= sigma_next < sigma``.
        noise_level: ``eta > 0``; 0 (the ODE limit) is rejected, see :func:`ode_step`.
        sigma_max: Flow-GRPO's ``sigmas[1]`` (the schedule's second entry), ``0 <= . < 1``;
            replaces ``sigma`` in ``1 - sigma`` only where ``sigma == 1`` (where the formula
            would divide by zero). Defaults to ``sigma_next`` there, which *is* ``sigmas[1]``
            on the first step of a schedule.
        prev_sample: if given, the step's result is not sampled; the log-prob of this
            ``x'`` is returned instead (the training pass). No gradient reaches it.
        generator: RNG for ``xi``; ignored when ``prev_sample`` is given.
        sde_type: ``"flow"`` (this function) or ``"dance"`` (dispatches to
            :func:`dance_sde_step_with_logprob`, which ignores ``sigma_max``).

    Gradients: ``log_prob`` and ``prev_mean`` are differentiable w.r.t. ``velocity`` (and
    ``sample``); ``x'`` enters ``log_prob`` detached. A sampled ``prev_sample`` keeps its
    graph (``mu + s * xi``), as in Flow-GRPO; rollouts normally run under ``no_grad``.

    Dtype: computed in float32 for any input dtype, or float64 if ``velocity`` or ``sample``
    is float64 (see the module docstring).

    Raises:
        TypeError / ValueError on bad input, before any computation. Tensor sigmas are
        copied to the host once for this check (they are ``(B,)``, so it is cheap, but it is
        a device sync on GPU).
    """
    if sde_type == "dance":
        return dance_sde_step_with_logprob(
            velocity,
            sample,
            sigma,
            sigma_next,
            noise_level=noise_level,
            prev_sample=prev_sample,
            generator=generator,
        )
    if sde_type != "flow":
        raise ValueError(f"sde_type must be 'flow' or 'dance', got {sde_type!r}")

    v, x, sig, sig_next, eta = _sde_step_inputs(
        velocity, sample, sigma, sigma_next, noise_level, sigma_max, prev_sample, generator
    )
    dt = sig_next - sig

    at_one = sig == 1.0
    sig_tilde_at_one = sig_next if sigma_max is None else torch.full_like(sig, float(sigma_max))
    sig_tilde = torch.where(at_one, sig_tilde_at_one, sig)
    std_dev_t = eta * torch.sqrt(sig / (1.0 - sig_tilde))

    eps2 = std_dev_t**2
    prev_mean = (
        x * (1.0 + eps2 / (2.0 * sig) * dt) + v * (1.0 + eps2 * (1.0 - sig) / (2.0 * sig)) * dt
    )
    std = std_dev_t * torch.sqrt(-dt)
    return _sde_result(v, prev_mean, std, std_dev_t, prev_sample, generator)


def dance_sde_step_with_logprob(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
    *,
    noise_level: float = 0.3,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One DanceGRPO SDE step ``sigma -> sigma_next`` and the Gaussian log-prob of its result.

    Shapes and return convention as :func:`sde_step_with_logprob`:
    ``(prev_sample (B, *S), log_prob (B,), prev_mean (B, *S), std_dev_t (B, 1, ..., 1))``.

    Math (DanceGRPO, Xue et al. 2025), with ``dt = sigma_next - sigma < 0``, ``eta =
    noise_level`` and the predicted clean sample ``x0 = x - sigma * v``::

        mu = x + dt * [v + eta**2 / 2 * (x - (1 - sigma) * x0) / sigma**2]
        s  = eta * sqrt(sigma - sigma_next)
        x' = mu + s * xi                        (if prev_sample is None)
        log_prob = mean over S of -(sg(x') - mu)**2 / (2 s**2) - log s - log sqrt(2 pi)

    ``std_dev_t`` is ``eta`` broadcast to ``(B, 1, ..., 1)``: the diffusion coefficient per
    unit time (``s = std_dev_t * sqrt(-dt)``), the same convention as Flow-GRPO's ``eps_t``,
    so :func:`kl_to_reference` applies unchanged. The default ``noise_level=0.3`` is
    DanceGRPO's. Dtype policy, gradients and errors as :func:`sde_step_with_logprob`.
    """
    v, x, sig, sig_next, eta = _sde_step_inputs(
        velocity, sample, sigma, sigma_next, noise_level, None, prev_sample, generator
    )
    dt = sig_next - sig

    x0 = x - sig * v
    prev_mean = x + dt * (v + 0.5 * eta**2 * (x - (1.0 - sig) * x0) / sig**2)
    std_dev_t = torch.full_like(sig, eta)
    std = std_dev_t * torch.sqrt(sig - sig_next)
    return _sde_result(v, prev_mean, std, std_dev_t, prev_sample, generator)


def ode_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigma: SigmaLike,
    sigma_next: SigmaLike,
) -> torch.Tensor:
    """The deterministic Euler step of the flow ODE: ``x' = x + (sigma_next - sigma) * v``.

    Shapes: ``velocity``, ``sample``: ``(B, *S)``; ``sigma``, ``sigma_next``: a float, a 0-d
    tensor or a ``(B,)`` tensor. Returns ``x'``: ``(B, *S)`` in the step functions' compute
    dtype (float32, or float64 for float64 input). Same sigma rules and errors as
    :func:`sde_step_with_logprob`; this is its ``noise_level -> 0`` limit.
    """
    v, x, sig, sig_next = _step_inputs(velocity, sample, sigma, sigma_next)
    dt = sig_next - sig
    return x + dt * v


# --------------------------------------------------------------------------------------------
# loss and KL
# --------------------------------------------------------------------------------------------


def _check_batch_vector(name: str, x: object, batch: int | None) -> torch.Tensor:
    x = _check_float_tensor(name, x)
    if x.ndim != 1 or x.shape[0] < 1:
        raise ValueError(f"{name} must have shape (B,) with B >= 1, got {tuple(x.shape)}")
    if batch is not None and x.shape[0] != batch:
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(x.shape)}")
    return x


def grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float = 1e-4,
    adv_clip_max: float = 5.0,
    kl: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-GRPO's clipped policy-gradient loss for one step of the trajectories.

    Shapes: ``log_prob``, ``old_log_prob``, ``advantages``, ``kl``: ``(B,)``. Returns
    ``(loss, info)`` with ``loss`` a differentiable 0-d tensor.

    Math, with ``A^ = clamp(A, -adv_clip_max, adv_clip_max)`` and
    ``r = exp(log_prob - old_log_prob)``::

        loss = mean_b max(-A^ * r, -A^ * clamp(r, 1 - clip_range, 1 + clip_range))
               + beta * mean_b kl                                  (if kl is given)

    Only ``log_prob`` (and ``kl``) carry gradients; ``old_log_prob`` and ``advantages`` are
    detached (they come from the rollout).

    ``info`` holds detached 0-d tensors in ``log_prob``'s dtype (tensors, not Python floats,
    so that logging costs no device sync; call ``float()`` on them):
    ``policy_loss``; ``approx_kl = 0.5 * mean((log_prob - old_log_prob)**2)``; ``clipfrac =
    mean(|r - 1| > clip_range)``; ``ratio_mean``, ``ratio_min``, ``ratio_max``; and, when
    ``kl`` is given, ``kl = mean(kl)``.

    Raises:
        TypeError / ValueError on bad input, including non-finite ``log_prob``,
        ``old_log_prob``, ``advantages`` or ``kl`` (never a silent NaN loss), and
        ``beta > 0`` without ``kl``. The finiteness check costs one host sync per call.
    """
    log_prob = _check_batch_vector("log_prob", log_prob, None)
    batch = log_prob.shape[0]
    old_log_prob = _check_batch_vector("old_log_prob", old_log_prob, batch)
    advantages = _check_batch_vector("advantages", advantages, batch)
    named = [("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages)]
    if kl is not None:
        named.append(("kl", _check_batch_vector("kl", kl, batch)))
    for name, t in named[1:]:
        if t.device != log_prob.device:
            raise ValueError(f"{name} is on {t.device} but log_prob is on {log_prob.device}")
    eps = _check_nonneg("clip_range", clip_range, strict=False)
    adv_max = _check_nonneg("adv_clip_max", adv_clip_max, strict=True)
    beta_f = _check_nonneg("beta", beta, strict=False)
    if beta_f > 0.0 and kl is None:
        raise ValueError(f"beta={beta_f} > 0 needs kl, a (B,) tensor of per-sample KL terms")
    # One host sync for all finiteness checks and the advantages' sum and sum of squares
    # (the linear fold's guard, jagg_autograd.fold_guard); work out which argument is
    # non-finite only on failure.
    a32 = advantages.detach().float()  # float32: float64 is not on every device (MPS)
    finite = torch.stack([torch.isfinite(t.detach()).all() for _, t in named]).all()
    ok, a_sum, a_sq = torch.stack([finite.float(), a32.sum(), a32.square().sum()]).tolist()
    if not ok:
        for name, t in named:
            bad = ~torch.isfinite(t.detach())
            if bool(bad.any()):
                idx = torch.nonzero(bad).flatten().tolist()
                raise ValueError(f"{name} has non-finite entries at batch index {idx}")

    note_advantages(log_prob, a_sum, a_sq, batch)
    dtype = log_prob.dtype
    adv = advantages.detach().to(dtype).clamp(-adv_max, adv_max)
    log_ratio = log_prob - old_log_prob.detach().to(dtype)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - eps, 1.0 + eps)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    loss = policy_loss
    if kl is not None:
        kl_mean = kl.to(dtype).mean()
        loss = policy_loss + beta_f * kl_mean

    with torch.no_grad():
        r = ratio.detach()
        info: dict[str, torch.Tensor] = {
            "policy_loss": policy_loss.detach(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
            "clipfrac": ((r - 1.0).abs() > eps).to(dtype).mean(),
            "ratio_mean": r.mean(),
            "ratio_min": r.min(),
            "ratio_max": r.max(),
        }
        if kl is not None:
            info["kl"] = kl_mean.detach()
    return loss, info


def kl_to_reference(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std_dev_t: SigmaLike,
) -> torch.Tensor:
    """Flow-GRPO's per-sample KL regulariser between the policy's and the reference's step.

    Shapes: ``mean``, ``ref_mean``: ``(B, *S)`` (the ``prev_mean`` of a step under the policy
    and under the frozen reference); ``std_dev_t``: a float, a 0-d tensor, a ``(B,)`` tensor
    or the ``(B, 1, ..., 1)`` tensor the step functions return. Returns ``(B,)``.

    Math::

        kl_b = mean over S of (mean - ref_mean)**2 / (2 * std_dev_t**2)

    This is Flow-GRPO's convention, NOT the per-step KL itself: both transitions are
    ``N(mu, s**2 I)`` with ``s = std_dev_t * sqrt(-dt)``, whose per-element KL is
    ``(mu - mu_ref)**2 / (2 s**2)``, so ``kl_b = (-dt) * KL(N(mu, s^2 I) || N(mu_ref, s^2 I)) / D``
    with ``D = prod(S)``: the KL rate per unit of sigma, averaged over elements.
    ``ref_mean`` is treated as a constant (detached).
    """
    mean = _check_float_tensor("mean", mean)
    ref_mean = _check_float_tensor("ref_mean", ref_mean)
    if mean.ndim < 1 or mean.shape[0] < 1:
        raise ValueError(f"mean must have shape (B, *S) with B >= 1, got {tuple(mean.shape)}")
    if ref_mean.shape != mean.shape:
        raise ValueError(
            f"ref_mean must have the same shape as mean {tuple(mean.shape)}, "
            f"got {tuple(ref_mean.shape)}"
        )
    if ref_mean.device != mean.device:
        raise ValueError(f"ref_mean is on {ref_mean.device} but mean is on {mean.device}")
    batch, ndim = mean.shape[0], mean.ndim
    if _is_real_number(std_dev_t):
        vals = np.asarray([float(std_dev_t)])
        std = torch.full((batch,), float(std_dev_t), dtype=mean.dtype, device=mean.device)
    elif isinstance(std_dev_t, torch.Tensor):
        if not std_dev_t.is_floating_point():
            raise TypeError(f"std_dev_t must be a floating-point tensor, got {std_dev_t.dtype}")
        per_sample_shape = std_dev_t.ndim <= ndim and all(d == 1 for d in std_dev_t.shape[1:])
        if not (std_dev_t.ndim == 0 or (per_sample_shape and std_dev_t.shape[0] == batch)):
            raise ValueError(
                f"std_dev_t must be a float, a 0-d tensor, a ({batch},) tensor or a "
                f"({batch}, 1, ..., 1) tensor, got shape {tuple(std_dev_t.shape)}"
            )
        vals = std_dev_t.detach().to("cpu", torch.float64).reshape(-1).numpy()
        std = std_dev_t.detach().to(mean.dtype).to(mean.device).reshape(-1).expand(batch)
    else:
        raise TypeError(
            f"std_dev_t must be a float or a torch.Tensor, got {type(std_dev_t).__name__}"
        )
    if not (np.isfinite(vals) & (vals > 0)).all():
        raise ValueError(f"std_dev_t must be finite and > 0, got {vals.tolist()}")

    diff2 = (mean - ref_mean.detach().to(mean.dtype)) ** 2
    std = std.reshape(batch, *([1] * (ndim - 1)))
    return (diff2 / (2.0 * std**2)).reshape(batch, -1).mean(dim=1)



