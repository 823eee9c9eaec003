"""Online Flow-GRPO for any task, with the gradient through the configured estimator.

``GRPOTrainer(config, task=...)`` trains a task's velocity model (a
:class:`~jagg_autograd.tasks.GRPOTask`; the digits demo is ``task="digits"``).  One GRPO
step (:meth:`~GRPOTrainer.train_step`), with Flow-GRPO's names:

1. :meth:`~GRPOTrainer.rollout` (no grad): ``prompts_per_step`` prompts, each repeated
   ``group_size`` times, sampled with Flow-GRPO's SDE step (``sde_type="dance"``:
   DanceGRPO's) over ``num_steps`` steps, in the minibatches that will be trained.
2. :meth:`~GRPOTrainer.advantages`: the task's reward, group-normalised
   (:func:`~jagg_autograd.grpo.group_advantages` raises on NaN rewards).
3. :meth:`~GRPOTrainer.minibatches`: each minibatch's trained steps (the estimator's) and,
   with ``beta > 0``, the reference policy's means (once per rollout).
4. :meth:`~GRPOTrainer.train_epochs`: ``num_inner_epochs`` passes over the minibatches,
   each one's loss from the estimator (:mod:`jagg_autograd.estimators`, chosen by
   ``mode``), an :meth:`~GRPOTrainer.optimizer_step` (``max_grad_norm`` clipping, AdamW)
   every ``gradient_accumulation_steps`` minibatches.

A held-out evaluation every ``eval_every`` steps (fixed noise never used in training) and
a gradient :meth:`~GRPOTrainer.probe` every ``probe_every`` steps touch neither the
training noise stream nor the timings.  The runaway guard
(:mod:`jagg_autograd.runaway_guard`, ``guard_ratio``) watches each step's gradient norm and,
when it runs away, switches the run to the estimator's fallback (``log["guard"]``).  The
log, its files and the summary are :mod:`jagg_autograd.runlog`'s.  A non-finite loss or
gradient norm stops the run with a :class:`TrainingDivergedError` naming the step, before
the optimizer step.

Checkpoints, exact resume and stopping: :mod:`jagg_autograd.trainer_checkpoints`;
several processes (``torchrun`` / ``accelerate launch``):
:mod:`jagg_autograd.trainer_parallel`.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from jagg_autograd.checkpoint import (
    AsyncCheckpointer,
    check_resume_config,
    resolve_checkpoint,
)
from jagg_autograd.config import (
    PLACEMENTS,
    PRECISIONS,
    SAMPLERS,
    SCHEDULES,
    SDE_TYPES,
    TUNING,
    GRPOConfig,
    sigma_schedule,
)
from jagg_autograd.data_parallel import (
    SampleLayout,
    ShardedGenerator,
    all_gather_samples,
    all_reduce_mean_,
    destroy_process_group,
    draw_randn,
    init_process_group_from_env,
    reduce_scalars,
)
from jagg_autograd.ema import ParamEMA
from jagg_autograd.estimators import MODES, Minibatch, mix_window_start
from jagg_autograd.grpo import group_advantages
from jagg_autograd.lr_schedule import lr_factor
from jagg_autograd.memory import SavedTensorTracker
from jagg_autograd.policy import Policy, build_reference, resolve_device
from jagg_autograd.rollout import (
    STEP_SELECTIONS,
    Trajectories,
    reference_means,
    sample_trajectories,
)
from jagg_autograd.runlog import RunLog, StepStats, summarize
from jagg_autograd.tasks import GRPOTask, get_task, task_factory
from jagg_autograd.tracking import make_tracker
from jagg_autograd.trainer_checkpoints import CheckpointMixin, saved_config, stop_on_signals
from jagg_autograd.trainer_guard import GuardMixin
from jagg_autograd.trainer_measure import MeasurementMixin
from jagg_autograd.trainer_parallel import check_world_size, dist_device, reduce_row

__all__ = [
    "MODES", "PLACEMENTS", "PRECISIONS", "SAMPLERS", "SCHEDULES", "SDE_TYPES",
    "STEP_SELECTIONS", "TUNING", "GRPOConfig", "GRPOTrainer", "TrainingDivergedError",
    "mix_window_start", "sigma_schedule", "summarize", "train",
]  # fmt: skip
# The digits-shaped helpers kept public here live in the digits task, imported on first
# use so that the trainer stays task-agnostic (importing it loads no digits code).
_DIGITS = {"Rollout": "Rollout", "rollout": "rollout", "evaluate": "evaluate",
           "trajectory_log_probs": "trajectory_log_probs", "_estimator_loss": "estimator_loss",
           "subsample_log_probs": "subsample_log_probs"}  # fmt: skip


def __getattr__(name: str) -> Any:
    if name in _DIGITS:
        from jagg_autograd.tasks import digits

        return getattr(digits, _DIGITS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TrainingDivergedError(RuntimeError):
    """A non-finite loss or gradient norm: the run stops before the optimizer step."""


def _check_finite(value: torch.Tensor, what: str, step: int, where: str) -> None:
    if not bool(torch.isfinite(value)):
        raise TrainingDivergedError(
            f"GRPO step {step}: the {what} is {float(value)} ({where}); stopped before the "
            "optimizer step. Lower lr, clip_range or adv_clip_max, or set max_grad_norm; the "
            "log keeps every finished step"
        )


def _resolve_task(config: GRPOConfig, name: str) -> GRPOTask:
    """The registered task ``name`` built with the config's options."""
    options = dict(config.task_options)
    params = inspect.signature(task_factory(name)).parameters
    if "eval_per_digit" in params and "eval_per_digit" not in options:
        options["eval_per_digit"] = config.eval_per_digit
    return get_task(name, **options)


