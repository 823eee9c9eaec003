"""GRPO's per-group advantages (also importable from :mod:`jagg_autograd.grpo`).

NaN policy: :func:`group_advantages` raises ``ValueError`` on non-finite rewards (naming
the offending indices) rather than skipping groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from jagg_autograd._validate import _check_nonneg

__all__ = ["group_advantages"]


def _group_inverse(group_ids: object, batch: int) -> tuple[np.ndarray, int]:
    """Group index per sample (0..G-1) in order of first appearance, and G."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise TypeError(
                f"group_ids must be an integer tensor or a sequence of hashables (e.g. prompt "
                f"strings), got a tensor of dtype {group_ids.dtype}"
            )
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids must have shape (B,), got {tuple(group_ids.shape)}")
        keys: list[object] = group_ids.detach().cpu().tolist()
    elif isinstance(group_ids, np.ndarray):
        if group_ids.ndim != 1:
            raise ValueError(f"group_ids must have shape (B,), got {group_ids.shape}")
        keys = group_ids.tolist()
    elif isinstance(group_ids, Sequence) and not isinstance(group_ids, (str, bytes)):
        keys = list(group_ids)
    else:
        raise TypeError(
            "group_ids must be an integer tensor or a sequence of hashables (e.g. prompt "
            f"strings), got {type(group_ids).__name__}"
        )
    if len(keys) != batch:
        raise ValueError(
            f"group_ids has {len(keys)} entries but rewards has {batch}; "
            "expected one group id per reward"
        )
    index: dict[object, int] = {}
    inverse = np.empty(batch, dtype=np.int64)
    for i, k in enumerate(keys):
        try:
            inverse[i] = index.setdefault(k, len(index))
        except TypeError as exc:
            raise TypeError(
                f"group_ids entries must be hashable, got {type(k).__name__} at index {i}"
            ) from exc
    return inverse, len(index)


def group_advantages(
    rewards: torch.Tensor | Sequence[float] | np.ndarray,
    group_ids: torch.Tensor | Sequence[object] | np.ndarray,
    *,
    global_std: bool = False,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-prompt (group-relative) advantages, Flow-GRPO's ``PerPromptStatTracker``.

    Shapes: ``rewards``: ``(B,)``; ``group_ids``: ``(B,)`` integer tensor, or a length-B
    sequence of hashables (e.g. the prompt strings). Returns ``(B,)`` advantages in
    ``rewards``' float dtype (float32 for non-tensor input) on ``rewards``' device.

    Math, for sample ``i`` in group ``g``::

        A_i = (R_i - mean_{j in g} R_j) / (std + eps)
        std = std_{j in g} R_j        (global_std=False)   or   std_j R_j over the whole batch

    with population (``ddof=0``) standard deviations, as ``numpy.std`` in Flow-GRPO. A group
    of one sample, or of equal rewards, gets advantage 0. Computed in float64 on the rewards
    divided by a power of two near their largest magnitude (exact, so the result is the same;
    huge rewards such as 1e300 do not overflow the squared deviations).

    NaN policy: non-finite rewards raise ``ValueError`` naming ``rewards`` and the offending
    indices; no group is silently skipped.
    """
    if isinstance(rewards, torch.Tensor):
        if not rewards.is_floating_point():
            raise TypeError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
        out_dtype, device = rewards.dtype, rewards.device
        r = rewards.detach().to("cpu", torch.float64).numpy()
    else:
        try:
            r = np.asarray(rewards, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"rewards must be a (B,) float tensor or sequence of floats: {exc}"
            ) from exc
        out_dtype, device = torch.float32, torch.device("cpu")
    if r.ndim != 1 or r.shape[0] < 1:
        raise ValueError(f"rewards must have shape (B,) with B >= 1, got {tuple(r.shape)}")
    bad = ~np.isfinite(r)
    if bad.any():
        raise ValueError(
            f"rewards has non-finite values at index {np.flatnonzero(bad).tolist()} "
            f"({r[bad].tolist()}); fix or drop those samples before computing advantages"
        )
    if not isinstance(global_std, bool):
        raise TypeError(f"global_std must be a bool, got {type(global_std).__name__}")
    eps_f = _check_nonneg("eps", eps, strict=True)
    inverse, n_groups = _group_inverse(group_ids, r.shape[0])

    # A = (R - mean) / (std + eps) is invariant under R -> R / c, eps -> eps / c.  With c a
    # power of two the division is exact (no rounding), and |R / c| <= 1 keeps the squares
    # below overflow: rewards near 1e300 would otherwise give an infinite std and all-zero
    # advantages.
    scale = float(np.ldexp(1.0, np.frexp(np.abs(r).max())[1])) if np.any(r) else 1.0
    r = r / scale
    counts = np.bincount(inverse, minlength=n_groups).astype(np.float64)
    means = np.bincount(inverse, weights=r, minlength=n_groups) / counts
    centered = r - means[inverse]
    if global_std:
        std = np.full_like(r, r.std())
    else:
        var = np.bincount(inverse, weights=centered**2, minlength=n_groups) / counts
        std = np.sqrt(var)[inverse]
    with np.errstate(over="ignore"):  # eps / scale overflows only for subnormal rewards: A = 0
        adv = centered / (std + eps_f / scale)
    return torch.as_tensor(adv, dtype=out_dtype, device=device)
