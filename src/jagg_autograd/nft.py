"""DiffusionNFT's forward-process policy loss (Zheng et al. 2025, NVlabs/DiffusionNFT).

DiffusionNFT trains on the *forward* (noising) process: no SDE log-probs and no backward
through the sampler.  The clean samples ``x_0`` of a rollout are re-noised at a few of
the sampler's timesteps, ``x_t = (1 - t) x_0 + t eps`` (the library's convention: ``t`` is
sigma, ``z_sigma = (1 - sigma) x_clean + sigma noise``, velocity ``v = dz/dsigma = eps -
x_0``, so ``x_0 = x_t - t v``), and two implicit policies built from the trained
velocity ``v_theta`` and the sampling policy's ``v_old``::

    v_plus  = beta v_theta + (1 - beta) v_old          (positive policy)
    v_minus = (1 + beta) v_old - beta v_theta           (implicit negative policy)

are fitted to the clean sample, the positive one weighted by the optimality probability
``r`` of the sample and the negative one by ``1 - r``.

Taken from ``scripts/train_nft_sd3.py`` of github.com/NVlabs/DiffusionNFT (HEAD of the
stored snapshot), the training loop ("Loop over timesteps for this micro-batch"):

* ``r = clamp((clamp(A, -M, M) / M) / 2 + 0.5, 0, 1)``, ``M = adv_clip_max`` (5 in
  ``config/base.py``), ``A`` the per-prompt normalised advantage (``adv_mode="all"``);
* ``x0_pred = x_t - t v`` for ``v_plus`` and ``v_minus``; each squared error is divided by
  the detached per-sample mean absolute error (computed in float64, clipped at 1e-5) and
  averaged over the sample's elements ("adaptive weighting");
* ``loss = mean_b(M (r L_plus + (1 - r) L_minus) / beta)`` plus ``train.beta`` times the
  per-sample mean squared velocity difference to the reference model (here the trainer's
  ``beta`` / reference);
* each training timestep is its own forward + backward with the loss divided by
  ``gradient_accumulation_steps * num_train_timesteps`` (a mean over timesteps);
* timesteps: per sample a random permutation of the sampler's timesteps, the first
  ``num_train_timesteps`` of it, fresh noise ``randn_like(x0)`` per timestep;
* ``v_old`` is the "old" adapter, the one that samples the rollouts (updated after each
  epoch as ``old <- decay old + (1 - decay) new``); here ``decay = 0`` (their
  ``decay_type=0``): ``v_old`` is the policy at the rollout's parameters.

**JAGG over a sample's timesteps** (:func:`nft_noised`, :func:`nft_timesteps_loss`): with
one noise ``eps`` per sample for all its K timesteps ("shared" noise) the inputs
``x_t = (1 - t) x_0 + t eps`` lie on one straight segment in ``t``, JAGG's exactness family
(a): for a model affine in ``(z, t)`` the JAGG gradient of the K-timestep loss through one
``jagg_trajectory`` call over the sorted timesteps equals the per-timestep loop's.  With
fresh noise per timestep (theirs) the inputs jump between timesteps and JAGG is only an
approximation.

Their sampler is a deterministic DPM2 solver without CFG (``config/nft.py``:
``sample.solver="dpm2"``, ``deterministic=True``, ``guidance_scale=1.0``); the trainer
keeps its own rollout (the task's sampler and model, CFG included if the task has it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "NFT_GRADIENTS",
    "NFT_NOISES",
    "ParamSnapshot",
    "draw_timesteps",
    "nft_loss",
    "nft_noised",
    "nft_timesteps_loss",
    "optimality_probability",
]

#: ``nft_noise``: DiffusionNFT's fresh noise per timestep, or one noise per sample.
NFT_NOISES = ("fresh", "shared")
#: ``nft_gradient``: one forward + backward per timestep (their loop), or one JAGG call.
NFT_GRADIENTS = ("exact", "jagg")


def optimality_probability(adv: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """``r = clamp((clamp(adv, -M, M) / M) / 2 + 0.5, 0, 1)`` (train_nft_sd3.py)."""
    a = adv.clamp(-adv_clip_max, adv_clip_max)
    return ((a / adv_clip_max) / 2.0 + 0.5).clamp(0.0, 1.0)


def _adaptive_x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per-sample ``mean((x0_pred - x0)^2) / mean|x0_pred - x0|`` (the weight detached)."""
    dims = tuple(range(1, x0.dim()))
    with torch.no_grad():
        w = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=1e-5)
    return ((x0_pred - x0) ** 2 / w).mean(dim=dims)  # float64, as theirs


