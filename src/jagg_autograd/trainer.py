"""Online Flow-GRPO on the embedded digits DiT, with the gradient through JAGG.

One training step of :func:`train`:

1. **Rollout** (``torch.no_grad``): ``prompts_per_step`` digit labels, each repeated
   ``group_size`` times, are sampled with Flow-GRPO's SDE step
   (:func:`jagg_autograd.grpo.sde_step_with_logprob`) over ``num_steps`` steps; the latents
   ``x_0..x_T`` and the old log-probs ``log p(x_{k+1} | x_k)`` are stored.
2. **Reward**: the shipped classifier's probability of the prompted digit
   (:func:`jagg_autograd.models.digits.digit_reward`); per-prompt group advantages
   (:func:`jagg_autograd.grpo.group_advantages`, which raises on NaN rewards).
3. **Training** over the stored trajectory: the velocities ``v_k`` of the stored latents
   are recomputed with :func:`jagg_autograd.jagg_trajectory` (``mode="exact"``, JAGG, or
   JAGG with a :class:`~jagg_autograd.CosineRouter`), the log-probs of the stored
   ``x_{k+1}`` under the current policy come from the same SDE step, and the clipped GRPO
   loss averaged over the steps is minimised with AdamW.  Two baselines train on a
   subset of steps at a chosen backward budget instead: ``mode="subsample"`` (DanceGRPO's
   timestep_fraction: a random subset of steps per sample) and ``mode="mixgrpo"``
   (MixGRPO: SDE only inside a window of ``window`` steps that slides along the
   trajectory during training, ODE elsewhere; only the window's steps are trained).

Optional along the run: a held-out evaluation every ``eval_every`` steps (SDE or ODE
sampler, fixed noise never used in training) and a gradient probe every ``probe_every``
steps (cosine / relative error of the run's gradient estimator to the exact gradient on a
separate full-SDE batch).  Neither touches the training noise stream nor the timings.
:class:`GRPOTrainer` runs the loop one step at a time (the quality study interleaves
several of them); :func:`train` is the whole run.

The parameters change only through optimizer steps, so with ``batching="per_step"`` the
first log-prob recomputation after a rollout reproduces the rollout's bit for bit (ratio 1);
:func:`rollout` and :func:`trajectory_log_probs` are public so that this can be tested.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from jagg_autograd.diagnostics import compare_grads
from jagg_autograd.grpo import (
    group_advantages,
    grpo_loss,
    ode_step,
    sde_step_with_logprob,
    shifted_sigma_schedule,
)
from jagg_autograd.models.digits import (
    NUM_CLASSES,
    digit_reward,
    load_digits_classifier,
    load_digits_dit,
)
from jagg_autograd.router import DEFAULT_JAGG_FRAC, DEFAULT_THRESHOLD, CosineRouter
from jagg_autograd.window import BATCHINGS, expected_anchor_count, jagg_trajectory

__all__ = [
    "MODES",
    "SAMPLERS",
    "SCHEDULES",
    "TUNING",
    "GRPOConfig",
    "GRPOTrainer",
    "Rollout",
    "evaluate",
    "rollout",
    "sigma_schedule",
    "train",
    "trajectory_log_probs",
]

MODES = ("exact", "jagg", "router", "subsample", "mixgrpo")
SAMPLERS = ("sde", "ode")
SCHEDULES = ("linear", "shifted")
TUNING = ("full", "lora")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class GRPOConfig:
    """Settings of one online GRPO run on the digits DiT (defaults = the demo's defaults).

    The defaults make the default run visibly learn on a 2-core CPU in a few minutes:

    * 32 trajectories per step as 8 prompts x 4 samples: covering most digits every step
      makes the per-step reward curve far less noisy than 4 x 8 (which learned as well);
    * the full DiT (0.6 M parameters) with AdamW at ``lr=1e-4``: in 40-step trials full
      fine-tuning at 1e-4 raised the fixed-noise reward by +0.22 (3e-5: +0.11, 3e-4: +0.20
      but noisier) and rank-8 LoRA at 1e-3 by only +0.06;
    * the linear schedule ``sigma_i = 1 - i/T`` the DiT was trained and evaluated on, 10 SDE
      steps at ``eta = 0.7``, JAGG with window 4 and shared anchors (4 anchors of 10 steps);
    * one optimizer step per rollout, so every ratio is exactly 1 when the gradient is
      taken and ``clip_range`` (Flow-GRPO's 1e-4, kept) only acts with ``minibatches > 1``,
      on the chunks trained after an earlier optimizer step of the same rollout.
    """

    steps: int = 60
    """GRPO steps (rollout + optimizer steps)."""
    prompts_per_step: int = 8
    """Distinct digit prompts per rollout (drawn without replacement from 0..9)."""
    group_size: int = 4
    """Samples per prompt; advantages are normalised within each group."""
    num_steps: int = 10
    """Sampler steps T of a trajectory."""
    noise_level: float = 0.7
    """SDE noise level eta of Flow-GRPO's step."""
    schedule: str = "linear"
    """Sigma schedule: "linear" (sigma_i = 1 - i/T, what the DiT was evaluated with) or
    "shifted" (SD3's shift)."""
    shift: float = 3.0
    """Shift of the "shifted" schedule."""
    mode: str = "jagg"
    """Gradient: "exact" (every step with grad), "jagg", "router" (JAGG + CosineRouter),
    or the baselines "subsample" (DanceGRPO) and "mixgrpo" (MixGRPO's sliding window)."""
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
    batching: str = "stacked"
    """jagg_trajectory batching: "stacked" (fewest model calls) or "per_step"
    (bit-identical to the rollout)."""
    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (0: the pretrained weights are the prior, not 0)."""
    clip_range: float = 1e-4
    """PPO ratio clip epsilon of the GRPO loss (Flow-GRPO's value)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to +-adv_clip_max."""
    max_grad_norm: float | None = 1.0
    """Gradient-norm clip (None: off)."""
    minibatches: int = 1
    """Optimizer steps per rollout; the rollout is sampled in that many chunks so that each
    chunk's recomputation matches the rollout's batch exactly."""
    tuning: str = "full"
    """"full" (all DiT parameters) or "lora" (peft adapters on the attention projections)."""
    lora_rank: int = 8
    """LoRA rank (tuning="lora")."""
    eval_per_digit: int = 16
    """Samples per digit for the fixed-noise evaluation before and after training (0: off)."""
    eval_every: int = 0
    """Also evaluate every ``eval_every`` GRPO steps (0: only before and after)."""
    eval_sampler: str = "sde"
    """Evaluation sampler: "sde" (the rollout's SDE with fixed noise) or "ode" (the
    deterministic Euler sampler from fixed initial noise)."""
    eval_seed: int | None = None
    """Seed of the evaluation noise (None: ``seed + 10000``, disjoint from training)."""
    probe_every: int = 0
    """Every ``probe_every`` GRPO steps, before the optimizer step, measure the cosine and
    relative error of this run's gradient estimator to the exact gradient on a separate
    full-SDE batch of the current policy (0: off; excluded from the timings)."""
    seed: int = 0
    """Seeds the prompts, the rollout noise and the evaluation noise."""
    out: str | None = None
    """Folder for ``log.json`` and ``reward.png`` (None: nothing written)."""
    threads: int | None = 1
    """torch.set_num_threads (None: leave torch's setting). 1 by default: on a shared
    2-core machine two intra-op threads contend with other processes and ran up to 20x
    slower than one in our measurements, while this small model gains little from two."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field."""
        ints_pos = {
            "steps": self.steps,
            "prompts_per_step": self.prompts_per_step,
            "group_size": self.group_size,
            "num_steps": self.num_steps,
            "minibatches": self.minibatches,
            "lora_rank": self.lora_rank,
        }
        for name, v in ints_pos.items():
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.prompts_per_step > NUM_CLASSES:
            raise ValueError(
                f"prompts_per_step must be <= {NUM_CLASSES} (distinct digits), "
                f"got {self.prompts_per_step}"
            )
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2 (a group of one has advantage 0), got {self.group_size}"
            )
        if self.num_steps < 2:
            raise ValueError(
                f"num_steps must be >= 2 (a trajectory of >= 2 steps), got {self.num_steps}"
            )
        if self.eval_sampler not in SAMPLERS:
            raise ValueError(f"eval_sampler must be one of {SAMPLERS}, got {self.eval_sampler!r}")
        for name, v in (("eval_every", self.eval_every), ("probe_every", self.probe_every)):
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
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.batching not in BATCHINGS:
            raise ValueError(f"batching must be one of {BATCHINGS}, got {self.batching!r}")
        if self.tuning not in TUNING:
            raise ValueError(f"tuning must be one of {TUNING}, got {self.tuning!r}")
        if not _is_int(self.window) or not 2 <= self.window <= self.num_steps:
            raise ValueError(
                f"window must be an int in [2, num_steps={self.num_steps}], got {self.window!r}"
            )
        if not isinstance(self.shared_anchors, bool):
            raise ValueError(f"shared_anchors must be a bool, got {self.shared_anchors!r}")
        if not _is_real(self.noise_level) or self.noise_level <= 0:
            raise ValueError(f"noise_level must be a finite number > 0, got {self.noise_level!r}")
        if not _is_real(self.shift) or self.shift <= 0:
            raise ValueError(f"shift must be a finite number > 0, got {self.shift!r}")
        if not _is_real(self.threshold):
            raise ValueError(f"threshold must be a finite number, got {self.threshold!r}")
        if not _is_real(self.lr) or self.lr <= 0:
            raise ValueError(f"lr must be a finite number > 0, got {self.lr!r}")
        if not _is_real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(
                f"weight_decay must be a finite number >= 0, got {self.weight_decay!r}"
            )
        if not _is_real(self.clip_range) or self.clip_range < 0:
            raise ValueError(f"clip_range must be a finite number >= 0, got {self.clip_range!r}")
        if not _is_real(self.adv_clip_max) or self.adv_clip_max <= 0:
            raise ValueError(f"adv_clip_max must be a finite number > 0, got {self.adv_clip_max!r}")
        if self.max_grad_norm is not None and (
            not _is_real(self.max_grad_norm) or self.max_grad_norm <= 0
        ):
            raise ValueError(f"max_grad_norm must be None or > 0, got {self.max_grad_norm!r}")
        if (self.prompts_per_step * self.group_size) % self.minibatches:
            raise ValueError(
                f"minibatches={self.minibatches} must divide the rollout batch "
                f"prompts_per_step * group_size = {self.prompts_per_step * self.group_size}"
            )
        if not _is_int(self.eval_per_digit) or self.eval_per_digit < 0:
            raise ValueError(f"eval_per_digit must be an int >= 0, got {self.eval_per_digit!r}")
        if not _is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.threads is not None and (not _is_int(self.threads) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------
# rollout and log-probs
# --------------------------------------------------------------------------------------------


def sigma_schedule(config: GRPOConfig) -> torch.Tensor:
    """``(num_steps + 1,)`` float64 sigmas from 1 to 0: linear ``1 - i/T`` or SD3-shifted."""
    if config.schedule == "linear":
        return torch.linspace(1.0, 0.0, config.num_steps + 1, dtype=torch.float64)
    return shifted_sigma_schedule(config.num_steps, config.shift, dtype=torch.float64)


@dataclass
class Rollout:
    """One batch of stored trajectories.

    latents: ``(T + 1, B, 1, 8, 8)`` float32, ``x_0`` (noise) .. ``x_T`` (the image).
    log_probs: ``(T, B)`` float32, ``log p(x_{k+1} | x_k)`` under the rollout policy.
    labels: ``(B,)`` int64 prompts.
    """

    latents: torch.Tensor
    log_probs: torch.Tensor
    labels: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)


@torch.no_grad()
def rollout(
    model: Callable[..., torch.Tensor],
    labels: torch.Tensor,
    sigmas: torch.Tensor,
    *,
    noise_level: float,
    generator: torch.Generator | None = None,
    sde_steps: Sequence[int] | None = None,
) -> Rollout:
    """Sample trajectories with the SDE step, storing latents and old log-probs.

    The model is called exactly as :func:`jagg_trajectory` calls it with
    ``batching="per_step"`` (``z (B, 1, 8, 8)``, ``t (B,)`` float32 filled with ``sigma_k``,
    ``labels (B,)``), which is what makes that recomputation bit-identical.
    ``sde_steps``: the steps that use the SDE (None: all); the others take the
    deterministic ODE step, draw no noise and get log-prob NaN (they cannot be trained):
    an empty list is the ODE sampler, a window of steps is MixGRPO's mixed sampler.
    """
    s = sigmas.tolist()
    n = labels.shape[0]
    sde = set(range(len(s) - 1)) if sde_steps is None else set(sde_steps)
    x = torch.randn((n, 1, 8, 8), generator=generator, dtype=torch.float32)
    xs = [x]
    lps = []
    for k in range(len(s) - 1):
        t = torch.full((n,), s[k], dtype=torch.float32)
        v = model(x, t, labels=labels)
        if k in sde:
            x, lp, _, _ = sde_step_with_logprob(
                v, x, s[k], s[k + 1], noise_level=noise_level, sigma_max=s[1], generator=generator
            )
        else:
            x = ode_step(v, x, s[k], s[k + 1])
            lp = torch.full((n,), math.nan)
        xs.append(x)
        lps.append(lp)
    return Rollout(torch.stack(xs), torch.stack(lps), labels)


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
    lo, hi = (0, T) if steps is None else steps
    if not 0 <= lo < hi <= T or hi - lo < 2:
        raise ValueError(f"steps must be (lo, hi) with 0 <= lo, lo + 2 <= hi <= {T}, got {steps}")
    s = sigmas.tolist()
    core_mode = "exact" if mode == "exact" else "jagg"
    v, stats = jagg_trajectory(
        model,
        ro.latents[lo:hi],
        sigmas[lo:hi],
        window=min(window, hi - lo),
        shared_anchors=shared_anchors,
        cond={"labels": ro.labels},
        mode=core_mode,
        router=router if mode == "router" else None,
        batching=batching,
        return_stats=True,
    )
    lps = []
    for i, k in enumerate(range(lo, hi)):
        _, lp, _, _ = sde_step_with_logprob(
            v[i],
            ro.latents[k],
            s[k],
            s[k + 1],
            noise_level=noise_level,
            sigma_max=s[1],
            prev_sample=ro.latents[k + 1],
        )
        lps.append(lp)
    return torch.stack(lps), stats


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
    T, B = ro.log_probs.shape
    if not 1 <= num <= T:
        raise ValueError(f"num must be in [1, T={T}], got {num}")
    ks = torch.argsort(torch.rand((B, T), generator=generator), dim=1)[:, :num].T.contiguous()
    bs = torch.arange(B).expand(num, B)
    z, nxt = ro.latents[ks, bs], ro.latents[ks + 1, bs]
    sig, sig_next = sigmas[ks], sigmas[ks + 1]
    sigma_max = float(sigmas[1])
    slots = [slice(None)] if batching == "stacked" else [slice(j, j + 1) for j in range(num)]
    lps = []
    for sl in slots:
        zs = z[sl].flatten(0, 1)
        n = zs.shape[0] // B
        v = model(zs, sig[sl].flatten().to(torch.float32), labels=ro.labels.repeat(n))
        _, lp, _, _ = sde_step_with_logprob(
            v,
            zs,
            sig[sl].flatten(),
            sig_next[sl].flatten(),
            noise_level=noise_level,
            sigma_max=sigma_max,
            prev_sample=nxt[sl].flatten(0, 1),
        )
        lps.append(lp.view(n, B))
    return torch.cat(lps), ro.log_probs[ks, bs], ks


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
    """Mean reward of ``per_digit`` samples of every digit, with fixed noise (``seed``).

    ``sampler``: "sde" (the rollout's SDE step) or "ode" (deterministic Euler steps, the
    noise is only the initial latent).  The same seed before and after training gives the
    same noise, so the difference is the policy's.
    """
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
# training
# --------------------------------------------------------------------------------------------


def _trainable(model: nn.Module, config: GRPOConfig) -> list[nn.Parameter]:
    if config.tuning == "lora":
        from jagg_autograd.integrations.diffusers import add_lora

        # The label embeddings stay frozen with LoRA: only the adapters train.
        return add_lora(model.transformer, rank=config.lora_rank)
    model.requires_grad_(True)
    return [p for p in model.parameters() if p.requires_grad]


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
            label="fixed-noise eval (all digits)",
        )
    cfg = log["config"]
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward = p(prompted digit)")
    ax.set_ylim(0.0, 1.0)
    ax.set_title(f"GRPO on the digits DiT: mode={cfg['mode']}, W={cfg['window']}")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarize(log: dict[str, Any]) -> str:
    """The one-paragraph summary the demo prints."""
    cfg = log["config"]
    rows = log["steps"]
    n = len(rows)
    k = max(1, min(5, n // 4))
    first = sum(r["reward_mean"] for r in rows[:k]) / k
    last = sum(r["reward_mean"] for r in rows[-k:]) / k
    txt = (
        f"GRPO ({cfg['mode']}, window {cfg['window']}, "
        f"{'shared' if cfg['shared_anchors'] else 'disjoint'} anchors, {cfg['batching']} "
        f"batching, {cfg['tuning']} fine-tuning, lr {cfg['lr']:g}) ran {n} steps of "
        f"{cfg['prompts_per_step']}x{cfg['group_size']} trajectories of {cfg['num_steps']} SDE "
        f"steps in {log['total_seconds']:.1f} s "
        f"(rollout {log['rollout_seconds']:.1f} s, training {log['train_seconds']:.1f} s). "
        f"Rollout reward: {first:.3f} (mean of the first {k} steps) -> {last:.3f} "
        f"(last {k}), change {last - first:+.3f}."
    )
    ev = log.get("eval") or {}
    if "initial" in ev and "final" in ev:
        a, b = ev["initial"]["mean_reward"], ev["final"]["mean_reward"]
        txt += (
            f" Fixed-noise evaluation on all 10 digits ({ev['initial']['samples']} samples): "
            f"{a:.3f} -> {b:.3f} ({b - a:+.3f})."
        )
    routed = sum(r["routed_frac"] for r in rows) / n
    txt += (
        f" Mean exact-routed window fraction {routed:.2f}, mean model samples with grad per "
        f"step {sum(r['grad_samples'] for r in rows) / n:.0f}."
    )
    probes = [r["probe_cosine"] for r in rows if "probe_cosine" in r]
    if probes:
        txt += (
            f" Gradient cosine to exact over {len(probes)} probes: mean "
            f"{sum(probes) / len(probes):.3f}, min {min(probes):.3f}."
        )
    if log.get("out"):
        txt += f" Log and plot in {log['out']}."
    return txt


def _grpo_loss_mean(
    lp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, config: GRPOConfig
) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Mean over the trained slots of the clipped GRPO loss; ``lp``, ``old``: (n, B)."""
    losses, infos = [], []
    for j in range(lp.shape[0]):
        loss_j, info_j = grpo_loss(
            lp[j], old[j], adv, clip_range=config.clip_range, adv_clip_max=config.adv_clip_max
        )
        losses.append(loss_j)
        infos.append(info_j)
    # Mean over the sampler steps: Flow-GRPO accumulates every step's loss into one
    # optimizer step, scaled so that the step count does not change the learning rate;
    # over a random subset this mean is an unbiased estimate of the full one.
    return torch.stack(losses).mean(), infos


def _estimator_loss(
    model: nn.Module,
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
    """The loss whose gradient is this run's estimator (``mode`` overrides the config's)."""
    mode = config.mode if mode is None else mode
    B = ro.labels.numel()
    if mode == "subsample":
        num = config.subsample_steps or expected_anchor_count(
            config.num_steps, config.window, config.shared_anchors
        )
        lp, old, _ = subsample_log_probs(
            model,
            ro,
            sigmas,
            noise_level=config.noise_level,
            num=num,
            generator=generator,
            batching=config.batching,
        )
        calls = 1 if config.batching == "stacked" else num
        cost = {"routed_frac": 0.0, "backward_calls": calls, "grad_samples": num * B}
    else:
        steps = None
        if mode == "mixgrpo":
            lo = mix_window_start(config, step)
            steps = (lo, lo + config.window)
        lp, stats = trajectory_log_probs(
            model,
            ro,
            sigmas,
            noise_level=config.noise_level,
            mode="exact" if mode == "mixgrpo" else mode,
            window=config.window,
            shared_anchors=config.shared_anchors,
            router=router,
            batching=config.batching,
            steps=steps,
        )
        old = ro.log_probs if steps is None else ro.log_probs[steps[0] : steps[1]]
        cost = {
            "routed_frac": float(stats.exact.float().mean()) if mode != "mixgrpo" else 0.0,
            "backward_calls": int(stats.backward_calls),
            "grad_samples": int(stats.grad_samples),
        }
    loss, infos = _grpo_loss_mean(lp, old, adv, config)
    return loss, infos, cost


class GRPOTrainer:
    """Online GRPO on the digits DiT, one :meth:`step` at a time.

    ``GRPOTrainer(config)`` loads the models and, if ``eval_per_digit > 0``, runs the
    initial evaluation; :meth:`step` runs one GRPO step (plus the probe / evaluation due
    at it) and returns its log row; :meth:`finish` runs the final evaluation and returns
    (and writes) the log of :func:`train`.  Each trainer owns its noise generators, so
    several trainers stepped in turn give the runs each would give alone.
    """

    def __init__(self, config: GRPOConfig | None = None) -> None:
        config = GRPOConfig() if config is None else config
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
        config.validate()
        self.config = config
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        self.out = Path(config.out) if config.out is not None else None
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self._t_start = time.perf_counter()
        torch.manual_seed(config.seed)
        self.generator = torch.Generator().manual_seed(config.seed)
        self.model = load_digits_dit()
        self.classifier = load_digits_classifier()
        self.params = _trainable(self.model, config)
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay
        )
        self.router = (
            CosineRouter(config.threshold, config.jagg_frac) if config.mode == "router" else None
        )
        self.sigmas = sigma_schedule(config)
        # Disjoint from the training noise stream.
        self.eval_seed = config.seed + 10_000 if config.eval_seed is None else config.eval_seed
        self.step_index = 0
        self.rollout_seconds = 0.0
        self.train_seconds = 0.0
        self._mb = config.prompts_per_step * config.group_size // config.minibatches
        self.log: dict[str, Any] = {
            "config": config.to_dict(),
            "sigmas": [round(x, 6) for x in self.sigmas.tolist()],
            "num_trainable_parameters": sum(p.numel() for p in self.params),
            "steps": [],
            "evals": [],
            "eval": {},
            "out": str(self.out) if self.out is not None else None,
        }
        if config.eval_per_digit:
            self._record_eval()

    # ------------------------------------------------------------------ measurements

    def evaluate(self) -> dict[str, Any]:
        """Held-out reward of the current policy on the fixed evaluation noise."""
        c = self.config
        return evaluate(
            self.model,
            self.classifier,
            self.sigmas,
            per_digit=c.eval_per_digit,
            noise_level=c.noise_level,
            seed=self.eval_seed,
            sampler=c.eval_sampler,
        )

    def _record_eval(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        ev = self.evaluate()
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
        g = torch.Generator().manual_seed((self.eval_seed + 1) * 1_000_003 + self.step_index)
        digits = torch.randperm(NUM_CLASSES, generator=g)[: c.prompts_per_step]
        labels = digits.repeat_interleave(c.group_size)
        ro = rollout(self.model, labels, self.sigmas, noise_level=c.noise_level, generator=g)
        adv = group_advantages(
            digit_reward(ro.latents[-1], labels, classifier=self.classifier), labels
        )
        kw = {"step": self.step_index, "generator": g}
        ref, _, _ = _estimator_loss(self.model, ro, adv, self.sigmas, c, None, mode="exact", **kw)
        g_ref = torch.autograd.grad(ref, self.params, allow_unused=True)
        est, _, cost = _estimator_loss(self.model, ro, adv, self.sigmas, c, self.router, **kw)
        g_est = torch.autograd.grad(est, self.params, allow_unused=True)
        cos, rel, _, _ = compare_grads(g_ref, g_est, self.params)
        return {
            "probe_cosine": cos,
            "probe_rel_error": rel,
            "probe_routed_frac": cost["routed_frac"],
            "probe_seconds": time.perf_counter() - t0,
        }

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, Any]:
        """One GRPO step: probe if due, rollout, optimizer step(s), evaluation if due."""
        c = self.config
        probe = self.probe() if c.probe_every and self.step_index % c.probe_every == 0 else {}
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
        return row

    def finish(self) -> dict[str, Any]:
        """Final evaluation, totals and summary; writes ``log.json`` / ``reward.png``."""
        log = self.log
        if self.config.eval_per_digit:
            self._record_eval()
            log["eval"] = {"initial": log["evals"][0], "final": log["evals"][-1]}
        log["rollout_seconds"] = self.rollout_seconds
        log["train_seconds"] = self.train_seconds
        log["total_seconds"] = time.perf_counter() - self._t_start
        log["summary"] = summarize(log)
        if self.out is not None:
            with open(self.out / "log.json", "w", encoding="utf-8") as fh:
                json.dump(log, fh, indent=1)
            _plot(self.out / "reward.png", log)
        return log


def train(
    config: GRPOConfig | None = None,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run online GRPO on the digits DiT; return the log (also written to ``config.out``).

    Log keys: ``config``, ``steps`` (one dict per GRPO step: ``reward_mean``,
    ``reward_std``, ``loss``, ``clipfrac``, ``approx_kl``, ``ratio_min``/``ratio_max``,
    ``routed_frac`` (fraction of (window, sample) pairs given the exact gradient),
    ``backward_calls``, ``grad_samples``, ``rollout_seconds``, ``train_seconds``, and on
    probe steps ``probe_cosine`` / ``probe_rel_error``), ``evals`` (every evaluation:
    ``step``, ``mean_reward``, ``per_digit``, ``wall_seconds`` = rollout + training time
    so far), ``eval`` (the first and last of them as ``initial`` / ``final``),
    ``total_seconds``, ``rollout_seconds``, ``train_seconds``, ``summary``, ``out``.

    Raises:
        ValueError: bad config (see :meth:`GRPOConfig.validate`), or non-finite rewards /
            log-probs (from :func:`group_advantages` / :func:`grpo_loss`).
    """
    trainer = GRPOTrainer(config)
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
    finally:
        if bar is not None:
            bar.close()
    return trainer.finish()


def _grpo_step(tr: GRPOTrainer) -> dict[str, Any]:
    """One rollout + ``config.minibatches`` optimizer steps; returns the step's log row."""
    config = tr.config
    gen = tr.generator
    mb = tr._mb
    t0 = time.perf_counter()
    digits = torch.randperm(NUM_CLASSES, generator=gen)[: config.prompts_per_step]
    labels = digits.repeat_interleave(config.group_size)
    sde_steps = None
    if config.mode == "mixgrpo":
        lo = mix_window_start(config, tr.step_index)
        sde_steps = range(lo, lo + config.window)
    # Sample in the chunks that will be trained, so that each chunk's recomputation sees
    # exactly the batch of its rollout (the condition for a bit-identical ratio).
    chunks = [
        rollout(
            tr.model,
            labels[i : i + mb],
            tr.sigmas,
            noise_level=config.noise_level,
            generator=gen,
            sde_steps=sde_steps,
        )
        for i in range(0, labels.numel(), mb)
    ]
    rewards = torch.cat(
        [digit_reward(c.latents[-1], c.labels, classifier=tr.classifier) for c in chunks]
    )
    adv = group_advantages(rewards, labels)  # raises ValueError on NaN rewards
    t1 = time.perf_counter()

    acc: dict[str, list[float]] = {
        k: [] for k in ("loss", "clipfrac", "approx_kl", "ratio_min", "ratio_max", "grad_norm")
    }
    routed, backward_calls, grad_samples = [], 0, 0
    for i, ro in enumerate(chunks):
        loss, infos, cost = _estimator_loss(
            tr.model,
            ro,
            adv[i * mb : (i + 1) * mb],
            tr.sigmas,
            config,
            tr.router,
            step=tr.step_index,
            generator=gen,
        )
        tr.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = tr.params
        if config.max_grad_norm is not None:
            gn = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        else:
            gn = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None))
        tr.optimizer.step()
        acc["loss"].append(float(loss.detach()))
        acc["clipfrac"].append(float(torch.stack([f["clipfrac"] for f in infos]).mean()))
        acc["approx_kl"].append(float(torch.stack([f["approx_kl"] for f in infos]).mean()))
        acc["ratio_min"].append(float(torch.stack([f["ratio_min"] for f in infos]).min()))
        acc["ratio_max"].append(float(torch.stack([f["ratio_max"] for f in infos]).max()))
        acc["grad_norm"].append(float(gn))
        routed.append(cost["routed_frac"])
        backward_calls += int(cost["backward_calls"])
        grad_samples += int(cost["grad_samples"])
    t2 = time.perf_counter()

    return {
        "prompts": digits.tolist(),
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "loss": sum(acc["loss"]) / len(acc["loss"]),
        "clipfrac": sum(acc["clipfrac"]) / len(acc["clipfrac"]),
        "approx_kl": sum(acc["approx_kl"]) / len(acc["approx_kl"]),
        "ratio_min": min(acc["ratio_min"]),
        "ratio_max": max(acc["ratio_max"]),
        "grad_norm": sum(acc["grad_norm"]) / len(acc["grad_norm"]),
        "routed_frac": sum(routed) / len(routed),
        "backward_calls": backward_calls,
        "backward_passes": len(chunks),
        "grad_samples": grad_samples,
        "rollout_seconds": t1 - t0,
        "train_seconds": t2 - t1,
    }
