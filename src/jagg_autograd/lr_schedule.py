"""The learning rate of each optimizer step: constant, or a linear / cosine decay to 0.

Flow-GRPO, DanceGRPO and DiffusionNFT train at a constant learning rate; TRL's
``GRPOConfig`` inherits transformers' ``lr_scheduler_type`` (default ``"linear"``) and
``warmup_steps``.  Both are here, with transformers' formulas
(``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_cosine_schedule_with_warmup``).  One difference: transformers' ``"constant"``
ignores ``warmup_steps`` (``"constant_with_warmup"`` uses it); here ``"constant"`` warms
up when ``warmup > 0``.  Optimizer step ``k`` (0-based) of ``N`` in the run,
``w`` warm-up steps, runs at ``lr * lr_factor(kind, k, N, w)``::

    k < w:              k / w                                  (linear warm-up from 0)
    constant:           1
    linear:             max(0, (N - k) / (N - w))
    cosine:             (1 + cos(pi * min(1, (k - w) / (N - w)))) / 2

The factor is a pure function of ``k``, so a resumed run (which knows ``k`` from its
step) continues on the same curve without a scheduler state to save.
"""

from __future__ import annotations

import math

__all__ = ["LR_SCHEDULERS", "lr_factor"]

LR_SCHEDULERS = ("constant", "linear", "cosine")


def lr_factor(kind: str, step: int, total: int, warmup: int = 0) -> float:
    """The multiple of the base learning rate at optimizer step ``step`` (0-based) of
    ``total``, after ``warmup`` linear warm-up steps (formulas in the module docstring).

    Example::

        lr_factor("linear", 0, 150)     # 1.0
        lr_factor("linear", 75, 150)    # 0.5
        lr_factor("cosine", 75, 150)    # 0.5
        lr_factor("constant", 3, 150, warmup=10)   # 0.3
    """
    if kind not in LR_SCHEDULERS:
        raise ValueError(f"kind must be one of {LR_SCHEDULERS}, got {kind!r}")
    for name, v, lo in (("step", step, 0), ("total", total, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")
    if step < warmup:
        return step / warmup
    if kind == "constant":
        return 1.0
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    # Clamped: past the end (transformers' cosine would rise again) the rate stays 0.
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
