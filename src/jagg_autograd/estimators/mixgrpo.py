"""MixGRPO: the SDE only inside a window of ``window`` consecutive steps that slides along
the trajectory during training (the ODE step elsewhere), and only the window's steps
trained, exactly.

The window starts at step 0 and moves one step later every ``mix_shift_interval`` GRPO
steps (None: it sweeps the trajectory once over the run) until it reaches the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from jagg_autograd.estimators.base import LossContext, Minibatch, MinibatchResult
from jagg_autograd.estimators.exact import ExactEstimator

__all__ = ["MixGRPOEstimator", "mix_window_start"]


def mix_window_start(config: Any, step: int) -> int:
    """First step of MixGRPO's window of ``config.window`` SDE steps at GRPO step ``step``.

    The window starts at step 0 and moves one step later every ``mix_shift_interval``
    GRPO steps until it reaches the end of the trajectory (MixGRPO's progressive schedule).
    """
    T, W = config.num_steps, config.window
    interval = config.mix_shift_interval or max(1, config.steps // (T - W + 1))
    return min(step // interval, T - W)


class MixGRPOEstimator(ExactEstimator):
    """The exact gradient of the SDE window's steps at this GRPO step."""

    name = "mixgrpo"
    uses_timestep_fraction = False
    sampler_words = "ODE/SDE"

    def num_train_steps(self) -> int:
        return self.config.window

    def window(self, step: int) -> tuple[int, int]:
        """``(lo, hi)``: the window's steps at GRPO step ``step``."""
        lo = mix_window_start(self.config, step)
        return lo, lo + self.config.window

    def sde_steps(self, step: int) -> Sequence[int]:
        return range(*self.window(step))

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        return f"mixgrpo (sliding SDE window of {cfg['window']} steps)"

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
        # Known quirk, kept because a refactor changes no number: with beta > 0 the
        # rollout's reference means cover all T steps (train_steps is None) and the KL
        # reads them by slot j = 0..W-1, i.e. at steps 0..W-1, not at the window's
        # lo..lo+W-1 (the same steps only while the window starts at 0).
        return self.batched(ctx, mb, self.window(ctx.step_index))

    def routed_frac(self, res: Any) -> float:
        return 0.0
