"""The uniform layout of a trajectory: which steps are anchors, how the windows fall.

``trajectory_layout``, ``causal_layout`` and ``expected_anchor_count`` are public;
:func:`check_window` is the window check of a call (after the latents' layout, before the
options), :func:`check_anchors` the check of its explicit ``anchors=``.
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


def causal_layout(T: int, n_anchors: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Anchor steps and windows of the causal fold: ``n_anchors`` segments, longest first.

    The causal fold holds each step's Jacobian at the anchor at or before it, so an anchor
    after the last step it could serve is wasted (the window layout's end anchor T-1 serves
    only itself) and step 0 must be an anchor (steps before the first anchor fold nowhere).
    The anchors split the T steps into n segments of floor(T / n) or ceil(T / n) steps,
    the longer ones first: the steps nearest the data, whose score-function upstream
    ||g_k|| ~ 1 / sigma_k is the largest, are held the least far.
    Windows are the segments (a_i, a_{i+1} - 1) and (a_{n-1}, T - 1): every step belongs to
    the window of the anchor it folds onto.

    Which layout suits the causal fold depends on where the upstream gradient is large.
    On a prefix of the sampler's steps (Flow-GRPO's ``timestep_fraction``) the window
    layout's end anchor only serves itself; this layout is better there (shapes, the first 5
    of 10 steps trained, 2 anchors, 24 probe batches of 8 x 4: per-batch cosine to the exact
    gradient 0.822 with anchors {0, 3} against 0.770 with the window layout's {0, 4},
    neither with the linear fold's mean error).  On a whole trajectory the last step,
    nearest the data, has the largest score-function gradient (||g_k|| ~ 1 / sigma_k) and
    the window layout's end anchor holds it exactly; there the window layout is better
    (digits, 10 steps, 4 anchors: 0.916 with {0, 3, 6, 9} against 0.843 with {0, 3, 6, 8}).
    The trainer's JAGG estimator therefore passes these anchors
    (``jagg_trajectory(anchors=)``) for the causal fold on a prefix only.  ``T >= 1`` and
    ``1 <= n_anchors <= T``.

    Example: ``causal_layout(5, 2) == ([0, 3], [(0, 2), (3, 4)])``.
    """
    T = as_int("T", T, "an int >= 1 (steps of the trajectory)")
    n = as_int("n_anchors", n_anchors, f"an int in [1, T={T}]")
    if T < 1 or not 1 <= n <= T:
        raise ValueError(f"causal_layout needs T >= 1 and 1 <= n_anchors <= T, got T={T}, n={n}")
    q, r = divmod(T, n)
    anchors = [i * q + min(i, r) for i in range(n)]  # the first r segments get q + 1 steps
    ends = [a - 1 for a in anchors[1:]] + [T - 1]
    return anchors, list(zip(anchors, ends))


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


def check_anchors(
    T: int, anchors: object, fold: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """Explicit anchor steps of a trajectory call (``jagg_trajectory(anchors=)``) and the
    windows they make.

    ``anchors``: strictly increasing ints in [0, T-1] starting at 0 (a step before the
    first anchor has no anchor to fold onto); for ``fold="linear"`` also ending at T-1 (a
    step after the last anchor has no later anchor to interpolate towards).  Windows:
    linear, the anchor pairs (a_i, a_{i+1}) (shared boundaries); causal, the segments
    (a_i, a_{i+1} - 1) and (a_{n-1}, T-1), each step in the window of the anchor it
    folds onto (as :func:`causal_layout`'s).
    """
    what = f"a strictly increasing sequence of ints in [0, T-1={T - 1}] starting at 0" + (
        f" and ending at T-1={T - 1} (fold='linear')" if fold == "linear" else ""
    )
    if isinstance(anchors, torch.Tensor):
        if anchors.dim() != 1 or anchors.is_floating_point() or anchors.dtype == torch.bool:
            raise TypeError(f"anchors must be {what}, got a tensor of shape "
                            f"{tuple(anchors.shape)} and dtype {anchors.dtype}")  # fmt: skip
        anchors = anchors.tolist()
    if isinstance(anchors, (str, bytes)) or not hasattr(anchors, "__iter__"):
        raise TypeError(f"anchors must be {what}, got {anchors!r}")
    a = [as_int("anchors", x, what) for x in anchors]  # type: ignore[attr-defined]
    bad = (
        not a
        or a[0] != 0
        or a[-1] > T - 1
        or any(y <= x for x, y in zip(a, a[1:]))
        or (fold == "linear" and a[-1] != T - 1)
    )
    if bad:
        raise ValueError(f"anchors must be {what}, got {a}")
    if fold == "linear":
        return a, list(zip(a[:-1], a[1:]))
    return a, list(zip(a, [x - 1 for x in a[1:]] + [T - 1]))
