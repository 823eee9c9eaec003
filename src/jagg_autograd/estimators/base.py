"""The interface every gradient estimator of the trainer implements, and what they share.

An estimator answers what the training loop asks, and the loop never asks which one it
runs: which steps a sample trains (:meth:`Estimator.num_train_steps`,
:meth:`Estimator.train_steps`), which rollout steps use the SDE (:meth:`Estimator.sde_steps`),
whether the rollout's reference means are needed (``needs_logprob_reference``), whether
the gradient probe applies (``supports_probe``), the loss of one minibatch
(:meth:`Estimator.loss`, returning a typed :class:`MinibatchResult`), its own checks of the
config (:meth:`Estimator.check`), the safer estimator the runaway guard falls back to
(:meth:`Estimator.fallback`) and its description in the run summary
(:meth:`Estimator.describe`).

An estimator object is built once per trainer (``Estimator(config)``) and may keep state
across minibatches (DiffusionNFT's parameter snapshot).  ``ctx`` is what a loss reads of
the trainer (:class:`LossContext`: the policy, the trainable parameters, the reference,
the GRPO step index).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from jagg_autograd.grpo import grpo_loss, kl_to_reference
from jagg_autograd.rollout import StepLogProbs, Trajectories, select_steps

if TYPE_CHECKING:  # the config imports the registry, not the other way round
    from jagg_autograd.config import GRPOConfig

__all__ = [
    "Estimator",
    "EstimatorShim",
    "LossContext",
    "Minibatch",
    "MinibatchResult",
    "grpo_loss_mean",
    "timed_backward",
]

Infos = list[dict[str, torch.Tensor]]


class LossContext(Protocol):
    """What an estimator's loss reads of the trainer (a :class:`GRPOTrainer` is one)."""

    config: GRPOConfig
    policy: Callable[..., torch.Tensor]
    params: list[torch.Tensor]
    reference: Callable[..., torch.Tensor] | None
    step_index: int


@dataclass
class Minibatch:
    """A rollout minibatch and what is fixed for it until the next rollout.

    ``steps``: the trained steps chosen at the rollout (None: the estimator's own, e.g.
    all T, a random draw per loss call, or MixGRPO's window); ``ref_means``: the
    reference policy's SDE means at those steps (``beta > 0``).
    """

    traj: Trajectories
    adv: torch.Tensor
    steps: tuple[int, int] | torch.Tensor | None
    ref_means: torch.Tensor | None = None


@dataclass
class MinibatchResult:
    """One minibatch's loss and its cost, as the estimator reports them.

    ``loss``: the loss whose gradient is the estimator's (detached when the estimator ran
    its backwards itself: ``backward_done``, their time in ``backward_seconds``);
    ``infos``: the per-slot GRPO statistics (``clipfrac``, ``approx_kl``, ``ratio_min``,
    ``ratio_max``, optionally ``kl``); ``path``: which execution path ran (logged per
    minibatch); ``pairs``: the trained (step, sample) pairs; ``routed_frac``: the fraction
    of windows given the exact gradient.  The with-grad cost is ``stats``'s (a
    :class:`~jagg_autograd.JaggStats`, read after the backward: deferred calls fill it in
    there) or, without stats, ``grad_samples`` / ``grad_forward_calls``.
    """

    loss: torch.Tensor
    infos: Infos
    path: str
    pairs: int
    routed_frac: float = 0.0
    stats: Any = None
    grad_samples: int = 0
    grad_forward_calls: int = 0
    backward_done: bool = False
    backward_seconds: float = 0.0

    def grad_cost(self) -> tuple[int, int]:
        """``(grad_samples, grad_forward_calls)``; call it after the backward."""
        st = self.stats
        if st is None:
            return int(self.grad_samples), int(self.grad_forward_calls)
        calls = st.grad_forward_calls if hasattr(st, "grad_forward_calls") else st.backward_calls
        return int(st.grad_samples), int(calls)

    @property
    def plan_seconds(self) -> float:
        """Adaptive placement's planning time (inside the backward; 0 without stats)."""
        return float(getattr(self.stats, "plan_seconds", 0.0) or 0.0)


def grpo_loss_mean(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    config: GRPOConfig,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Infos]:
    """Mean over the trained slots of the clipped GRPO loss; ``lp``, ``old``, ``kl``: (n, B)."""
    losses, infos = [], []
    for j in range(lp.shape[0]):
        loss_j, info_j = grpo_loss(
            lp[j],
            old[j],
            adv,
            clip_range=config.clip_range,
            adv_clip_max=config.adv_clip_max,
            kl=None if kl is None else kl[j],
            beta=config.beta if kl is not None else 0.0,
        )
        losses.append(loss_j)
        infos.append(info_j)
    # Mean over the trained steps (the 1/T'): Flow-GRPO accumulates every step's loss into
    # one optimizer step, scaled so that the step count does not change the learning rate;
    # over a random subset this mean is an unbiased estimate of the full one.
    return torch.stack(losses).mean(), infos


