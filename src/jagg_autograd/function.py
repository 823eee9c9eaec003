"""The autograd Function that spans a window (or a whole trajectory) of JAGG steps.

Forward hands back the velocities the sampler already computed; backward replaces the T
per-step vector-Jacobian products with the anchors' composite gradients

    G_j = sum_k w_cur[k] g_k [cur(k) = j] + sum_k w_nxt[k] g_k [cur(k) = j - 1]

(``jagg_autograd.mix``), which then flow through the ONE graph of the batched anchor
forward.  Samples routed to the exact gradient pass their interior g_k unchanged to the
graph of their with-grad recomputation.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from jagg_autograd.mix import _jagg_mix_unchecked


class JaggFunction(torch.autograd.Function):
    """Inputs: anchor velocities (n_a * B, *S) with graph, exact-recomputed interior
    velocities (n_ex, *S) with graph (or None), and the assembled velocity values
    (T, B, *S) without graph.  Output: those values, now connected to both graphs.

    Saved for backward: the (T, B) weights, the anchor steps and the exact (step, sample)
    index pairs: no activations beyond what the anchors' own graph keeps.
    """

    @staticmethod
    def forward(
        ctx: Any,
        anchor_v: torch.Tensor,
        exact_v: torch.Tensor | None,
        values: torch.Tensor,
        w_cur: torch.Tensor,
        w_nxt: torch.Tensor,
        anchors: torch.Tensor,
        exact_k: torch.Tensor,
        exact_b: torch.Tensor,
        backend: str,
    ) -> torch.Tensor:
        ctx.save_for_backward(w_cur, w_nxt, anchors, exact_k, exact_b)
        ctx.backend = backend
        ctx.has_exact = exact_v is not None
        ctx.anchor_shape = anchor_v.shape
        # The values were produced under no_grad for this very output: handing the same
        # storage back (marked dirty) avoids a copy of all T * B velocities.
        ctx.mark_dirty(values)
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w_cur, w_nxt, anchors, exact_k, exact_b = ctx.saved_tensors
        T, B = grad.shape[:2]
        g3 = grad.reshape(T, B, -1)
        g_anchor = _jagg_mix_unchecked(g3, w_cur, w_nxt, anchors, ctx.backend)
        g_anchor = g_anchor.reshape(ctx.anchor_shape)
        g_exact = grad[exact_k, exact_b] if ctx.has_exact else None
        return g_anchor, g_exact, None, None, None, None, None, None, None
