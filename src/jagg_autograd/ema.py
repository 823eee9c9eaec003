"""An exponential moving average of the trained weights, evaluated in their place.

Flow-GRPO's GenEval and OCR runs evaluate (and save) an EMA of the trainable weights
(``config.train.ema = True``; ``flow_grpo/ema.py``, built in ``scripts/train_sd3.py`` as
``EMAModuleWrapper(params, decay=0.9, update_step_interval=8)``), while rollouts and the
loss use the raw weights.  A GRPO gradient is mostly noise (97-99 % of a batch's, issue
18), and AdamW moves every weight by about ``lr`` per step whatever its gradient's size,
so the raw weights also random-walk; the average keeps the drift the steps share and
cancels much of that walk.  (On the shapes task, at an interval 4x too long -- below -- it
kept a +0.08 gain where the raw weights fell back below the start, and cost some while
they still rose: SHAPES.md.)

Math, after optimizer step ``s`` (0-based) when ``(s + 1) % every == 0``::

    d_s = min((1 + s) / (10 + s), decay)          (Flow-GRPO's warm-up)
    ema <- ema + (1 - d_s) (theta - ema)

Steps in between leave ``ema`` unchanged (``every`` > 1 averages fewer, further-apart
points, as Flow-GRPO's interval of 8 does).

**Flow-GRPO's interval in rollouts.**  Its ``s`` is ``global_step``, which counts optimizer
steps, but ``ema.step`` runs after every *minibatch* (outside the ``sync_gradients``
branch).  Its GenEval config trains 4 minibatches per epoch at 2 accumulated per optimizer
step, so an epoch sees ``global_step`` at ``2e, 2e+1, 2e+1, 2e+2`` and the update fires
twice (on the same weights) in every fourth epoch: decay 0.81 per 4 rollouts, whose
averaged weights are 17-21 rollouts old (at epochs 100-300), not the 160 optimizer steps its
comment names.  With one optimizer step per rollout (this trainer's default) ``decay=0.9,
every=2`` averages the same past (mean age within 2.5 rollouts of it from epoch 100 on;
``every=8`` would average weights 47-77 rollouts old); at Flow-GRPO's own two optimizer
steps per rollout, ``every=4`` does (within 1.6 rollouts): tests/test_ema.py replays the
loops.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from jagg_autograd.nft import ParamSnapshot

__all__ = ["ParamEMA"]


class ParamEMA:
    """EMA of ``params`` (:meth:`update` after each optimizer step; :meth:`call` runs a
    function at the averaged values and restores the raw ones).

    Example::

        ema = ParamEMA(params, decay=0.9, every=8)
        for step in range(steps):
            ...; optimizer.step(); ema.update()
        scores = ema.call(evaluate)        # evaluate() sees the averaged weights
    """

    def __init__(self, params: Sequence[torch.Tensor], decay: float, every: int = 1) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
            raise ValueError(f"decay must be a number in (0, 1), got {decay!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        self.decay, self.every = float(decay), every
        # The averaged values live in a snapshot, whose call() swaps them in and back out.
        self.snapshot = ParamSnapshot(params)
        self.updates = 0

    @property
    def values(self) -> list[torch.Tensor]:
        """The averaged tensors, in the order of ``params``."""
        return self.snapshot.values

    def current_decay(self) -> float:
        """``d_s`` of the next :meth:`update` (``s`` = updates so far)."""
        return min((1 + self.updates) / (10 + self.updates), self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current weights in (on every ``every``-th call), count the step."""
        if (self.updates + 1) % self.every == 0:
            w = 1.0 - self.current_decay()
            for e, p in zip(self.snapshot.values, self.snapshot.params):
                e.lerp_(p.detach().to(e.dtype), w)
        self.updates += 1

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` without grad at the averaged weights; the raw weights are
        restored afterwards (also on error)."""
        return self.snapshot.call(fn, *args, **kw)

    def load(self, values: Sequence[torch.Tensor], updates: int) -> None:
        """Restore a saved average (a checkpoint's) and its step count."""
        if len(values) != len(self.snapshot.values):
            raise ValueError(
                f"values must hold {len(self.snapshot.values)} tensors, got {len(values)}"
            )
        with torch.no_grad():
            for e, v in zip(self.snapshot.values, values):
                e.copy_(v)
        self.updates = int(updates)
