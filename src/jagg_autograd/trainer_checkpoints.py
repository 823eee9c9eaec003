"""Checkpoints, exact resume and stopping for :class:`~jagg_autograd.trainer.GRPOTrainer`.

Checkpoints (``save_every``; :mod:`jagg_autograd.checkpoint`, written by rank 0 in the
background) hold the trainable tensors by name, the AdamW state, ``generator`` (prompts,
rollout noise and the estimator's draws, in that order), the global RNG states, the step
index, the log (with the timing totals), the first evaluation's grid pictures and the
EMA of the weights (``ema_decay``).  The
estimators keep no state across GRPO steps (DiffusionNFT's snapshot is retaken at each
rollout), so nothing else is needed for ``resume_from`` to continue bit for bit.

The first Ctrl-C / SIGTERM during :func:`~jagg_autograd.trainer.train` with checkpoints
on stops the run after the current step (every rank after the same step) and writes a
checkpoint; a second one stops at once.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Any

import torch

from jagg_autograd.checkpoint import AsyncCheckpointer, load_checkpoint

__all__ = ["CheckpointMixin", "saved_config", "stop_on_signals"]


class CheckpointMixin:
    """The checkpoint half of :class:`~jagg_autograd.trainer.GRPOTrainer` (it reads the
    trainer's ``config``, ``model``, ``params``, ``optimizer``, ``generator``, ``runlog``,
    ``log``, ``step_index``, timing totals and rank)."""

    def request_stop(self) -> None:
        """Stop after the current step (checkpoint written with ``save_every``): what
        Ctrl-C / SIGTERM do during :func:`train` when checkpoints are on."""
        self._stop_requested = True

    def named_trainable(self) -> dict[str, torch.Tensor]:
        """The trainable tensors by their names in the model (a checkpoint's weights)."""
        ids = {id(p) for p in self.params}
        named = {n: p for n, p in self.model.named_parameters() if id(p) in ids}
        if len(named) != len(self.params):
            named = {f"param.{i}": p for i, p in enumerate(self.params)}
        return named

    def resume_config(self) -> dict[str, Any]:
        """The config a checkpoint records and a resume compares (plus the world size)."""
        return {**self.config.resolved(), "world_size": self.world_size}

    def save_checkpoint(self) -> None:
        """``<out>/checkpoint-<step>/`` of the state now (rank 0; written in the background,
        :class:`~jagg_autograd.checkpoint.AsyncCheckpointer`)."""
        c = self.config
        if not self.is_main or c.out is None:
            return
        if self._checkpointer is None:
            self._checkpointer = AsyncCheckpointer()
        self.runlog.totals(self.rollout_seconds, self.train_seconds)
        extra: dict[str, Any] = {}
        extra_tensors: dict[str, torch.Tensor] = {}
        if self._grid_rows:  # grid.png's top row: the first evaluation's pictures
            pics, captions, step = self._grid_rows[0]
            extra["grid_first"] = {"captions": captions, "step": step}
            extra_tensors["grid_first"] = pics
        if self.ema is not None:
            extra["ema_updates"] = self.ema.updates
            extra_tensors.update({f"ema.{i}": v for i, v in enumerate(self.ema.values)})
        self._checkpointer.save(
            c.out, self.step_index, trainable=self.named_trainable(), optimizer=self.optimizer,
            generators={"train": self.generator}, config=self.resume_config(), log=self.log,
            extra=extra, extra_tensors=extra_tensors, keep_last=c.keep_checkpoints,
        )  # fmt: skip

    def wait_for_checkpoint(self) -> None:
        """Wait until the checkpoint being written is on disk (and stop the writer)."""
        ckpt, self._checkpointer = self._checkpointer, None
        if ckpt is not None:
            ckpt.close()

    def _resume(self) -> None:
        """Load the checkpoint into the freshly built run (the reference is built before)."""
        c = self.config
        ck = load_checkpoint(
            self._resume_path, trainable=self.named_trainable(), optimizer=self.optimizer,
            generators={"train": self.generator}, config=self.resume_config(), rank=self.rank,
        )  # fmt: skip
        log = ck.log
        evals = log.get("evals", [])
        # A run's last evaluation is taken at its end; a run that continues takes it only
        # if it is on the --eval-every schedule.
        periodic = c.eval_every and ck.step % c.eval_every == 0
        if evals and ck.step > 0 and evals[-1]["step"] == ck.step and not periodic:
            evals.pop()
        log["config"] = self.log["config"]
        log["task"] = self.log["task"]
        log["out"] = self.log["out"]
        log["world_size"] = self.world_size
        log["status"], log["eval"], log["summary"] = "running", {}, ""
        log.pop("error", None)
        log.pop("grid", None)
        log.setdefault("resumed_from", []).append({"path": str(ck.path), "step": ck.step})
        self.runlog.log = self.log = log
        self.runlog.resume_clock(float(log.get("total_seconds", 0.0)))
        self.step_index = ck.step
        # Every GRPO step takes the same number of optimizer steps (the config is checked
        # against the checkpoint's), so the schedule's position follows from the step.
        self.optimizer_step_index = ck.step * c.optimizer_steps_per_grpo_step
        self.rollout_seconds = float(log.get("rollout_seconds", 0.0))
        self.train_seconds = float(log.get("train_seconds", 0.0))
        if self.ema is not None and "ema_updates" in ck.extra:
            self.ema.load([ck.extra_tensors[f"ema.{i}"] for i in range(len(self.ema.values))],
                          ck.extra["ema_updates"])  # fmt: skip
        # (a checkpoint without an average: it starts at the resumed weights)
        first = ck.extra.get("grid_first")
        if first is not None and "grid_first" in ck.extra_tensors:
            self._grid_rows = [(ck.extra_tensors["grid_first"], list(first["captions"]),
                                int(first["step"]))]  # fmt: skip


def saved_config(path: Any) -> dict[str, Any]:
    """The config recorded in the checkpoint at ``path`` (what a resume is checked against)."""
    from jagg_autograd._checkpoint_io import read_state

    state = read_state(path)
    if state is None:  # pragma: no cover - resolve_checkpoint checked it
        raise ValueError(f"{path} is not a checkpoint")
    return dict(state.get("config", {}))


@contextlib.contextmanager
def stop_on_signals(trainer: CheckpointMixin) -> Any:
    """With checkpoints on (``save_every``), the first Ctrl-C / SIGTERM stops the run after
    the current step with a checkpoint (every rank after the same step); a second one
    stops at once.  Without them (or off the main thread) nothing changes."""
    if not trainer.config.save_every or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def handler(signum: int, frame: Any) -> None:
        if trainer._stop_requested:
            raise KeyboardInterrupt
        trainer.request_stop()
        if trainer.is_main:
            print(f"\njagg_autograd: {signal.Signals(signum).name}: stopping after the current "
                  "step with a checkpoint (again: stop now)", file=sys.stderr)  # fmt: skip

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)
