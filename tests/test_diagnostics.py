"""gradient_fidelity: exact where JAGG is exact, equal to an independent computation where
it is not, router figures, no side effects on the model, validation before any call."""

from __future__ import annotations

import json
import math

import pytest
import torch
from fields import AffineField, Counting, MLPField, params_grad, rel_err, segment_latents

from jagg_autograd import CosineRouter, jagg_trajectory, trajectory_layout
from jagg_autograd.diagnostics import FidelityReport, gradient_fidelity

F64 = torch.float64


def _window_case(W=5, B=3, D=3, seed=0, on_segment=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.1, 0.05][:W], dtype=F64)
    if on_segment:
        lat = segment_latents(*torch.randn(2, B, D, generator=g, dtype=F64), t)
    else:
        lat = torch.randn(W, B, D, generator=g, dtype=F64)
    up = torch.randn(W, B, D, generator=g, dtype=F64)
    return lat, t, up


def _trajectory_case(T=9, W=4, shared=True, B=2, D=3, seed=0, on_segment=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, T, dtype=F64) ** 1.5
    lat = torch.randn(T, B, D, generator=g, dtype=F64)
    if on_segment:
        # Interior steps on the segment between their window's anchors (JAGG exact).
        for lo, hi in trajectory_layout(T, W, shared)[1]:
            if hi - lo >= 2:
                lat[lo : hi + 1] = segment_latents(lat[lo], lat[hi], t[lo : hi + 1])
    up = torch.randn(T, B, D, generator=g, dtype=F64)
    return lat, t, up


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


# ---------------------------------------------------------------------------- exactness


def test_affine_window_is_exact():
    lat, t, up = _window_case()
    rep = gradient_fidelity(AffineField(3), lat, t, up)
    assert isinstance(rep, FidelityReport)
    assert abs(rep.cosine - 1.0) < 1e-10
    assert rep.rel_error < 1e-10
    assert abs(rep.norm_ratio - 1.0) < 1e-10
    assert rep.value_max_abs_diff < 1e-12
    assert rep.windows == [(0, 4)]
    assert rep.per_window is None
    assert rep.grad_samples == {"exact": 5 * 3, "jagg": 2 * 3}
    assert rep.backward_calls == {"exact": 1, "jagg": 1}


@pytest.mark.parametrize("shared", [True, False])
def test_affine_trajectory_is_exact(shared):
    T, W = 9, 4
    lat, t, up = _trajectory_case(T, W, shared)
    rep = gradient_fidelity(
        AffineField(3), lat, t, up, window=W, shared_anchors=shared, per_window=True
    )
    assert abs(rep.cosine - 1.0) < 1e-10
    assert rep.rel_error < 1e-10
    anchors, windows = trajectory_layout(T, W, shared)
    assert rep.windows == windows
    assert rep.grad_samples["jagg"] == len(anchors) * 2
    assert [(w.first, w.last) for w in rep.per_window] == windows
    assert all(abs(w.cosine - 1.0) < 1e-10 and w.rel_error < 1e-10 for w in rep.per_window)


# ----------------------------------------------------------------- independent oracle


def test_mlp_window_matches_independent_computation():
    W, B, D = 5, 3, 3
    lat, t, up = _window_case(W, B, D, seed=1, on_segment=False)
    model = MLPField(D)
    rep = gradient_fidelity(model, lat, t, up)
    assert rep.rel_error > 1e-3
    assert rep.cosine < 1.0

    # Exact: one model call and one backward per step.
    exact = sum(params_grad((model(lat[k], t[k].expand(B)) * up[k]).sum(), model) for k in range(W))
    # JAGG: hand-computed alphas and composite gradients, two backward calls.
    alpha = [(float(t[k]) - float(t[0])) / (float(t[-1]) - float(t[0])) for k in range(W)]
    G0 = sum((1.0 - alpha[k]) * up[k] for k in range(W))
    G1 = sum(alpha[k] * up[k] for k in range(W))
    jagg = params_grad((model(lat[0], t[0].expand(B)) * G0).sum(), model) + params_grad(
        (model(lat[-1], t[-1].expand(B)) * G1).sum(), model
    )
    assert abs(rep.cosine - _cos(jagg, exact)) < 1e-10
    assert abs(rep.rel_error - rel_err(jagg, exact)) < 1e-10
    assert abs(rep.norm_ratio - float(jagg.norm() / exact.norm())) < 1e-10
    assert abs(rep.exact_norm - float(exact.norm())) < 1e-10
    # A single window is its own decomposition.
    rep_w = gradient_fidelity(model, lat, t, up, per_window=True)
    assert rep_w.per_window == ((0, W - 1, rep.cosine, rep.rel_error),)


