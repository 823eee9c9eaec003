"""The exact GRPO gradient: Flow-GRPO's per-step loop, the batched oracle, and DanceGRPO's
subsampling (the exact gradient on a random subset of steps per sample).

``mode="exact"`` runs Flow-GRPO's training loop by default (``exact_loop``): forward and
backward one trained step at a time (one step's activations; the same gradient as the
batched call, kept with ``exact_loop=False`` as the oracle, and used by the probe).
``mode="subsample"`` trains ``subsample_steps`` random steps per sample, drawn per
minibatch and inner epoch from the run's generator like DanceGRPO's ``timestep_fraction``
(the same as ``mode="exact"`` with ``timestep_selection="random"`` at that fraction).
"""

from __future__ import annotations

from typing import Any

import torch

from jagg_autograd.estimators.base import (
    Estimator,
    LossContext,
    Minibatch,
    MinibatchResult,
    timed_backward,
)
from jagg_autograd.grpo import kl_to_reference, sde_step_with_logprob
from jagg_autograd.rollout import Trajectories, draw_random_steps, policy_log_probs
from jagg_autograd.window import expected_anchor_count

__all__ = ["ExactEstimator", "SubsampleEstimator", "gathered_log_probs"]


def fraction_note(cfg: dict[str, Any]) -> str:
    """", k prefix/random steps trained" when ``timestep_fraction < 1`` (else "")."""
    if cfg.get("timestep_fraction", 1.0) < 1.0:
        return f", {cfg.get('num_train_steps')} {cfg['timestep_selection']} steps trained"
    return ""


class ExactEstimator(Estimator):
    """Every trained step with grad: Flow-GRPO's per-step loop, or one batched call."""

    name = "exact"

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        txt = "exact"
        if not cfg.get("exact_loop", True):
            txt += " (batched: one backward over all trained steps)"
        return txt + fraction_note(cfg)

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
        if inline_backward and self.config.exact_loop:
            return self.step_loop(ctx, mb, scale=scale)
        return self.batched(ctx, mb, mb.steps)

    def batched(
        self, ctx: LossContext, mb: Minibatch, steps: tuple[int, int] | torch.Tensor | None
    ) -> MinibatchResult:
        """All trained steps in one :func:`~jagg_autograd.jagg_trajectory` call (mode
        "exact") and one backward: the oracle (T' steps of activations)."""
        c = self.config
        res = policy_log_probs(
            ctx.policy, mb.traj, steps=steps, noise_level=c.noise_level, mode="exact",
            window=c.window, shared_anchors=c.shared_anchors, batching=c.batching,
            chunk_size=c.chunk_size,
        )  # fmt: skip
        loss, infos = self.policy_loss(res.log_probs, res.old_log_probs, mb.adv,
                                       self.kl_terms(res, mb))  # fmt: skip
        return MinibatchResult(loss, infos, "exact", res.log_probs.numel(),
                               routed_frac=self.routed_frac(res), stats=res.stats)  # fmt: skip

    def routed_frac(self, res: Any) -> float:
        """As the demo always logged it: exact mode counts every window as exact-routed."""
        return float(res.stats.exact.float().mean())

    def step_loop(self, ctx: LossContext, mb: Minibatch, *, scale: float) -> MinibatchResult:
        """Flow-GRPO's training loop: per trained step j, its velocities with grad, its loss
        term ``loss_j / T'`` (KL included) and at once ``(scale * loss_j / T').backward()``;
        one step's activations at a time."""
        c = self.config
        B = mb.traj.batch_size
        steps = (0, mb.traj.num_steps) if mb.steps is None else mb.steps
        n = steps[1] - steps[0] if isinstance(steps, tuple) else steps.shape[0]
        losses, infos, bw = [], [], 0.0
        for j in range(n):
            sj = (steps[0] + j, steps[0] + j + 1) if isinstance(steps, tuple) else steps[j : j + 1]
            res = policy_log_probs(
                ctx.policy, mb.traj, steps=sj, noise_level=c.noise_level, mode="exact",
                batching=c.batching, chunk_size=c.chunk_size,
            )  # fmt: skip
            kl = None
            if mb.ref_means is not None:
                kl = kl_to_reference(res.means[0], mb.ref_means[j], res.std_dev_t[0])[None]
            loss_j, info_j = self.policy_loss(res.log_probs, res.old_log_probs, mb.adv, kl)
            bw += timed_backward(loss_j * (scale / n))
            losses.append(loss_j.detach())
            infos += info_j
        return MinibatchResult(
            torch.stack(losses).mean(),  # the batched path's arithmetic
            infos, "exact", n * B, routed_frac=1.0, grad_samples=n * B, grad_forward_calls=n,
            backward_done=True, backward_seconds=bw,
        )  # fmt: skip