def nft_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    xt: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    adv: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
) -> torch.Tensor:
    """DiffusionNFT's policy loss of one timestep (0-d, differentiable in ``v`` only).

    ``v``, ``v_old``, ``xt``, ``x0``: ``(B, *S)``; ``t`` (sigma), ``adv``: ``(B,)``.
    """
    v_old = v_old.detach()
    te = t.to(xt.dtype).view(-1, *([1] * (xt.dim() - 1)))
    v_plus = beta * v + (1.0 - beta) * v_old
    v_minus = (1.0 + beta) * v_old - beta * v
    pos = _adaptive_x0_loss(xt - te * v_plus, x0)
    neg = _adaptive_x0_loss(xt - te * v_minus, x0)
    r = optimality_probability(adv.to(pos.dtype), adv_clip_max)
    return (adv_clip_max * (r * pos + (1.0 - r) * neg) / beta).mean()


def nft_noised(x0: torch.Tensor, ts: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x_0 + t eps`` at K timesteps per sample: ``(K, B, *S)``.

    ``x0``: ``(B, *S)``; ``ts``: ``(K, B)`` sigmas; ``eps``: ``(B, *S)`` (shared noise: one
    segment per sample) or ``(K, B, *S)`` (fresh noise per timestep).  In ``x0``'s dtype.
    """
    te = ts.to(x0.dtype).view(*ts.shape, *([1] * (x0.dim() - 1)))
    return (1 - te) * x0 + te * eps.to(x0.dtype)


def nft_timesteps_loss(
    v: torch.Tensor,
    v_old: torch.Tensor,
    xt: torch.Tensor,
    x0: torch.Tensor,
    ts: torch.Tensor,
    adv: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    v_ref: torch.Tensor | None = None,
    kl_beta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The mean over K timesteps of :func:`nft_loss` (plus ``kl_beta`` times their KL to
    the reference, ``mean_b mean((v - v_ref)^2)``), as their loop accumulates it.

    ``v``, ``v_old``, ``xt``, ``v_ref``: ``(K, B, *S)``; ``x0``: ``(B, *S)``; ``ts``:
    ``(K, B)``; ``adv``: ``(B,)``.  Returns the loss and the mean KL (None without
    ``v_ref``).
    """
    K = v.shape[0]
    losses, kls = [], []
    for j in range(K):
        t = ts[j].to(device=x0.device, dtype=x0.dtype)
        loss_j = nft_loss(v[j], v_old[j], xt[j], x0, t, adv, beta=beta, adv_clip_max=adv_clip_max)
        if v_ref is not None:
            kl = ((v[j] - v_ref[j].detach()) ** 2).flatten(1).mean(1).mean()
            loss_j = loss_j + kl_beta * kl
            kls.append(kl.detach())
        losses.append(loss_j)
    kl_mean = torch.stack(kls).mean() if kls else None
    return torch.stack(losses).mean(), kl_mean


def draw_timesteps(
    sigmas: torch.Tensor, batch: int, num: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``(num, B)`` sigmas: per sample ``num`` distinct steps of the sampler's ``T`` (a random
    permutation, truncated, as DanceGRPO / DiffusionNFT draw them), ``sigmas[k]`` of each.

    ``sigmas``: ``(T + 1,)`` or ``(T + 1, B)``; the final ``sigma = 0`` is never drawn.
    """
    from jagg_autograd.rollout import draw_random_steps

    T = sigmas.shape[0] - 1
    ks = draw_random_steps(T, batch, num, generator).to(sigmas.device)
    sig = sigmas if sigmas.dim() == 2 else sigmas[:, None].expand(-1, batch)
    return sig[ks, torch.arange(batch, device=ks.device).expand_as(ks)]


class ParamSnapshot:
    """The values of ``params`` now, to evaluate a model at them later (:meth:`call`)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.values = [p.detach().clone() for p in self.params]

    def call(self, fn: Callable[..., torch.Tensor], *args: Any, **kw: Any) -> torch.Tensor:
        """``fn(*args, **kw)`` without grad at the snapshot's values; the current values
        are restored afterwards (also on error)."""
        with torch.no_grad():
            now = [p.detach().clone() for p in self.params]
            try:
                for p, s in zip(self.params, self.values):
                    p.copy_(s)
                return fn(*args, **kw)
            finally:
                for p, s in zip(self.params, now):
                    p.copy_(s)
