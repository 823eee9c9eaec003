"""DiffusionNFT's forward-process loss (:mod:`jagg_autograd.nft`): the rollout's clean
samples re-noised at ``nft_timesteps`` random timesteps per sample, no log-probs.

Two noises and two gradients (``nft_noise`` x ``nft_gradient``):

* ``nft_noise="fresh"`` (DiffusionNFT's): a new ``eps`` per timestep; ``"shared"``: one
  ``eps`` per sample for all its timesteps, so its inputs ``x_t`` lie on one segment;
* ``nft_gradient="exact"`` (their loop, path ``"nft"``): per timestep a no-grad forward of
  the old policy, a forward + backward of the trained one (and a no-grad reference
  forward when ``beta > 0``); ``"jagg"`` (needs shared noise; path ``"nft+values+deferred"``
  on-policy, ``"nft+deferred"`` after an optimizer step): the old policy's velocities at
  the K timesteps without grad, then ONE ``jagg_trajectory`` call over the sample's sorted
  timesteps ``(K, B)`` with ``window`` / ``shared_anchors`` or ``placement="adaptive"`` /
  ``budget``; on-policy the old velocities are the trained model's and are passed as
  ``values=`` (deferred backward: only the anchors are forwarded with grad, one chunk
  alive).  The reference's velocities (``beta > 0``) are computed without grad once per
  minibatch, before the backward.  Exact for a model affine in ``(z, t)``
  (``tests/test_nft_jagg.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from jagg_autograd.data_parallel import draw_randn
from jagg_autograd.estimators.base import (
    Estimator,
    LossContext,
    Minibatch,
    MinibatchResult,
    timed_backward,
)
from jagg_autograd.nft import (
    ParamSnapshot,
    draw_timesteps,
    nft_loss,
    nft_noised,
    nft_timesteps_loss,
)
from jagg_autograd.rollout import Trajectories
from jagg_autograd.window import jagg_trajectory

__all__ = ["NFTEstimator", "nft_num_timesteps"]

#: DiffusionNFT's ``train.timestep_fraction`` (``config/base.py``): with T = 10 sampler
#: steps ``int(10 * 0.99)`` = 9 training timesteps per sample.
NFT_TIMESTEP_FRACTION = 0.99


def nft_num_timesteps(config: Any) -> int:
    """``nft_timesteps``, or DiffusionNFT's ``int(num_steps * 0.99)`` where it is None."""
    if config.nft_timesteps is not None:
        return int(config.nft_timesteps)
    return max(1, int(config.num_steps * NFT_TIMESTEP_FRACTION))


