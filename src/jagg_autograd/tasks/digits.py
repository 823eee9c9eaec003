"""The digits demo as a GRPO task: class-conditional 8x8 digits, reward = classifier probability.

Prompts are digit labels 0..9 (a rollout draws ``prompts_per_step`` distinct ones); the
velocity model is the shipped :class:`~jagg_autograd.models.digits.DigitsDiT`
(``model(z (n, 1, 8, 8), t (n,), labels=(n,))``); the reward is the shipped classifier's
probability of the prompted digit (:func:`~jagg_autograd.models.digits.digit_reward`);
the held-out evaluation is ``eval_per_digit`` samples of every digit.

Below the task: the digits-shaped wrappers kept from the first demo (a :class:`Rollout`
of label-conditioned trajectories, :func:`rollout`, :func:`trajectory_log_probs`,
:func:`subsample_log_probs`, :func:`evaluate`, :func:`estimator_loss`); the trainer itself
works on :class:`~jagg_autograd.rollout.Trajectories` of any task.  With
``batching="per_step"`` the first log-prob recomputation after a :func:`rollout`
reproduces the rollout's bit for bit (ratio 1): these are public so that this is tested.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from jagg_autograd.estimators import EstimatorShim, Minibatch, RouterEstimator, get_estimator
from jagg_autograd.estimators.exact import gathered_log_probs
from jagg_autograd.models.digits import (
    IMAGE_SIZE,
    NUM_CLASSES,
    digit_reward,
    load_digits_classifier,
    load_digits_dit,
)
from jagg_autograd.rollout import Trajectories, policy_log_probs, sample_trajectories
from jagg_autograd.router import CosineRouter
from jagg_autograd.tasks.base import GRPOTask

__all__ = [
    "DigitsTask",
    "Rollout",
    "estimator_loss",
    "evaluate",
    "rollout",
    "subsample_log_probs",
    "trajectory_log_probs",
]


class DigitsTask(GRPOTask):
    """GRPO on the embedded digits DiT (the demo's task, ``task="digits"``).

    Args:
        eval_per_digit: held-out evaluation samples per digit (10 * this in all).
    """

    name = "digits"
    latent_shape = (1, IMAGE_SIZE, IMAGE_SIZE)
    max_prompts = NUM_CLASSES

    def __init__(self, eval_per_digit: int = 16) -> None:
        if isinstance(eval_per_digit, bool) or not isinstance(eval_per_digit, int):
            raise ValueError(f"eval_per_digit must be an int >= 0, got {eval_per_digit!r}")
        if eval_per_digit < 0:
            raise ValueError(f"eval_per_digit must be an int >= 0, got {eval_per_digit!r}")
        self.eval_per_digit = eval_per_digit
        self.device = torch.device("cpu")
        self._model: nn.Module | None = None
        self.classifier = load_digits_classifier()

    def velocity_model(self) -> nn.Module:
        if self._model is None:
            self._model = load_digits_dit()
        return self._model

    def trainable_parameters(self, tuning: str, lora_rank: int) -> list[nn.Parameter]:
        model = self.velocity_model()
        if tuning == "lora":
            from jagg_autograd.integrations.diffusers import add_lora

            # The label embeddings stay frozen with LoRA: only the adapters train.
            return add_lora(model.transformer, rank=lora_rank)
        if tuning != "full":
            raise ValueError(f"tuning must be 'full' or 'lora', got {tuning!r}")
        model.requires_grad_(True)
        return [p for p in model.parameters() if p.requires_grad]

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[Any]:
        if not 1 <= n <= NUM_CLASSES:
            raise ValueError(f"prompts_per_step must be in [1, {NUM_CLASSES}], got {n}")
        return torch.randperm(NUM_CLASSES, generator=generator)[:n].tolist()

    def cond(self, prompts: Sequence[Any]) -> dict[str, torch.Tensor]:
        return {"labels": torch.tensor(list(prompts), dtype=torch.long, device=self.device)}

    def reward(self, latents: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor:
        labels = torch.tensor(list(prompts), dtype=torch.long, device=latents.device)
        return digit_reward(latents, labels, classifier=self.classifier)

    def eval_prompts(self) -> list[Any]:
        return [d for d in range(NUM_CLASSES) for _ in range(self.eval_per_digit)]

    def eval_breakdown(self, latents: torch.Tensor, prompts: Sequence[Any]) -> dict[str, Any]:
        r = self.reward(latents, prompts)
        labels = torch.tensor(list(prompts), device=r.device)
        per = [r[labels == d].mean() for d in range(NUM_CLASSES)]
        return {"per_digit": [round(float(p), 4) for p in per]}

    def to(self, device: torch.device) -> DigitsTask:
        self.device = torch.device(device)
        self.classifier = self.classifier.to(self.device)
        return self


# --------------------------------------------------------------------------------------------
# the digits-shaped rollout kept from the demo (wrappers of jagg_autograd.rollout)
# --------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One batch of stored trajectories of a label-conditioned model (the digits demo's).

    latents: ``(T + 1, B, *S)`` float32, ``x_0`` (noise) .. ``x_T`` (the image).
    log_probs: ``(T, B)`` float32, ``log p(x_{k+1} | x_k)`` under the rollout policy.
    labels: ``(B,)`` int64 prompts.  ``extra["velocities"]``: ``(T, B, *S)``.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)

    def trajectories(self, sigmas: torch.Tensor) -> Trajectories:
        """The same trajectories as the trainer stores them."""
        return Trajectories(
            self.latents,
            sigmas.to(self.latents.device),
            self.log_probs,
            self.extra.get("velocities"),
            {"labels": self.labels},
        )


@torch.no_grad()
def rollout(
    model: Callable[..., torch.Tensor],
    labels: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    generator: torch.Generator | None = None,
    sde_steps: Sequence[int] | None = None,
    latent_shape: tuple[int, ...] = (1, 8, 8),
) -> Rollout:
    """Sample trajectories of ``model(z, t, labels=labels)``, storing latents and old log-probs.

    :func:`jagg_autograd.rollout.sample_trajectories` from ``x_0 = randn((B, *latent_shape),
    generator)``: the model is called exactly as :func:`jagg_trajectory` calls it with
    ``batching="per_step"``, which is what makes that recomputation bit-identical.
    ``sde_steps``: the steps that use the SDE (None: all); the others take the
    deterministic ODE step, draw no noise and get log-prob NaN (they cannot be trained):
    an empty list is the ODE sampler, a window of steps is MixGRPO's mixed sampler.
    """
    n = labels.shape[0]
    x = torch.randn((n, *latent_shape), generator=generator, dtype=torch.float32)
    tr = sample_trajectories(
        model,
        x.to(labels.device),
        sigmas,
        cond={"labels": labels},
        noise_level=noise_level,
        generator=generator,
        sde_steps=sde_steps,
    )
    return Rollout(tr.latents, tr.log_probs, labels, {"velocities": tr.velocities})


def trajectory_log_probs(
    model: Callable[..., torch.Tensor],
    ro: Rollout,
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    mode: str = "jagg",
    window: int = 4,
    shared_anchors: bool = True,
    router: CosineRouter | None = None,
    batching: str = "stacked",
    steps: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, Any]:
    """Log-probs ``(n, B)`` of the stored transitions under the current policy, with grad.

    Velocities of the stored ``x_lo..x_{hi-1}`` (``steps = (lo, hi)``, None: all T steps)
    come from one :func:`jagg_trajectory` call (so the backward is JAGG's, or the exact one
    for ``mode="exact"``); each step's log-prob is the SDE step's density of the stored
    ``x_{k+1}``. Returns ``(log_probs, JaggStats)``.
    """
    T = ro.latents.shape[0] - 1
    if steps is not None and (not 0 <= steps[0] < steps[1] <= T or steps[1] - steps[0] < 2):
        raise ValueError(f"steps must be (lo, hi) with 0 <= lo, lo + 2 <= hi <= {T}, got {steps}")
    res = policy_log_probs(
        model,
        ro.trajectories(sigmas),
        steps=steps,
        noise_level=noise_level,
        mode=mode,
        window=window,
        shared_anchors=shared_anchors,
        router=router if mode == "router" else None,
        batching=batching,
    )
    return res.log_probs, res.stats


def subsample_log_probs(
    model: Callable[..., torch.Tensor],
    ro: Rollout,
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    num: int,
    generator: torch.Generator | None = None,
    batching: str = "stacked",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DanceGRPO's timestep subsampling: ``num`` random steps per sample, with grad.

    Each sample draws its own ``num`` of the T steps (a fresh random permutation per
    sample, as DanceGRPO's timestep_fraction does).  Returns ``(log_probs (num, B),
    old_log_probs (num, B), steps (num, B))``: slot j of sample b is step ``steps[j, b]``.
    With ``batching="stacked"`` the ``num * B`` evaluations are one model call.
    """
    return gathered_log_probs(
        model,
        ro.trajectories(sigmas),
        noise_level=noise_level,
        num=num,
        generator=generator,
        batching=batching,
    )


@torch.no_grad()
def evaluate(
    model: Callable[..., torch.Tensor],
    classifier: nn.Module,
    sigmas: torch.Tensor,
    *,
    per_digit: int,
    noise_level: float,
    seed: int,
    sampler: str = "sde",
) -> dict[str, Any]:
    """Digits: mean reward of ``per_digit`` samples of every digit, with fixed noise (``seed``).

    ``sampler``: "sde" (the rollout's SDE step) or "ode" (deterministic Euler steps, the
    noise is only the initial latent).  The same seed before and after training gives the
    same noise, so the difference is the policy's.  (The trainer evaluates any task the
    same way, through the task's ``eval_prompts`` and ``reward``.)
    """
    from jagg_autograd.config import SAMPLERS

    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_digit)
    g = torch.Generator().manual_seed(seed)
    ro = rollout(
        model,
        labels,
        sigmas,
        noise_level=noise_level,
        generator=g,
        sde_steps=[] if sampler == "ode" else None,
    )
    r = digit_reward(ro.latents[-1], labels, classifier=classifier)
    per = r.view(NUM_CLASSES, per_digit).mean(1)
    return {
        "mean_reward": float(r.mean()),
        "per_digit": [round(float(p), 4) for p in per],
        "samples": int(labels.numel()),
    }


def estimator_loss(
    model: Callable[..., torch.Tensor],
    ro: Rollout,
    adv: torch.Tensor,
    sigmas: torch.Tensor,
    config: Any,
    router: CosineRouter | None,
    *,
    step: int,
    generator: torch.Generator,
    mode: str | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, float]]:
    """The estimator's loss on a digits :class:`Rollout` (``mode`` overrides the config's).

    The trainer's minibatch loss on a bare model, kept for tests and scripts: eager paths
    only (no ``values``), all T steps (or the config's subsample / MixGRPO steps); the
    router is ``router`` (``mode="router"`` only).
    """
    params = (
        [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    )
    est = get_estimator(config.mode if mode is None else mode)(config)
    if isinstance(est, RouterEstimator):
        est.router = router  # type: ignore[misc]
    ctx = EstimatorShim(model, config, params, step_index=step)
    mb = Minibatch(ro.trajectories(sigmas), adv, None)
    res = est.loss(ctx, mb, generator=generator, on_policy=False)
    gs, calls = res.grad_cost()
    return res.loss, res.infos, {"routed_frac": res.routed_frac, "backward_calls": calls,
                                 "grad_samples": gs}  # fmt: skip
