"""The compositional shapes task: GenEval-style text-to-image GRPO on a CPU.

:class:`ShapesTask` implements :class:`~jagg_autograd.tasks.base.GRPOTask` for the shipped
text encoder + SD3 MMDiT (:mod:`jagg_autograd.models.shapes`), the prompts of
:mod:`~jagg_autograd.tasks.shapes_scenes` and the programmatic reward of
:mod:`~jagg_autograd.tasks.shapes_reward` (Flow-GRPO's per-clause partial credit; the
evaluations also log GenEval's strict accuracy, overall and per category):

* the velocity model is the library's :class:`~jagg_autograd.integrations.diffusers.
  SD3Velocity` around the MMDiT, with CFG (``guidance_scale``; the negative is the empty
  prompt's embedding, which pre-training learned by caption dropout);
* the text encoder is frozen (as SD3's are in Flow-GRPO); "full" tuning trains the whole
  MMDiT, "lora" peft adapters on its attention projections;
* training prompts come from the training split only, category first (uniform over the six
  GenEval categories), then a prompt of that category; the evaluation prompts are the fixed
  held-out set :func:`~jagg_autograd.tasks.shapes_scenes.eval_prompt_set`;
* :func:`save_grid` (from :mod:`jagg_autograd.grid`, re-exported) draws pictures with
  their captions (prompt and score) into a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from jagg_autograd.grid import grid_caption, save_grid
from jagg_autograd.tasks.base import GRPOTask
from jagg_autograd.tasks.shapes_reward import shapes_reward, shapes_scores
from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    IMAGE_SIZE,
    eval_prompt_set,
    parse_prompt,
    prompt_split,
)

__all__ = ["DEFAULT_GUIDANCE_SCALE", "ShapesTask", "grid_caption", "save_grid"]

#: CFG weight of the task's velocity model: shapes_meta.json's held-out evaluations of the
#: shipped model (10 steps, 192 samples, +-0.035; mean partial-credit reward / strict
#: accuracy): with the trainer's SDE (eta 0.7) it peaks at 2 (0.483 / 0.354; 1: 0.368 /
#: 0.229, 3: 0.453 / 0.333, 4.5: 0.431 / 0.307); with the ODE 2 and 3 tie (0.507 / 0.385,
#: 0.514 / 0.401; 1: 0.444, 4.5: 0.488).  The model shipped before also peaked at 2.
DEFAULT_GUIDANCE_SCALE = 2.0


class ShapesTask(GRPOTask):
    """GRPO task on the shipped shapes text-to-image model.

    Args:
        guidance_scale: CFG weight of the velocity model (None or 1: no CFG).
        eval_per_category: evaluation samples per GenEval category (held-out prompts; 64:
            384 samples, about 22 s with the ODE on one thread beside another job).  Fewer
            are too noisy to judge GRPO by: with 16 (96 samples) models a few steps apart,
            or the same weights with one module reset, scored 0.42-0.52 (issue 21's
            trials).
        device: where the model lives (default CPU).
        model: a :class:`~jagg_autograd.models.shapes.ShapesModel` to use instead of the
            shipped one (e.g. in tests).
    """

    name = "shapes"
    latent_shape = (3, IMAGE_SIZE, IMAGE_SIZE)
    #: ``jagg-demo --task shapes`` settings (GRPOConfig fields; flags override them), from
    #: issue 21's trials (benchmarks/results/shapes/SHAPES.md; 8 prompts x 4, seed 0): on
    #: the model shipped before, training all 10 steps peaked early and fell back (a 4x4-patch
    #: texture) and the first 5 steps rose faster.  On the shipped model (no pooled text
    #: vector, 2026-12-06) lr 6e-5 and 4.5e-5 collapse the raw weights by step 150
    #: (held-out 0.302 / 0.344 from 0.477); at lr 3e-5 they peak at step 100 on each of
    #: seeds 0-2 and fall back by 150.  The EMA is Flow-GRPO's GenEval run's in rollouts:
    #: 0.9 every 2 (ema.py: its loop updates twice every 4 epochs; the 0.9 every 8 used
    #: until 2026-12-06 averaged 3x older weights).  At it the held-out gain over seeds 0-2
    #: is +0.048 at step 100 and +0.033 at 150 (chosen on those runs: 100 steps).  Window 5
    #: over the 5 trained steps keeps the default's anchor density (2 of 5).  The ODE
    #: evaluation is GenEval's protocol; a third of the time is evaluations (with the EMA
    #: each scores the averaged and the raw weights).
    demo_defaults: ClassVar[dict[str, Any]] = {
        "lr": 3e-5,
        "steps": 100,
        "timestep_fraction": 0.5,
        "window": 5,
        "ema_decay": 0.9,
        "ema_every": 2,
        "eval_every": 50,
        "eval_sampler": "ode",
    }

    def __init__(
        self,
        *,
        guidance_scale: float | None = DEFAULT_GUIDANCE_SCALE,
        eval_per_category: int = 64,
        device: str | torch.device | None = None,
        model: nn.Module | None = None,
    ) -> None:
        from jagg_autograd.models.shapes import ShapesModel, load_shapes_model

        if guidance_scale is not None and (
            isinstance(guidance_scale, bool)
            or not isinstance(guidance_scale, (int, float))
            or not math.isfinite(guidance_scale)
        ):
            raise ValueError(
                f"guidance_scale must be None or a finite number, got {guidance_scale!r}"
            )
        if (
            isinstance(eval_per_category, bool)
            or not isinstance(eval_per_category, int)
            or (eval_per_category < 1)
        ):
            raise ValueError(f"eval_per_category must be an int >= 1, got {eval_per_category!r}")
        if model is None:
            model = load_shapes_model(device=device)
        elif not isinstance(model, ShapesModel):
            raise TypeError(f"model must be a ShapesModel, got {type(model).__name__}")
        self.model = model
        self.model.text_encoder.requires_grad_(False)
        self.guidance_scale = guidance_scale
        self.eval_per_category = eval_per_category
        self._velocity = model.velocity(guidance_scale)
        train = prompt_split("train")
        self._train_by_cat = {
            c: [p for p in train if parse_prompt(p).category == c] for c in CATEGORIES
        }

    def velocity_model(self) -> nn.Module:
        """:class:`SD3Velocity` around the MMDiT: ``model(z (n, 3, 32, 32), t (n,), **cond)``."""
        return self._velocity

    def trainable_parameters(self, tuning: str, lora_rank: int) -> list[nn.Parameter]:
        """The MMDiT's parameters ("full") or new LoRA adapters on it ("lora"); the text
        encoder stays frozen either way."""
        if tuning == "full":
            self.model.transformer.requires_grad_(True)
            return [p for p in self.model.transformer.parameters() if p.requires_grad]
        if tuning == "lora":
            from jagg_autograd.integrations.diffusers import add_lora

            return add_lora(self.model.transformer, rank=lora_rank)
        raise ValueError(f"tuning must be 'full' or 'lora', got {tuning!r}")

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[str]:
        """``n`` training prompts: a category uniformly, then one of its training prompts."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        cats = torch.randint(len(CATEGORIES), (n,), generator=generator).tolist()
        u = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
        out = []
        for c, x in zip(cats, u, strict=True):
            ps = self._train_by_cat[CATEGORIES[c]]
            out.append(ps[min(int(x * len(ps)), len(ps) - 1)])
        return out

    def cond(self, prompts: Sequence[Any]) -> dict[str, torch.Tensor]:
        """SD3Velocity's keyword arguments (prompt and empty-prompt embeddings, no grad)."""
        return self.model.cond(list(prompts))

    def reward(self, latents: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor:
        """Flow-GRPO's partial-credit GenEval score (at most 1; see
        :mod:`~jagg_autograd.tasks.shapes_reward`) of each final latent (= picture)."""
        return shapes_reward(latents, list(prompts))

    def eval_prompts(self) -> list[str]:
        """The fixed held-out evaluation prompts (``eval_per_category`` per category)."""
        return eval_prompt_set(self.eval_per_category, "heldout")

    def to(self, device: torch.device | str) -> ShapesTask:
        """Move the text encoder (the trainer moves the velocity model itself)."""
        self.model.text_encoder.to(torch.device(device))
        return self

    def eval_breakdown(self, latents: torch.Tensor, prompts: Sequence[Any]) -> dict[str, float]:
        """GenEval's figures of an evaluation, as Flow-GRPO logs them: ``strict_accuracy``
        (the fraction of fully correct pictures) overall, and per category ``{category}``
        (the mean reward) and ``{category}_strict_accuracy``."""
        r, strict = shapes_scores(latents, list(prompts))
        strict = strict.double()
        cats = [parse_prompt(p).category for p in prompts]
        out = {"strict_accuracy": float(strict.mean())} if len(cats) else {}
        for c in CATEGORIES:
            idx = [i for i, k in enumerate(cats) if k == c]
            if idx:
                out[c] = float(r[idx].mean())
                out[f"{c}_strict_accuracy"] = float(strict[idx].mean())
        return out
