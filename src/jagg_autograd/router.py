"""The cosine-similarity router: which samples' windows are near-linear enough for JAGG.

Score of sample b in a window with anchors L < R (interior steps L < k < R):

    score_b = min_k cos(v_k[b], (1 - alpha_k[b]) v_L[b] + alpha_k[b] v_R[b])

computed on the velocities the forward pass already produced (no extra model call).  A
window without interior steps is exactly linear by construction and scores 1.0.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from jagg_autograd._backend import resolve_backend


def _cos_from_sums(dot: torch.Tensor, nv: torch.Tensor, nl: torch.Tensor) -> torch.Tensor:
    # Two zero vectors agree perfectly (score 1); one zero vector against a non-zero one has
    # no direction in common (score 0).  NaN/Inf inputs stay NaN and so route to exact.
    denom = torch.sqrt(nv * nl)
    cos = dot / denom
    zero = denom == 0
    both_zero = (nv == 0) & (nl == 0)
    return torch.where(zero, both_zero.to(cos.dtype), cos).clamp(max=1.0)


def _per_window_min(cos: torch.Tensor, left: list[int], right: list[int]) -> torch.Tensor:
    B = cos.shape[1]
    out = torch.ones((len(left), B), dtype=cos.dtype, device=cos.device)
    for i, (lo, hi) in enumerate(zip(left, right)):
        if hi - lo >= 2:
            # amin propagates NaN, so a NaN step makes the whole window route to exact.
            out[i] = cos[lo + 1 : hi].amin(0)
    return out


def _check_route_args(
    velocities: object, alpha: object, left: object, right: object
) -> tuple[list[int], list[int]]:
    """Validate the routing op's arguments; return left/right as lists of Python ints."""
    if not isinstance(velocities, torch.Tensor) or velocities.dim() != 3:
        raise ValueError("velocities must be a (T, B, N) tensor")
    if not velocities.is_floating_point():
        raise TypeError(f"velocities must be a floating tensor, got {velocities.dtype}")
    if not isinstance(alpha, torch.Tensor) or tuple(alpha.shape) != tuple(velocities.shape[:2]):
        raise ValueError(
            f"alpha must be a (T, B) = {tuple(velocities.shape[:2])} tensor, got "
            f"{tuple(getattr(alpha, 'shape', ()))}"
        )
    if not alpha.is_floating_point():
        raise TypeError(f"alpha must be a floating tensor, got {alpha.dtype}")
    T = velocities.shape[0]
    steps = {}
    for name, value in (("left", left), ("right", right)):
        if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, torch.Tensor)):
            raise TypeError(f"{name} must be a sequence of int steps, got {type(value).__name__}")
        try:
            # operator.index: ints and numpy/torch integer scalars, never floats; bool is an
            # int subclass but never a step.
            if any(isinstance(x, bool) for x in value):
                raise TypeError
            steps[name] = [operator.index(x) for x in value]
        except TypeError:
            raise TypeError(f"{name} must be a sequence of int steps, got {value!r}") from None
    lo, hi = steps["left"], steps["right"]
    if len(lo) != len(hi):
        raise ValueError(
            f"left and right must have one entry per window, got {len(lo)} and {len(hi)}"
        )
    bad = [(a, b) for a, b in zip(lo, hi) if not 0 <= a <= b < T]
    if bad:
        raise ValueError(
            f"every window needs 0 <= left <= right < T={T} (anchor steps), got (left, right) "
            f"{bad}"
        )
    return lo, hi


def cosine_route_ref(
    velocities: torch.Tensor, alpha: torch.Tensor, left: list[int], right: list[int]
) -> torch.Tensor:
    """Pure-PyTorch reference of the routing score.

    velocities: (T, B, N) floating; alpha: (T, B) floating; left/right: anchor steps of
    each of n_w windows, ints with 0 <= left <= right < T.
    Returns scores (n_w, B) in float32 (float64 for float64 velocities).
    """
    left, right = _check_route_args(velocities, alpha, left, right)
    acc = torch.float64 if velocities.dtype == torch.float64 else torch.float32
    v = velocities.to(acc)
    a = alpha.to(acc).unsqueeze(-1)
    T, B, _ = v.shape
    dot = torch.zeros((T, B), dtype=acc, device=v.device)
    nv = torch.zeros_like(dot)
    nl = torch.zeros_like(dot)
    for lo, hi in zip(left, right):
        if hi - lo < 2:
            continue
        vk = v[lo + 1 : hi]
        lin = (1 - a[lo + 1 : hi]) * v[lo] + a[lo + 1 : hi] * v[hi]
        dot[lo + 1 : hi] = (vk * lin).sum(-1)
        nv[lo + 1 : hi] = (vk * vk).sum(-1)
        nl[lo + 1 : hi] = (lin * lin).sum(-1)
    return _per_window_min(_cos_from_sums(dot, nv, nl), left, right)


