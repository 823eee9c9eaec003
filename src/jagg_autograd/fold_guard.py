"""A guard for the linear fold: warn when advantages with a non-zero mean meet it.

JAGG's t-linear fold (``fold="linear"``) moves part of a step's upstream gradient g_k onto
the *later* anchor q, whose input x_q depends on step k's own SDE noise, so its gradient has
a mean error per sample, E[J_q^T g_k] != 0 where the exact E[J_k^T g_k] = 0 (measured on
digits: mean error 1.5x the RMS of an exact batch gradient with unit advantages;
``benchmarks/bias_probe.py``).  With advantages that are zero-mean over the samples of each
group, and decisions that do not depend on them, these errors cancel; with raw rewards (or
any advantages of non-zero mean) they do not, and the gradient is biased by up to the whole
GRPO signal.  ``fold="causal"`` has no such term for any advantages; what mean error it
keeps comes from holding an anchor's Jacobian across its window (shapes, groups of 16, 2
anchors of 5 steps at {0, 3}: systematic share +0.012, 3.4 floor SDs, against the linear
fold's 10.7; ``benchmarks/results/shapes_bias_g16``).

``jagg_trajectory`` never sees the advantages: its upstream gradient is g_k = A_b * (score
term) folded together by the loss.  The loss does, so the check lives there:
:func:`jagg_autograd.grpo.grpo_loss` calls :func:`note_advantages` with the sum and sum of
squares of each call's advantages (computed in the same host sync as its finiteness check,
so the guard costs no extra sync), and the guard accumulates them over calls.  Advantages
normalised within whole groups sum to 0 over a rollout, so the accumulated statistic

    z = sum_calls sum_b A_b / sqrt(sum_calls sum_b A_b^2)

stays O(1) (a minibatch holding part of a group adds a random +-O(1) that the rest of the
group takes back), while advantages of mean m and RMS s give z = sqrt(N) m / s, which
passes :data:`Z_WARN` within a few minibatches.  A call whose advantages have the same sum,
sum of squares and count as the previous call's is the same minibatch at another timestep
(Flow-GRPO's loop calls the loss once per step with the same advantages) and is not
counted again: counting it T times would scale a minibatch's transient z by sqrt(T).  Only
past the threshold is the loss's autograd graph searched (a few hundred nodes at most) for
a JAGG call of the linear fold: the eager and deferred Functions carry their fold on their
graph node (:func:`mark_fold`).  The warning is given once per process
(:func:`reset_guard` re-arms it).

Not caught: advantages that are zero-mean over the batch but not within each group (a
batch-level baseline); the per-sample bias depends on the prompt, so those cancel only
partly.  The trainer always normalises per group
(:func:`jagg_autograd.advantages.group_advantages`).
"""

from __future__ import annotations

import math
import warnings

import torch

__all__ = ["FOLD_ATTR", "Z_WARN", "folds_in_graph", "mark_fold", "note_advantages", "reset_guard"]

#: The attribute a JAGG Function's graph node carries: the call's fold.
FOLD_ATTR = "jagg_fold"
#: |z| above which the accumulated advantages are taken to have a non-zero mean.  Zero-mean
#: advantages give |z| of order 1 (a 6-sigma event for a random walk of minibatch means);
#: raw rewards in [0, 1] at 32 samples per step reach it in the first step.
Z_WARN = 6.0
#: Samples accumulated before the guard may warn (a few minibatches).
MIN_SAMPLES = 32
_MAX_NODES = 512


class _Guard:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.total = 0.0
        self.squares = 0.0
        self.count = 0
        self.warned = False
        self.last: tuple[float, float, int] | None = None


_GUARD = _Guard()


def reset_guard() -> None:
    """Forget the accumulated advantages and re-arm the (once per process) warning."""
    _GUARD.reset()


def mark_fold(out: torch.Tensor, fold: str) -> torch.Tensor:
    """Record ``fold`` on ``out``'s graph node (a JAGG Function's output); returns ``out``."""
    if out.grad_fn is not None:
        setattr(out.grad_fn, FOLD_ATTR, fold)
    return out


def folds_in_graph(t: torch.Tensor, max_nodes: int = _MAX_NODES) -> set[str]:
    """The folds of the JAGG calls ``t`` depends on, searching at most ``max_nodes`` nodes
    of its autograd graph breadth-first (a loss reaches its JAGG node within a few ops)."""
    found: set[str] = set()
    if t.grad_fn is None:
        return found
    seen = {id(t.grad_fn)}
    queue = [t.grad_fn]
    while queue and len(seen) <= max_nodes:
        node = queue.pop(0)
        fold = getattr(node, FOLD_ATTR, None)
        if fold is not None:
            found.add(fold)
            continue  # nothing behind a JAGG node is another JAGG call of this loss
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                queue.append(nxt)
    return found


def note_advantages(log_prob: torch.Tensor, total: float, squares: float, count: int) -> None:
    """Accumulate one loss call's advantages (their sum, sum of squares and number) and
    warn once if they have a non-zero mean while ``log_prob`` comes through a JAGG call of
    the linear fold (see the module docstring for the statistic and its threshold)."""
    g = _GUARD
    if g.warned or (total, squares, count) == g.last:
        return
    g.last = (total, squares, count)
    g.total += total
    g.squares += squares
    g.count += count
    if g.count < MIN_SAMPLES or g.squares <= 0.0:
        return
    z = g.total / math.sqrt(g.squares)
    if abs(z) < Z_WARN or "linear" not in folds_in_graph(log_prob):
        return
    g.warned = True
    mean = g.total / g.count
    rms = math.sqrt(g.squares / g.count)
    warnings.warn(
        f"advantages have a non-zero mean ({mean:+.3g}, RMS {rms:.3g} over {g.count} "
        f"samples, z = {z:+.1f}) and the log-probs come through a JAGG call with "
        "fold='linear': the linear fold's per-sample bias cancels only for advantages "
        "that are zero-mean within each group; otherwise the gradient is biased.  "
        "Normalise the advantages per group (jagg_autograd.advantages.group_advantages) "
        "or use fold='causal' (no noise-driven mean error for any advantages).",
        RuntimeWarning,
        stacklevel=3,
    )
