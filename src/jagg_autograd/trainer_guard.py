"""The runaway guard's half of :class:`~jagg_autograd.trainer.GRPOTrainer`: after every GRPO
step the logged gradient norm goes to a :class:`~jagg_autograd.runaway_guard.RunawayGuard`;
when it trips, the run continues on the estimator's
:meth:`~jagg_autograd.estimators.Estimator.fallback` (logged in ``log["guard"]``, warned).

The switches and the guard's state are functions of the log, so a resumed run rebuilds
them from it (:meth:`GuardMixin._restore_guard`) and continues bit for bit; the trainer's
``config`` keeps the run's own settings (what the log and a resume compare).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from jagg_autograd.runaway_guard import RunawayGuard
from jagg_autograd.runlog import describe_method

__all__ = ["GuardMixin"]


class GuardMixin:
    """Reads the trainer's ``config``, ``estimator``, ``log`` and ``is_main``; sets
    ``estimator`` and ``guard``."""

    def _new_guard(self) -> RunawayGuard | None:
        """A guard for the current estimator (None: off, or nothing to fall back to)."""
        c = self.config
        if c.guard_ratio is None or self.estimator.fallback() is None:
            return None
        return RunawayGuard(c.guard_ratio, c.guard_window)

    def _switch_estimator(self, changes: dict[str, Any] | None = None) -> dict[str, Any]:
        """Replace the estimator by its fallback, or by the one ``changes`` (a logged
        switch's) make of it, and the guard by a fresh one; returns the config changes."""
        if changes is None:
            changes = self.estimator.fallback()
            assert changes is not None  # a guard exists only where there is a fallback
        cfg = dataclasses.replace(self.estimator.config, **changes)
        self.estimator = cfg.estimator()
        self.guard = self._new_guard()
        return changes

    def _watch(self, row: dict[str, Any]) -> None:
        """Show the step's gradient norm to the runaway guard; on a trip, fall back."""
        if self.guard is None:
            return
        ratio = self.guard.observe(row["grad_norm"])
        if ratio is not None:
            row["guard_norm_ratio"] = ratio
        if not self.guard.tripped:
            return
        before = describe_method(self.estimator.config.resolved())
        changes = self._switch_estimator()
        after = describe_method(self.estimator.config.resolved())
        event = {"step": row["step"], "ratio": ratio, "window": self.config.guard_window,
                 "from": before, "to": after, "changes": changes}  # fmt: skip
        self.log.setdefault("guard", []).append(event)
        if self.is_main:
            warnings.warn(
                f"GRPO step {row['step']}: the gradient norm ran away ({ratio:.2f}x its "
                f"median over the estimator's first {self.config.guard_window} steps, "
                f"guard_ratio={self.config.guard_ratio}); the run goes on with {after} "
                f"instead of {before} (log['guard'])",
                RuntimeWarning,
                stacklevel=3,
            )

    def _restore_guard(self) -> None:
        """A resumed run's estimator and guard: the logged switches again (their logged
        changes, not the fallback of a config the resume may have changed, e.g. its fold),
        then the logged norms since the last one (the guard's state is a function of the
        log)."""
        events = self.log.get("guard", [])
        for ev in events:
            self._switch_estimator(dict(ev["changes"]))
        if self.guard is not None:
            since = events[-1]["step"] if events else -1
            self.guard.replay(r["grad_norm"] for r in self.log["steps"] if r["step"] > since)
