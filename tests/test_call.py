"""The core's seams: one option set, one parsed call, one plan chooser, three executors.

Numbers are covered by the behaviour tests (test_window, test_deferred, ...); these pin
the structure a new option or placement relies on.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
from fields import MLPField

from jagg_autograd import CosineRouter, gradient_fidelity, jagg_trajectory, jagg_window
from jagg_autograd.call import OPTION_NAMES, JaggOptions, options_from, parse_call
from jagg_autograd.planner import choose_plan
from jagg_autograd.window import EXECUTORS, execute

F64 = torch.float64


def _keywords(fn):
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def test_public_functions_share_one_option_set():
    defaults = {f.name: f.default for f in dataclasses.fields(JaggOptions)}
    traj = _keywords(jagg_trajectory)
    assert set(traj) == set(OPTION_NAMES)
    assert traj.pop("window") is inspect.Parameter.empty  # required for a trajectory
    win = _keywords(jagg_window)
    # the layout of a trajectory: a window call has none
    assert set(win) == set(OPTION_NAMES) - {"window", "shared_anchors", "anchors"}
    fid = _keywords(gradient_fidelity)
    assert set(fid) - set(OPTION_NAMES) == {"per_window"}
    for kw in (traj, win, {k: v for k, v in fid.items() if k != "per_window"}):
        for name, default in kw.items():
            assert default == defaults[name], name


def test_options_from_takes_only_options():
    o = options_from({"model": object(), "mode": "exact", "chunk_size": 3})
    assert (o.mode, o.chunk_size, o.batching) == ("exact", 3, "stacked")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.mode = "jagg"


def _case(T=7, B=3):
    g = torch.Generator().manual_seed(0)
    return (
        MLPField(2, seed=1),
        torch.randn(T, B, 2, generator=g, dtype=F64),
        torch.linspace(1.0, 0.1, T, dtype=F64),
    )


def _parse(model, lat, t, trajectory=True, **kw):
    kw.setdefault("window", 3)
    return parse_call(model, lat, t, JaggOptions(**kw), trajectory=trajectory)


def test_parse_call_chooses_the_executor():
    model, lat, t = _case()
    assert _parse(model, lat, t).executor == "eager"
    assert _parse(model, lat, t, mode="exact").executor == "direct"
    assert _parse(model, lat, t, deferred=True).executor == "deferred"
    with torch.no_grad():
        call = _parse(model, lat, t, deferred=True)
    assert call.executor == "direct" and not call.needs_grad
    frozen = model.requires_grad_(False)
    assert _parse(frozen, lat, t, deferred=True).executor == "direct"  # nothing to differentiate
    assert set(EXECUTORS) == {"direct", "eager", "deferred"}
    call = _parse(model, lat, t)
    with pytest.raises(dataclasses.FrozenInstanceError):
        call.executor = "deferred"


def test_parse_call_records_layout_and_checked_options():
    model, lat, t = _case(T=7)
    call = _parse(model, lat, t, deferred=True, placement="adaptive", budget=3.5)
    assert call.anchors == (0, 2, 4, 6) and call.windows == ((0, 2), (2, 4), (4, 6))
    assert call.t64.shape == (7, 3) and call.t64.dtype == F64
    assert call.opts.backend == "auto" and call.budget_total == round(3.5 * 3)
    assert {name for name, _, _ in call.versions} >= {"latents", "timesteps"}
    assert len(call.targets) == len(list(model.parameters()))
    win = _parse(model, lat[:4], t[:4], trajectory=False)
    assert win.anchors == (0, 3) and win.windows == ((0, 3),)


def test_choose_plan_exact_uniform_routed_adaptive():
    model, lat, t = _case(T=7, B=3)
    with torch.no_grad():
        vals = torch.stack([model(lat[k], t[k].expand(3)) for k in range(7)])
    exact = choose_plan(_parse(model, lat, t, mode="exact"), vals)
    assert bool(exact.plan.anchor_mask.all()) and bool(exact.exact.all())
    uni = choose_plan(_parse(model, lat, t), vals)
    assert uni.plan.whole_steps == [0, 2, 4, 6]  # the eager executor's whole-step calls
    assert uni.plan.anchor_mask.sum() == 4 * 3 and uni.scores is None
    routed = choose_plan(_parse(model, lat, t, router=CosineRouter(threshold=2.0)), vals)
    assert bool(routed.exact.all()) and bool(routed.plan.anchor_mask.all())
    call = _parse(model, lat, t, deferred=True, placement="adaptive", budget=3.0)
    assert choose_plan(call, vals).plan is None  # chosen in the backward, from g
    up = torch.randn(vals.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    adaptive = choose_plan(call, vals, up)
    assert int(adaptive.plan.anchor_mask.sum()) == call.budget_total


def test_execute_runs_the_parsed_call_like_the_public_function():
    model, lat, t = _case()
    up = torch.randn(lat.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    for kw in ({}, {"deferred": True}, {"mode": "exact"}):
        out, stats = execute(_parse(model, lat, t, return_stats=True, **kw))
        ref, ref_stats = jagg_trajectory(model, lat, t, window=3, return_stats=True, **kw)
        assert torch.equal(out, ref)
        g = torch.autograd.grad((out * up).sum(), list(model.parameters()))
        g_ref = torch.autograd.grad((ref * up).sum(), list(model.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
        assert torch.equal(stats.anchor_mask, ref_stats.anchor_mask)