@pytest.mark.parametrize("shared", [True, False])
def test_mlp_per_window_matches_masked_upstream(shared):
    T, W, B, D = 8, 3, 2, 3
    lat, t, up = _trajectory_case(T, W, shared, B, D, seed=2, on_segment=False)
    model = MLPField(D)
    rep = gradient_fidelity(model, lat, t, up, window=W, shared_anchors=shared, per_window=True)
    assert rep.rel_error > 1e-3
    for w in rep.per_window:
        mask = torch.zeros(T, 1, 1, dtype=F64)
        mask[w.first : w.last + 1] = 1.0
        grads = [
            params_grad(
                (
                    jagg_trajectory(model, lat, t, window=W, shared_anchors=shared, mode=m)
                    * up
                    * mask
                ).sum(),
                model,
            )
            for m in ("exact", "jagg")
        ]
        if w.last - w.first < 2:  # no interior step: JAGG is exact there
            assert w.rel_error < 1e-12
        assert abs(w.cosine - _cos(grads[1], grads[0])) < 1e-10
        assert abs(w.rel_error - rel_err(grads[1], grads[0])) < 1e-10


# -------------------------------------------------------------------------------- router


def test_router_forced_exact_and_forced_jagg():
    W, B, D = 5, 3, 3
    lat, t, up = _window_case(W, B, D, seed=3, on_segment=False)
    model = MLPField(D)
    plain = gradient_fidelity(model, lat, t, up)
    assert plain.routed_cosine is None and plain.routed_rel_error is None
    assert plain.exact_fraction is None and plain.router is None
    assert "routed" not in plain.grad_samples

    forced = gradient_fidelity(model, lat, t, up, router=CosineRouter(threshold=2.0))
    assert abs(forced.routed_cosine - 1.0) < 1e-10
    assert forced.routed_rel_error < 1e-10
    assert forced.exact_fraction == 1.0
    assert forced.grad_samples["routed"] == 2 * B + (W - 2) * B
    assert forced.backward_calls["routed"] == 2
    assert "threshold=2.0" in forced.router

    never = gradient_fidelity(model, lat, t, up, router=CosineRouter(threshold=-2.0))
    assert never.exact_fraction == 0.0
    assert abs(never.routed_cosine - plain.cosine) < 1e-12
    assert abs(never.routed_rel_error - plain.rel_error) < 1e-12
    assert never.cosine == plain.cosine and never.rel_error == plain.rel_error


def test_scores_shapes_and_summary_figures():
    lat, t, up = _window_case(5, 3, 3, seed=4)
    rep = gradient_fidelity(MLPField(3), lat, t, up)
    assert len(rep.scores) == 1 and len(rep.scores[0]) == 3
    flat = torch.tensor(rep.scores, dtype=F64).flatten()
    assert rep.score_min == float(flat.min())
    assert rep.score_median == pytest.approx(float(flat.quantile(0.5)))

    T, W, B = 9, 4, 2
    lat, t, up = _trajectory_case(T, W, False, B, on_segment=False)
    rep = gradient_fidelity(MLPField(3), lat, t, up, window=W, shared_anchors=False)
    n_windows = len(trajectory_layout(T, W, False)[1])
    assert [len(r) for r in rep.scores] == [B] * n_windows
    assert rep.scores[-1] == [1.0] * B  # the single last step has no interior
    assert all(-1.0 <= s <= 1.0 for r in rep.scores for s in r)


# ------------------------------------------------------------------------ side effects


@pytest.mark.parametrize("training", [True, False])
def test_model_grads_mode_and_params_untouched(training):
    lat, t, up = _window_case(seed=5, on_segment=False)
    model = MLPField(3).train(training)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    before = [p.detach().clone() for p in model.parameters()]
    gradient_fidelity(model, lat, t, up, router=CosineRouter(threshold=0.99), per_window=True)
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
        assert torch.equal(p.grad, torch.full_like(p, 7.0))


def test_params_subset_and_non_module_model():
    lat, t, up = _window_case(seed=6, on_segment=False)
    model = MLPField(3)
    first = list(model.net[0].parameters())
    rep = gradient_fidelity(model, lat, t, up, params=first + first)  # duplicates dropped
    exact = sum(
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad((model(lat[k], t[k].expand(3)) * up[k]).sum(), first)
            ]
        )
        for k in range(5)
    )
    assert abs(rep.exact_norm - float(exact.norm())) < 1e-10

    def fn(z, t, **cond):
        return model(z, t)

    rep_fn = gradient_fidelity(fn, lat, t, up, params=list(model.parameters()))
    rep_mod = gradient_fidelity(model, lat, t, up)
    assert rep_fn.cosine == pytest.approx(rep_mod.cosine, abs=1e-12)


