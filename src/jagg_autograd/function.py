"""The eager executor: anchors run with grad in the forward pass, and its autograd Function.

Forward hands back the velocities the sampler already computed; backward replaces the T
per-step vector-Jacobian products with the anchors' composite gradients

    G_r = sum_k w_cur[k, b] g_{k,b} [cur(k, b) = r] + sum_k w_nxt[k, b] g_{k,b} [nxt(k, b) = r]

(``jagg_autograd.mix``), which then flow through the graph of the with-grad anchor calls.
Samples routed to the exact gradient are anchors at every step of their window (weights
1, 0), so their g_k pass unchanged to the graph of their with-grad recomputation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from jagg_autograd.caller import Caller, run_pairs_grad, run_steps
from jagg_autograd.checks import check_fresh
from jagg_autograd.distributed import fsdp_collective
from jagg_autograd.fold_guard import mark_fold
from jagg_autograd.mix import mix_slots
from jagg_autograd.planner import choose_plan

if TYPE_CHECKING:
    from jagg_autograd.call import JaggCall, JaggStats


def run_eager(call: JaggCall) -> tuple[torch.Tensor, JaggStats | None]:
    """The anchor steps with grad now (one stacked call; per_step: one per anchor), the
    interior under no_grad (or from ``values``), the routed-out pairs with grad; the
    output carries the plan's composite gradients to their graphs (:class:`JaggFunction`).
    """
    caller = Caller(call)
    opts = call.opts
    T, B, S = call.T, call.B, caller.S
    anchors = list(call.anchors)
    if opts.batching == "per_step":
        anchor_parts = [caller.steps([a], True) for a in anchors]
        anchor_v = torch.cat(anchor_parts) if len(anchor_parts) > 1 else anchor_parts[0]
    else:
        anchor_v = caller.steps(anchors, True)
    if opts.values is not None:
        check_fresh(anchor_v.view(len(anchors), B, *S), opts.values[anchors], call.values_limit)
        vals = opts.values.clone()
    else:
        anchor_set = set(anchors)
        interior = [k for k in range(T) if k not in anchor_set]
        inner = run_steps(caller, interior, False, opts.batching, opts.chunk_size)
        vals = torch.empty((T, B, *S), dtype=caller.out_dtype, device=call.latents.device)
        vals[anchors] = anchor_v.detach().view(len(anchors), B, *S)
        for steps, v in inner:
            vals[steps] = v.view(len(steps), B, *S)
    choice = choose_plan(call, vals)
    plan = choice.plan
    rows = [anchor_v]
    collective = fsdp_collective(call.model)
    if plan.pair_k.numel() > 0 or collective:
        extra = run_pairs_grad(
            caller, plan.pair_k, plan.pair_b, opts.batching, opts.chunk_size, collective
        )
        if extra is not None:
            rows.append(extra)
    grad_v = torch.cat(rows) if len(rows) > 1 else anchor_v
    out = JaggFunction.apply(
        grad_v, vals, plan.w_cur, plan.w_nxt, plan.slots, plan.n_rows, opts.backend
    )
    mark_fold(out, call.opts.fold)  # for the loss's guard (fold_guard)
    if not opts.return_stats:
        return out, None
    return out, call.stats(caller, choice.scores, choice.exact, plan.anchor_mask)


class JaggFunction(torch.autograd.Function):
    """Inputs: the with-grad velocities of every anchor pair (n_rows, *S), rows in the
    order of the slot table, and the assembled velocity values (T, B, *S) without graph.
    Output: those values, now connected to the anchors' graph.

    Saved for backward: the (T, B) weights and slot table: no activations beyond what
    the anchors' own graph keeps.
    """

    @staticmethod
    def forward(
        ctx: Any,
        grad_v: torch.Tensor,
        values: torch.Tensor,
        w_cur: torch.Tensor,
        w_nxt: torch.Tensor,
        slots: torch.Tensor,
        n_rows: int,
        backend: str,
    ) -> torch.Tensor:
        ctx.save_for_backward(w_cur, w_nxt, slots)
        ctx.backend = backend
        ctx.rows_shape = grad_v.shape
        # Rows past the plan's n_rows are padding calls (collective FSDP routing).
        ctx.n_plan_rows = n_rows
        # The values were produced under no_grad for this very output: handing the same
        # storage back (marked dirty) avoids a copy of all T * B velocities.
        ctx.mark_dirty(values)
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        w_cur, w_nxt, slots = ctx.saved_tensors
        T, B = grad.shape[:2]
        n_rows = ctx.n_plan_rows
        g_rows = mix_slots(grad.reshape(T, B, -1), w_cur, w_nxt, slots, n_rows, ctx.backend)
        if ctx.rows_shape[0] > n_rows:  # padding calls (collective FSDP): zero gradient
            pad = g_rows.new_zeros((ctx.rows_shape[0] - n_rows, g_rows.shape[1]))
            g_rows = torch.cat([g_rows, pad])
        if g_rows.dtype == torch.float16:
            _check_fp16_composite(grad, g_rows)
        return g_rows.view(ctx.rows_shape), None, None, None, None, None, None


def _check_fp16_composite(grad: torch.Tensor, g_rows: torch.Tensor) -> None:
    """A composite sums up to W per-step gradients: in float16 it can overflow although
    every one of them is finite.  The eager path hands the composite to the anchors' graph
    in the velocities' dtype, so it cannot rescale it: refuse rather than return inf/NaN
    (inf already upstream is left alone, for a GradScaler to see and skip)."""
    if bool(torch.isinf(g_rows).any()) and bool(torch.isfinite(grad).all()):
        raise RuntimeError(
            "float16 overflow in JAGG's composite gradient: the per-step gradients are "
            "finite but their t-weighted sum onto an anchor exceeds float16's range. Use "
            "deferred=True (it rescales each anchor chunk), bfloat16, a smaller window, or a "
            "lower loss scale (GradScaler init_scale)"
        )
