"""``GRPOConfig``: the settings of one online GRPO run, and their checks.

A flat dataclass (the field names are the API, the logged ``config`` and the CLI flags of
``jagg-demo``): each field carries its help, its group and, where it has them, its choices
in ``field(metadata=...)``, from which :mod:`jagg_autograd.demo` generates its parser.  The
checks that apply to every mode are a table (:data:`_RULES`); what only one estimator
needs is checked by that estimator (:meth:`jagg_autograd.estimators.Estimator.check`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from jagg_autograd.checks import (
    MIN_PROMOTION_FRAC,
    PLACEMENTS,
    promotes_to_exact,
    promotion_fraction_ok,
)
from jagg_autograd.estimators import ESTIMATORS, Estimator, get_estimator
from jagg_autograd.grpo import shifted_sigma_schedule
from jagg_autograd.lr_schedule import LR_SCHEDULERS
from jagg_autograd.nft import NFT_GRADIENTS, NFT_NOISES
from jagg_autograd.planner import FOLDS, PROMOTE_TO, PROMOTIONS
from jagg_autograd.rollout import STEP_SELECTIONS
from jagg_autograd.router import DEFAULT_JAGG_FRAC, DEFAULT_THRESHOLD
from jagg_autograd.tasks import GRPOTask, task_factory, task_names
from jagg_autograd.tracking import REPORT_TO
from jagg_autograd.window import BATCHINGS

__all__ = [
    "GROUPS",
    "PLACEMENTS",
    "PRECISIONS",
    "SAMPLERS",
    "SCHEDULES",
    "SDE_TYPES",
    "TUNING",
    "GRPOConfig",
    "sigma_schedule",
]

SAMPLERS = ("sde", "ode")
SCHEDULES = ("linear", "shifted")
TUNING = ("full", "lora")
PRECISIONS = ("fp32", "bf16")
SDE_TYPES = ("flow", "dance")
#: The field groups, in the order ``--help`` lists them.
GROUPS = ("task", "gradient", "rollout", "optimisation", "run")


def _modes() -> tuple[str, ...]:
    return tuple(ESTIMATORS)  # the live registry: a registered estimator is a mode


def _f(default: Any, group: str, help: str, **meta: Any) -> Any:
    """A field with its help and group (``meta``: ``choices`` (a tuple or a callable giving
    one), ``flags`` (extra option strings), ``cli`` (False: no flag; a config file still
    sets it), ``cli_default`` (the CLI's default where it differs))."""
    metadata = {"group": group, "help": help, **meta}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


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
    * ``reuse_values`` and ``deferred`` on, ``placement="uniform"``, ``fold="linear"`` (4
      anchors of 10 steps), no router: the third quality study (``python -m
      benchmarks.quality --tasks digits``, digits, 4 seeds x 60 steps, probes of 24 batches
      at steps 0 and 30 on seeds 0 and 1) measured this final held-out reward +0.02 +-
      0.10 % of exact GRPO's at 0.453 of its training phase (0.448 for one minibatch in
      isolation, ``python -m benchmarks.train_phase``), with a systematic share of the
      gradient error of at most +0.016 along the run (floor SD ~0.007); adaptive
      placement (group-fair) -1.37 / -0.38 / +0.50 % at budgets 3 / 4 / 5 (b4: higher
      per-batch cosine 0.966 vs 0.952 but not more reward, -0.0033 +- 0.0105 paired), the
      causal fold -3.03 %, the router +0.19 %: see
      ``benchmarks/results/quality3/QUALITY.md``.

    * the runaway guard on (``guard_ratio=1.5``, ``guard_window=10``,
      :mod:`jagg_autograd.runaway_guard`): replayed on every logged run (``python -m
      benchmarks.guard_scan``) it never trips on digits (largest ratio 1.49) nor on the
      shapes demo's 100 steps, and trips on the shapes runs whose linear fold ran away
      (22 of 44, steps 62-148), switching them to the causal fold.

    Every field's help is in its metadata (``dataclasses.fields(GRPOConfig)``, or
    ``jagg-demo --help``).
    """

    task: str = _f("digits", "task", "the GRPO task: a registered name "
                   "(jagg_autograd.tasks.get_task); a task object given to GRPOTrainer "
                   "replaces it", choices=task_names)  # fmt: skip
    task_options: dict[str, Any] = _f({}, "task", "keyword options of the task's factory "
                                      "(digits also gets eval_per_digit)", cli=False)  # fmt: skip
    steps: int = _f(60, "rollout", "GRPO steps (rollout + optimizer steps)")
    prompts_per_step: int = _f(8, "rollout", "distinct prompts per rollout (digits: drawn "
                               "without replacement from 0..9)")  # fmt: skip
    group_size: int = _f(4, "rollout", "samples per prompt; advantages are normalised within "
                         "each group")  # fmt: skip
    num_steps: int = _f(10, "rollout", "sampler steps T of a trajectory")
    noise_level: float = _f(0.7, "rollout", "SDE noise level eta of Flow-GRPO's step")
    sde_type: str = _f("flow", "rollout", "SDE step: flow (Flow-GRPO) or dance (DanceGRPO)",
                       choices=SDE_TYPES)  # fmt: skip
    schedule: str = _f("linear", "rollout", "sigma schedule: linear (sigma_i = 1 - i/T, the "
                       "digits DiT's) or shifted (FLUX/DanceGRPO's)",
                       choices=SCHEDULES)  # fmt: skip
    shift: float = _f(3.0, "rollout", "shift of --schedule shifted")
    mode: str = _f("jagg", "gradient", "the gradient estimator (jagg_autograd.estimators): "
                   "exact, JAGG, JAGG + router, or the baselines subsample (DanceGRPO), "
                   "mixgrpo (MixGRPO's sliding window), nft (DiffusionNFT's loss)",
                   choices=_modes)  # fmt: skip
    exact_loop: bool = _f(True, "gradient", "--mode exact: forward + backward one trained "
                          "step at a time like Flow-GRPO's loop (one step's activations); "
                          "off: one batched call and backward (the oracle)")  # fmt: skip
    nft_beta: float = _f(1.0, "gradient", "--mode nft: DiffusionNFT's beta, the step of the "
                         "implicit policies v+ = beta v + (1 - beta) v_old")  # fmt: skip
    nft_timesteps: int | None = _f(None, "gradient", "--mode nft: training timesteps drawn "
                                   "per sample and minibatch (None: DiffusionNFT's "
                                   "int(0.99 num_steps), 9 of T = 10; before issue 20 the "
                                   "default was 4)")  # fmt: skip
    nft_noise: str = _f("fresh", "gradient", "--mode nft: fresh (DiffusionNFT's: a new noise "
                        "per timestep) or shared (one noise per sample for all its timesteps: "
                        "its x_t on one segment, JAGG's exact case)",
                        choices=NFT_NOISES)  # fmt: skip
    nft_gradient: str = _f("exact", "gradient", "--mode nft: exact (one forward + backward "
                           "per timestep, their loop) or jagg (one jagg_trajectory over the "
                           "sample's sorted timesteps: --window / --placement / --budget; "
                           "needs --nft-noise shared)", choices=NFT_GRADIENTS)  # fmt: skip
    track_memory: bool = _f(False, "run", "log peak_saved_bytes, the peak of live "
                            "tensors saved for backward in the training phase (hooks cost "
                            "time)")  # fmt: skip
    window: int = _f(4, "gradient", "JAGG window W (steps per window, anchors included, "
                     ">= 2); --mode mixgrpo: its SDE window")  # fmt: skip
    shared_anchors: bool = _f(True, "gradient", "adjacent windows share their boundary anchor")
    threshold: float = _f(DEFAULT_THRESHOLD, "gradient", "--mode router: CosineRouter threshold")
    jagg_frac: float | None = _f(DEFAULT_JAGG_FRAC, "gradient", "--mode router: CosineRouter "
                                 "jagg_frac (None: off)")  # fmt: skip
    subsample_steps: int | None = _f(None, "gradient", "--mode subsample: steps trained "
                                     "per sample, drawn at random (None: JAGG's anchor "
                                     "count)")  # fmt: skip
    mix_shift_interval: int | None = _f(None, "gradient", "--mode mixgrpo: GRPO steps per "
                                        "window move (None: one sweep of the run)")  # fmt: skip
    timestep_fraction: float = _f(1.0, "optimisation", "fraction of the T steps trained per "
                                  "sample, T' = max(1, int(T * fraction))")  # fmt: skip
    timestep_selection: str = _f("prefix", "optimisation", "which T' steps: prefix "
                                 "(Flow-GRPO) or random per sample (DanceGRPO)",
                                 choices=STEP_SELECTIONS)  # fmt: skip
    batching: str = _f("stacked", "gradient", "stacked: fewest model calls; per_step: "
                       "bit-identical to the rollout", choices=BATCHINGS)  # fmt: skip
    reuse_values: bool = _f(True, "gradient", "on-policy minibatches reuse the rollout's "
                            "velocities (values=, deferred); jagg and router only")  # fmt: skip
    deferred: bool = _f(True, "gradient", "anchors run with grad in the backward, chunk by "
                        "chunk (every minibatch; per-step-loop activation memory)")  # fmt: skip
    placement: str = _f("uniform", "gradient", "anchor placement: uniform (the window "
                        "layout), adaptive (chosen in the backward; every minibatch runs "
                        "deferred; router: uniform) or stochastic (jagg: floor(budget) "
                        "anchors per sample, a random subset promoted and re-weighted by "
                        "1/probability -- causal fold, to one more anchor with probability "
                        "budget - floor(budget): the (floor(budget)+1)-anchor causal fold in "
                        "expectation; --promote-to exact, causal or linear fold, to every "
                        "trained step: the exact gradient in expectation; "
                        "jagg_autograd.planner.stochastic_choice)",
                        choices=PLACEMENTS)  # fmt: skip
    fold: str = _f("linear", "gradient", "JAGG's fold of a step's gradient onto its anchors "
                   "(jagg, router): linear (both window ends; unbiased only with zero-mean, "
                   "group-fair advantages) or causal (the anchor at or before the step; "
                   "no noise-driven mean error for any advantages, a smaller one from the held "
                   "Jacobian, lower per-batch cosine; on a prefix of "
                   "the steps, timestep_fraction < 1, with uniform placement and no router, the "
                   "window layout's anchor count placed by causal_layout)",
                   choices=FOLDS)  # fmt: skip
    guard_ratio: float | None = _f(1.5, "gradient", "runaway guard "
                                   "(jagg_autograd.runaway_guard): when the median "
                                   "gradient norm of the last guard_window GRPO steps "
                                   "exceeds guard_ratio x its median over the estimator's "
                                   "first guard_window, the run falls back to a safer "
                                   "estimator (jagg / router: linear fold -> causal fold -> "
                                   "exact), logs it in log['guard'] and warns; exact, "
                                   "subsample, mixgrpo and nft have no fallback (None or "
                                   "<= 0 on the command line: off)")  # fmt: skip
    guard_window: int = _f(10, "gradient", "GRPO steps of the runaway guard's baseline and "
                           "of its rolling median")  # fmt: skip
    budget: float | None = _f(None, "gradient", "adaptive / stochastic placement: mean "
                              "anchors per sample (None: the uniform count; stochastic: "
                              "a fractional part of 0 or >= 0.01, not 0 with promote_to "
                              "exact)")  # fmt: skip
    promotion: str = _f("uniform", "gradient", "stochastic placement: which samples are "
                        "promoted -- uniform (each with the same probability: budget - "
                        "floor(budget) per added anchor) or proxy (more often where the "
                        "planner's proxy of the promoted term is large, re-weighted by "
                        "1/probability: the same expectation, less variance)",
                        choices=PROMOTIONS)  # fmt: skip
    promote_to: str = _f("anchor", "gradient", "stochastic placement: what a promoted "
                         "sample gets -- anchor (one more nested anchor: the "
                         "(floor(budget)+1)-anchor causal fold in expectation) or exact "
                         "(every trained step with a non-zero upstream gradient, re-weighted: "
                         "the exact gradient in "
                         "expectation, from a causal or linear base fold)",
                         choices=PROMOTE_TO)  # fmt: skip
    chunk_size: int | None = _f(None, "gradient", "samples per anchor / no-grad call (None: "
                                "jagg_trajectory's default)")  # fmt: skip
    lr: float = _f(1e-4, "optimisation", "AdamW learning rate (the peak, with a schedule)")
    lr_scheduler_type: str = _f("constant", "optimisation", "learning rate over the run's "
                                "optimizer steps (jagg_autograd.lr_schedule): constant "
                                "(Flow-GRPO's; with --warmup-steps transformers' "
                                "constant_with_warmup), or a linear / cosine decay to 0 "
                                "(TRL's names; transformers' formulas)",
                                choices=LR_SCHEDULERS)  # fmt: skip
    warmup_steps: int = _f(0, "optimisation", "optimizer steps (not GRPO steps: x "
                           "num_inner_epochs x optimizer_steps_per_rollout) of linear warm-up "
                           "from lr 0, before the schedule")  # fmt: skip
    weight_decay: float = _f(0.0, "optimisation", "AdamW weight decay (0: the pretrained "
                             "weights are the prior, not 0)")  # fmt: skip
    clip_range: float = _f(1e-4, "optimisation", "PPO ratio clip of the GRPO loss "
                           "(Flow-GRPO's)")  # fmt: skip
    adv_clip_max: float = _f(5.0, "optimisation", "advantages are clipped to +-adv_clip_max")
    beta: float = _f(0.0, "optimisation", "weight of the KL to the reference policy (0: off, "
                     "no reference pass)")  # fmt: skip
    max_grad_norm: float | None = _f(1.0, "optimisation", "gradient-norm clip (None or <= 0 "
                                     "on the command line: off)")  # fmt: skip
    optimizer_steps_per_rollout: int = _f(1, "optimisation", "optimizer steps per rollout "
                                          "and epoch (Flow-GRPO: 2; --minibatches: the old "
                                          "name)", flags=("--minibatches",))  # fmt: skip
    minibatches: int | None = _f(None, "optimisation", "old name of "
                                 "optimizer_steps_per_rollout (moved there, then None)",
                                 cli=False)  # fmt: skip
    gradient_accumulation_steps: int = _f(1, "optimisation", "minibatches per optimizer "
                                          "step (one JAGG call per minibatch covers all its "
                                          "trained steps)")  # fmt: skip
    num_inner_epochs: int = _f(1, "optimisation", "passes over the rollout's minibatches")
    global_std: bool = _f(False, "optimisation", "advantages divided by the std of the "
                          "whole rollout, not each group's (Flow-GRPO's sample.global_std; "
                          "its GenEval config: True)")  # fmt: skip
    ema_decay: float = _f(0.0, "optimisation", "evaluate (and grid) an EMA of the trained "
                          "weights with this decay (each evaluation also logs the raw weights' "
                          "raw_mean_reward); rollouts use the raw ones (0: off; Flow-GRPO's "
                          "GenEval run: 0.9, which with one optimizer step per rollout "
                          "is --ema-every 2, ema.py)")  # fmt: skip
    ema_every: int = _f(1, "optimisation", "optimizer steps between EMA updates")
    tuning: str = _f("full", "optimisation", "full fine-tuning or LoRA adapters (needs peft)",
                     choices=TUNING)  # fmt: skip
    lora_rank: int = _f(8, "optimisation", "LoRA rank (--tuning lora)")
    eval_per_digit: int = _f(16, "run", "held-out evaluation size: the digits task's samples "
                             "per digit (0: no evaluation)")  # fmt: skip
    eval_every: int = _f(0, "run", "also evaluate every N GRPO steps (0: only before and "
                         "after)")  # fmt: skip
    eval_sampler: str = _f("sde", "run", "evaluation sampler: the rollout's SDE with fixed "
                           "noise, or the deterministic ODE", choices=SAMPLERS)  # fmt: skip
    eval_seed: int | None = _f(None, "run", "seed of the evaluation noise (None: seed + "
                               "10000, disjoint from training)")  # fmt: skip
    grid_samples: int = _f(8, "run", "held-out pictures of the first and last evaluation in "
                           "grid.png (0: no grid)")  # fmt: skip
    probe_every: int = _f(0, "run", "every N GRPO steps, the gradient cosine / relative "
                          "error of the estimator to exact on a fresh batch (0: off)")  # fmt: skip
    probe_batches: int = _f(1, "run", "fresh batches per probe (the same prompts and noise "
                            "for every run at a step, from eval_seed); >= 3 adds the bias "
                            "figures (probe_systematic_share, probe_bias_to_signal, ...: "
                            "jagg_autograd.bias); the study uses 24")  # fmt: skip
    seed: int = _f(0, "run", "seeds the prompts, the rollout noise and the evaluation noise")
    device: str = _f("cpu", "run", "cpu or cuda (cuda:N); noise is drawn on the CPU")
    precision: str = _f("fp32", "run", "fp32, or bf16 (the model under autocast; latents, "
                        "log-probs and the loss in fp32)", choices=PRECISIONS)  # fmt: skip
    out: str | None = _f(None, "run", "folder for log.json, reward.png and grid.png (None: "
                         "nothing written)", cli_default="jagg_demo_out")  # fmt: skip
    # 1 by default: on a shared 2-core machine two intra-op threads contend with other
    # processes and ran up to 20x slower than one, while this small model gains little.
    threads: int | None = _f(1, "run", "torch intra-op threads (None: leave torch's)")
    progress: bool = _f(True, "run", "show a progress bar")
    save_every: int = _f(0, "run", "write <out>/checkpoint-<step>/ every N GRPO steps (0: "
                         "only at the end and on Ctrl-C; needs --out)")  # fmt: skip
    keep_checkpoints: int | None = _f(None, "run", "keep only the newest N checkpoints "
                                      "(None: all)")  # fmt: skip
    resume_from: str | None = _f(None, "run", "continue a run from a checkpoint folder, a "
                                 "run folder (its latest checkpoint) or 'latest' (the "
                                 "latest in --out)")  # fmt: skip
    report_to: str = _f("none", "run", "experiment tracker of rank 0: none, tensorboard "
                        "(pip install 'jagg-autograd[tensorboard]') or wandb (WANDB_MODE="
                        "offline works)", choices=REPORT_TO)  # fmt: skip
    collective_timeout: float = _f(600.0, "run", "several processes (torchrun): seconds "
                                   "a collective may wait for a peer before the run stops "
                                   "with an error (a dead process)")  # fmt: skip

    def __post_init__(self) -> None:
        if self.minibatches is not None:
            if self.optimizer_steps_per_rollout not in (1, self.minibatches):
                raise ValueError(
                    f"minibatches={self.minibatches!r} is the old name of "
                    f"optimizer_steps_per_rollout={self.optimizer_steps_per_rollout!r}: give one"
                )
            self.optimizer_steps_per_rollout = self.minibatches
            self.minibatches = None

    def estimator(self) -> Estimator:
        """A fresh estimator of this config's ``mode`` (``ValueError`` if none is registered)."""
        return get_estimator(self.mode)(self)

    @property
    def num_minibatches(self) -> int:
        """Minibatches per rollout: optimizer steps per epoch x accumulation steps."""
        return self.optimizer_steps_per_rollout * self.gradient_accumulation_steps

    @property
    def optimizer_steps_per_grpo_step(self) -> int:
        """Optimizer steps of one GRPO step: inner epochs x optimizer steps per rollout."""
        return self.num_inner_epochs * self.optimizer_steps_per_rollout

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run (the learning-rate schedule's length)."""
        return self.steps * self.optimizer_steps_per_grpo_step

    @property
    def num_train_steps(self) -> int:
        """T': the steps trained per sample (the estimator's: e.g. ``subsample_steps``)."""
        return self.estimator().num_train_steps()

    def validate(self, task: GRPOTask | None = None) -> None:
        """Raise ``ValueError`` naming the first bad field.

        ``task``: the task object the run uses (default: the registered ``self.task``),
        whose ``max_prompts`` bounds ``prompts_per_step``.  The common rules come first,
        then the estimator's own :meth:`~jagg_autograd.estimators.Estimator.check`.
        """
        for names, ok, what in _RULES:
            for name in names:
                v = getattr(self, name)
                if not ok(v, self):
                    choices = _choices_of(name) if "choices" in _FIELD_META[name] else None
                    raise ValueError(
                        f"{name} must be {what.format(c=self, choices=choices)}, got {v!r}"
                    )
            if names == ("task_options",):  # the task is known once its fields are sane
                self._check_task(task)
        est = self.estimator()
        if self.probe_every and not est.supports_probe:
            raise ValueError(
                f"probe_every must be 0 with mode={self.mode!r} (the probe compares to the "
                "exact GRPO gradient, which this estimator does not estimate)"
            )
        est.check()
        over = est.fallback() if self.guard_ratio is not None else None
        if over is not None:  # the runaway guard's fallback must run too: checked now
            try:
                dataclasses.replace(self, **over).validate(task)
            except ValueError as exc:
                raise ValueError(
                    f"guard_ratio: the runaway guard's fallback of mode={self.mode!r} "
                    f"({over}) cannot run with this config ({exc}); set guard_ratio=None"
                ) from exc

    def _check_task(self, task: GRPOTask | None) -> None:
        source = task if task is not None else task_factory(self.task)
        max_prompts = getattr(source, "max_prompts", None)
        if max_prompts is not None and self.prompts_per_step > max_prompts:
            name = getattr(source, "name", None) or self.task
            raise ValueError(
                f"prompts_per_step must be <= {max_prompts} (distinct prompts of task "
                f"{name!r}), got {self.prompts_per_step}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resolved(self) -> dict[str, Any]:
        """:meth:`to_dict` plus what the run derives from it (logged as ``config``)."""
        d = self.to_dict()
        d["minibatches"] = self.optimizer_steps_per_rollout
        d["num_minibatches"] = self.num_minibatches
        d["num_train_steps"] = self.num_train_steps
        self.estimator().resolve(d)
        return d


def sigma_schedule(config: GRPOConfig) -> torch.Tensor:
    """``(num_steps + 1,)`` float64 sigmas from 1 to 0: linear ``1 - i/T`` or shifted."""
    if config.schedule == "linear":
        return torch.linspace(1.0, 0.0, config.num_steps + 1, dtype=torch.float64)
    return shifted_sigma_schedule(config.num_steps, config.shift, dtype=torch.float64)


# --------------------------------------------------------------------------------------------
# the common checks: (fields, ok(value, config), "must be ...") in the order they run
# --------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _choice(name: str) -> Callable[[Any, GRPOConfig], bool]:
    return lambda v, c: v in _choices_of(name)


def _choices_of(name: str) -> tuple[Any, ...]:
    ch = _FIELD_META[name]["choices"]
    return tuple(ch() if callable(ch) else ch)


def _optional(ok: Callable[[Any, GRPOConfig], bool]) -> Callable[[Any, GRPOConfig], bool]:
    return lambda v, c: v is None or ok(v, c)


_FIELD_META = {f.name: f.metadata for f in dataclasses.fields(GRPOConfig)}
_POS_INT = ("steps", "prompts_per_step", "group_size", "num_steps", "optimizer_steps_per_rollout",
            "gradient_accumulation_steps", "num_inner_epochs", "lora_rank",
            "ema_every", "guard_window")  # fmt: skip
_CHOICES = ("eval_sampler", "mode", "schedule", "batching", "tuning", "precision", "placement",
            "timestep_selection", "sde_type", "nft_noise", "nft_gradient",
            "report_to", "fold", "lr_scheduler_type")  # fmt: skip

_RULES: list[tuple[tuple[str, ...], Callable[[Any, GRPOConfig], bool], str]] = [
    (_POS_INT, lambda v, c: _is_int(v) and v >= 1, "an int >= 1"),
    (("task",), lambda v, c: isinstance(v, str), "a registered task name"),
    (("task_options",), lambda v, c: isinstance(v, dict), "a dict"),
    (("group_size",), lambda v, c: v >= 2, ">= 2 (a group of one has advantage 0)"),
    (("num_steps",), lambda v, c: v >= 2, ">= 2 (a trajectory of >= 2 steps)"),
    *[((n,), _choice(n), "one of {choices}") for n in _CHOICES],
    (("eval_every", "probe_every", "grid_samples"), lambda v, c: _is_int(v) and v >= 0,
     "an int >= 0"),
    (("probe_batches",), lambda v, c: _is_int(v) and v >= 1, "an int >= 1"),
    (("eval_seed",), _optional(lambda v, c: _is_int(v)), "None or an int"),
    (("subsample_steps",), _optional(lambda v, c: _is_int(v) and 1 <= v <= c.num_steps),
     "None or an int in [1, num_steps={c.num_steps}]"),
    (("mix_shift_interval",), _optional(lambda v, c: _is_int(v) and v >= 1),
     "None or an int >= 1"),
    (("jagg_frac",), _optional(lambda v, c: _is_real(v) and 0.0 <= v <= 1.0), "None or in [0, 1]"),
    (("window",), lambda v, c: _is_int(v) and 2 <= v <= c.num_steps,
     "an int in [2, num_steps={c.num_steps}]"),
    (("shared_anchors", "reuse_values", "deferred", "progress", "exact_loop", "track_memory",
      "global_std"),
     lambda v, c: isinstance(v, bool), "a bool"),
    (("noise_level", "shift", "lr", "adv_clip_max"), lambda v, c: _is_real(v) and v > 0,
     "a finite number > 0"),
    (("weight_decay", "clip_range", "beta"), lambda v, c: _is_real(v) and v >= 0,
     "a finite number >= 0"),
    (("threshold",), lambda v, c: _is_real(v), "a finite number"),
    (("max_grad_norm",), _optional(lambda v, c: _is_real(v) and v > 0), "None or > 0"),
    (("guard_ratio",), _optional(lambda v, c: _is_real(v) and v > 1), "None or a finite number "
     "> 1 (the norm's rise that trips the runaway guard)"),
    (("ema_decay",), lambda v, c: _is_real(v) and 0.0 <= v < 1.0, "in [0, 1) (0: off)"),
    (("timestep_fraction",), lambda v, c: _is_real(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    (("nft_beta",), lambda v, c: _is_real(v) and v > 0, "a finite number > 0"),
    (("nft_timesteps",), _optional(lambda v, c: _is_int(v) and v >= 1),
     "None or an int in [1, num_steps={c.num_steps}]"),
    (("budget",), _optional(lambda v, c: _is_real(v) and v > 0), "None or a finite number > 0"),
    # Checked here, not at the first minibatch after a rollout (jagg_trajectory's check).
    (("budget",),
     lambda v, c: c.placement != "stochastic" or v is None
     or (1 if c.fold == "causal" else 2) <= v <= c.num_train_steps,
     "None or in [1 (causal fold) or 2 (linear), T'={c.num_train_steps}] (the trained "
     "steps) for placement='stochastic'"),
    # exact, subsample and mixgrpo ignore the placement (and the router resolves it to
    # uniform) as they do adaptive's; nft would ignore it silently, the linear fold's rows
    # do not nest: refused.
    (("placement",),
     lambda v, c: v != "stochastic"
     or (c.mode != "nft"
         and (c.mode != "jagg" or c.fold == "causal" or c.promote_to == "exact")),
     "'uniform' or 'adaptive' with mode={c.mode!r}, fold={c.fold!r}, "
     "promote_to={c.promote_to!r} ('stochastic' needs fold='causal' (or promote_to='exact') "
     "with mode='jagg' and is not an nft placement: it re-weights the fold's nested rows)"),
    (("promotion",), lambda v, c: v == "uniform" or c.placement == "stochastic",
     "'uniform' unless placement='stochastic' (nothing else promotes)"),
    (("budget",), lambda v, c: c.placement != "stochastic" or v is None
     or promotion_fraction_ok(float(v)),
     f"None or a number whose fractional part is 0 or >= {MIN_PROMOTION_FRAC} with "
     "placement='stochastic' (the promotion probabilities scale with it)"),
    # The router, exact, subsample and mixgrpo would ignore it (the router resolves the
    # placement to uniform): a run asked to be exact in expectation would silently not be.
    (("promote_to",), lambda v, c: v == "anchor" or (c.placement == "stochastic"
                                                    and c.mode == "jagg"),
     "'anchor' unless placement='stochastic' with mode='jagg' (nothing else promotes; "
     "got mode={c.mode!r})"),
    (("budget",), lambda v, c: c.promote_to != "exact" or promotes_to_exact(v, c.num_train_steps),
     "fractional (say 2.4) or >= T'={c.num_train_steps} with promote_to='exact' (an integer "
     "budget, or None, promotes nothing: the deterministic base layout)"),
    (("chunk_size",), _optional(lambda v, c: _is_int(v) and v >= 1), "None or an int >= 1"),
    (("device",), lambda v, c: isinstance(v, str) and v.split(":")[0] in ("cpu", "cuda"),
     "'cpu' or 'cuda' (or 'cuda:N')"),
    (("optimizer_steps_per_rollout",),
     lambda v, c: (c.prompts_per_step * c.group_size) % c.num_minibatches == 0,
     "such that optimizer_steps_per_rollout (minibatches) x gradient_accumulation_steps = "
     "{c.num_minibatches} divides the rollout batch prompts_per_step * group_size"),
    (("eval_per_digit",), lambda v, c: _is_int(v) and v >= 0, "an int >= 0"),
    (("seed",), lambda v, c: _is_int(v), "an int"),
    (("threads",), _optional(lambda v, c: _is_int(v) and v >= 1), "None or an int >= 1"),
    (("save_every",), lambda v, c: _is_int(v) and v >= 0, "an int >= 0"),
    (("warmup_steps",), lambda v, c: _is_int(v) and 0 <= v <= c.total_optimizer_steps,
     "an int in [0, {c.total_optimizer_steps}] (the run's optimizer steps: steps x "
     "num_inner_epochs x optimizer_steps_per_rollout)"),
    (("keep_checkpoints",), _optional(lambda v, c: _is_int(v) and v >= 1), "None or an int >= 1"),
    (("resume_from",), _optional(lambda v, c: isinstance(v, str) and v != ""),
     "None, 'latest' or a folder"),
    (("resume_from",), lambda v, c: v != "latest" or c.out is not None,
     "a folder when out is None ('latest' is looked up in --out)"),
    (("collective_timeout",), lambda v, c: _is_real(v) and v > 0, "a finite number > 0"),
]  # fmt: skip
