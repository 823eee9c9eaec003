"""What the model-agnostic GRPO trainer needs from a task.

A task bundles a velocity model (CFG included, trainable parameters full or LoRA), a prompt
sampler, the conditioning of prompts, a reward on final latents, a fixed held-out
evaluation set and a way to turn latents into pictures.  The digits demo and the
compositional shapes task are two implementations; anything about digits, shapes or a
reward lives in the task, never in the trainer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn


class GRPOTask(ABC):
    """Interface of a task for :class:`jagg_autograd.trainer.GRPOTrainer`.

    Prompts are plain Python objects (an int label, a caption string, ...); a batch of
    prompts is a ``list`` of them.  Every tensor of :meth:`cond` has dim 0 equal to the
    number of prompts (the trainer passes it to ``jagg_trajectory`` as batched cond).
    """

    #: name used by ``--task``.
    name: str = ""
    #: shape S of one latent, e.g. (1, 8, 8) or (4, 16, 16).
    latent_shape: tuple[int, ...] = ()
    #: most distinct prompts one rollout may draw (None: no limit); checked by the config.
    max_prompts: int | None = None
    #: :class:`~jagg_autograd.trainer.GRPOConfig` fields that ``jagg-demo --task <name>``
    #: uses for this task unless given on the command line (e.g. its learning rate and
    #: step count); the trainer itself never reads them.
    demo_defaults: ClassVar[dict[str, Any]] = {}

    @abstractmethod
    def velocity_model(self) -> nn.Module:
        """``model(z (n, *S), t (n,), **cond) -> v (n, *S)``, t = sigma in [0, 1].

        The same module on every call (the trainer moves it to its device and trains it).
        """

    @abstractmethod
    def trainable_parameters(self, tuning: str, lora_rank: int) -> list[nn.Parameter]:
        """Make the parameters trainable ("full" or "lora") and return them."""

    @abstractmethod
    def sample_prompts(self, n: int, generator: torch.Generator) -> list[Any]:
        """``n`` training prompts (never the held-out ones), deterministic in ``generator``."""

    @abstractmethod
    def cond(self, prompts: Sequence[Any]) -> dict[str, torch.Tensor]:
        """Keyword arguments of the velocity model for these prompts (dim 0 = len)."""

    @abstractmethod
    def reward(self, latents: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor:
        """``(n,)`` float rewards of final latents ``(n, *S)`` for their prompts."""

    @abstractmethod
    def eval_prompts(self) -> list[Any]:
        """The fixed held-out evaluation prompts (one entry per evaluation sample)."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor | None:
        """Pictures ``(n, H, W, C)`` in [0, 1] for grids, or None if latents are no pictures.

        Default: latents ``(n, C, H, W)`` with C in (1, 3), or ``(n, H, W)``, in [-1, 1]
        are the pictures themselves; any other latent shape gives None (no grid).
        """
        x = latents.float()
        if x.dim() == 3:
            x = x.unsqueeze(1)
        if x.dim() != 4 or x.shape[1] not in (1, 3):
            return None
        return ((x.clamp(-1, 1) + 1) / 2).permute(0, 2, 3, 1)

    def eval_breakdown(
        self, latents: torch.Tensor, prompts: Sequence[Any]
    ) -> dict[str, Any]:
        """Optional per-category mean reward of an evaluation (e.g. GenEval categories), and
        any further figures (e.g. the shapes task's GenEval ``strict_accuracy``).

        JSON-ready values (floats, or lists of floats such as the digits' ``per_digit``);
        they are merged into the evaluation's log entry beside ``mean_reward``.
        """
        return {}

    def to(self, device: torch.device) -> GRPOTask:
        """Move what the task owns besides the velocity model (e.g. a reward model).

        The trainer moves the velocity model itself; the default does nothing.
        """
        return self