class NFTEstimator(Estimator):
    """``v_old`` is the sampling policy, i.e. the parameters at the rollout: on-policy
    minibatches (no optimizer step since the rollout) call the current policy without
    grad; later ones call it at a snapshot of the trainable parameters taken before the
    rollout's first optimizer step (``self.snapshot``: ``(step_index, ParamSnapshot)``;
    fresh noise and timesteps are drawn per minibatch and inner epoch, as theirs, so
    ``v_old`` cannot be precomputed at the rollout)."""

    name = "nft"
    needs_logprob_reference = False  # its KL reference runs at x_t, inside the loss
    supports_probe = False  # DiffusionNFT's loss does not estimate the GRPO gradient
    uses_timestep_fraction = False

    #: ``nft_gradient="jagg"``: how each timestep's g folds onto its anchors (``fold=`` of
    #: ``jagg_trajectory``; not a config field: ``benchmarks/nft_jagg.py`` sets "causal").
    fold: str = "linear"

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.snapshot: tuple[int, ParamSnapshot] | None = None

    def check(self) -> None:
        super().check()
        c = self.config
        if c.nft_timesteps is not None and c.nft_timesteps > c.num_steps:
            raise ValueError(
                f"nft_timesteps must be an int in [1, num_steps={c.num_steps}], "
                f"got {c.nft_timesteps!r}"
            )
        if c.nft_gradient == "jagg" and self.num_train_steps() < 2:
            raise ValueError(
                "nft_gradient='jagg' needs nft_timesteps >= 2 (one timestep is its own "
                f"anchor: use nft_gradient='exact'), got {self.num_train_steps()}"
            )
        if c.nft_gradient == "jagg" and c.nft_noise != "shared":
            raise ValueError(
                "nft_gradient='jagg' needs nft_noise='shared' (got nft_noise="
                f"{c.nft_noise!r}): with one noise per sample its inputs x_t lie on one "
                "segment and JAGG is exact for a model affine in (z, t); with fresh noise "
                "per timestep the inputs jump and the gradient would be a silent approximation"
            )

    def num_train_steps(self) -> int:
        return nft_num_timesteps(self.config)

    def resolve(self, d: dict[str, Any]) -> None:
        d["nft_timesteps"] = self.num_train_steps()

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        k = cfg.get("nft_timesteps")
        k = 4 if k is None and "nft_noise" not in cfg else k  # logs before issue 20: 4
        txt = (
            f"nft (DiffusionNFT forward-process loss, beta {cfg.get('nft_beta', 1.0):g}, "
            f"{k} timesteps per sample"
        )
        noise, grad = cfg.get("nft_noise", "fresh"), cfg.get("nft_gradient", "exact")
        if noise != "fresh" or grad != "exact":
            txt += f", {noise} noise, {grad} gradient"
            if grad == "jagg":
                if cfg.get("placement", "uniform") == "adaptive":
                    b = cfg.get("budget")
                    txt += " (adaptive placement" + (f" budget {b:g})" if b else ")")
                else:
                    txt += f" (window {cfg['window']})"
        return txt + ")"

    def loss(
        self,
        ctx: LossContext,
        mb: Minibatch,
        *,
        generator: torch.Generator,
        on_policy: bool,
        scale: float = 1.0,
        inline_backward: bool = False,
    ) -> MinibatchResult:
        c = self.config
        traj, B, n = mb.traj, mb.traj.batch_size, self.num_train_steps()
        if float(traj.sigmas[-1].max()) != 0.0:
            raise ValueError(
                "mode='nft' needs a schedule ending at sigma = 0 (clean final latents)"
            )
        snap = self.snapshot
        if on_policy and (snap is None or snap[0] != ctx.step_index):
            snap = self.snapshot = (ctx.step_index, ParamSnapshot(ctx.params))

        def v_old_of(xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            if on_policy or snap is None:
                with torch.no_grad():
                    return ctx.policy(xt, t, **traj.cond)
            return snap[1].call(ctx.policy, xt, t, **traj.cond)

        x0 = traj.latents[-1]  # sigma = 0: the clean samples
        ts = draw_timesteps(traj.sigmas, B, n, generator)
        shared = None
        if c.nft_noise == "shared":  # one eps per sample, drawn after the timesteps
            shared = draw_randn(x0.shape, generator, dtype=torch.float32).to(x0)
        if c.nft_gradient == "jagg":
            return self.jagg_loss(ctx, mb, ts, shared, None if snap is None else snap[1],
                                  on_policy=on_policy, scale=scale,
                                  inline_backward=inline_backward)  # fmt: skip
        losses, infos, bw = [], [], 0.0
        for j in range(n):
            t = ts[j].to(device=x0.device, dtype=x0.dtype)
            if shared is None:  # DiffusionNFT's randn_like(x0) inside the timestep loop
                eps = draw_randn(x0.shape, generator, dtype=torch.float32).to(x0)
            else:
                eps = shared
            te = t.view(-1, *([1] * (x0.dim() - 1)))
            xt = (1 - te) * x0 + te * eps
            v_old = v_old_of(xt, t)
            v = ctx.policy(xt, t, **traj.cond)
            loss_j, info = self.timestep_loss(ctx, v, v_old, xt, x0, t, mb.adv, traj.cond)
            bw += timed_backward(loss_j * (scale / n))
            losses.append(loss_j.detach().float())
            infos.append(info)
        return MinibatchResult(
            torch.stack(losses).mean(), infos, "nft", traj.num_steps * B, routed_frac=0.0,
            grad_samples=n * B, grad_forward_calls=n, backward_done=True, backward_seconds=bw,
        )  # fmt: skip

    def jagg_loss(
        self,
        ctx: LossContext,
        mb: Minibatch,
        ts: torch.Tensor,
        eps: torch.Tensor,
        snap: ParamSnapshot | None,
        *,
        on_policy: bool,
        scale: float,
        inline_backward: bool,
    ) -> MinibatchResult:
        """The K timesteps of every sample in one ``jagg_trajectory`` call (shared noise)."""
        c, traj = self.config, mb.traj
        x0, B = traj.latents[-1], traj.batch_size
        # Sorted per sample (sigma descending, as the sampler runs): strictly monotone,
        # the draw being K distinct steps.
        ts = ts.sort(dim=0, descending=True).values.to(x0.device)
        xt = nft_noised(x0, ts, eps)
        # The old policy's velocities without grad, batched as ``batching`` / ``chunk_size``
        # say: on-policy they are the trained model's values.
        if on_policy or snap is None:
            v_old = self.velocities(ctx.policy, xt, ts, traj)
        else:
            v_old = snap.call(self.velocities, ctx.policy, xt, ts, traj)
        v_ref = None
        if ctx.reference is not None:  # without grad, once per minibatch
            v_ref = self.velocities(ctx.reference, xt, ts, traj)
        kw: dict[str, Any] = {
            "window": min(c.window, xt.shape[0]), "shared_anchors": c.shared_anchors,
            "cond": traj.cond, "batched_cond": traj.batched_cond, "batching": c.batching,
            "chunk_size": c.chunk_size, "deferred": True,
            "params": ctx.params, "return_stats": True,
        }  # fmt: skip
        if c.placement == "adaptive":
            kw["placement"] = "adaptive"
            if c.budget is not None:
                kw["budget"] = c.budget
        if self.fold != "linear":
            kw["fold"] = self.fold
        if on_policy:
            kw["values"] = v_old
        v, stats = jagg_trajectory(ctx.policy, xt, ts, **kw)
        loss, kl = nft_timesteps_loss(
            v, v_old, xt, x0, ts, mb.adv, beta=c.nft_beta, adv_clip_max=c.adv_clip_max,
            v_ref=v_ref, kl_beta=c.beta,
        )  # fmt: skip
        info = {"clipfrac": torch.zeros(()), "approx_kl": torch.zeros(()),
                "ratio_min": torch.ones(()), "ratio_max": torch.ones(())}  # fmt: skip
        if kl is not None:
            info["kl"] = kl.cpu()
        bw, done = 0.0, False
        if inline_backward:
            bw, done = timed_backward(loss * scale), True
            loss = loss.detach()
        path = "nft+values+deferred" if on_policy else "nft+deferred"
        return MinibatchResult(
            loss.float() if done else loss, [info] * xt.shape[0], path, traj.num_steps * B,
            stats=stats, backward_done=done, backward_seconds=bw,
        )  # fmt: skip

    def velocities(
        self, model: Any, xt: torch.Tensor, ts: torch.Tensor, traj: Trajectories
    ) -> torch.Tensor:
        """``model`` at every ``(K, B)`` input without grad, ``(K, B, *S)``, conditioned as
        ``traj``: the library's value path (stacked: ``chunk_size`` samples per call, one
        call by default)."""
        with torch.no_grad():
            return jagg_trajectory(
                model, xt, ts, window=2, cond=traj.cond, batched_cond=traj.batched_cond,
                batching=self.config.batching, chunk_size=self.config.chunk_size,
            )  # fmt: skip

    def timestep_loss(
        self,
        ctx: LossContext,
        v: torch.Tensor,
        v_old: torch.Tensor,
        xt: torch.Tensor,
        x0: torch.Tensor,
        t: torch.Tensor,
        adv: torch.Tensor,
        cond: dict[str, Any],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One timestep's loss (plus ``beta`` times their KL to the reference at ``x_t``)."""
        c = self.config
        loss_j = nft_loss(v, v_old, xt, x0, t, adv, beta=c.nft_beta, adv_clip_max=c.adv_clip_max)
        info = {"clipfrac": torch.zeros(()), "approx_kl": torch.zeros(()),
                "ratio_min": torch.ones(()), "ratio_max": torch.ones(())}  # fmt: skip
        if ctx.reference is not None:
            # Their KL: train.beta * mean_b mean((v_theta - v_ref)^2) at the same x_t.
            with torch.no_grad():
                v_ref = ctx.reference(xt, t, **cond)
            kl = ((v - v_ref) ** 2).flatten(1).mean(1)
            loss_j = loss_j + c.beta * kl.mean()
            info["kl"] = kl.detach().mean().cpu()
        return loss_j, info