class SubsampleEstimator(ExactEstimator):
    """DanceGRPO: the exact gradient on ``subsample_steps`` random steps per sample.

    The steps are drawn per loss call (every minibatch and inner epoch) from the run's
    generator, in draw order (one ``rand((B, T))``, :func:`draw_random_steps`); their
    log-probs are one stacked model call (``batching="per_step"``: one per slot)."""

    name = "subsample"
    uses_timestep_fraction = False

    def num_train_steps(self) -> int:
        c = self.config
        return c.subsample_steps or expected_anchor_count(c.num_steps, c.window, c.shared_anchors)

    def resolve(self, d: dict[str, Any]) -> None:
        d["timestep_fraction"] = self.num_train_steps() / self.config.num_steps
        d["timestep_selection"] = "random"

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        return f"subsample ({cfg.get('num_train_steps')} random steps per sample)"

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
        num = self.num_train_steps()
        lp, old, _ = gathered_log_probs(
            ctx.policy, mb.traj, noise_level=c.noise_level, num=num, generator=generator,
            batching=c.batching,
        )  # fmt: skip
        loss, infos = self.policy_loss(lp, old, mb.adv, None)
        grad = num * mb.traj.batch_size
        calls = 1 if c.batching == "stacked" else num
        return MinibatchResult(loss, infos, "exact", grad, routed_frac=0.0,
                               grad_samples=grad, grad_forward_calls=calls)  # fmt: skip


def gathered_log_probs(
    model: Any,
    traj: Trajectories,
    *,
    noise_level: float,
    num: int,
    generator: torch.Generator | None,
    batching: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exact log-probs of ``num`` random steps per sample, with grad.

    Returns ``(log_probs (num, B), old_log_probs (num, B), steps (num, B))``: slot j of
    sample b is step ``steps[j, b]`` (draw order, not sorted: the slots of a sample need
    not be monotone, so this is not a :func:`~jagg_autograd.jagg_trajectory` call).
    """
    T, B = traj.log_probs.shape
    if not 1 <= num <= T:
        raise ValueError(f"num must be in [1, T={T}], got {num}")
    ks = draw_random_steps(T, B, num, generator).to(traj.latents.device)
    bs = torch.arange(B, device=ks.device).expand(num, B)
    z, nxt = traj.latents[ks, bs], traj.latents[ks + 1, bs]
    sig = traj.sigmas if traj.sigmas.dim() == 2 else traj.sigmas[:, None].expand(-1, B)
    sig, sig_next = sig[ks, bs], sig[ks + 1, bs]
    sigma_max = float(traj.sigmas[1].max())
    slots = [slice(None)] if batching == "stacked" else [slice(j, j + 1) for j in range(num)]
    per_sample = traj.batched_cond
    if per_sample is None:  # unsaid: every tensor with one row per sample
        per_sample = {
            k for k, v in traj.cond.items()
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B
        }  # fmt: skip
    lps = []
    for sl in slots:
        zs = z[sl].flatten(0, 1)
        n = zs.shape[0] // B
        cond = {
            k: v.repeat(n, *([1] * (v.dim() - 1))) if k in per_sample else v
            for k, v in traj.cond.items()
        }
        v = model(zs, sig[sl].flatten().to(zs.dtype), **cond)
        _, lp, _, _ = sde_step_with_logprob(
            v,
            zs,
            sig[sl].flatten(),
            sig_next[sl].flatten(),
            noise_level=noise_level,
            sigma_max=sigma_max if traj.sde_type == "flow" else None,
            prev_sample=nxt[sl].flatten(0, 1),
            sde_type=traj.sde_type,
        )
        lps.append(lp.view(n, B))
    return torch.cat(lps), traj.log_probs[ks, bs], ks
