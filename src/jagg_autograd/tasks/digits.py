"""The digits demo as a GRPO task: class-conditional 8x8 digits, reward = classifier probability.

Prompts are digit labels 0..9 (a rollout draws ``prompts_per_step`` distinct ones); the
velocity model is the shipped :class:`~jagg_autograd.models.digits.DigitsDiT`
(``model(z (n, 1, 8, 8), t (n,), labels=(n,))``); the reward is the shipped classifier's
probability of the prompted digit (:func:`~jagg_autograd.models.digits.digit_reward`);
the held-out evaluation is ``eval_per_digit`` samples of every digit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from jagg_autograd.models.digits import (
    IMAGE_SIZE,
    NUM_CLASSES,
    digit_reward,
    load_digits_classifier,
    load_digits_dit,
)
from jagg_autograd.tasks.base import GRPOTask

__all__ = ["DigitsTask"]


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
