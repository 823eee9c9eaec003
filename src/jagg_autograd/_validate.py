"""Argument checks shared by the GRPO pieces (``grpo``, ``schedules``, ``advantages``)."""

from __future__ import annotations

import math
import numbers

import torch


def _is_real_number(x: object) -> bool:
    # bool is an int subclass; a True sigma or noise level is almost surely a bug.
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_float_tensor(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    return x


def _check_nonneg(name: str, x: object, *, strict: bool) -> float:
    if not _is_real_number(x):
        raise TypeError(f"{name} must be a float, got {type(x).__name__}")
    val = float(x)
    ok = math.isfinite(val) and (val > 0.0 if strict else val >= 0.0)
    if not ok:
        raise ValueError(f"{name} must be a finite number {'>' if strict else '>='} 0, got {x}")
    return val
