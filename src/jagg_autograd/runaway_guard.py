"""The runaway guard: a run whose approximate gradient starts feeding on itself falls back
to a safer estimator before the damage is done.

Why.  JAGG's linear fold has a mean error (the later anchor sees the step's own noise)
that zero-mean advantages cancel only while the policy stays near where the error was
small.  On the shapes task it does not for long: at groups of 16 the default kept pace
with exact GRPO for 100 steps, then its estimate ran away -- gradient norm 8-12x its
start while exact's stayed within 1.08x, probe cosine 0.79 -> 0.1-0.3, and -52 % held-out
reward at step 250 (``benchmarks/results/shapes_quality_g16_250``).  The norm is the
earliest free symptom: over every logged run of ``benchmarks/results`` (scanned with a
rolling median of 10 steps against the first 10), the shapes runs of the linear fold
crossed 1.5x in 22 of 44 runs (between steps 62 and 148), while none of 31 exact, 22
causal-fold, 7 digits-JAGG, 7 digits-exact and 4 digits-causal runs did (their maxima:
1.26, 1.31, 1.24, 1.25, 1.49).

What.  :class:`RunawayGuard` watches one number per GRPO step, the logged gradient norm
(before clipping, averaged over the step's optimizer steps; identical on every rank).
Its baseline is the median of the first ``window`` steps of the current estimator; from
then on it compares the median of the last ``window`` steps to it and trips when the
ratio exceeds ``ratio``.  The trainer then builds the estimator's
:meth:`~jagg_autograd.estimators.Estimator.fallback` (JAGG's linear fold -> the causal
fold, free of the linear fold's noise-driven mean error -> exact GRPO) for the rest of the
run, logs the event and warns; the guard starts a new baseline for the new estimator.

The decision is one per run, from a batch statistic, never per sample, so it cannot make
a sample's gradient depend on its own advantage (the rule every planner keeps).  Its
state is a function of the logged norms, so a resumed run rebuilds it by replaying the
log (:meth:`RunawayGuard.replay`) and continues bit for bit.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["RunawayGuard"]


@dataclass
class RunawayGuard:
    """Trips when the median gradient norm of the last ``window`` observations exceeds
    ``ratio`` times the median of the first ``window`` positive ones since the last
    :meth:`reset` (zero norms, steps whose advantages were all 0, do not fill the
    baseline).

    ``ratio > 1``; ``window >= 1``.  :meth:`observe` returns the current ratio (None while
    the baseline fills) and sets ``tripped``.

    Example::

        guard = RunawayGuard(ratio=1.5, window=3)
        for g in [1.0, 1.1, 0.9, 1.0, 2.0, 2.2]:
            guard.observe(g)
        guard.tripped  # True: median(1.0, 2.0, 2.2) = 2.0 > 1.5 x median(1.0, 1.1, 0.9)
    """

    ratio: float
    window: int
    baseline: float | None = None
    tripped: bool = False
    _first: list[float] = field(default_factory=list)
    _recent: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if (
            isinstance(self.ratio, bool)
            or not isinstance(self.ratio, (int, float))
            or not (math.isfinite(self.ratio) and self.ratio > 1)
        ):
            raise ValueError(f"ratio must be a finite number > 1, got {self.ratio!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")

    def reset(self) -> None:
        """Forget everything: the next ``window`` observations are the new baseline."""
        self.baseline, self.tripped = None, False
        self._first, self._recent = [], []

    def observe(self, grad_norm: float) -> float | None:
        """Add one GRPO step's gradient norm; the ratio of the recent median to the
        baseline (None while the baseline fills)."""
        g = float(grad_norm)
        self._recent = [*self._recent[-(self.window - 1) :], g] if self.window > 1 else [g]
        if self.baseline is None:
            if g <= 0:  # a zero gradient (every advantage 0) says nothing of the scale
                return None
            self._first.append(g)
            if len(self._first) < self.window:
                return None
            self.baseline = statistics.median(self._first)
        r = statistics.median(self._recent) / self.baseline
        if r > self.ratio:
            self.tripped = True
        return r

    def replay(self, norms: Iterable[float]) -> float | None:
        """Observe ``norms`` in order (a resumed run's logged steps since the last reset);
        the last ratio."""
        r = None
        for g in norms:
            r = self.observe(g)
        return r
