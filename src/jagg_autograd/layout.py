"""The uniform layout of a trajectory: which steps are anchors, how the windows fall.

``trajectory_layout`` and ``expected_anchor_count`` are public; :func:`check_window` is
the window check of a call (after the latents' layout, before the options).
"""

from __future__ import annotations

import math
import operator

import torch


def as_int(name: str, value: object, expected: str) -> int:
    """``value`` as a Python int: ints and numpy/torch integer scalars, never bool or float."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {value!r}") from None


def check_layout_args(T: object, window: object, shared_anchors: object) -> tuple[int, int]:
    T = as_int("T", T, "an int >= 1 (steps of the trajectory)")
    if T < 1:
        raise ValueError(f"T must be an int >= 1 (steps of the trajectory), got {T}")
    window = as_int("window", window, "an int >= 2")
    if window < 2:
        raise ValueError(f"window must be an int >= 2 (two anchor steps), got {window}")
    if not isinstance(shared_anchors, bool):
        raise TypeError(f"shared_anchors must be a bool, got {shared_anchors!r}")
    return T, window


def trajectory_layout(
    T: int, window: int, shared_anchors: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Anchor steps and windows (first, last) of a T-step trajectory.

    shared_anchors=True: anchors 0, W-1, 2(W-1), ..., and T-1; adjacent windows share
    their boundary step, ceil((T-1)/(W-1)) + 1 anchors in all.  False (the paper):
    disjoint windows [0..W-1], [W..2W-1], ...; a shorter last window; a last single step
    is its own anchor (exact).  T >= 1 and window >= 2 are ints (numpy/torch integer
    scalars accepted); a window longer than T is one window over all T steps.
    """
    T, window = check_layout_args(T, window, shared_anchors)
    if shared_anchors:
        anchors = list(range(0, T, window - 1))
        if anchors[-1] != T - 1:
            anchors.append(T - 1)
        return anchors, list(zip(anchors[:-1], anchors[1:]))
    windows = [(s, min(s + window - 1, T - 1)) for s in range(0, T, window)]
    anchors = sorted({a for w in windows for a in w})
    return anchors, windows


def expected_anchor_count(T: int, window: int, shared_anchors: bool = True) -> int:
    """Anchors (= samples per B in the one backward) of a T-step trajectory.

    Arguments as in :func:`trajectory_layout`.
    """
    T, window = check_layout_args(T, window, shared_anchors)
    if shared_anchors:
        return math.ceil((T - 1) / (window - 1)) + 1
    return len(trajectory_layout(T, window, False)[0])


def check_window(
    T: int, window: object, shared_anchors: object, trajectory: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Anchors and windows of a call on latents of T steps.

    trajectory=False (``jagg_window``): the latents are one window, W = T >= 2 steps,
    anchors [0, W-1].  True (``jagg_trajectory``): ``window`` an int in [2, T].
    """
    if not trajectory:
        if T < 2:
            raise ValueError(f"a window needs W >= 2 steps, got latents with W={T}")
        # A window is the one-window trajectory: anchors [0, W-1], no shared boundary.
        return trajectory_layout(T, T, True)
    if T < 2:
        raise ValueError(
            f"a trajectory needs T >= 2 steps, got latents with T={T}: a single step has no "
            "window to approximate, call the model directly (its gradient is exact)"
        )
    window = as_int("window", window, f"an int in [2, T={T}]")
    if not 2 <= window <= T:
        raise ValueError(f"window must be an int in [2, T={T}], got {window}")
    if not isinstance(shared_anchors, bool):
        raise TypeError(f"shared_anchors must be a bool, got {shared_anchors!r}")
    return trajectory_layout(T, window, shared_anchors)