@dataclass
class RolloutBatch:
    """One rollout: the prompts, each ``group_size`` times (``rep``), the group ids, and
    the trajectories of the minibatches that will be trained."""

    prompts: list[Any]
    rep: list[Any]
    groups: torch.Tensor
    trajs: list[Trajectories]
    local_rep: list[Any] | None = None  # this rank's samples' prompts (None: all of rep)


class GRPOTrainer(MeasurementMixin, CheckpointMixin, GuardMixin):
    """Online GRPO on a task, one :meth:`step` at a time.

    ``GRPOTrainer(config, task=None)``: ``task`` is a :class:`~jagg_autograd.tasks.GRPOTask`,
    a registered name, or None (``config.task``, default ``"digits"``).  The constructor
    checks ``config.out``, builds the task's model on ``config.device`` and, if
    ``eval_per_digit > 0``, runs the initial evaluation; :meth:`step` runs one GRPO step
    (plus the probe / evaluation due at it) and returns its log row; :meth:`finish` runs
    the final evaluation and returns (and writes) the log of :func:`train`.  Each trainer
    owns its noise generator, so several trainers stepped in turn give the runs each
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
        # Several processes (torchrun / accelerate launch): join the group first.
        self.dist = init_process_group_from_env(
            device=dist_device(config.device), timeout_s=config.collective_timeout
        )
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.is_main = self.rank == 0
        if self.world_size > 1 and config.device != "cpu":
            config = dataclasses.replace(config, device=str(self.dist.device))
        check_world_size(config, self.world_size)
        self.config = config
        # Rank 0 alone writes the log, the pictures and the checkpoints.
        self.runlog = RunLog(config.task, config.resolved(), config.out if self.is_main else None)
        self.log = self.runlog.log
        self.device = resolve_device(config.device)
        self.step_index = 0
        self.optimizer_step_index = 0  # the learning-rate schedule's position
        self.rollout_seconds = 0.0
        self.train_seconds = 0.0
        self._stop_requested = False
        self._checkpointer: AsyncCheckpointer | None = None
        self._resume_path = None
        if config.resume_from is not None:  # refused before anything is written or built
            self._resume_path = resolve_checkpoint(config.resume_from, config.out)
            check_resume_config(saved_config(self._resume_path), self.resume_config())
        # A missing tracker package fails here, on every rank, before any training.
        self.tracker = make_tracker(config.report_to, log_dir=config.out,
                                    config=self.log["config"], rank=self.rank)  # fmt: skip
        # Before any model is built: a bad --out fails at once (a resumed run keeps the
        # folder's log and pictures until the checkpoint is loaded).
        self.runlog.prepare_out(keep=self._resume_path is not None)
        self._grid_rows: list[tuple[torch.Tensor, list[str], int]] = []
        try:
            self._build(task_obj)
            if self._resume_path is not None:
                self._resume()
                self._restore_guard()
            elif config.eval_per_digit:
                self._record_eval()
        except BaseException as exc:  # the log on disk must not stay "running"
            self.abort(exc)
            raise
        self.runlog.write()

    def _build(self, task_obj: GRPOTask | None) -> None:
        """The task, its model on the device, the optimizer, the reference, the estimator."""
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
        self.policy = Policy(self.model, config.precision, self.device)
        self.reference: Callable[..., torch.Tensor] | None = None
        if config.beta > 0:
            self.reference = build_reference(
                self.policy, config.tuning, config.precision, self.device
            )
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay
        )
        # Evaluations (and the grid) see the average; rollouts and the loss the raw weights.
        self.ema = (ParamEMA(self.params, config.ema_decay, config.ema_every)
                    if config.ema_decay > 0 else None)  # fmt: skip
        self.estimator = config.estimator()
        self.guard = self._new_guard()
        self.sigmas = sigma_schedule(config)
        # Disjoint from the training noise stream.
        self.eval_seed = config.seed + 10_000 if config.eval_seed is None else config.eval_seed
        self.minibatch_size = config.prompts_per_step * config.group_size // config.num_minibatches
        # This rank's rows of every minibatch (all of them with one process).
        self.layout = SampleLayout(config.prompts_per_step * config.group_size,
                                   self.minibatch_size, self.rank, self.world_size)  # fmt: skip
        self.local_minibatch = self.layout.local_minibatch
        self.log["sigmas"] = [round(x, 6) for x in self.sigmas.tolist()]
        self.log["num_trainable_parameters"] = sum(p.numel() for p in self.params)
        self.log["world_size"] = self.world_size

    # ------------------------------------------------------------------ sampling

    def _sample(
        self,
        prompts: Sequence[Any],
        generator: torch.Generator | ShardedGenerator,
        *,
        sde_steps: Sequence[int] | None = None,
    ) -> Trajectories:
        """Trajectories of ``prompts`` (one sample each), noise from ``generator`` on the CPU
        (a :class:`ShardedGenerator`: this rank's rows of the single-process draws)."""
        shape = (len(prompts), *self.task.latent_shape)
        noise = draw_randn(shape, generator, dtype=torch.float32).to(self.device)
        cond = self.task.cond(prompts)
        return sample_trajectories(
            self.policy,
            noise,
            self.sigmas,
            cond=cond,
            # The task's contract: every tensor of cond(prompts) has one row per prompt --
            # said, not inferred (a (B, L, D) embedding with D == B is not a shared table).
            batched_cond=[k for k, v in cond.items() if isinstance(v, torch.Tensor)],
            noise_level=self.config.noise_level,
            generator=generator,
            sde_steps=sde_steps,
            sde_type=self.config.sde_type,
        )

    def sample_generator(self) -> torch.Generator | ShardedGenerator:
        """The generator of the per-sample draws of training: the trainer's one stream,
        of which each rank keeps its rows (the generator itself with one process)."""
        if self.world_size == 1:
            return self.generator
        return ShardedGenerator(self.generator, self.layout)

    def _group(self, prompts: Sequence[Any]) -> tuple[list[Any], torch.Tensor]:
        """Each prompt ``group_size`` times, and the group ids (the prompt's index)."""
        g = self.config.group_size
        rep = [p for p in prompts for _ in range(g)]
        return rep, torch.arange(len(prompts)).repeat_interleave(g)

    # ------------------------------------------------------------------ one GRPO step

    def rollout(self) -> RolloutBatch:
        """Draw the prompts and sample their groups, minibatch by minibatch."""
        c, size = self.config, self.local_minibatch
        # The prompts are drawn identically on every rank; each rank samples its rows.
        prompts = self.task.sample_prompts(c.prompts_per_step, self.generator)
        rep, groups = self._group(prompts)
        local = rep if self.world_size == 1 else self.layout.take(rep)
        gen = self.sample_generator()
        sde_steps = self.estimator.sde_steps(self.step_index)
        # Sample in the minibatches that will be trained, so that each minibatch's
        # recomputation sees exactly the batch of its rollout (the condition for a
        # bit-identical ratio, and for values= to be the current parameters' velocities).
        trajs = [self._sample(local[i : i + size], gen, sde_steps=sde_steps)
                 for i in range(0, len(local), size)]  # fmt: skip
        return RolloutBatch(list(prompts), rep, groups, trajs, list(local))

    def advantages(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rewards, advantages)`` of a rollout, both global (every sample of the step, in
        the single-process order): the task's reward, all-gathered over the ranks, then
        group-normalised over whole groups."""
        size = self.local_minibatch
        local = batch.rep if batch.local_rep is None else batch.local_rep
        rewards = torch.cat(
            [
                self.task.reward(t.latents[-1], local[i * size : (i + 1) * size])
                for i, t in enumerate(batch.trajs)
            ]
        ).float()
        rewards = all_gather_samples(rewards, self.layout)
        # raises on NaN rewards
        return rewards, group_advantages(rewards, batch.groups, global_std=self.config.global_std)

    def minibatches(self, trajs: list[Trajectories], adv: torch.Tensor) -> list[Minibatch]:
        """The rollout's minibatches (this rank's rows) with their trained steps and
        reference means; ``adv``: the global advantages."""
        c, size, gen = self.config, self.local_minibatch, self.sample_generator()
        if self.world_size > 1:
            adv = self.layout.take(adv)
        mbs = [
            Minibatch(t, adv[i * size : (i + 1) * size].to(t.latents.device),
                      self.estimator.train_steps(t.batch_size, gen))
            for i, t in enumerate(trajs)
        ]  # fmt: skip
        if self.reference is not None and self.estimator.needs_logprob_reference:
            for mb in mbs:  # once per rollout, reused by every inner epoch
                mb.ref_means = reference_means(
                    self.reference, mb.traj, steps=mb.steps, noise_level=c.noise_level
                )
        return mbs

    def train_epochs(self, mbs: list[Minibatch]) -> StepStats:
        """The inner epochs over the minibatches, an optimizer step every GA of them."""
        c = self.config
        GA = c.gradient_accumulation_steps
        stats = StepStats()
        gen = self.sample_generator()
        self.optimizer.zero_grad(set_to_none=True)
        for epoch in range(c.num_inner_epochs):
            for i, mb in enumerate(mbs):
                where = f"epoch {epoch}, minibatch {i}"
                ta = time.perf_counter()
                res = self.estimator.loss(
                    self, mb, generator=gen, on_policy=stats.optimizer_steps == 0,
                    scale=1.0 / GA, inline_backward=True,
                )  # fmt: skip
                _check_finite(res.loss.detach(), "loss", self.step_index, where)
                tb = time.perf_counter()
                if not res.backward_done:
                    (res.loss / GA).backward()
                tc = time.perf_counter()
                stats.add(res)
                if (i + 1) % GA == 0:
                    stats.add_optimizer_step(self.optimizer_step(where))
                bw_in = res.backward_seconds  # backwards run inside the step loops
                stats.phase["forward"] += tb - ta - bw_in
                stats.phase["backward"] += tc - tb + bw_in
                stats.phase["optimizer"] += time.perf_counter() - tc
        return stats

    def optimizer_step(self, where: str) -> torch.Tensor:
        """Average the gradients over the ranks (one collective), clip (or measure) the
        gradient norm, check it, step and zero the gradients."""
        c, params = self.config, self.params
        if self.world_size > 1:
            # Each rank's loss is the mean over its equal share of the minibatch, so the
            # mean of the ranks' gradients is the single-process gradient (DDP's average).
            all_reduce_mean_([p.grad for p in params if p.grad is not None])
        if c.max_grad_norm is not None:
            gn = torch.nn.utils.clip_grad_norm_(params, c.max_grad_norm)
        else:
            gn = torch.sqrt(sum((p.grad.detach() ** 2).sum() for p in params if p.grad is not None))
        _check_finite(gn.detach(), "gradient norm", self.step_index, where)
        lr = c.lr * lr_factor(c.lr_scheduler_type, self.optimizer_step_index,
                              c.total_optimizer_steps, c.warmup_steps)  # fmt: skip
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer_step_index += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update()
        return gn

    def train_step(self) -> dict[str, Any]:
        """One rollout + the inner epochs of minibatch optimizer steps; returns the log row."""
        t0 = time.perf_counter()
        batch = self.rollout()
        rewards, adv = self.advantages(batch)
        t1 = time.perf_counter()
        mbs = self.minibatches(batch.trajs, adv)
        t_ref = time.perf_counter()
        f0 = self.policy.forward_samples
        stats = self.train_epochs(mbs)
        t2 = time.perf_counter()
        row = stats.row(
            prompts=batch.prompts,
            rewards=rewards,
            forward_samples=self.policy.forward_samples - f0,
            rollout_seconds=t1 - t0,
            train_seconds=t2 - t1,
            reference_seconds=t_ref - t1,
        )
        row["lr"] = self.optimizer.param_groups[0]["lr"]  # the step's last optimizer step's
        return reduce_row(row) if self.world_size > 1 else row

    # ------------------------------------------------------------------ the loop

    def step(self) -> dict[str, Any]:
        """One GRPO step: probe if due, rollout, optimizer step(s), evaluation if due."""
        c = self.config
        probe = self.probe() if c.probe_every and self.step_index % c.probe_every == 0 else {}
        if c.track_memory:
            # The rollout and the reference run without grad (nothing saved): the peak is the
            # training phase's, the deferred backward's recomputation included.
            exclude = [*self.model.parameters(), *self.params]
            if isinstance(self.reference, Policy):
                exclude += list(self.reference.model.parameters())
            with SavedTensorTracker(exclude=exclude) as mem:
                row = self.train_step()
            row["peak_saved_bytes"] = int(mem.peak)
        else:
            row = self.train_step()
        if c.track_memory and self.world_size > 1:
            row.update(reduce_scalars({"peak_saved_bytes": row["peak_saved_bytes"]}, "max"))
            row["peak_saved_bytes"] = int(row["peak_saved_bytes"])
        row["step"] = self.step_index
        row.update(probe)
        self._watch(row)  # may switch the estimator for the next step
        self.step_index += 1
        self.rollout_seconds += row["rollout_seconds"]
        self.train_seconds += row["train_seconds"]
        self.log["steps"].append(row)
        self.tracker.log_scalars(row["step"], row)
        if (
            c.eval_per_digit
            and c.eval_every
            and self.step_index % c.eval_every == 0
            and self.step_index < c.steps
        ):
            self._record_eval()
        self.runlog.totals(self.rollout_seconds, self.train_seconds)
        self.runlog.write()
        stop = self._stop_requested
        if self.world_size > 1:  # every rank stops after the same step
            stop = reduce_scalars({"stop": float(stop)}, "max")["stop"] > 0
        if c.save_every and (stop or (self.step_index % c.save_every == 0
                                      and self.step_index < c.steps)):  # fmt: skip
            self.save_checkpoint()  # the end's is written by finish()
        if stop:
            raise KeyboardInterrupt(f"stopped by a signal after step {self.step_index}")
        return row

    def finish(self) -> dict[str, Any]:
        """Final evaluation, totals and summary; writes ``log.json`` / ``reward.png``."""
        log = self.log
        try:
            if self.config.eval_per_digit:
                self._record_eval()
                log["eval"] = {"initial": log["evals"][0], "final": log["evals"][-1]}
            self.runlog.totals(self.rollout_seconds, self.train_seconds)
            self.runlog.finish("finished")
            self.runlog.save_grid(self._grid_rows, self.task.name or "task")
            if log.get("grid"):
                self.tracker.log_image("grid", log["grid"], self.step_index)
            if self.config.save_every:
                self.save_checkpoint()
            self.wait_for_checkpoint()
        finally:
            self.tracker.close()
        return log

    def abort(self, exc: BaseException) -> dict[str, Any]:
        """Close the log of a run stopped by ``exc``: status "interrupted" (Ctrl-C) or
        "failed" (with the error's text), every finished step kept; returns the log."""
        interrupted = isinstance(exc, KeyboardInterrupt)
        if self.log["evals"]:
            self.log["eval"] = {"initial": self.log["evals"][0]}
        self.runlog.totals(self.rollout_seconds, self.train_seconds)
        status, error = ("interrupted", None) if interrupted else ("failed", exc)
        log = self.runlog.finish(status, error)
        try:
            self.wait_for_checkpoint()  # a checkpoint in flight is finished, not lost
        except Exception as ckpt_exc:  # the run's own error is the one to report
            print(f"jagg_autograd: the last checkpoint could not be written: {ckpt_exc}",
                  file=sys.stderr)  # fmt: skip
        finally:
            tracker = getattr(self, "tracker", None)
            if tracker is not None:
                tracker.close()
        return log


def train(
    config: GRPOConfig | None = None,
    *,
    task: GRPOTask | str | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run online GRPO on a task (default: digits); return the log (also written to ``out``).

    Log keys: ``run_id``, ``started_at``, ``status``, ``task``, ``config`` (resolved),
    ``steps`` (one row per GRPO step, :meth:`jagg_autograd.runlog.StepStats.row` and
    ``lr``, the rate of the step's last optimizer step; probe
    steps add ``probe_cosine`` / ``probe_rel_error``, ``track_memory`` adds
    ``peak_saved_bytes``, the runaway guard ``guard_norm_ratio``), ``guard`` (the runaway
    guard's switches, if any: ``step``, ``ratio``, ``from``, ``to``, ``changes``),
    ``evals`` (held-out evaluations, the first before training and the last after:
    ``step``, ``mean_reward``, the task's breakdown, ``wall_seconds``),
    ``eval`` (``initial`` / ``final``), ``total_seconds``, ``rollout_seconds``,
    ``train_seconds``, ``summary``, ``out``.

    Raises:
        ValueError: bad config (:meth:`GRPOConfig.validate`), an unwritable ``out``, or
            non-finite rewards / log-probs.
        TrainingDivergedError: a non-finite loss or gradient norm (the step is named).
        KeyboardInterrupt: re-raised after the partial log is written.
    """
    trainer = GRPOTrainer(config, task=task)
    try:
        with stop_on_signals(trainer):
            log = _run(trainer, on_step)
        if trainer.world_size > 1:
            # Leave together: a rank tearing gloo down while its peer is still finishing
            # was seen to abort ("terminate called without an active exception").
            reduce_scalars({"done": 1.0}, "sum")
        return log
    finally:
        if trainer.world_size > 1:
            destroy_process_group()
            # Free now what reference cycles still hold of the group (collective work and
            # its tensors): left to interpreter exit, gloo's teardown then aborted a rank
            # ("terminate called without an active exception") in 4 of 8 torchrun runs of
            # `benchmarks.parallel --worker` on a 2-core AVX-512 machine; 0 of 12 with this.
            del trainer
            gc.collect()


def _run(trainer: GRPOTrainer, on_step: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    bar = None
    if trainer.config.progress and trainer.is_main:
        from tqdm.auto import tqdm

        bar = tqdm(total=trainer.config.steps, initial=trainer.step_index, desc="GRPO",
                   unit="step", dynamic_ncols=True)  # fmt: skip
    try:
        while trainer.step_index < trainer.config.steps:  # a resumed run starts later
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