def cosine_route(
    velocities: torch.Tensor,
    alpha: torch.Tensor,
    left: list[int],
    right: list[int],
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Routing scores (n_w, B) of every window; see :func:`cosine_route_ref` for the math.

    velocities: (T, B, N) floating, any strides; alpha: (T, B) floating; left/right:
    sequences of int steps, 0 <= left <= right < T (left == right: a single-step window,
    score 1).  Bad arguments raise ``ValueError``/``TypeError`` naming the argument.
    """
    left, right = _check_route_args(velocities, alpha, left, right)
    if resolve_backend(backend, velocities.device, velocities.dtype) == "triton":
        from jagg_autograd._custom_ops import cosine_route_partials_op

        dev = velocities.device
        part = cosine_route_partials_op(
            velocities,
            alpha,
            torch.tensor(left, dtype=torch.int64, device=dev),
            torch.tensor(right, dtype=torch.int64, device=dev),
        ).sum(2)
        cos = _cos_from_sums(part[..., 0], part[..., 1], part[..., 2])
        return _per_window_min(cos, left, right)
    return cosine_route_ref(velocities, alpha, left, right)


def _check_threshold(threshold: object) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"threshold must be a real number, got {type(threshold).__name__}")
    if not math.isfinite(float(threshold)):
        raise ValueError(f"threshold must be finite, got {threshold!r}")
    return float(threshold)


def _check_jagg_frac(jagg_frac: object) -> float | None:
    if jagg_frac is None:
        return None
    if isinstance(jagg_frac, bool) or not isinstance(jagg_frac, (int, float)):
        raise TypeError(f"jagg_frac must be None or a number in [0, 1], got {jagg_frac!r}")
    if not 0.0 <= float(jagg_frac) <= 1.0:  # also rejects NaN
        raise ValueError(f"jagg_frac must be None or in [0, 1], got {jagg_frac!r}")
    return float(jagg_frac)


# Calibrated by the quality study (`python -m benchmarks.quality`, 4 seeds x 100 GRPO steps
# on the digits DiT, benchmarks/results/quality/QUALITY.md, "Router calibration" and the
# table above it): every tested setting kept the final held-out reward within noise of
# exact (paired differences -1.1 %..+0.3 %, seed std 1-2 %), so the cheapest one wins.
# At 0.7 the router routes 0.6 % of (window, sample) pairs (training time 0.671 of exact
# vs 0.655 for plain JAGG W=4): a safeguard that only fires on clearly non-linear windows.
# 0.8 / 0.85 / 0.9 routed 15 / 40 / 63 % for 0.770 / 0.906 / 1.004 of exact's time and no
# reward gain; jagg_frac 0.75 / 0.5 cost 0.822 / 0.948 for none either, so it stays off.
DEFAULT_THRESHOLD = 0.7
DEFAULT_JAGG_FRAC: float | None = None


class CosineRouter:
    """Send windows (per sample) whose velocities are not near-linear to the exact gradient.

    A sample's window gets the exact gradient for its interior steps when its score (see
    :func:`cosine_route_ref`) is below ``threshold``, is NaN/Inf, or, when ``jagg_frac`` is
    set, is not among the ``ceil(jagg_frac * B)`` highest scores of that window's batch
    (ties broken towards the lower sample index).  Windows with no interior step are never
    routed.  ``threshold > 1`` forces the exact gradient everywhere.

    The defaults ``DEFAULT_THRESHOLD = 0.7`` and ``DEFAULT_JAGG_FRAC = None`` come from the
    quality study (see the comment at their definition): on the digits DiT no tested
    setting improved the final reward, and 0.7 routes almost nothing while still catching
    windows whose velocities are far from linear.  Check yours with
    :func:`jagg_autograd.diagnostics.gradient_fidelity`.
    """

    def __init__(
        self, threshold: float = DEFAULT_THRESHOLD, jagg_frac: float | None = DEFAULT_JAGG_FRAC
    ) -> None:
        self.threshold = _check_threshold(threshold)
        self.jagg_frac = _check_jagg_frac(jagg_frac)

    def __repr__(self) -> str:
        return f"CosineRouter(threshold={self.threshold}, jagg_frac={self.jagg_frac})"

    def route(self, scores: torch.Tensor, has_interior: torch.Tensor) -> torch.Tensor:
        """Decide per window and sample: True = exact gradient.

        scores: (n_w, B) float; has_interior: (n_w,) bool.  Returns (n_w, B) bool.
        """
        jagg = scores >= self.threshold  # NaN compares False: routes to exact
        if self.jagg_frac is not None:
            B = scores.shape[1]
            keep = math.ceil(self.jagg_frac * B)
            # NaN sorts as the lowest score so it never takes one of the kept places.
            key = torch.nan_to_num(scores.double(), nan=-math.inf)
            order = torch.sort(key, dim=1, descending=True, stable=True).indices
            top = torch.zeros_like(jagg)
            top.scatter_(1, order[:, :keep], True)
            jagg &= top
        return ~jagg & has_interior.unsqueeze(1)
