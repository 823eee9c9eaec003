"""Online Flow-GRPO for any task, with the gradient through JAGG.

``GRPOTrainer(config, task=...)`` trains a task's velocity model (a
:class:`~jagg_autograd.tasks.GRPOTask`: model, prompts, reward, held-out evaluation; the
digits demo is ``task="digits"``).  One GRPO step, with Flow-GRPO's names:

1. **Rollout** (``torch.no_grad``, :func:`jagg_autograd.rollout.sample_trajectories`):
   ``prompts_per_step`` prompts, each repeated ``group_size`` times, sampled with Flow-GRPO's
   SDE step (``sde_type="dance"``: DanceGRPO's) over ``num_steps`` steps, in minibatches of
   ``B / (optimizer_steps_per_rollout * gradient_accumulation_steps)`` samples; latents
   ``x_0..x_T``, old log-probs and the velocities are stored in the (T, B, ...) layout.
2. **Reward** (the task's) and per-prompt group advantages
   (:func:`jagg_autograd.grpo.group_advantages`, which raises on NaN rewards).
3. **Training**, ``num_inner_epochs`` passes over the minibatches; the optimizer steps
   every ``gradient_accumulation_steps`` minibatches (``optimizer_steps_per_rollout``
   steps per epoch; the old name ``minibatches`` is an alias).  A minibatch's trained steps
   are a ``timestep_fraction`` of the T steps: a prefix (Flow-GRPO) or a random subset per
   sample (``timestep_selection="random"``, DanceGRPO).  Their velocities come from ONE
   :func:`jagg_autograd.jagg_trajectory` call (``mode="exact"``: every step with grad;
   ``"jagg"``; ``"router"``: JAGG + :class:`~jagg_autograd.CosineRouter`); each step's
   log-prob of the stored move gives the clipped GRPO loss (``clip_range``,
   ``adv_clip_max``, plus ``beta`` times Flow-GRPO's KL to the reference policy: the model
   with its LoRA adapters disabled, or a frozen copy of the initial weights for full
   fine-tuning, evaluated once per rollout), averaged over the trained steps (the 1/T').
   Gradient-norm clipping ``max_grad_norm``, AdamW.

   An **on-policy** minibatch (no optimizer step since the rollout) with
   ``reuse_values=True`` passes the rollout's velocities as ``values=`` with
   ``deferred=True``: no model call but the anchors'.  Off-policy ones recompute:
   ``deferred=True`` (``placement``/``budget`` apply), else today's eager path.  Each
   step's log row says which path ran (``paths``).  ``mode="exact"`` and the two baselines
   never take these paths.  Baselines: ``mode="subsample"`` (DanceGRPO's random subset of
   ``subsample_steps`` steps per sample, trained exactly; the same as ``mode="exact"`` with
   ``timestep_selection="random"`` and that fraction) and ``mode="mixgrpo"`` (MixGRPO: SDE
   only inside a window of ``window`` steps that slides along the trajectory during
   training, ODE elsewhere; only the window's steps are trained).

   ``mode="exact"`` runs Flow-GRPO's training loop by default (``exact_loop``): forward
   and backward one trained step at a time (one step's activations; the same gradient as
   the batched call, kept with ``exact_loop=False`` as the oracle).  ``mode="nft"`` is
   DiffusionNFT's forward-process loss (:mod:`jagg_autograd.nft`): the rollout's clean
   samples re-noised at ``nft_timesteps`` random timesteps, no log-probs.  With
   ``track_memory`` each row has ``peak_saved_bytes`` (peak saved-for-backward bytes).

Optional along the run: a held-out evaluation every ``eval_every`` steps (SDE or ODE
sampler, fixed noise never used in training) and a gradient probe every ``probe_every``
steps (cosine / relative error of the run's gradient estimator to the exact gradient on a
separate full-SDE batch).  Neither touches the training noise stream nor the timings.

**Runs keep what they did.** With ``out`` set, the folder is checked (and a previous run's
``reward.png`` removed) before anything is trained; ``log.json`` is written atomically
after every step with a ``run_id``, ``started_at`` and ``status`` ("running",
"finished", "interrupted", "failed"); Ctrl-C and errors leave a valid partial log with
every finished step.  A non-finite loss or gradient norm stops the run with a
:class:`TrainingDivergedError` naming the step, before the optimizer step.

The parameters change only through optimizer steps, so with ``batching="per_step"`` the
first log-prob recomputation after a rollout reproduces the rollout's bit for bit (ratio 1);
:func:`rollout` and :func:`trajectory_log_probs` (the digits-shaped wrappers kept from the
demo) are public so that this can be tested.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import inspect
import json
import math
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jagg_autograd.diagnostics import compare_grads
from jagg_autograd.grid import grid_caption, save_grid
from jagg_autograd.grpo import (
    group_advantages,
    grpo_loss,
    kl_to_reference,
    sde_step_with_logprob,
    shifted_sigma_schedule,
)
from jagg_autograd.memory import SavedTensorTracker
from jagg_autograd.rollout import (
    STEP_SELECTIONS,
    Trajectories,
    draw_random_steps,
    policy_log_probs,
    reference_means,
    sample_trajectories,
    select_steps,
)
from jagg_autograd.router import DEFAULT_JAGG_FRAC, DEFAULT_THRESHOLD, CosineRouter
from jagg_autograd.tasks import GRPOTask, get_task, task_factory
from jagg_autograd.window import BATCHINGS, expected_anchor_count, jagg_trajectory

__all__ = [
    "MODES",
    "PLACEMENTS",
    "PRECISIONS",
    "SAMPLERS",
    "SCHEDULES",
    "STEP_SELECTIONS",
    "TUNING",
    "GRPOConfig",
    "GRPOTrainer",
    "Rollout",
    "TrainingDivergedError",
    "evaluate",
    "rollout",
    "sigma_schedule",
    "train",
    "trajectory_log_probs",
]

MODES = ("exact", "jagg", "router", "subsample", "mixgrpo", "nft")
SAMPLERS = ("sde", "ode")
SCHEDULES = ("linear", "shifted")
TUNING = ("full", "lora")
PRECISIONS = ("fp32", "bf16")
PLACEMENTS = ("uniform", "adaptive")
SDE_TYPES = ("flow", "dance")
_JAGG_MODES = ("jagg", "router")  # the modes that take values / deferred / placement


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before the optimizer step."""


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GRPOConfig:
    """Settings of one online GRPO run (defaults = the digits demo's defaults).

    The defaults make the default run visibly learn on a 2-core CPU in a few minutes:

    * 32 trajectories per step as 8 prompts x 4 samples: covering most digits every step
      makes the per-step reward curve far less noisy than 4 x 8 (which learned as well);
    * the full DiT (0.6 M parameters) with AdamW at ``lr=1e-4``: in 40-step trials full
      fine-tuning at 1e-4 raised the fixed-noise reward by +0.22 (3e-5: +0.11, 3e-4: +0.20
      but noisier) and rank-8 LoRA at 1e-3 by only +0.06;
    * the linear schedule ``sigma_i = 1 - i/T`` the DiT was trained and evaluated on, 10 SDE
      steps at ``eta = 0.7``, JAGG with window 4 and shared anchors (4 anchors of 10 steps);
    * one optimizer step per rollout, so every ratio is exactly 1 when the gradient is
      taken and ``clip_range`` (Flow-GRPO's 1e-4, kept) only acts with
      ``optimizer_steps_per_rollout > 1`` or ``num_inner_epochs > 1``, on the minibatches
      trained after an earlier optimizer step of the same rollout;
    * ``reuse_values`` and ``deferred`` on, ``placement="uniform"`` (4 anchors of 10
      steps), no router: the second quality study (``python -m benchmarks.quality``,
      digits, 4 seeds x 60 steps) measured this final held-out reward +0.02 % of exact
      GRPO's at 0.463 of its training time (0.614 of the whole step), peak saved bytes at
      the per-step loop's; today's eager path (W = 4 + router 0.7) +0.19 % at 0.582;
      adaptive placement -2.5 % (budget 4), +1.5 % (3) and -7.9 % (5): see
      ``benchmarks/results/quality2/QUALITY.md``.
    """

    task: str = "digits"
    """Registered task name (:func:`jagg_autograd.tasks.get_task`); a task object given to
    :class:`GRPOTrainer` replaces it (its ``name`` is logged)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the task's factory (the digits task also gets
    ``eval_per_digit`` from this config)."""
    steps: int = 60
    """GRPO steps (rollout + optimizer steps)."""
    prompts_per_step: int = 8
    """Distinct prompts per rollout (digits: drawn without replacement from 0..9)."""
    group_size: int = 4
    """Samples per prompt; advantages are normalised within each group."""
    num_steps: int = 10
    """Sampler steps T of a trajectory."""
    noise_level: float = 0.7
    """SDE noise level eta of Flow-GRPO's step."""
    sde_type: str = "flow"
    """SDE step: "flow" (Flow-GRPO) or "dance" (DanceGRPO)."""
    schedule: str = "linear"
    """Sigma schedule: "linear" (sigma_i = 1 - i/T, what the digits DiT was evaluated with)
    or "shifted" (:func:`~jagg_autograd.grpo.shifted_sigma_schedule`, FLUX/DanceGRPO's)."""
    shift: float = 3.0
    """Shift of the "shifted" schedule."""
    mode: str = "jagg"
    """(No router by default: in the quality study eager JAGG + router 0.7 routed 1 % of
    windows on digits and 2.4 % on shapes for no reward difference, +0.19 % vs +0.02 %.)
    Gradient: "exact" (every step with grad), "jagg", "router" (JAGG + CosineRouter),
    or the baselines "subsample" (DanceGRPO), "mixgrpo" (MixGRPO's sliding window) and
    "nft" (DiffusionNFT's forward-process loss, :mod:`jagg_autograd.nft`: no log-probs)."""
    exact_loop: bool = True
    """mode="exact": forward + backward ONE trained step at a time, as Flow-GRPO's training
    loop does (peak activation memory of one step; the users' baseline).  The loss is a
    sum of per-step terms, so the gradient is the batched one's.  False: all trained steps
    in one call and one backward (T' steps of activations, the "batched exact" oracle)."""
    nft_beta: float = 1.0
    """mode="nft": DiffusionNFT's beta, the step of the implicit policies ``v_plus = beta
    v_theta + (1 - beta) v_old`` (their config/nft.py: 1.0; 0.1 for some rewards)."""
    nft_timesteps: int = 4
    """mode="nft": training timesteps drawn per sample and minibatch (of the T sampler
    steps; 4 = the with-grad samples of JAGG's 4 anchors per 10 steps)."""
    track_memory: bool = False
    """Log ``peak_saved_bytes``: the peak of live tensors saved for backward during the
    training phase (:class:`~jagg_autograd.memory.SavedTensorTracker`, parameters
    excluded; the deferred backward's recomputation included).  Off by default: the
    hooks cost time."""
    window: int = 4
    """JAGG window W (steps per window, anchors included); mode="mixgrpo": the number of
    consecutive SDE steps trained; ignored by mode="exact" and "subsample"."""
    shared_anchors: bool = True
    """Adjacent windows share their boundary anchor (fewer anchors per backward)."""
    threshold: float = DEFAULT_THRESHOLD
    """CosineRouter threshold (mode="router")."""
    jagg_frac: float | None = DEFAULT_JAGG_FRAC
    """CosineRouter jagg_frac (mode="router")."""
    subsample_steps: int | None = None
    """mode="subsample": steps trained per sample, drawn at random per sample and step like
    DanceGRPO's timestep_fraction (None: JAGG's budget, the anchor count of ``window`` and
    ``shared_anchors``)."""
    mix_shift_interval: int | None = None
    """mode="mixgrpo": GRPO steps between moves of the window by one step (None: the
    window sweeps the trajectory once, ``max(1, steps // (num_steps - window + 1))``)."""
    timestep_fraction: float = 1.0
    """Fraction of the T steps trained per sample, T' = max(1, int(T * fraction))
    (Flow-GRPO's and DanceGRPO's ``timestep_fraction``)."""
    timestep_selection: str = "prefix"
    """Which T' steps: "prefix" (steps 0..T'-1, Flow-GRPO) or "random" (a random subset
    per sample and rollout, DanceGRPO)."""
    batching: str = "stacked"
    """jagg_trajectory batching: "stacked" (fewest model calls) or "per_step"
    (bit-identical to the rollout)."""
    reuse_values: bool = True
    """(Default from the quality study: with ``deferred`` the training phase is 0.463 of
    exact GRPO's on digits, final reward +0.02 %.)  On-policy minibatches pass the
    rollout's velocities as ``values=`` (deferred backward, no forward but the anchors');
    modes jagg and router only."""
    deferred: bool = True
    """(Default from the quality study: peak saved bytes 1.00x the per-step loop's on
    digits, 1.02x on shapes, where the eager path needed 3.98x / 4.01x.)
    jagg_trajectory(deferred=True) on every minibatch: anchors run with grad in the
    backward, chunk by chunk (per-step-loop activation memory)."""
    placement: str = "uniform"
    """(Default from the quality study: adaptive placement at 4 anchors per 10 steps had the
    higher gradient cosine, 0.962 vs 0.943, but learned less on all 4 digits seeds, -2.5 %
    final reward, and ran slower, 0.475 vs 0.463 of exact.)  Anchor placement: "uniform"
    (the window layout) or "adaptive" (chosen in the
    backward from the upstream gradients, so every minibatch runs deferred, on-policy with
    values or off-policy without; mode="router" always uses "uniform")."""
    budget: float | None = None
    """placement="adaptive": mean anchors per sample (None: the uniform layout's count)."""
    chunk_size: int | None = None
    """jagg_trajectory chunk_size (deferred: samples per anchor call; None: the default)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (0: the pretrained weights are the prior, not 0)."""
    clip_range: float = 1e-4
    """PPO ratio clip epsilon of the GRPO loss (Flow-GRPO's value)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to +-adv_clip_max."""
    beta: float = 0.0
    """Weight of Flow-GRPO's KL to the reference policy (0: off, no reference pass)."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clip (None: off)."""
    optimizer_steps_per_rollout: int = 1
    """Optimizer steps per rollout and inner epoch (Flow-GRPO: 2, so the first half of
    the minibatches is on-policy)."""
    minibatches: int | None = None
    """Old name of ``optimizer_steps_per_rollout`` (an alias: moved there, then None)."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (Flow-GRPO's count GA, NOT GA x T': one JAGG call
    per minibatch covers all its trained steps)."""
    num_inner_epochs: int = 1
    """Passes over the rollout's minibatches (Flow-GRPO's ``num_inner_epochs``)."""
    tuning: str = "full"
    """"full" (all model parameters) or "lora" (peft adapters; needs peft)."""
    lora_rank: int = 8
    """LoRA rank (tuning="lora")."""
    eval_per_digit: int = 16
    """Held-out evaluation size: the digits task's samples per digit (0: no evaluation)."""
    eval_every: int = 0
    """Also evaluate every ``eval_every`` GRPO steps (0: only before and after)."""
    eval_sampler: str = "sde"
    """Evaluation sampler: "sde" (the rollout's SDE with fixed noise) or "ode" (the
    deterministic Euler sampler from fixed initial noise)."""
    eval_seed: int | None = None
    """Seed of the evaluation noise (None: ``seed + 10000``, disjoint from training)."""
    grid_samples: int = 8
    """Pictures per evaluation kept for ``grid.png`` (written to ``out`` at the end: the
    first evaluation's samples on the top row, the last one's below, same prompts and noise,
    each with its prompt and score; 0: no grid)."""
    probe_every: int = 0
    """Every ``probe_every`` GRPO steps, before the optimizer step, measure the cosine and
    relative error of this run's gradient estimator to the exact gradient on a separate
    full-SDE batch of the current policy (0: off; excluded from the timings)."""
    seed: int = 0
    """Seeds the prompts, the rollout noise and the evaluation noise."""
    device: str = "cpu"
    """"cpu" or "cuda" (or "cuda:N"); noise is drawn on the CPU, so runs agree across devices
    up to the model's round-off."""
    precision: str = "fp32"
    """"fp32" or "bf16" (the model under torch.autocast; latents, log-probs, loss in fp32)."""
    out: str | None = None
    """Folder for ``log.json`` and ``reward.png`` (None: nothing written)."""
    threads: int | None = 1
    """torch.set_num_threads (None: leave torch's setting). 1 by default: on a shared
    2-core machine two intra-op threads contend with other processes and ran up to 20x
    slower than one in our measurements, while this small model gains little from two."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def __post_init__(self) -> None:
        if self.minibatches is not None:
            if self.optimizer_steps_per_rollout not in (1, self.minibatches):
                raise ValueError(
                    f"minibatches={self.minibatches!r} is the old name of "
                    f"optimizer_steps_per_rollout={self.optimizer_steps_per_rollout!r}: give one"
                )
            self.optimizer_steps_per_rollout = self.minibatches
            self.minibatches = None

    @property
    def num_minibatches(self) -> int:
        """Minibatches per rollout: optimizer steps per epoch x accumulation steps."""
        return self.optimizer_steps_per_rollout * self.gradient_accumulation_steps

    @property
    def num_train_steps(self) -> int:
        """T': the steps trained per sample (mode="subsample": ``subsample_steps``)."""
        if self.mode == "subsample":
            return self.subsample_steps or expected_anchor_count(
                self.num_steps, self.window, self.shared_anchors
            )
        if self.mode == "mixgrpo":
            return self.window
        if self.mode == "nft":
            return self.nft_timesteps
        return max(1, int(self.num_steps * self.timestep_fraction))

    def validate(self, task: GRPOTask | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field.

        ``task``: the task object the run uses (default: the registered ``self.task``),
        whose ``max_prompts`` bounds ``prompts_per_step``.
        """
        ints_pos = {
            "steps": self.steps,
            "prompts_per_step": self.prompts_per_step,
            "group_size": self.group_size,
            "num_steps": self.num_steps,
            "optimizer_steps_per_rollout": self.optimizer_steps_per_rollout,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "num_inner_epochs": self.num_inner_epochs,
            "lora_rank": self.lora_rank,
        }
        for name, v in ints_pos.items():
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(self.task, str):
            raise ValueError(f"task must be a registered task name, got {self.task!r}")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"task_options must be a dict, got {self.task_options!r}")
        source = task if task is not None else task_factory(self.task)
        max_prompts = getattr(source, "max_prompts", None)
        if max_prompts is not None and self.prompts_per_step > max_prompts:
            name = getattr(source, "name", None) or self.task
            raise ValueError(
                f"prompts_per_step must be <= {max_prompts} (distinct prompts of task "
                f"{name!r}), got {self.prompts_per_step}"
            )
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (a group of one has advantage 0), got {self.group_size}"
            )
        if self.num_steps < 2:
            raise ValueError(
                f"num_steps must be >= 2 (a trajectory of >= 2 steps), got {self.num_steps}"
            )
        choices = {
            "eval_sampler": SAMPLERS,
            "mode": MODES,
            "schedule": SCHEDULES,
            "batching": BATCHINGS,
            "tuning": TUNING,
            "precision": PRECISIONS,
            "placement": PLACEMENTS,
            "timestep_selection": STEP_SELECTIONS,
            "sde_type": SDE_TYPES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("eval_every", "probe_every", "grid_samples"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.eval_seed is not None and not _is_int(self.eval_seed):
            raise ValueError(f"eval_seed must be None or an int, got {self.eval_seed!r}")
        if self.subsample_steps is not None and (
            not _is_int(self.subsample_steps) or not 1 <= self.subsample_steps <= self.num_steps
        ):
            raise ValueError(
                f"subsample_steps must be None or an int in [1, num_steps={self.num_steps}], "
                f"got {self.subsample_steps!r}"
            )
        if self.mix_shift_interval is not None and (
            not _is_int(self.mix_shift_interval) or self.mix_shift_interval < 1
        ):
            raise ValueError(
                f"mix_shift_interval must be None or an int >= 1, got {self.mix_shift_interval!r}"
            )
        if self.jagg_frac is not None and (
            not _is_real(self.jagg_frac) or not 0.0 <= self.jagg_frac <= 1.0
        ):
            raise ValueError(f"jagg_frac must be None or in [0, 1], got {self.jagg_frac!r}")
        if not _is_int(self.window) or not 2 <= self.window <= self.num_steps:
            raise ValueError(
                f"window must be an int in [2, num_steps={self.num_steps}], got {self.window!r}"
            )
        bools = ("shared_anchors", "reuse_values", "deferred", "progress", "exact_loop",
                 "track_memory")  # fmt: skip
        for name in bools:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        positive = {
            "noise_level": self.noise_level,
            "shift": self.shift,
            "lr": self.lr,
            "adv_clip_max": self.adv_clip_max,
        }
        for name, v in positive.items():
            if not _is_real(v) or v <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        for name in ("weight_decay", "clip_range", "beta"):
            v = getattr(self, name)
            if not _is_real(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not _is_real(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold!r}")
        if self.max_grad_norm is not None and (
            not _is_real(self.max_grad_norm) or self.max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be None or > 0, got {self.max_grad_norm!r}")
        if not _is_real(self.timestep_fraction) or not 0.0 < self.timestep_fraction <= 1.0:
            raise ValueError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction!r}")
        if self.mode in ("subsample", "mixgrpo", "nft") and (
            self.timestep_fraction != 1.0 or self.timestep_selection != "prefix"
        ):
            raise ValueError(
                f"timestep_fraction / timestep_selection do not combine with mode={self.mode!r} "
                "(subsample: set subsample_steps; mixgrpo: set window; nft: set nft_timesteps)"
            )
        if not _is_real(self.nft_beta) or self.nft_beta <= 0:
            raise ValueError(f"nft_beta must be a finite number > 0, got {self.nft_beta!r}")
        top = self.num_steps if self.mode == "nft" else math.inf  # other modes ignore it
        if not _is_int(self.nft_timesteps) or not 1 <= self.nft_timesteps <= top:
            raise ValueError(
                f"nft_timesteps must be an int in [1, num_steps={self.num_steps}], "
                f"got {self.nft_timesteps!r}"
            )
        if self.mode == "nft" and self.probe_every:
            raise ValueError(
                "probe_every must be 0 with mode='nft' (the probe compares to the exact GRPO "
                "gradient, which DiffusionNFT's loss does not estimate)"
            )
        if self.budget is not None and (not _is_real(self.budget) or self.budget <= 0):
            raise ValueError(f"budget must be None or a finite number > 0, got {self.budget!r}")
        if self.chunk_size is not None and (not _is_int(self.chunk_size) or self.chunk_size < 1):
            raise ValueError(f"chunk_size must be None or an int >= 1, got {self.chunk_size!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}")
        batch = self.prompts_per_step * self.group_size
        if batch % self.num_minibatches:
            raise ValueError(
                f"optimizer_steps_per_rollout (minibatches) x gradient_accumulation_steps = "
                f"{self.num_minibatches} must divide the rollout batch "
                f"prompts_per_step * group_size = {batch}"
            )
        if not _is_int(self.eval_per_digit) or self.eval_per_digit < 0:
            raise ValueError(f"eval_per_digit must be an int >= 0, got {self.eval_per_digit!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self) -> dict[str, Any]:
        """:meth:`to_dict` plus what the run derives from it (logged as ``config``)."""
        d = self.to_dict()
        d["minibatches"] = self.optimizer_steps_per_rollout
        d["num_minibatches"] = self.num_minibatches
        d["num_train_steps"] = self.num_train_steps
        if self.mode == "subsample":
            d["timestep_fraction"] = self.num_train_steps / self.num_steps
            d["timestep_selection"] = "random"
        if self.mode == "router":
            d["placement"] = "uniform"  # the router and the adaptive budget do not combine
        return d


# --------------------------------------------------------------------------------------------
# the digits-shaped rollout kept from the demo (wrappers of jagg_autograd.rollout)
# --------------------------------------------------------------------------------------------


def sigma_schedule(config: GRPOConfig) -> torch.Tensor:
    """``(num_steps + 1,)`` float64 sigmas from 1 to 0: linear ``1 - i/T`` or shifted."""
    if config.schedule == "linear":
        return torch.linspace(1.0, 0.0, config.num_steps + 1, dtype=torch.float64)
    return shifted_sigma_schedule(config.num_steps, config.shift, dtype=torch.float64)


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


def _as_trajectories(ro: Rollout, sigmas: torch.Tensor) -> Trajectories:
    return Trajectories(
        ro.latents,
        sigmas.to(ro.latents.device),
        ro.log_probs,
        ro.extra.get("velocities"),
        {"labels": ro.labels},
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
        _as_trajectories(ro, sigmas),
        steps=steps,
        noise_level=noise_level,
        mode=mode,
        window=window,
        shared_anchors=shared_anchors,
        router=router if mode == "router" else None,
        batching=batching,
    )
    return res.log_probs, res.stats


def _subsample(
    model: Callable[..., torch.Tensor],
    traj: Trajectories,
    *,
    noise_level: float,
    num: int,
    generator: torch.Generator | None,
    batching: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DanceGRPO's subsampling on :class:`Trajectories` (see :func:`subsample_log_probs`)."""
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
    lps = []
    for sl in slots:
        zs = z[sl].flatten(0, 1)
        n = zs.shape[0] // B
        cond = {
            k: v.repeat(n, *([1] * (v.dim() - 1)))
            if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B
            else v
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
    return _subsample(
        model,
        _as_trajectories(ro, sigmas),
        noise_level=noise_level,
        num=num,
        generator=generator,
        batching=batching,
    )


def mix_window_start(config: GRPOConfig, step: int) -> int:
    """First step of MixGRPO's window of ``config.window`` SDE steps at GRPO step ``step``.

    The window starts at step 0 and moves one step later every ``mix_shift_interval``
    GRPO steps until it reaches the end of the trajectory (MixGRPO's progressive schedule).
    """
    T, W = config.num_steps, config.window
    interval = config.mix_shift_interval or max(1, config.steps // (T - W + 1))
    return min(step // interval, T - W)


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
    from jagg_autograd.models.digits import NUM_CLASSES, digit_reward

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


# --------------------------------------------------------------------------------------------
# the policy call, the reference and the loss
# --------------------------------------------------------------------------------------------


class _Policy(nn.Module):
    """The task's velocity model under the run's precision, counting the samples it sees.

    ``bf16``: the call runs under ``torch.autocast`` and the velocity is returned in the
    latents' dtype (log-probs and the loss stay fp32).  ``forward_samples`` /
    ``grad_samples`` count the samples of every call (with grad: while grad is enabled).
    """

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.autocast = precision == "bf16"
        self.device_type = device.type
        self.forward_samples = 0
        self.grad_samples = 0

    def forward(self, z: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        self.forward_samples += z.shape[0]
        if torch.is_grad_enabled():
            self.grad_samples += z.shape[0]
        if not self.autocast:
            return self.model(z, t, **cond)
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            v = self.model(z, t, **cond)
        return v.to(z.dtype)


class _AdaptersOff:
    """The reference policy of LoRA training: the policy call with every adapter off."""

    def __init__(self, policy: _Policy) -> None:
        self.policy = policy

    def __call__(self, z: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        from jagg_autograd.integrations.diffusers import adapters_disabled

        with adapters_disabled(self.policy.model):
            return self.policy(z, t, **cond)


def _grpo_loss_mean(
    lp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    config: GRPOConfig,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
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


def _core_available() -> bool:
    return "values" in inspect.signature(jagg_trajectory).parameters


@dataclass
class _Minibatch:
    """A rollout minibatch and what is fixed for it until the next rollout."""

    traj: Trajectories
    adv: torch.Tensor
    steps: tuple[int, int] | torch.Tensor | None
    ref_means: torch.Tensor | None = None


def _minibatch_loss(
    tr: GRPOTrainer,
    mb: _Minibatch,
    *,
    mode: str,
    step: int,
    generator: torch.Generator,
    on_policy: bool,
    loop: bool = False,
    scale: float = 1.0,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, Any]]:
    """The loss whose gradient is this run's estimator on one minibatch, and its cost.

    ``mode="nft"``, and ``mode="exact"`` with ``loop=True`` (Flow-GRPO's per-step loop),
    run their backwards of ``scale * loss`` themselves, step by step: the loss is then
    returned detached and ``cost["backward_done"]`` is True (``cost["backward_seconds"]``:
    the time of those backwards).
    """
    c = tr.config
    B = mb.traj.batch_size
    if mode == "nft":
        return _nft_minibatch(tr, mb, generator=generator, on_policy=on_policy, scale=scale)
    if mode == "exact" and loop:
        return _exact_loop(tr, mb, scale=scale)
    if mode == "subsample":
        lp, old, _ = _subsample(
            tr.policy,
            mb.traj,
            noise_level=c.noise_level,
            num=c.num_train_steps,
            generator=generator,
            batching=c.batching,
        )
        loss, infos = _grpo_loss_mean(lp, old, mb.adv, c)
        calls = 1 if c.batching == "stacked" else c.num_train_steps
        grad = c.num_train_steps * B
        return (
            loss,
            infos,
            {
                "routed_frac": 0.0,
                "stats": None,
                "path": "exact",
                "grad_forward_calls": calls,
                "grad_samples": grad,
                "pairs": grad,
            },
        )
    steps = mb.steps
    if mode == "mixgrpo":
        lo = mix_window_start(c, step)
        steps = (lo, lo + c.window)
    kw: dict[str, Any] = {}
    reuse = False
    path = "exact" if mode in ("exact", "mixgrpo") else "eager"
    if mode in _JAGG_MODES:
        reuse = c.reuse_values and on_policy
        adaptive = c.placement == "adaptive" and mode == "jagg"
        if reuse or c.deferred or adaptive:
            # Values are only ever used with the deferred backward (no forward at all but the
            # anchors'); off-policy minibatches recompute every step.
            kw.update(deferred=True, params=tr.params)
            if adaptive:
                kw["placement"] = c.placement
                if c.budget is not None:
                    kw["budget"] = c.budget
            path = "values+deferred" if reuse else "deferred"
    res = policy_log_probs(
        tr.policy,
        mb.traj,
        steps=steps,
        noise_level=c.noise_level,
        mode="exact" if mode in ("exact", "mixgrpo") else "jagg",
        window=c.window,
        shared_anchors=c.shared_anchors,
        router=tr.router if mode == "router" else None,
        batching=c.batching,
        chunk_size=c.chunk_size,
        reuse_values=reuse,
        core_kwargs=kw,
    )
    kl = None
    if mb.ref_means is not None:
        kl = torch.stack(
            [
                kl_to_reference(res.means[j], mb.ref_means[j], res.std_dev_t[j])
                for j in range(res.means.shape[0])
            ]
        )
    loss, infos = _grpo_loss_mean(res.log_probs, res.old_log_probs, mb.adv, c, kl)
    # As the demo always logged it: exact mode counts every window as exact-routed.
    routed = float(res.stats.exact.float().mean()) if mode != "mixgrpo" else 0.0
    cost = {"routed_frac": routed, "stats": res.stats, "path": path,
            "pairs": res.log_probs.numel()}  # fmt: skip
    return loss, infos, cost


def _timed_backward(loss: torch.Tensor) -> float:
    """``loss.backward()`` now; its seconds (the step loops report them as backward time)."""
    t0 = time.perf_counter()
    loss.backward()
    return time.perf_counter() - t0


def _exact_loop(
    tr: GRPOTrainer, mb: _Minibatch, *, scale: float
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, Any]]:
    """Flow-GRPO's training loop: per trained step j, its velocities with grad, its loss
    term ``loss_j / T'`` (the clipped GRPO loss of :func:`_grpo_loss_mean`, KL included)
    and at once ``(scale * loss_j / T').backward()``; one step's activations at a time."""
    c = tr.config
    B = mb.traj.batch_size
    steps = (0, mb.traj.num_steps) if mb.steps is None else mb.steps
    n = steps[1] - steps[0] if isinstance(steps, tuple) else steps.shape[0]
    losses, infos, bw = [], [], 0.0
    for j in range(n):
        sj = (steps[0] + j, steps[0] + j + 1) if isinstance(steps, tuple) else steps[j : j + 1]
        res = policy_log_probs(
            tr.policy, mb.traj, steps=sj, noise_level=c.noise_level, mode="exact",
            batching=c.batching, chunk_size=c.chunk_size,
        )  # fmt: skip
        kl = None
        if mb.ref_means is not None:
            kl = kl_to_reference(res.means[0], mb.ref_means[j], res.std_dev_t[0])[None]
        loss_j, info_j = _grpo_loss_mean(res.log_probs, res.old_log_probs, mb.adv, c, kl)
        bw += _timed_backward(loss_j * (scale / n))
        losses.append(loss_j.detach())
        infos += info_j
    cost = {"routed_frac": 1.0, "stats": None, "path": "exact", "grad_forward_calls": n,
            "grad_samples": n * B, "pairs": n * B, "backward_done": True,
            "backward_seconds": bw}  # fmt: skip
    return torch.stack(losses).mean(), infos, cost  # the batched path's arithmetic


def _nft_minibatch(
    tr: GRPOTrainer,
    mb: _Minibatch,
    *,
    generator: torch.Generator,
    on_policy: bool,
    scale: float,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, Any]]:
    """DiffusionNFT's loss on one minibatch (:mod:`jagg_autograd.nft`), one forward +
    backward per training timestep as their train_nft_sd3.py does (loss / nft_timesteps).

    ``v_old`` is the sampling policy, i.e. the parameters at the rollout: on-policy
    minibatches (no optimizer step since the rollout) call the current policy without
    grad; later ones call it at a snapshot of the trainable parameters taken before the
    rollout's first optimizer step (fresh noise and timesteps are drawn per minibatch and
    inner epoch, as theirs, so ``v_old`` cannot be precomputed at the rollout).
    """
    from jagg_autograd.nft import ParamSnapshot, draw_timesteps, nft_loss

    c = tr.config
    traj, B, n = mb.traj, mb.traj.batch_size, c.nft_timesteps
    if float(traj.sigmas[-1].max()) != 0.0:
        raise ValueError("mode='nft' needs a schedule ending at sigma = 0 (clean final latents)")
    snap = getattr(tr, "_nft_snapshot", None)
    if on_policy and (snap is None or snap[0] != tr.step_index):
        snap = tr._nft_snapshot = (tr.step_index, ParamSnapshot(tr.params))

    def v_old_of(xt: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if on_policy or snap is None:
            with torch.no_grad():
                return tr.policy(xt, t, **traj.cond)
        return snap[1].call(tr.policy, xt, t, **traj.cond)

    x0 = traj.latents[-1]  # sigma = 0: the clean samples
    ts = draw_timesteps(traj.sigmas, B, n, generator)
    losses, infos, bw = [], [], 0.0
    for j in range(n):
        t = ts[j].to(device=x0.device, dtype=x0.dtype)
        eps = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0)
        te = t.view(-1, *([1] * (x0.dim() - 1)))
        xt = (1 - te) * x0 + te * eps
        v_old = v_old_of(xt, t)
        v = tr.policy(xt, t, **traj.cond)
        loss_j = nft_loss(v, v_old, xt, x0, t, mb.adv, beta=c.nft_beta,
                          adv_clip_max=c.adv_clip_max)  # fmt: skip
        info = {"clipfrac": torch.zeros(()), "approx_kl": torch.zeros(()),
                "ratio_min": torch.ones(()), "ratio_max": torch.ones(())}  # fmt: skip
        if tr.reference is not None:
            # Their KL: train.beta * mean_b mean((v_theta - v_ref)^2) at the same x_t.
            with torch.no_grad():
                v_ref = tr.reference(xt, t, **traj.cond)
            kl = ((v - v_ref) ** 2).flatten(1).mean(1)
            loss_j = loss_j + c.beta * kl.mean()
            info["kl"] = kl.detach().mean().cpu()
        bw += _timed_backward(loss_j * (scale / n))
        losses.append(loss_j.detach().float())
        infos.append(info)
    cost = {"routed_frac": 0.0, "stats": None, "path": "nft", "grad_forward_calls": n,
            "grad_samples": n * B, "pairs": traj.num_steps * B, "backward_done": True,
            "backward_seconds": bw}  # fmt: skip
    return torch.stack(losses).mean(), infos, cost


def _stats_cost(cost: dict[str, Any]) -> tuple[int, int]:
    """``(grad_samples, grad_forward_calls)``, read after the backward (deferred calls fill
    them in there)."""
    st = cost["stats"]
    if st is None:
        return int(cost["grad_samples"]), int(cost["grad_forward_calls"])
    calls = st.grad_forward_calls if hasattr(st, "grad_forward_calls") else st.backward_calls
    return int(st.grad_samples), int(calls)


def _estimator_loss(
    model: Callable[..., torch.Tensor],
    ro: Rollout,
    adv: torch.Tensor,
    sigmas: torch.Tensor,
    config: GRPOConfig,
    router: CosineRouter | None,
    *,
    step: int,
    generator: torch.Generator,
    mode: str | None = None,
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], dict[str, float]]:
    """The estimator's loss on a digits :class:`Rollout` (``mode`` overrides the config's).

    A thin front of the trainer's minibatch loss, kept for tests and scripts: eager paths
    only (no ``values``), all T steps (or the config's subsample / MixGRPO steps).
    """
    params = (
        [p for p in model.parameters() if p.requires_grad] if isinstance(model, nn.Module) else []
    )
    shim = _Shim(model, config, router, params)
    mb = _Minibatch(_as_trajectories(ro, sigmas), adv, None)
    loss, infos, cost = _minibatch_loss(
        shim,  # type: ignore[arg-type]
        mb,
        mode=config.mode if mode is None else mode,
        step=step,
        generator=generator,
        on_policy=False,
    )
    gs, calls = _stats_cost(cost)
    return loss, infos, {"routed_frac": cost["routed_frac"], "backward_calls": calls,
                         "grad_samples": gs}  # fmt: skip


@dataclass
class _Shim:
    """What :func:`_minibatch_loss` reads of a trainer, for :func:`_estimator_loss`."""

    policy: Callable[..., torch.Tensor]
    config: GRPOConfig
    router: CosineRouter | None
    params: list[torch.Tensor] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# the trainer
# --------------------------------------------------------------------------------------------


def _write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def _resolve_task(config: GRPOConfig, name: str) -> GRPOTask:
    """The registered task ``name`` built with the config's options."""
    options = dict(config.task_options)
    params = inspect.signature(task_factory(name)).parameters
    if "eval_per_digit" in params and "eval_per_digit" not in options:
        options["eval_per_digit"] = config.eval_per_digit
    return get_task(name, **options)


def _resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available (use device='cpu')")
    return device


class GRPOTrainer:
    """Online GRPO on a task, one :meth:`step` at a time.

    ``GRPOTrainer(config, task=None)``: ``task`` is a :class:`~jagg_autograd.tasks.GRPOTask`,
    a registered name, or None (``config.task``, default ``"digits"``).  The constructor
    checks ``config.out``, builds the task's model on ``config.device`` and, if
    ``eval_per_digit > 0``, runs the initial evaluation; :meth:`step` runs one GRPO step
    (plus the probe / evaluation due at it) and returns its log row; :meth:`finish` runs
    the final evaluation and returns (and writes) the log of :func:`train`.  Each trainer
    owns its noise generators, so several trainers stepped in turn give the runs each
    would give alone.
    """

    def __init__(
        self, config: GRPOConfig | None = None, task: GRPOTask | str | None = None
    ) -> None:
        config = GRPOConfig() if config is None else config
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        if isinstance(task, str):
            config = dataclasses.replace(config, task=task)
        task_obj = task if isinstance(task, GRPOTask) else None
        if task_obj is None and task is not None and not isinstance(task, str):
            raise TypeError(f"task must be a GRPOTask or a task name, got {type(task).__name__}")
        config.validate(task_obj)
        wants_core = config.mode in _JAGG_MODES and (
            config.reuse_values or config.deferred or config.placement != "uniform"
        )
        if wants_core and not _core_available():
            raise ValueError(
                "reuse_values / deferred / placement need jagg_trajectory(values=, deferred=, "
                "placement=), which this build of jagg_autograd.window does not have"
            )
        self.config = config
        self.run_id = uuid.uuid4().hex
        self.started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._t_start = time.perf_counter()
        self.out = Path(config.out) if config.out is not None else None
        self.log: dict[str, Any] = {
            "run_id": self.run_id,
            "started_at": self.started_at,
            "status": "running",
            "task": config.task,
            "config": config.resolved(),
            "steps": [],
            "evals": [],
            "eval": {},
            "rollout_seconds": 0.0,
            "train_seconds": 0.0,
            "total_seconds": 0.0,
            "summary": "",
            "out": str(self.out) if self.out is not None else None,
        }
        self.device = _resolve_device(config.device)
        self.step_index = 0
        self.rollout_seconds = 0.0
        self.train_seconds = 0.0
        self._prepare_out()  # before any model is built: a bad --out fails at once
        self._grid_rows: list[tuple[torch.Tensor, list[str], int]] = []
        try:
            self._build(task_obj)
            if config.eval_per_digit:
                self._record_eval()
        except BaseException as exc:  # the log on disk must not stay "running"
            self.abort(exc)
            raise
        self._write()

    def _build(self, task_obj: GRPOTask | None) -> None:
        """The task, its model on the device, the optimizer, the reference, the schedule."""
        config = self.config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.task = (task_obj or _resolve_task(config, config.task)).to(self.device)
        self.log["task"] = self.log["config"]["task"] = self.task.name or config.task
        self.model = self.task.velocity_model()
        self.params = self.task.trainable_parameters(config.tuning, config.lora_rank)
        self.model.to(self.device)
        self.policy = _Policy(self.model, config.precision, self.device)
        self.reference: Callable[..., torch.Tensor] | None = None
        if config.beta > 0:
            if config.tuning == "lora":
                self.reference = _AdaptersOff(self.policy)
            else:
                frozen = copy.deepcopy(self.model).requires_grad_(False)
                self.reference = _Policy(frozen, config.precision, self.device)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay
        )
        self.router = (
            CosineRouter(config.threshold, config.jagg_frac) if config.mode == "router" else None
        )
        self.sigmas = sigma_schedule(config)
        # Disjoint from the training noise stream.
        self.eval_seed = config.seed + 10_000 if config.eval_seed is None else config.eval_seed
        self._mb = config.prompts_per_step * config.group_size // config.num_minibatches
        self.log["sigmas"] = [round(x, 6) for x in self.sigmas.tolist()]
        self.log["num_trainable_parameters"] = sum(p.numel() for p in self.params)

    # ------------------------------------------------------------------ files

    def _prepare_out(self) -> None:
        if self.out is None:
            return
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            for name in ("log.json", "reward.png", "grid.png"):
                if (self.out / name).is_dir():
                    raise OSError(f"{self.out / name} is a directory")
            for name in ("reward.png", "grid.png"):
                stale = self.out / name
                if stale.exists():
                    stale.unlink()  # a previous run's picture must not look like this run's
            self._write()
        except OSError as exc:
            raise ValueError(f"out={str(self.out)!r} is not a writable folder: {exc}") from exc

    def _write(self) -> None:
        if self.out is not None:
            self.log["total_seconds"] = time.perf_counter() - self._t_start
            _write_json_atomic(self.out / "log.json", self.log)

    # ------------------------------------------------------------------ sampling

    def _sample(
        self,
        prompts: Sequence[Any],
        generator: torch.Generator,
        *,
        sde_steps: Sequence[int] | None = None,
    ) -> Trajectories:
        """Trajectories of ``prompts`` (one sample each), noise from ``generator`` on the CPU."""
        shape = (len(prompts), *self.task.latent_shape)
        noise = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        return sample_trajectories(
            self.policy,
            noise,
            self.sigmas,
            cond=self.task.cond(prompts),
            noise_level=self.config.noise_level,
            generator=generator,
            sde_steps=sde_steps,
            sde_type=self.config.sde_type,
        )

    def _group(self, prompts: Sequence[Any]) -> tuple[list[Any], torch.Tensor]:
        """Each prompt ``group_size`` times, and the group ids (the prompt's index)."""
        g = self.config.group_size
        rep = [p for p in prompts for _ in range(g)]
        return rep, torch.arange(len(prompts)).repeat_interleave(g)

    # ------------------------------------------------------------------ measurements

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out reward of the current policy on the fixed evaluation noise."""
        prompts = self.task.eval_prompts()
        g = torch.Generator().manual_seed(self.eval_seed)
        traj = self._sample(prompts, g, sde_steps=[] if self.config.eval_sampler == "ode" else None)
        final = traj.latents[-1]
        r = self.task.reward(final, prompts)
        if self.config.grid_samples:
            # Evenly spread over the evaluation set (tasks order it by category / label).
            k = min(self.config.grid_samples, len(prompts))
            idx = torch.linspace(0, len(prompts) - 1, k).round().long().tolist()
            pics = self.task.decode(final[idx].detach().cpu())
            if pics is not None:  # None: the task's latents are not pictures
                row = (pics, [grid_caption(prompts[i], float(r[i])) for i in idx], self.step_index)
                # grid.png shows the first evaluation and the latest: keep only those two.
                self._grid_rows = [*self._grid_rows[:1], row]
        return {
            "mean_reward": float(r.mean()),
            **self.task.eval_breakdown(final, prompts),
            "samples": len(prompts),
        }

    def _record_eval(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        counts = self.policy.forward_samples, self.policy.grad_samples
        ev = self.evaluate()
        self.policy.forward_samples, self.policy.grad_samples = counts
        ev.update(
            step=self.step_index,
            wall_seconds=self.rollout_seconds + self.train_seconds,
            train_seconds=self.train_seconds,
            sampler=self.config.eval_sampler,
            eval_seconds=time.perf_counter() - t0,
        )
        self.log["evals"].append(ev)
        return ev

    def probe(self) -> dict[str, float]:
        """Cosine / relative error of this run's gradient to the exact one, now.

        On a fresh full-SDE batch of the current policy (same prompts and noise for every
        run with this ``eval_seed`` at this step): the exact gradient of the mean GRPO loss
        over all T steps against this run's estimator of it on the same batch (the
        routed/JAGG gradient, the subsampled one, or MixGRPO's window of this step).
        Nothing is accumulated into ``.grad``.
        """
        c = self.config
        t0 = time.perf_counter()
        counts = self.policy.forward_samples, self.policy.grad_samples
        g = torch.Generator().manual_seed((self.eval_seed + 1) * 1_000_003 + self.step_index)
        prompts, groups = self._group(self.task.sample_prompts(c.prompts_per_step, g))
        traj = self._sample(prompts, g)
        adv = group_advantages(self.task.reward(traj.latents[-1], prompts), groups)
        mb = _Minibatch(traj, adv, None)
        kw = {"step": self.step_index, "generator": g, "on_policy": True}
        ref, _, _ = _minibatch_loss(self, mb, mode="exact", **kw)
        g_ref = torch.autograd.grad(ref, self.params, allow_unused=True)
        mb.steps = self._train_steps(traj.batch_size, g)
        est, _, cost = _minibatch_loss(self, mb, mode=c.mode, **kw)
        g_est = torch.autograd.grad(est, self.params, allow_unused=True)
        cos, rel, _, _ = compare_grads(g_ref, g_est, self.params)
        self.policy.forward_samples, self.policy.grad_samples = counts
        return {
            "probe_cosine": cos,
            "probe_rel_error": rel,
            "probe_routed_frac": cost["routed_frac"],
            "probe_seconds": time.perf_counter() - t0,
        }

    def _train_steps(
        self, batch: int, generator: torch.Generator
    ) -> tuple[int, int] | torch.Tensor | None:
        """The trained steps of a minibatch (None: all T; subsample/MixGRPO choose their own)."""
        c = self.config
        if c.mode in ("subsample", "mixgrpo", "nft") or c.num_train_steps == c.num_steps:
            return None
        return select_steps(
            c.num_steps, batch, c.num_train_steps, c.timestep_selection, generator=generator
        )

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, Any]:
        """One GRPO step: probe if due, rollout, optimizer step(s), evaluation if due."""
        c = self.config
        probe = self.probe() if c.probe_every and self.step_index % c.probe_every == 0 else {}
        if c.track_memory:
            # The rollout and the reference run without grad (nothing saved): the peak is the
            # training phase's, the deferred backward's recomputation included.
            exclude = [*self.model.parameters(), *self.params]
            if isinstance(self.reference, _Policy):
                exclude += list(self.reference.model.parameters())
            with SavedTensorTracker(exclude=exclude) as mem:
                row = _grpo_step(self)
            row["peak_saved_bytes"] = int(mem.peak)
        else:
            row = _grpo_step(self)
        row["step"] = self.step_index
        row.update(probe)
        self.step_index += 1
        self.rollout_seconds += row["rollout_seconds"]
        self.train_seconds += row["train_seconds"]
        self.log["steps"].append(row)
        if (
            c.eval_per_digit
            and c.eval_every
            and self.step_index % c.eval_every == 0
            and self.step_index < c.steps
        ):
            self._record_eval()
        self._totals()
        self._write()
        return row

    def _totals(self) -> None:
        self.log["rollout_seconds"] = self.rollout_seconds
        self.log["train_seconds"] = self.train_seconds
        self.log["total_seconds"] = time.perf_counter() - self._t_start

    def finish(self) -> dict[str, Any]:
        """Final evaluation, totals and summary; writes ``log.json`` / ``reward.png``."""
        log = self.log
        if self.config.eval_per_digit:
            self._record_eval()
            log["eval"] = {"initial": log["evals"][0], "final": log["evals"][-1]}
        self._totals()
        log["status"] = "finished"
        log["summary"] = summarize(log)
        self._write()
        if self.out is not None:
            _plot(self.out / "reward.png", log)
            self._save_grid()
        return log

    def _save_grid(self) -> None:
        """``grid.png``: the first and the last evaluation's kept samples, one row each."""
        if len(self._grid_rows) < 2 or self.out is None:
            return
        (a, ca, sa), (b, cb, sb) = self._grid_rows[0], self._grid_rows[-1]
        path = save_grid(
            self.out / "grid.png",
            torch.cat([a, b]),
            [f"step {sa}: {c}" for c in ca] + [f"step {sb}: {c}" for c in cb],
            ncols=a.shape[0],
            title=f"{self.task.name or 'task'}: held-out samples before (top) and after "
            "(bottom) training, fixed noise",
        )
        self.log["grid"] = str(path)
        self._write()

    def abort(self, exc: BaseException) -> dict[str, Any]:
        """Close the log of a run stopped by ``exc`` (Ctrl-C or an error); keep every step.

        Status "interrupted" (KeyboardInterrupt) or "failed" with the error's text; the
        summary says how many steps finished; the log and, if a step finished, the plot
        are written.  Returns the log.
        """
        log = self.log
        interrupted = isinstance(exc, KeyboardInterrupt)
        log["status"] = "interrupted" if interrupted else "failed"
        if not interrupted:
            log["error"] = f"{type(exc).__name__}: {exc}"
        if log["evals"]:
            log["eval"] = {"initial": log["evals"][0]}
        self._totals()
        log["summary"] = summarize(log)
        self._write()
        if self.out is not None and log["steps"]:
            _plot(self.out / "reward.png", log)
        return log


def train(
    config: GRPOConfig | None = None,
    *,
    task: GRPOTask | str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run online GRPO on a task (default: digits); return the log (also written to ``out``).

    Log keys: ``run_id``, ``started_at``, ``status``, ``task``, ``config`` (the resolved
    config), ``steps`` (one dict per GRPO step: ``reward_mean``, ``reward_std``, ``loss``,
    ``clipfrac``, ``approx_kl``, ``ratio_min``/``ratio_max``, ``grad_norm``,
    ``routed_frac`` (fraction of (window, sample) pairs given the exact gradient),
    ``anchor_frac`` (trained (step, sample) pairs run with grad), ``forward_samples``
    (model samples of the training phase), ``grad_samples`` (with grad),
    ``grad_forward_calls`` (= ``backward_calls``, the with-grad model calls),
    ``backward_passes`` (``loss.backward()`` calls), ``optimizer_steps``, ``paths`` (per
    minibatch: "values+deferred", "deferred", "eager", "exact" or "nft"), ``rollout_seconds``,
    ``train_seconds`` and its phases ``reference_seconds``, ``forward_seconds``,
    ``backward_seconds``, ``optimizer_seconds``; on probe steps ``probe_cosine`` /
    ``probe_rel_error``; with ``track_memory`` ``peak_saved_bytes``), ``evals`` (the
    held-out evaluations, the first before training and the last after: ``step``,
    ``mean_reward``, the task's breakdown (digits: ``per_digit``), ``wall_seconds`` =
    rollout + training time so far), ``eval`` (the first and last as ``initial`` /
    ``final``), ``total_seconds``, ``rollout_seconds``,
    ``train_seconds``, ``summary``, ``out``.

    Raises:
        ValueError: bad config (see :meth:`GRPOConfig.validate`), an unwritable ``out``,
            or non-finite rewards / log-probs (from :func:`group_advantages` /
            :func:`grpo_loss`).
        TrainingDivergedError: a non-finite loss or gradient norm (the step is named).
        KeyboardInterrupt: re-raised after the partial log is written.
    """
    trainer = GRPOTrainer(config, task=task)
    bar = None
    if trainer.config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=trainer.config.steps, desc="GRPO", unit="step", dynamic_ncols=True)
    try:
        for _ in range(trainer.config.steps):
            row = trainer.step()
            if on_step is not None:
                on_step(row)
            if bar is not None:
                bar.set_postfix(
                    reward=f"{row['reward_mean']:.3f}",
                    clipfrac=f"{row['clipfrac']:.2f}",
                    routed=f"{row['routed_frac']:.2f}",
                    s_per_step=f"{row['rollout_seconds'] + row['train_seconds']:.2f}",
                )
                bar.update(1)
    except BaseException as exc:
        trainer.abort(exc)
        raise
    finally:
        if bar is not None:
            bar.close()
    return trainer.finish()


def _check_finite(value: torch.Tensor, what: str, step: int, where: str) -> None:
    if not bool(torch.isfinite(value)):
        raise TrainingDivergedError(
            f"GRPO step {step}: the {what} is {float(value)} ({where}); stopped before the "
            "optimizer step. Lower lr, clip_range or adv_clip_max, or set max_grad_norm; the "
            "log keeps every finished step"
        )


def _grpo_step(tr: GRPOTrainer) -> dict[str, Any]:
    """One rollout + the inner epochs of minibatch optimizer steps; returns the log row."""
    c = tr.config
    gen = tr.generator
    mb_size = tr._mb
    t0 = time.perf_counter()
    prompts = tr.task.sample_prompts(c.prompts_per_step, gen)
    rep, groups = tr._group(prompts)
    sde_steps = None
    if c.mode == "mixgrpo":
        lo = mix_window_start(c, tr.step_index)
        sde_steps = range(lo, lo + c.window)
    # Sample in the minibatches that will be trained, so that each minibatch's
    # recomputation sees exactly the batch of its rollout (the condition for a
    # bit-identical ratio, and for values= to be the current parameters' velocities).
    trajs = [tr._sample(rep[i : i + mb_size], gen, sde_steps=sde_steps)
             for i in range(0, len(rep), mb_size)]  # fmt: skip
    rewards = torch.cat(
        [
            tr.task.reward(t.latents[-1], rep[i * mb_size : (i + 1) * mb_size])
            for i, t in enumerate(trajs)
        ]
    ).float()
    adv = group_advantages(rewards, groups)  # raises ValueError on NaN rewards
    t1 = time.perf_counter()

    mbs = [
        _Minibatch(t, adv[i * mb_size : (i + 1) * mb_size].to(t.latents.device),
                   tr._train_steps(t.batch_size, gen))
        for i, t in enumerate(trajs)
    ]  # fmt: skip
    if tr.reference is not None and c.mode != "nft":  # nft: its reference runs at x_t
        for mb in mbs:  # once per rollout, reused by every inner epoch
            mb.ref_means = reference_means(
                tr.reference, mb.traj, steps=mb.steps, noise_level=c.noise_level
            )
    t_ref = time.perf_counter()
    f0 = tr.policy.forward_samples

    keys = ("loss", "clipfrac", "approx_kl", "ratio_min", "ratio_max", "grad_norm", "kl")
    acc: dict[str, list[float]] = {k: [] for k in keys}
    routed, paths, grad_calls, grad_samples, pairs = [], [], 0, 0, 0
    plan_s = 0.0  # adaptive placement's planning time (inside the backward)
    passes = 0  # loss.backward() calls (the step loops run one per trained step)
    phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    opt_steps = 0
    GA = c.gradient_accumulation_steps
    tr.optimizer.zero_grad(set_to_none=True)
    for epoch in range(c.num_inner_epochs):
        for i, mb in enumerate(mbs):
            where = f"epoch {epoch}, minibatch {i}"
            ta = time.perf_counter()
            loss, infos, cost = _minibatch_loss(
                tr, mb, mode=c.mode, step=tr.step_index, generator=gen, on_policy=opt_steps == 0,
                loop=c.exact_loop, scale=1.0 / GA,
            )  # fmt: skip
            _check_finite(loss.detach(), "loss", tr.step_index, where)
            tb = time.perf_counter()
            if not cost.get("backward_done"):
                (loss / GA).backward()
            tc = time.perf_counter()
            bw_in = cost.get("backward_seconds", 0.0)  # backwards run inside the step loops
            gs, calls = _stats_cost(cost)
            grad_samples += gs
            grad_calls += calls
            plan_s += float(getattr(cost.get("stats"), "plan_seconds", 0.0) or 0.0)
            pairs += cost["pairs"]
            routed.append(cost["routed_frac"])
            paths.append(cost["path"])
            passes += calls if cost.get("backward_done") else 1
            acc["loss"].append(float(loss.detach()))
            for k in ("clipfrac", "approx_kl"):
                acc[k].append(float(torch.stack([f[k] for f in infos]).mean()))
            acc["ratio_min"].append(float(torch.stack([f["ratio_min"] for f in infos]).min()))
            acc["ratio_max"].append(float(torch.stack([f["ratio_max"] for f in infos]).max()))
            if "kl" in infos[0]:
                acc["kl"].append(float(torch.stack([f["kl"] for f in infos]).mean()))
            if (i + 1) % GA == 0:
                params = tr.params
                if c.max_grad_norm is not None:
                    gn = torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
                else:
                    gn = torch.sqrt(
                        sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None)
                    )
                _check_finite(gn.detach(), "gradient norm", tr.step_index, where)
                tr.optimizer.step()
                tr.optimizer.zero_grad(set_to_none=True)
                opt_steps += 1
                acc["grad_norm"].append(float(gn))
            phase["forward"] += tb - ta - bw_in
            phase["backward"] += tc - tb + bw_in
            phase["optimizer"] += time.perf_counter() - tc
    t2 = time.perf_counter()

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    row = {
        "prompts": list(prompts),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "loss": mean(acc["loss"]),
        "clipfrac": mean(acc["clipfrac"]),
        "approx_kl": mean(acc["approx_kl"]),
        "ratio_min": min(acc["ratio_min"]),
        "ratio_max": max(acc["ratio_max"]),
        "grad_norm": mean(acc["grad_norm"]),
        "routed_frac": mean(routed),
        "anchor_frac": grad_samples / pairs,
        "forward_samples": tr.policy.forward_samples - f0,
        "grad_samples": grad_samples,
        "grad_forward_calls": grad_calls,
        "backward_calls": grad_calls,
        "backward_passes": passes,
        "optimizer_steps": opt_steps,
        "paths": paths,
        "rollout_seconds": t1 - t0,
        "train_seconds": t2 - t1,
        "reference_seconds": t_ref - t1,
        "plan_seconds": plan_s,
        **{f"{k}_seconds": v for k, v in phase.items()},
    }
    if acc["kl"]:
        row["kl"] = mean(acc["kl"])
    return row


# --------------------------------------------------------------------------------------------
# plot and summary
# --------------------------------------------------------------------------------------------


def _plot(path: Path, log: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["steps"]]
    mean = [r["reward_mean"] for r in log["steps"]]
    std = [r["reward_std"] for r in log["steps"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    ax.fill_between(steps, lo, hi, alpha=0.2, label="rollout reward ± std")
    ax.plot(steps, mean, marker=".", label="rollout reward (mean)")
    k = max(1, len(mean) // 8)
    if len(mean) >= 2 * k and k > 1:
        smooth = [
            sum(mean[max(0, i - k + 1) : i + 1]) / len(mean[max(0, i - k + 1) : i + 1])
            for i in range(len(mean))
        ]
        ax.plot(steps, smooth, label=f"moving average ({k})")
    ev = log.get("eval") or {}
    if "initial" in ev and "final" in ev:
        ax.scatter(
            [0, steps[-1]],
            [ev["initial"]["mean_reward"], ev["final"]["mean_reward"]],
            color="black",
            zorder=3,
            label="held-out eval",
        )
    cfg = log["config"]
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0.0, 1.0)
    status = "" if log.get("status") in (None, "finished") else f" [{log['status']}]"
    ax.set_title(f"GRPO on {cfg.get('task', 'digits')}: {_method(cfg)}{status}", fontsize=9)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _method(cfg: dict[str, Any]) -> str:
    """The gradient settings that apply to the run's mode, in words."""
    mode = cfg["mode"]
    if mode == "exact":
        txt = "exact"
    elif mode == "subsample":
        txt = f"subsample ({cfg.get('num_train_steps')} random steps per sample)"
    elif mode == "mixgrpo":
        txt = f"mixgrpo (sliding SDE window of {cfg['window']} steps)"
    elif mode == "nft":
        txt = (
            f"nft (DiffusionNFT forward-process loss, beta {cfg.get('nft_beta', 1.0):g}, "
            f"{cfg.get('nft_timesteps', 4)} timesteps per sample)"
        )
    else:
        anchors = "shared" if cfg["shared_anchors"] else "disjoint"
        txt = f"{mode}, window {cfg['window']}, {anchors} anchors"
        if mode == "router":
            txt += f", router threshold {cfg['threshold']:g}"
            if cfg.get("jagg_frac") is not None:
                txt += f" jagg_frac {cfg['jagg_frac']:g}"
        extras = []
        if cfg.get("reuse_values"):
            extras.append("on-policy values")
        if cfg.get("deferred"):
            extras.append("deferred backward")
        if cfg.get("placement", "uniform") != "uniform":
            budget = cfg.get("budget")
            extras.append(
                f"{cfg['placement']} placement" + (f" budget {budget:g}" if budget else "")
            )
        if extras:
            txt += ", " + ", ".join(extras)
    if mode == "exact" and not cfg.get("exact_loop", True):
        txt += " (batched: one backward over all trained steps)"
    if mode in ("exact", "jagg", "router") and cfg.get("timestep_fraction", 1.0) < 1.0:
        txt += f", {cfg.get('num_train_steps')} {cfg['timestep_selection']} steps trained"
    return txt


def summarize(log: dict[str, Any]) -> str:
    """The one-paragraph summary the demo prints (only the settings that apply to the mode)."""
    cfg = log["config"]
    rows = log["steps"]
    n = len(rows)
    status = log.get("status", "finished")
    opt = f"{cfg['tuning']} fine-tuning" + (
        f" (rank {cfg['lora_rank']})" if cfg["tuning"] == "lora" else ""
    )
    extra = []
    if cfg.get("beta", 0.0) > 0:
        extra.append(f"KL beta {cfg['beta']:g}")
    if cfg.get("optimizer_steps_per_rollout", 1) > 1:
        extra.append(f"{cfg['optimizer_steps_per_rollout']} optimizer steps per rollout")
    if cfg.get("gradient_accumulation_steps", 1) > 1:
        extra.append(f"accumulation {cfg['gradient_accumulation_steps']}")
    if cfg.get("num_inner_epochs", 1) > 1:
        extra.append(f"{cfg['num_inner_epochs']} inner epochs")
    if cfg.get("precision", "fp32") != "fp32" or cfg.get("device", "cpu") != "cpu":
        extra.append(f"{cfg.get('precision')} on {cfg.get('device')}")
    head = (
        f"GRPO on {cfg.get('task', 'digits')} ({_method(cfg)}, {cfg['batching']} batching, "
        f"{opt}, lr {cfg['lr']:g}{''.join(', ' + e for e in extra)})"
    )
    sde = "ODE/SDE" if cfg["mode"] == "mixgrpo" else "SDE"
    if n == 0:
        txt = f"{head}: {status} before the first step finished."
    else:
        k = max(1, min(5, n // 4))
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        done = "ran" if status == "finished" else f"{status} after"
        txt = (
            f"{head} {done} {n} steps of {cfg['prompts_per_step']}x{cfg['group_size']} "
            f"trajectories of {cfg['num_steps']} {sde} steps in {log['total_seconds']:.1f} s "
            f"(rollout {log['rollout_seconds']:.1f} s, training {log['train_seconds']:.1f} s). "
            f"Rollout reward: {first:.3f} (mean of the first {k} steps) -> {last:.3f} "
            f"(last {k}), change {last - first:+.3f}."
        )
    ev = log.get("eval") or {}
    if "initial" in ev and "final" in ev:
        a, b = ev["initial"]["mean_reward"], ev["final"]["mean_reward"]
        txt += (
            f" Held-out evaluation ({ev['initial']['samples']} samples, fixed noise): "
            f"{a:.3f} -> {b:.3f} ({b - a:+.3f})."
        )
    if n:
        if cfg["mode"] == "router":
            routed = sum(r["routed_frac"] for r in rows) / n
            txt += f" Mean exact-routed window fraction {routed:.2f}."
        txt += (
            f" Mean model samples with grad per step "
            f"{sum(r['grad_samples'] for r in rows) / n:.0f}."
        )
    probes = [r["probe_cosine"] for r in rows if "probe_cosine" in r]
    if probes:
        txt += (
            f" Gradient cosine to exact over {len(probes)} probes: mean "
            f"{sum(probes) / len(probes):.3f}, min {min(probes):.3f}."
        )
    if log.get("error"):
        txt += f" Stopped by {log['error']}"
    if log.get("out"):
        txt += f" Log{' and plot' if n else ''} in {log['out']}."
    return txt
