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
   loss averaged over the steps is minimised with AdamW.

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

from jagg_autograd.grpo import (
    group_advantages,
    grpo_loss,
    sde_step_with_logprob,
    shifted_sigma_schedule,
)
from jagg_autograd.models.digits import (
    NUM_CLASSES,
    digit_reward,
    load_digits_classifier,
    load_digits_dit,
)
from jagg_autograd.router import CosineRouter
from jagg_autograd.window import BATCHINGS, jagg_trajectory

__all__ = [
    "MODES",
    "SCHEDULES",
    "TUNING",
    "GRPOConfig",
    "Rollout",
    "evaluate",
    "rollout",
    "sigma_schedule",
    "train",
    "trajectory_log_probs",
]

MODES = ("exact", "jagg", "router")
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
    """Gradient: "exact" (every step with grad), "jagg" or "router" (JAGG + CosineRouter)."""
    window: int = 4
    """JAGG window W (steps per window, anchors included); ignored by mode="exact"."""
    shared_anchors: bool = True
    """Adjacent windows share their boundary anchor (fewer anchors per backward)."""
    threshold: float = 0.9
    """CosineRouter threshold (mode="router")."""
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
) -> Rollout:
    """Sample trajectories with the SDE step, storing latents and old log-probs.

    The model is called exactly as :func:`jagg_trajectory` calls it with
    ``batching="per_step"`` (``z (B, 1, 8, 8)``, ``t (B,)`` float32 filled with ``sigma_k``,
    ``labels (B,)``), which is what makes that recomputation bit-identical.
    """
    s = sigmas.tolist()
    n = labels.shape[0]
    x = torch.randn((n, 1, 8, 8), generator=generator, dtype=torch.float32)
    xs = [x]
    lps = []
    for k in range(len(s) - 1):
        t = torch.full((n,), s[k], dtype=torch.float32)
        v = model(x, t, labels=labels)
        x, lp, _, _ = sde_step_with_logprob(
            v, x, s[k], s[k + 1], noise_level=noise_level, sigma_max=s[1], generator=generator
        )
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
) -> tuple[torch.Tensor, Any]:
    """Log-probs ``(T, B)`` of the stored transitions under the current policy, with grad.

    Velocities of the stored ``x_0..x_{T-1}`` come from one :func:`jagg_trajectory` call (so
    the backward is JAGG's, or the exact one for ``mode="exact"``); each step's log-prob is
    the SDE step's density of the stored ``x_{k+1}``. Returns ``(log_probs, JaggStats)``.
    """
    T = ro.latents.shape[0] - 1
    s = sigmas.tolist()
    core_mode = "exact" if mode == "exact" else "jagg"
    v, stats = jagg_trajectory(
        model,
        ro.latents[:-1],
        sigmas[:-1],
        window=min(window, T),
        shared_anchors=shared_anchors,
        cond={"labels": ro.labels},
        mode=core_mode,
        router=router if mode == "router" else None,
        batching=batching,
        return_stats=True,
    )
    lps = []
    for k in range(T):
        _, lp, _, _ = sde_step_with_logprob(
            v[k],
            ro.latents[k],
            s[k],
            s[k + 1],
            noise_level=noise_level,
            sigma_max=s[1],
            prev_sample=ro.latents[k + 1],
        )
        lps.append(lp)
    return torch.stack(lps), stats


@torch.no_grad()
def evaluate(
    model: Callable[..., torch.Tensor],
    classifier: nn.Module,
    sigmas: torch.Tensor,
    *,
    per_digit: int,
    noise_level: float,
    seed: int,
) -> dict[str, Any]:
    """Mean reward of ``per_digit`` SDE samples of every digit, with fixed noise (``seed``).

    The same seed before and after training gives the same initial noise and step noise,
    so the difference is the policy's.
    """
    labels = torch.arange(NUM_CLASSES).repeat_interleave(per_digit)
    g = torch.Generator().manual_seed(seed)
    ro = rollout(model, labels, sigmas, noise_level=noise_level, generator=g)
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
    if log.get("out"):
        txt += f" Log and plot in {log['out']}."
    return txt


