"""Model-agnostic GRPO rollout and its training-phase recomputation, in the (T, B, ...) layout.

:func:`sample_trajectories` samples B trajectories with any velocity callable
``model(z (B, *S), t (B,), **cond) -> v (B, *S)`` (a diffusers adapter with CFG, a LoRA'd
DiT, the digits DiT) and records what GRPO's training phase needs, step k = 0..T-1 going
``sigma_k -> sigma_{k+1}``::

    latents     (T + 1, B, *S)  x_0 (noise) .. x_T (the sample)
    sigmas      (T + 1,) or (T + 1, B)  the schedule (per sample if given per sample)
    log_probs   (T, B)          log p(x_{k+1} | x_k) under the rollout policy (NaN on ODE steps)
    velocities  (T, B, *S)      v_k = model(x_k, sigma_k, **cond) as the rollout computed them

The velocities are what ``jagg_trajectory(..., values=...)`` takes on an on-policy
minibatch (no optimizer step since the rollout): the training phase then needs no model
call except the anchors'.  Flow-GRPO stores ``(B, T, ...)``; here dim 0 is the step.

:func:`policy_log_probs` is the training phase of one minibatch: the velocities of the
trained steps from ONE :func:`jagg_trajectory` call (every trained step of every sample),
then each trained step's SDE log-prob of the stored ``x_{k+1}`` (and its mean, for the KL
term).  The trained steps are a ``(lo, hi)`` range shared by all samples (Flow-GRPO's
``timestep_fraction`` prefix, MixGRPO's window) or a ``(T', B)`` index table of per-sample
steps (DanceGRPO's random subset), see :func:`select_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from jagg_autograd.checks import check_cond
from jagg_autograd.grpo import ode_step, sde_step_with_logprob
from jagg_autograd.window import jagg_trajectory

__all__ = [
    "STEP_SELECTIONS",
    "StepLogProbs",
    "Trajectories",
    "draw_random_steps",
    "policy_log_probs",
    "reference_means",
    "sample_trajectories",
    "select_steps",
]

STEP_SELECTIONS = ("prefix", "random")


@dataclass
class Trajectories:
    """B stored trajectories of T steps (see the module docstring for the shapes)."""

    latents: torch.Tensor
    sigmas: torch.Tensor
    log_probs: torch.Tensor
    velocities: torch.Tensor | None
    cond: dict[str, Any] = field(default_factory=dict)
    sde_type: str = "flow"
    # The cond keys that hold one row per sample (dim 0 = B), passed to the core as
    # ``batched_cond=``; None: the core infers them (and warns where a tensor is ambiguous).
    batched_cond: frozenset[str] | None = None

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[0]

    @property
    def batch_size(self) -> int:
        return self.log_probs.shape[1]


def _sigma_list_or_none(sigmas: torch.Tensor) -> list[float] | None:
    """Python floats of a shared (T + 1,) schedule (the rollout's exact arithmetic), else None."""
    return sigmas.tolist() if sigmas.dim() == 1 else None


def _check_sigmas(sigmas: object, batch: int) -> torch.Tensor:
    if not isinstance(sigmas, torch.Tensor) or not sigmas.is_floating_point():
        raise TypeError("sigmas must be a floating-point tensor of shape (T + 1,) or (T + 1, B)")
    if sigmas.dim() not in (1, 2) or sigmas.shape[0] < 2:
        raise ValueError(
            f"sigmas must have shape (T + 1,) or (T + 1, B) with T >= 1, got {tuple(sigmas.shape)}"
        )
    if sigmas.dim() == 2 and sigmas.shape[1] != batch:
        raise ValueError(
            f"sigmas of shape {tuple(sigmas.shape)} must be (T + 1, B) with B = {batch} "
            "(the noise's dim 0); a (B, T + 1) table must be transposed to (T + 1, B)"
        )
    if not bool(((sigmas[1:] - sigmas[:-1]) < 0).all()):
        raise ValueError("sigmas must be strictly decreasing along dim 0 (from noise to data)")
    if not bool(((sigmas >= 0) & (sigmas <= 1)).all()):
        raise ValueError(
            "sigmas must lie in [0, 1] (noise levels, not the scheduler's 1000 * sigma "
            "timesteps: divide those by 1000)"
        )
    return sigmas


@torch.no_grad()
def sample_trajectories(
    model: Callable[..., torch.Tensor],
    noise: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    cond: Mapping[str, Any] | None = None,
    noise_level: float = 0.7,
    generator: torch.Generator | None = None,
    sde_steps: Collection[int] | None = None,
    sde_type: str = "flow",
    store_velocities: bool = True,
    batched_cond: Collection[str] | None = None,
) -> Trajectories:
    """Sample B trajectories from ``noise`` along ``sigmas``, storing what training needs.

    Step k calls ``model(x_k, t_k, **cond)`` with ``t_k`` ``(B,)`` in ``noise``'s dtype
    filled with ``sigma_k`` (exactly how ``jagg_trajectory(..., batching="per_step")``
    calls it, which makes that recomputation bit-identical), then takes the SDE step
    (:func:`~jagg_autograd.grpo.sde_step_with_logprob`; ``sde_type="dance"``: DanceGRPO's)
    with noise from ``generator`` and ``sigma_max = sigmas[1]``, or the ODE step on steps
    not in ``sde_steps`` (None: all steps are SDE; ``[]``: the ODE sampler; a window:
    MixGRPO's mixed sampler), whose log-prob is NaN (they cannot be trained).

    Args:
        model: the velocity callable (CFG inside it, as the diffusers adapters do).
        noise: ``x_0`` ``(B, *S)``.
        sigmas: ``(T + 1,)`` decreasing noise levels in [0, 1] (e.g.
            :func:`~jagg_autograd.grpo.flow_match_sigmas`), or ``(T + 1, B)`` per sample.
        cond: keyword arguments of the model, unchanged at every step.
        store_velocities: keep ``velocities`` ``(T, B, *S)`` (for ``values=``).
        batched_cond: the keys of ``cond`` with one row per sample (dim 0 = B), kept for
            the training phase's core calls (:func:`policy_log_probs`); None: inferred there.

    Returns:
        :class:`Trajectories`.
    """
    if not isinstance(noise, torch.Tensor) or not noise.is_floating_point() or noise.dim() < 1:
        raise TypeError("noise must be a floating-point tensor of shape (B, *S)")
    n = noise.shape[0]
    sigmas = _check_sigmas(sigmas, n)
    if sde_type not in ("flow", "dance"):
        raise ValueError(f"sde_type must be 'flow' or 'dance', got {sde_type!r}")
    cond = dict(cond or {})
    if batched_cond is not None:
        batched_cond = check_cond(cond, n, noise.device, batched_cond)[1]
    T = sigmas.shape[0] - 1
    sde = set(range(T)) if sde_steps is None else {int(k) for k in sde_steps}
    s = _sigma_list_or_none(sigmas)
    sig_dev = sigmas.to(noise.device)
    # Flow-GRPO's sigma_max is the schedule's second entry (a float): per-sample schedules
    # use the step's own sigma_next there, which is sigmas[1] on the first step.
    sigma_max = s[1] if s is not None else None
    x = noise
    xs, lps, vs = [x], [], []
    for k in range(T):
        if s is not None:
            t = torch.full((n,), s[k], dtype=noise.dtype, device=noise.device)
            a, b = s[k], s[k + 1]
        else:
            t = sig_dev[k].to(noise.dtype)
            a, b = sig_dev[k], sig_dev[k + 1]
        v = model(x, t, **cond)
        if k in sde:
            x, lp, _, _ = sde_step_with_logprob(
                v,
                x,
                a,
                b,
                noise_level=noise_level,
                sigma_max=sigma_max if sde_type == "flow" else None,
                generator=generator,
                sde_type=sde_type,
            )
        else:
            x = ode_step(v, x, a, b)
            lp = torch.full((n,), math.nan, device=x.device)
        xs.append(x)
        lps.append(lp)
        if store_velocities:
            vs.append(v.detach())
    return Trajectories(
        torch.stack(xs),
        sigmas,
        torch.stack(lps),
        torch.stack(vs) if store_velocities else None,
        cond,
        sde_type,
        batched_cond,
    )


def select_steps(
    num_steps: int,
    batch: int,
    num_train: int,
    selection: str = "prefix",
    *,
    generator: torch.Generator | None = None,
) -> tuple[int, int] | torch.Tensor:
    """The trained steps of a minibatch: ``num_train`` of the ``num_steps`` per sample.

    ``"prefix"`` (Flow-GRPO's ``timestep_fraction``): steps ``0..num_train-1`` for every
    sample, returned as the range ``(0, num_train)``.  ``"random"`` (DanceGRPO): each
    sample draws its own ``num_train`` distinct steps (the first ``num_train`` of a random
    permutation, the draw of :func:`jagg_autograd.trainer.subsample_log_probs`), returned
    sorted as a ``(num_train, B)`` long tensor so the per-sample timesteps stay monotone.
    """
    if selection not in STEP_SELECTIONS:
        raise ValueError(f"selection must be one of {STEP_SELECTIONS}, got {selection!r}")
    if not 1 <= num_train <= num_steps:
        raise ValueError(f"num_train must be in [1, num_steps={num_steps}], got {num_train}")
    if selection == "prefix":
        return (0, num_train)
    return draw_random_steps(num_steps, batch, num_train, generator).sort(dim=0).values


def draw_random_steps(
    num_steps: int, batch: int, num_train: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``(num_train, B)`` distinct random steps per sample, in draw order (DanceGRPO's
    per-sample ``randperm``, truncated): one ``rand((B, T))`` from ``generator``."""
    from jagg_autograd.data_parallel import draw_rand  # a ShardedGenerator: this rank's rows

    ks = torch.argsort(draw_rand((batch, num_steps), generator), dim=1)
    return ks[:, :num_train].T.contiguous()


def _gather(
    traj: Trajectories, steps: tuple[int, int] | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, Any]:
    """``(z, z_next, sig, sig_next, values, timesteps)`` of the trained steps.

    A range keeps views of the stored tensors and the shared schedule as given (the
    arithmetic of today's recomputation); an index table gathers per sample.
    """
    vel = traj.velocities
    if isinstance(steps, tuple):
        lo, hi = steps
        if not 0 <= lo < hi <= traj.num_steps:
            raise ValueError(
                f"steps must be (lo, hi) with 0 <= lo < hi <= T={traj.num_steps}, got {steps}"
            )
        sig = traj.sigmas[lo : hi + 1]
        vals = None if vel is None else vel[lo:hi]
        return (
            traj.latents[lo:hi],
            traj.latents[lo + 1 : hi + 1],
            sig[:-1],
            sig[1:],
            vals,
            sig[:-1],
        )
    ks = steps.to(traj.latents.device)
    if ks.dim() != 2 or ks.shape[1] != traj.batch_size:
        raise ValueError(f"steps must be a (T', B={traj.batch_size}) index table, got {ks.shape}")
    bs = torch.arange(traj.batch_size, device=ks.device).expand_as(ks)
    sig = traj.sigmas if traj.sigmas.dim() == 2 else traj.sigmas[:, None].expand(-1, bs.shape[1])
    sig = sig.to(ks.device)
    t = sig[ks, bs]
    return (
        traj.latents[ks, bs],
        traj.latents[ks + 1, bs],
        t,
        sig[ks + 1, bs],
        None if vel is None else vel[ks, bs],
        t,
    )


@dataclass
class StepLogProbs:
    """One minibatch's recomputation: every field is ``(T', B, ...)`` over the trained steps."""

    log_probs: torch.Tensor
    old_log_probs: torch.Tensor
    means: torch.Tensor
    std_dev_t: torch.Tensor
    stats: Any


def _sde_slot(
    traj: Trajectories,
    v: torch.Tensor,
    z: torch.Tensor,
    z_next: torch.Tensor,
    a: Any,
    b: Any,
    noise_level: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_prob (B,), mean (B, *S), std_dev_t (B,))`` of one trained step's stored move."""
    s = _sigma_list_or_none(traj.sigmas)
    _, lp, mean, std = sde_step_with_logprob(
        v,
        z,
        a,
        b,
        noise_level=noise_level,
        sigma_max=(s[1] if s is not None else None) if traj.sde_type == "flow" else None,
        prev_sample=z_next,
        sde_type=traj.sde_type,
    )
    return lp, mean, std.reshape(-1)


def _slot_sigmas(sig: torch.Tensor, sig_next: torch.Tensor, j: int) -> tuple[Any, Any]:
    # A shared schedule passes Python floats, exactly as the rollout did.
    if sig.dim() == 1:
        return float(sig[j]), float(sig_next[j])
    return sig[j], sig_next[j]


def policy_log_probs(
    model: Callable[..., torch.Tensor],
    traj: Trajectories,
    *,
    steps: tuple[int, int] | torch.Tensor | None = None,
    noise_level: float = 0.7,
    mode: str = "jagg",
    window: int = 4,
    shared_anchors: bool = True,
    router: Any = None,
    batching: str = "stacked",
    chunk_size: int | None = None,
    reuse_values: bool = False,
    core_kwargs: Mapping[str, Any] | None = None,
) -> StepLogProbs:
    """Log-probs of the stored moves of the trained steps under the current policy, with grad.

    The velocities of all trained (step, sample) pairs come from ONE
    :func:`~jagg_autograd.jagg_trajectory` call over the ``(T', B, *S)`` latents of the
    trained steps (``mode="exact"``: every step with grad, the oracle; ``"jagg"``: JAGG
    windows of ``window`` steps along each sample's trained steps); then step j's
    log-prob ``log p(x_{k_j+1} | x_{k_j})`` is the SDE step's density of the stored move.

    ``reuse_values=True`` passes the rollout's velocities of those pairs as
    ``values=`` (valid only while no optimizer step happened since the rollout);
    ``core_kwargs`` go to ``jagg_trajectory`` as they are (``deferred``, ``placement``,
    ``budget``, ``params``): only what is given is passed, so the call stays today's
    when nothing is asked.
    """
    T = traj.num_steps
    steps = (0, T) if steps is None else steps
    z, z_next, sig, sig_next, vals, t = _gather(traj, steps)
    n = z.shape[0]
    kw = dict(core_kwargs or {})
    if reuse_values:
        if vals is None:
            raise ValueError("reuse_values=True needs trajectories sampled with velocities")
        kw["values"] = vals
    if n >= 2:
        v, stats = jagg_trajectory(
            model,
            z,
            t,
            window=min(window, n),
            shared_anchors=shared_anchors,
            cond=traj.cond,
            batched_cond=traj.batched_cond,
            mode="exact" if mode == "exact" else "jagg",
            router=router,
            batching=batching,
            chunk_size=chunk_size,
            return_stats=True,
            **kw,
        )
    else:
        v, stats = _single_step(model, z, t, traj.cond)
    lps, means, stds = [], [], []
    for j in range(n):
        a, b = _slot_sigmas(sig, sig_next, j)
        lp, mean, std = _sde_slot(traj, v[j], z[j], z_next[j], a, b, noise_level)
        lps.append(lp)
        means.append(mean)
        stds.append(std)
    if isinstance(steps, tuple):
        old = traj.log_probs[steps[0] : steps[1]]
    else:
        ks = steps.to(traj.log_probs.device)
        old = traj.log_probs[ks, torch.arange(traj.batch_size, device=ks.device).expand_as(ks)]
    return StepLogProbs(torch.stack(lps), old, torch.stack(means), torch.stack(stds), stats)


def _single_step(
    model: Callable[..., torch.Tensor], z: torch.Tensor, t: torch.Tensor, cond: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    """One trained step (T' = 1): a plain exact model call (a window needs 2 steps)."""
    from jagg_autograd.window import JaggStats

    B = z.shape[1]
    tt = t[0].to(z.dtype)
    tt = tt.expand(B) if tt.dim() == 0 else tt
    v = model(z[0], tt, **cond).unsqueeze(0)
    ones = torch.ones((1, B), dtype=torch.bool, device=z.device)
    grad = int(torch.is_grad_enabled())
    stats = JaggStats(torch.ones((1, B), device=z.device), ones, grad * B, grad, [(0, 0)], [0])
    return v, stats


@torch.no_grad()
def reference_means(
    ref_model: Callable[..., torch.Tensor],
    traj: Trajectories,
    *,
    steps: tuple[int, int] | torch.Tensor | None = None,
    noise_level: float = 0.7,
) -> torch.Tensor:
    """``(T', B, *S)`` SDE means of the reference policy at the trained steps, for the KL.

    One no-grad call per trained step (batch B); computed once per rollout and reused
    across inner epochs (the reference does not change).  ``ref_model`` is the policy with
    its LoRA adapters disabled, or a frozen copy of the initial weights.
    """
    steps = (0, traj.num_steps) if steps is None else steps
    z, z_next, sig, sig_next, _, t = _gather(traj, steps)
    out = []
    for j in range(z.shape[0]):
        tj = t[j].to(z.dtype)
        tj = tj.expand(z.shape[1]) if tj.dim() == 0 else tj
        v = ref_model(z[j], tj, **traj.cond)
        a, b = _slot_sigmas(sig, sig_next, j)
        out.append(_sde_slot(traj, v, z[j], z_next[j], a, b, noise_level)[1])
    return torch.stack(out)
