"""The deferred executor: anchors run with grad inside the backward, chunk by chunk.

The forward (:func:`run_deferred`) makes no with-grad model call: it hands back the
velocities (the caller's ``values``, or all T steps under ``no_grad``) through
:class:`DeferredJaggFunction`.  The backward, once the upstream gradients
g (T, B, *S) exist,

1. plans the anchors (a uniform / routed mask fixed in the forward, or the adaptive
   placement chosen from g and the velocities, ``jagg_autograd.planner``),
2. folds g onto the anchor pairs (the mixing op, ``jagg_autograd.mix``),
3. runs the anchor pairs with grad ``chunk_size`` samples at a time and back-propagates
   and frees each chunk before the next, so peak activation memory is one chunk's — with
   ``chunk_size = B`` that of Flow-GRPO's per-step loop,
4. with caller-given ``values``, compares every recomputed anchor with them (a
   deviation beyond tolerance means the values are stale) before any gradient leaves,

and returns the accumulated parameter (and cond) gradients as the gradients of the
Function's inputs, so they reach ``.grad`` through autograd like any op's.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.function import once_differentiable

from jagg_autograd.caller import Caller
from jagg_autograd.checks import resolve_params, stale_error
from jagg_autograd.distributed import ddp_for_deferred, ddp_post_forward, ddp_pre_forward
from jagg_autograd.fold_guard import mark_fold
from jagg_autograd.mix import mix_slots
from jagg_autograd.planner import Plan, apply_promotion, choose_plan

if TYPE_CHECKING:
    from jagg_autograd.call import JaggCall, JaggStats

__all__ = [
    "DeferredJaggFunction",
    "DeferredSpec",
    "overflow_scale",
    "resolve_params",  # the deferred call's trainable tensors (defined in checks.py)
    "run_deferred",
    "run_deferred_backward",
]


def run_deferred(call: JaggCall) -> tuple[torch.Tensor, JaggStats | None]:
    """No with-grad model call now: the values (``values=``, or every step under
    no_grad), connected by :class:`DeferredJaggFunction` to the parameters and cond
    tensors whose gradients its backward computes."""
    caller = Caller(call)
    opts = call.opts
    ddp = ddp_for_deferred(call.model)
    if ddp is not None:
        caller.model = ddp_pre_forward(ddp)  # the chunks run on ddp.module
    vals = opts.values
    if vals is None:
        vals = caller.all_steps(False, opts.batching, opts.chunk_size)
    choice = choose_plan(call, vals)
    stats = None
    if opts.return_stats:
        plan = choice.plan
        mask = (
            plan.anchor_mask.clone()
            if plan is not None
            else torch.zeros((call.T, call.B), dtype=torch.bool, device=vals.device)
        )
        stats = call.stats(caller, choice.scores, choice.exact, mask)
        stats.anchors = [] if plan is None else mask.any(1).nonzero().flatten().tolist()
    spec = DeferredSpec(call, caller, choice.plan, stats)
    out = DeferredJaggFunction.apply(spec, vals, *call.targets)
    # For the loss's guard (fold_guard).  Promotion to exact is unbiased for any
    # advantages, whatever its base fold: no linear-fold warning for it.
    o = call.opts
    unbiased = o.placement == "stochastic" and o.promote_to == "exact"
    mark_fold(out, "exact in expectation" if unbiased else o.fold)
    if ddp is not None:
        out = ddp_post_forward(ddp, out)
    return out, stats


@dataclass
class DeferredSpec:
    """Everything the backward needs besides the saved tensors.

    call: the parsed call (options, timesteps, targets, values tolerance, versions).
    caller: runs the model on (step, sample) pairs.
    plan: the plan fixed in the forward (uniform / routed / exact), or None for adaptive
        (chosen in the backward by ``choose_plan`` from the upstream gradients).
    stats: the call's ``JaggStats`` (completed here) or None.

    ``call.targets`` are the gradient-carrying inputs that follow ``values`` in ``apply``:
    the parameters, then the cond tensors named by ``call.grad_cond_keys``.
    """

    call: JaggCall
    caller: Caller
    plan: Plan | None
    stats: Any


def _chunk_bounds(ks: torch.Tensor, per: int, per_step: bool) -> list[tuple[int, int]]:
    n = ks.numel()
    if per_step:
        cuts = [0, *torch.nonzero(ks[1:] != ks[:-1]).flatten().add(1).tolist(), n]
        out = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            out.extend((a, min(a + per, hi)) for a in range(lo, hi, per))
        return out
    return [(a, min(a + per, n)) for a in range(0, n, per)]


class DeferredJaggFunction(torch.autograd.Function):
    """``apply(spec, values, *inputs)``: values (T, B, *S) without graph; inputs: the
    tensors whose gradient the anchors produce (parameters, cond tensors that require
    grad).  Output: the values (same storage), connected to those inputs.

    Saved for backward: the values (the output's own storage, no copy).
    """

    @staticmethod
    def forward(
        ctx: Any, spec: DeferredSpec, values: torch.Tensor, *inputs: torch.Tensor
    ) -> torch.Tensor:
        ctx.spec = spec
        out = values.detach()
        ctx.save_for_backward(out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        spec: DeferredSpec = ctx.spec
        (values,) = ctx.saved_tensors
        _check_versions(spec.call.versions)
        grads = run_deferred_backward(spec, values, grad, list(ctx.needs_input_grad[2:]))
        return (None, None, *grads)


def _check_versions(versions: tuple[tuple[str, torch.Tensor, int], ...]) -> None:
    for name, t, version in versions:
        if t._version != version:
            raise RuntimeError(
                f"{name} was modified by an inplace operation between the deferred forward "
                f"and its backward (version {version} -> {t._version}); the anchors are "
                "recomputed in the backward and would see the new state (an optimizer step "
                "or a reused rollout buffer before backward()?)"
            )


def run_deferred_backward(
    spec: DeferredSpec,
    values: torch.Tensor,
    grad: torch.Tensor,
    needed: list[bool],
) -> list[torch.Tensor | None]:
    """Plan, mix, run the anchors in chunks and return one gradient per target.

    needed: which targets autograd asks a gradient for (the others get None).  The cond
    tensors are replaced by detached leaves for the recomputation (as checkpointing
    does): their own graphs (a text encoder, a parameter) are traversed once, by autograd,
    after the Function returns the leaves' gradients -- never once per chunk.
    """
    caller, call = spec.caller, spec.call
    targets = list(call.targets)
    n_par = len(targets) - len(call.grad_cond_keys)
    leaves = {k: caller.cond[k].detach().requires_grad_(True) for k in call.grad_cond_keys}
    diff = targets[:n_par] + [leaves[k] for k in call.grad_cond_keys]
    wanted = [i for i, need in enumerate(needed) if need]
    saved_cond = caller.cond
    caller.cond = {**caller.cond, **leaves}
    try:
        part = _chunked_grads(spec, values, grad, [diff[i] for i in wanted], targets)
    finally:
        caller.cond = saved_cond
    out: list[torch.Tensor | None] = [None] * len(diff)
    for i, g in zip(wanted, part):
        out[i] = g
    return out


def _plan_rows(
    spec: DeferredSpec, values: torch.Tensor, grad: torch.Tensor
) -> tuple[Plan, torch.Tensor, float]:
    """The plan (adaptive: chosen now, from g), g folded onto its rows, the planning time."""
    T, B = values.shape[:2]
    t0 = time.perf_counter()
    plan = spec.plan if spec.plan is not None else choose_plan(spec.call, values, grad).plan
    plan_s = time.perf_counter() - t0
    # float16: fold in float32, so a composite (a sum of up to W per-step gradients) that
    # leaves float16's range stays finite; each chunk is rescaled before its backward.
    g_in = grad.reshape(T, B, -1)
    g_rows = mix_slots(
        g_in.float() if g_in.dtype == torch.float16 else g_in,
        plan.w_cur,
        plan.w_nxt,
        plan.slots,
        plan.n_rows,
        spec.call.opts.backend,
    )
    return plan, apply_promotion(g_rows, plan), plan_s


def _chunked_grads(
    spec: DeferredSpec,
    values: torch.Tensor,
    grad: torch.Tensor,
    targets: list[torch.Tensor],
    hooked: list[torch.Tensor],
) -> list[torch.Tensor | None]:
    caller, call = spec.caller, spec.call
    check_values = call.opts.values is not None
    plan, g_rows, plan_s = _plan_rows(spec, values, grad)
    # Rows of whole steps first (the uniform plan), then the pairs: one (k, b) list.
    ks, bs = _pairs_in_row_order(plan, call.B)
    per = call.B if call.opts.chunk_size is None else call.opts.chunk_size
    acc: list[torch.Tensor | None] = [None] * len(targets)
    owned = [False] * len(targets)
    worst = torch.zeros((), dtype=torch.float64, device=values.device)
    calls = samples = 0
    for lo, hi in _chunk_bounds(ks, per, call.opts.batching == "per_step"):
        k, b = ks[lo:hi], bs[lo:hi]
        with torch.enable_grad(), _autocast(values.device, call.autocast):
            v = caller.pairs(k, b, grad=True)
        if v.dtype != values.dtype:
            raise TypeError(
                f"the model returns {v.dtype} but the values are {values.dtype}: values= must "
                "be the model's own outputs (same dtype), or the staleness check is blind"
            )
        if check_values:
            dev = (v.detach().to(torch.float64) - values[k, b].to(torch.float64)).abs()
            worst = torch.maximum(worst, dev.amax())
        if not v.requires_grad or not targets:
            continue
        calls += 1
        samples += hi - lo
        up = g_rows[lo:hi].view_as(v)
        scale = overflow_scale(up, v.dtype)
        with _hooks_suspended(hooked):
            gs = torch.autograd.grad(v, targets, (up / scale).to(v.dtype), allow_unused=True)
        del v
        _accumulate(acc, owned, gs, scale)
    if check_values and bool(worst > call.values_limit):
        raise stale_error(float(worst), float(call.values_limit))
    if spec.stats is not None:
        st = spec.stats
        st.grad_samples = samples
        st.grad_forward_calls = calls
        st.anchor_mask.copy_(plan.anchor_mask)
        st.anchors[:] = plan.anchor_mask.any(1).nonzero().flatten().tolist()
        st.plan_seconds = plan_s
    return acc


def _accumulate(
    acc: list[torch.Tensor | None],
    owned: list[bool],
    gs: tuple[torch.Tensor | None, ...],
    scale: float,
) -> None:
    """acc[i] += gs[i] * scale for a chunk's gradients."""
    for i, gi in enumerate(gs):
        if gi is None:
            continue
        if scale != 1.0:
            gi = gi * scale
        # Never add into a tensor autograd handed back: it may be expanded (stride 0)
        # or alias the upstream; the first sum allocates a buffer this loop owns.
        if acc[i] is None:
            acc[i] = gi
        elif owned[i]:
            acc[i].add_(gi)
        else:
            acc[i] = acc[i] + gi
            owned[i] = True


def overflow_scale(up: torch.Tensor, dtype: torch.dtype) -> float:
    """A power of two s with up / s inside ``dtype``'s range (1.0 when it already is).

    Only float16 can overflow here (bfloat16 and float32 share float32's exponent range):
    a composite gradient sums up to W per-step gradients, so it can leave float16's range
    although each of them is representable.  Back-propagating up / s and multiplying the
    parameter gradients by s is exact up to rounding (s is a power of two).
    """
    if dtype != torch.float16 or up.dtype == torch.float16:
        return 1.0
    m = float(up.detach().abs().amax()) if up.numel() else 0.0
    limit = torch.finfo(torch.float16).max / 4  # headroom for the backward's own sums
    if not m > limit or not math.isfinite(m):
        return 1.0  # in range, or already inf/NaN upstream (a GradScaler's business)
    return float(2.0 ** math.ceil(math.log2(m / limit)))


@contextlib.contextmanager
def _hooks_suspended(targets: list[torch.Tensor]) -> Iterator[None]:
    """Keep the targets' tensor hooks from seeing a chunk's partial gradient.

    ``autograd.grad`` runs a tensor's hooks whenever it computes that tensor's gradient;
    the chunks' gradients are private partial sums, so the user's hooks must see only the
    total, once, when the Function hands it to autograd.  The hook dicts are emptied for
    the duration of the chunk's ``autograd.grad`` and refilled right after.
    """
    stash = []
    for t in targets:
        hooks = getattr(t, "_backward_hooks", None)
        if hooks:
            stash.append((hooks, dict(hooks)))
            hooks.clear()
    try:
        yield
    finally:
        for hooks, saved in stash:
            hooks.update(saved)


def _pairs_in_row_order(plan: Plan, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not plan.whole_steps:
        return plan.pair_k, plan.pair_b
    dev = plan.anchor_mask.device
    w = torch.tensor(plan.whole_steps, dtype=torch.long, device=dev)
    wk = w.repeat_interleave(B)
    wb = torch.arange(B, device=dev).repeat(len(plan.whole_steps))
    return torch.cat([wk, plan.pair_k]), torch.cat([wb, plan.pair_b])


class _autocast:
    """Re-enter the forward's autocast state for the recomputation (as checkpointing does)."""

    def __init__(self, device: torch.device, state: tuple[bool, torch.dtype] | None) -> None:
        self.ctx = (
            torch.autocast(device.type, dtype=state[1], enabled=state[0])
            if state is not None
            else None
        )

    def __enter__(self) -> None:
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(*exc)