def train(
    config: GRPOConfig | None = None,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run online GRPO on the digits DiT; return the log (also written to ``config.out``).

    Log keys: ``config``, ``steps`` (one dict per GRPO step: ``reward_mean``,
    ``reward_std``, ``loss``, ``clipfrac``, ``approx_kl``, ``ratio_min``/``ratio_max``,
    ``routed_frac`` (fraction of (window, sample) pairs given the exact gradient),
    ``backward_calls``, ``grad_samples``, ``rollout_seconds``, ``train_seconds``), ``eval``
    (fixed-noise reward before/after), ``total_seconds``, ``rollout_seconds``,
    ``train_seconds``, ``summary``, ``out``.

    Raises:
        ValueError: bad config (see :meth:`GRPOConfig.validate`), or non-finite rewards /
            log-probs (from :func:`group_advantages` / :func:`grpo_loss`).
    """
    config = GRPOConfig() if config is None else config
    if not isinstance(config, GRPOConfig):
        raise TypeError(f"config must be a GRPOConfig, got {type(config).__name__}")
    config.validate()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    out = Path(config.out) if config.out is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)

    t_start = time.perf_counter()
    torch.manual_seed(config.seed)
    gen = torch.Generator().manual_seed(config.seed)
    model = load_digits_dit()
    classifier = load_digits_classifier()
    params = _trainable(model, config)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    router = CosineRouter(config.threshold) if config.mode == "router" else None
    sigmas = sigma_schedule(config)
    eval_seed = config.seed + 10_000  # disjoint from the training noise stream
    log: dict[str, Any] = {
        "config": config.to_dict(),
        "sigmas": [round(s, 6) for s in sigmas.tolist()],
        "num_trainable_parameters": sum(p.numel() for p in params),
        "steps": [],
        "eval": {},
        "out": str(out) if out is not None else None,
    }

    def fixed_noise_eval() -> dict[str, Any]:
        # Same noise seed before and after training: the difference is the policy's.
        return evaluate(
            model,
            classifier,
            sigmas,
            per_digit=config.eval_per_digit,
            noise_level=config.noise_level,
            seed=eval_seed,
        )

    if config.eval_per_digit:
        log["eval"]["initial"] = fixed_noise_eval()

    bar = None
    if config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.steps, desc="GRPO", unit="step", dynamic_ncols=True)
    mb = config.prompts_per_step * config.group_size // config.minibatches
    rollout_total = train_total = 0.0
    try:
        for step in range(config.steps):
            row = _grpo_step(model, classifier, opt, params, router, sigmas, gen, config, mb)
            row["step"] = step
            rollout_total += row["rollout_seconds"]
            train_total += row["train_seconds"]
            log["steps"].append(row)
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

    if config.eval_per_digit:
        log["eval"]["final"] = fixed_noise_eval()
    log["rollout_seconds"] = rollout_total
    log["train_seconds"] = train_total
    log["total_seconds"] = time.perf_counter() - t_start
    log["summary"] = summarize(log)
    if out is not None:
        with open(out / "log.json", "w", encoding="utf-8") as fh:
            json.dump(log, fh, indent=1)
        _plot(out / "reward.png", log)
    return log


def _grpo_step(
    model: nn.Module,
    classifier: nn.Module,
    opt: torch.optim.Optimizer,
    params: Sequence[nn.Parameter],
    router: CosineRouter | None,
    sigmas: torch.Tensor,
    gen: torch.Generator,
    config: GRPOConfig,
    mb: int,
) -> dict[str, Any]:
    """One rollout + ``config.minibatches`` optimizer steps; returns the step's log row."""
    t0 = time.perf_counter()
    digits = torch.randperm(NUM_CLASSES, generator=gen)[: config.prompts_per_step]
    labels = digits.repeat_interleave(config.group_size)
    # Sample in the chunks that will be trained, so that each chunk's recomputation sees
    # exactly the batch of its rollout (the condition for a bit-identical ratio).
    chunks = [
        rollout(model, labels[i : i + mb], sigmas, noise_level=config.noise_level, generator=gen)
        for i in range(0, labels.numel(), mb)
    ]
    rewards = torch.cat(
        [digit_reward(c.latents[-1], c.labels, classifier=classifier) for c in chunks]
    )
    adv = group_advantages(rewards, labels)  # raises ValueError on NaN rewards
    t1 = time.perf_counter()

    acc: dict[str, list[float]] = {
        k: [] for k in ("loss", "clipfrac", "approx_kl", "ratio_min", "ratio_max", "grad_norm")
    }
    routed, backward_calls, grad_samples = [], 0, 0
    for i, ro in enumerate(chunks):
        a = adv[i * mb : (i + 1) * mb]
        lp, stats = trajectory_log_probs(
            model,
            ro,
            sigmas,
            noise_level=config.noise_level,
            mode=config.mode,
            window=config.window,
            shared_anchors=config.shared_anchors,
            router=router,
            batching=config.batching,
        )
        T = lp.shape[0]
        losses, infos = [], []
        for k in range(T):
            loss_k, info_k = grpo_loss(
                lp[k],
                ro.log_probs[k],
                a,
                clip_range=config.clip_range,
                adv_clip_max=config.adv_clip_max,
            )
            losses.append(loss_k)
            infos.append(info_k)
        # Mean over the sampler steps: Flow-GRPO accumulates every step's loss into one
        # optimizer step, scaled so that the step count does not change the learning rate.
        loss = torch.stack(losses).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if config.max_grad_norm is not None:
            gn = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm)
        else:
            gn = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None))
        opt.step()
        acc["loss"].append(float(loss.detach()))
        acc["clipfrac"].append(float(torch.stack([f["clipfrac"] for f in infos]).mean()))
        acc["approx_kl"].append(float(torch.stack([f["approx_kl"] for f in infos]).mean()))
        acc["ratio_min"].append(float(torch.stack([f["ratio_min"] for f in infos]).min()))
        acc["ratio_max"].append(float(torch.stack([f["ratio_max"] for f in infos]).max()))
        acc["grad_norm"].append(float(gn))
        routed.append(float(stats.exact.float().mean()))
        backward_calls += int(stats.backward_calls)
        grad_samples += int(stats.grad_samples)
    t2 = time.perf_counter()

    row: dict[str, Any] = {
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
    return row