def test_unused_param_counts_as_zero():
    lat, t, up = _window_case(seed=7, on_segment=False)
    model = MLPField(3)
    model.spare = torch.nn.Parameter(torch.ones(4, dtype=F64))  # never used in forward
    rep = gradient_fidelity(model, lat, t, up)
    del model.spare
    ref = gradient_fidelity(model, lat, t, up)
    assert rep.cosine == pytest.approx(ref.cosine, abs=1e-12)
    assert rep.rel_error == pytest.approx(ref.rel_error, abs=1e-12)


def test_zero_exact_gradient_is_nan_not_a_crash():
    lat, t, up = _window_case(seed=8)
    rep = gradient_fidelity(MLPField(3), lat, t, torch.zeros_like(up))
    assert math.isnan(rep.cosine) and math.isnan(rep.rel_error) and math.isnan(rep.norm_ratio)
    assert rep.exact_norm == 0.0
    assert "nan" in str(rep)


def test_works_under_no_grad_and_float32_model():
    lat, t, up = _window_case(seed=9, on_segment=False)
    model = MLPField(3, dtype=torch.float32)
    with torch.no_grad():
        rep = gradient_fidelity(model, lat.float(), t.float(), up)  # float64 upstream
    assert 0.0 < rep.cosine <= 1.0 and rep.rel_error > 1e-3
    assert rep.value_max_abs_diff < 1e-5


# ---------------------------------------------------------------------------- validation


def _bad_cases():
    lat, t, up = _window_case(seed=10)
    return [
        ("upstream not a tensor", dict(upstream=up.tolist()), TypeError, "upstream"),
        ("upstream shape", dict(upstream=up[:-1]), ValueError, "upstream"),
        ("upstream integer", dict(upstream=up.long()), TypeError, "upstream"),
        ("upstream NaN", dict(upstream=up.clone().fill_(math.nan)), ValueError, "upstream"),
        ("upstream inf", dict(upstream=up.clone().fill_(math.inf)), ValueError, "upstream"),
        ("params empty", dict(params=[]), ValueError, "params"),
        ("params non-tensor", dict(params=[1.0]), TypeError, r"params\[0\]"),
        ("params no grad", dict(params=[torch.ones(2)]), ValueError, r"params\[0\]"),
        ("params bare tensor", dict(params=torch.ones(2, requires_grad=True)), TypeError, "params"),
        ("router", dict(router="cosine"), TypeError, "router"),
        ("router threshold", dict(router=0.9), TypeError, "router"),
        ("window str", dict(window="3"), TypeError, "window"),
        ("window bool", dict(window=True), TypeError, "window"),
        ("window too big", dict(window=9), ValueError, "window"),
        ("shared_anchors", dict(window=3, shared_anchors=1), TypeError, "shared_anchors"),
        ("per_window", dict(per_window="yes"), TypeError, "per_window"),
        ("timesteps", dict(timesteps=t[:-1]), ValueError, "timesteps"),
        ("batching", dict(batching="fused"), ValueError, "batching"),
        ("latents", dict(latents=lat.requires_grad_()), ValueError, "latents"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises_before_any_model_call(case):
    _, kw, exc, match = case
    lat, t, up = _window_case(seed=10)
    model = Counting(MLPField(3))
    args = dict(latents=lat, timesteps=t, upstream=up)
    args.update(kw)
    with pytest.raises(exc, match=match):
        gradient_fidelity(
            model, args.pop("latents"), args.pop("timesteps"), args.pop("upstream"), **args
        )
    assert model.calls == []


def test_non_module_model_needs_params():
    lat, t, up = _window_case(seed=11)
    calls = []

    def fn(z, t, **cond):
        calls.append(z.shape[0])
        return z

    with pytest.raises(TypeError, match="params"):
        gradient_fidelity(fn, lat, t, up)
    with pytest.raises(ValueError, match="params"):
        gradient_fidelity(Counting(torch.nn.Identity()), lat, t, up)
    assert calls == []


# -------------------------------------------------------------------------------- output


def test_to_dict_is_json_and_str_mentions_cosine():
    T, W = 7, 3
    lat, t, up = _trajectory_case(T, W, True, on_segment=False)
    rep = gradient_fidelity(
        MLPField(3), lat, t, up, window=W, router=CosineRouter(threshold=0.999), per_window=True
    )
    d = rep.to_dict()
    back = json.loads(json.dumps(d))
    assert back["cosine"] == rep.cosine
    assert back["scores"] == rep.scores
    assert back["per_window"][0]["first"] == 0
    assert back["grad_samples"].keys() == {"exact", "jagg", "routed"}
    assert all(type(v) in (float, int, str, list, dict, type(None)) for v in d.values())
    text = str(rep)
    assert "cosine" in text and "rel_error" in text and "per window" in text
    assert text == rep.summary()
    assert len(text.splitlines()) > 5
