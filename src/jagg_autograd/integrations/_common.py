"""Argument checks and small tensor helpers shared by the diffusers adapters and LoRA."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def _unwrap(module: object) -> object:
    """The innermost model behind torch.compile / DDP / peft wrappers (for type dispatch only)."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(module, "_orig_mod") and isinstance(module._orig_mod, nn.Module):
            module = module._orig_mod
        elif type(module).__name__ in ("DistributedDataParallel", "DataParallel"):
            module = module.module  # type: ignore[attr-defined]
        elif hasattr(module, "get_base_model") and callable(module.get_base_model):
            base = module.get_base_model()
            if base is module:
                break
            module = base
        else:
            break
    return module


def _check_scale(value: object, name: str, allow_none: bool = True) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number{' or None' if allow_none else ''}, got "
            f"{type(value).__name__}"
        )
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    return v


def _check_dtype(value: object, name: str, allowed: Sequence[torch.dtype] | None = None) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be None or a floating torch.dtype, got {value!r}")
    if allowed is not None and value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)} or None, got {value}")


def _param_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.float32


def _as_tensor(x: object, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def _checked_config(transformer: nn.Module, cls: type) -> Any:
    """``transformer``'s diffusers config; TypeError unless it (unwrapped) is a ``cls``."""
    base = _unwrap(transformer)
    if not isinstance(base, cls):
        raise TypeError(
            f"transformer must be a diffusers {cls.__name__}, got {type(base).__name__}"
        )
    return base.config  # type: ignore[attr-defined]


def _float_latents(z: object) -> torch.Tensor:
    z = _as_tensor(z, "z")
    if not z.dtype.is_floating_point:
        raise TypeError(f"z must be a floating-point tensor, got {z.dtype}")
    return z


def _batch(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """``x`` with dim 0 of size ``n`` (a size-1 dim 0 is broadcast, e.g. a shared negative)."""
    if x.ndim == 0:
        raise ValueError(f"{name} must have a batch dimension, got a 0-d tensor")
    if x.shape[0] == n:
        return x
    if x.shape[0] == 1:
        return x.expand(n, *x.shape[1:])
    raise ValueError(
        f"{name} must have dim 0 equal to the batch size {n} (or 1), got shape {tuple(x.shape)}"
    )


def _timesteps(t: object, n: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor of shape ({n},), got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"t must be a floating-point tensor (sigma in [0, 1]), got {t.dtype}")
    if t.ndim == 0:
        return t.expand(n)
    if t.shape != (n,):
        raise ValueError(f"t must have shape ({n},) (one sigma per sample), got {tuple(t.shape)}")
    return t


def _cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not x.dtype.is_floating_point or x.dtype == dtype:
        return x
    return x.to(dtype)


def _cfg_combine(v_u: torch.Tensor, v_c: torch.Tensor, w: float) -> torch.Tensor:
    """``sg(v_u) + w (v_c - sg(v_u))``: CFG value, gradient ``w * dv_c`` only."""
    v_u = v_u.detach()
    return v_u + w * (v_c - v_u)