def timed_backward(loss: torch.Tensor) -> float:
    """``loss.backward()`` now; its seconds (the step loops report them as backward time)."""
    t0 = time.perf_counter()
    loss.backward()
    return time.perf_counter() - t0


class Estimator:
    """Base of the trainer's gradient estimators (one subclass per ``mode``).

    Subclasses set ``name`` and override :meth:`loss`; the other hooks have the defaults of
    a GRPO estimator trained on Flow-GRPO's ``timestep_fraction`` of the steps.
    """

    name: ClassVar[str] = ""
    #: The rollout computes the reference policy's SDE means for the KL (``beta > 0``).
    needs_logprob_reference: ClassVar[bool] = True
    #: The gradient probe (cosine to the exact GRPO gradient) measures this estimator.
    supports_probe: ClassVar[bool] = True
    #: ``timestep_fraction`` / ``timestep_selection`` choose the trained steps.
    uses_timestep_fraction: ClassVar[bool] = True
    #: The rollout's sampler, in the summary's words.
    sampler_words: ClassVar[str] = "SDE"

    def __init__(self, config: GRPOConfig) -> None:
        self.config = config

    # ------------------------------------------------------------------ the config

    def check(self) -> None:
        """Raise ``ValueError`` naming a field this estimator cannot run with (called by
        :meth:`GRPOConfig.validate` after the common checks)."""
        c = self.config
        if not self.uses_timestep_fraction and (
            c.timestep_fraction != 1.0 or c.timestep_selection != "prefix"
        ):
            raise ValueError(
                f"timestep_fraction / timestep_selection do not combine with mode={c.mode!r} "
                "(subsample: set subsample_steps; mixgrpo: set window; nft: set nft_timesteps)"
            )

    def num_train_steps(self) -> int:
        """T': the steps trained per sample."""
        c = self.config
        return max(1, int(c.num_steps * c.timestep_fraction))

    def resolve(self, d: dict[str, Any]) -> None:
        """Adjust the logged config ``d`` to what the run really does (in place)."""

    def fallback(self) -> dict[str, Any] | None:
        """The config changes of the estimator a run switches to when this one's gradient
        runs away (:mod:`jagg_autograd.runaway_guard`), or None: nothing safer to fall back to (the
        exact-per-step estimators; the guard is then off)."""
        return None

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        """The gradient settings of a logged config ``cfg`` that apply to this estimator."""
        return cfg["mode"]

    @classmethod
    def summary_note(cls, cfg: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
        """A sentence the run summary adds for this estimator (after the evaluation)."""
        return ""

    # ------------------------------------------------------------------ the rollout

    def sde_steps(self, step: int) -> Sequence[int] | None:
        """The rollout steps sampled with the SDE at GRPO step ``step`` (None: all)."""
        return None

    def train_steps(
        self, batch: int, generator: torch.Generator
    ) -> tuple[int, int] | torch.Tensor | None:
        """A minibatch's trained steps, chosen at the rollout (None: all T, or the
        estimator's own choice in :meth:`loss`)."""
        c = self.config
        n = self.num_train_steps()
        if not self.uses_timestep_fraction or n == c.num_steps:
            return None
        return select_steps(c.num_steps, batch, n, c.timestep_selection, generator=generator)

    # ------------------------------------------------------------------ the loss

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
        """The loss whose gradient is this estimator's on minibatch ``mb``.

        ``on_policy``: no optimizer step since the rollout; ``generator``: the run's stream
        for the estimator's own random draws; ``inline_backward``: the estimator may run
        the backward of ``scale * loss`` itself (step by step) and return the loss detached
        with ``backward_done=True``.  Without it the loss must carry the graph (the probe).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ shared pieces

    def policy_loss(
        self, lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, kl: torch.Tensor | None
    ) -> tuple[torch.Tensor, Infos]:
        """The clipped GRPO loss averaged over the trained slots (a hook for tests)."""
        return grpo_loss_mean(lp, old, adv, self.config, kl)

    @staticmethod
    def kl_terms(res: StepLogProbs, mb: Minibatch) -> torch.Tensor | None:
        """Flow-GRPO's KL per trained slot, ``(n, B)`` (None without reference means)."""
        if mb.ref_means is None:
            return None
        return torch.stack(
            [
                kl_to_reference(res.means[j], mb.ref_means[j], res.std_dev_t[j])
                for j in range(res.means.shape[0])
            ]
        )


@dataclass
class EstimatorShim:
    """A :class:`LossContext` around a bare model (for tests and scripts)."""

    policy: Callable[..., torch.Tensor]
    config: GRPOConfig
    params: list[torch.Tensor] = field(default_factory=list)
    reference: Callable[..., torch.Tensor] | None = None
    step_index: int = 0
