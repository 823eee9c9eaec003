"""The direct executor: the model's own outputs, no JAGG Function.

Runs a call that needs no JAGG gradient (``JaggCall.executor == "direct"``):

* values only -- under ``no_grad``, or ``deferred=True`` with nothing to differentiate:
  ``values`` as given (detached), else every step under ``no_grad``;
* ``mode="exact"`` with grad (eager): every step with grad; the exact gradient flows
  through the model's own graphs, and given ``values`` are checked against the result.

Stats report the plan a call with grad would run (``planner.choose_plan``): a preview.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from jagg_autograd.caller import Caller
from jagg_autograd.checks import check_fresh
from jagg_autograd.planner import choose_plan

if TYPE_CHECKING:
    from jagg_autograd.call import JaggCall, JaggStats


def run_direct(call: JaggCall) -> tuple[torch.Tensor, JaggStats | None]:
    """Velocities (T, B, *S) of every step, with the model's own graph for exact mode."""
    caller = Caller(call)
    opts = call.opts
    if opts.mode == "exact" and call.needs_grad:
        out = caller.all_steps(True, opts.batching, opts.chunk_size)
        if opts.values is not None:
            check_fresh(out, opts.values, call.values_limit)
    elif opts.values is not None:
        out = opts.values.detach()
    else:
        out = caller.all_steps(False, opts.batching, opts.chunk_size)
    if not opts.return_stats:
        return out, None
    choice = choose_plan(call, out)
    return out, call.stats(caller, choice.scores, choice.exact, choice.plan.anchor_mask)
