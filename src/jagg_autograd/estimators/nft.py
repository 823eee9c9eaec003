"""DiffusionNFT's forward-process loss (:mod:`jagg_autograd.nft`): the rollout's clean
samples re-noised at ``nft_timesteps`` random timesteps per sample, no log-probs; one
forward + backward per training timestep, as their train_nft_sd3.py does."""

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
from jagg_autograd.nft import ParamSnapshot, draw_timesteps, nft_loss

__all__ = ["NFTEstimator"]


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

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.snapshot: tuple[int, ParamSnapshot] | None = None

    def check(self) -> None:
        super().check()
        c = self.config
        if c.nft_timesteps > c.num_steps:
            raise ValueError(
                f"nft_timesteps must be an int in [1, num_steps={c.num_steps}], "
                f"got {c.nft_timesteps!r}"
            )

    def num_train_steps(self) -> int:
        return self.config.nft_timesteps

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        return (
            f"nft (DiffusionNFT forward-process loss, beta {cfg.get('nft_beta', 1.0):g}, "
            f"{cfg.get('nft_timesteps', 4)} timesteps per sample)"
        )

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
        traj, B, n = mb.traj, mb.traj.batch_size, c.nft_timesteps
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
        losses, infos, bw = [], [], 0.0
        for j in range(n):
            t = ts[j].to(device=x0.device, dtype=x0.dtype)
            eps = draw_randn(x0.shape, generator, dtype=torch.float32).to(x0)
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
