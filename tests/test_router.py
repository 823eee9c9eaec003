"""CosineRouter: scores, decisions, and the gradients of mixed batches."""

from __future__ import annotations

import math

import pytest
import torch
from fields import MLPField, params_grad, rel_err, segment_latents
from hypothesis import given
from hypothesis import strategies as st

from jagg_autograd import CosineRouter, cosine_route_ref, jagg_trajectory, jagg_window

F64 = torch.float64


def _case(W=6, B=4, D=4, seed=0):
    """Latents on straight segments: a smooth field's velocities are then near-linear in t,
    so the scores sit close to 1 until a test pushes one sample off the line."""
    g = torch.Generator().manual_seed(seed)
    t = torch.linspace(1.0, 0.1, W, dtype=F64)
    z0, z1 = 0.3 * torch.randn(2, B, 2, D, generator=g, dtype=F64)
    lat = segment_latents(z0, z1, t) if W > 2 else torch.stack([z0, z1])
    up = torch.randn(W, B, 2, D, generator=g, dtype=F64)
    return lat, t, up


def test_forced_exact_equals_exact_mode():
    lat, t, up = _case()
    model = MLPField(4)
    exact = params_grad((jagg_window(model, lat, t, mode="exact") * up).sum(), model)
    v, st = jagg_window(model, lat, t, router=CosineRouter(threshold=1.5), return_stats=True)
    assert bool(st.exact.all())
    assert st.grad_samples == 2 * 4 + (6 - 2) * 4
    assert rel_err(params_grad((v * up).sum(), model), exact) < 1e-12


def test_forced_jagg_equals_no_router():
    lat, t, up = _case()
    model = MLPField(4)
    plain = params_grad((jagg_window(model, lat, t) * up).sum(), model)
    v, st = jagg_window(model, lat, t, router=CosineRouter(threshold=-2.0), return_stats=True)
    assert not bool(st.exact.any())
    assert rel_err(params_grad((v * up).sum(), model), plain) < 1e-14


def test_mixed_batch_exact_for_routed_samples_only():
    B = 4
    lat, t, up = _case(B=B)
    lat[3, 2] *= 25.0  # sample 2 leaves the straight line
    model = MLPField(4)
    v, st = jagg_window(model, lat, t, router=CosineRouter(threshold=0.9), return_stats=True)
    assert st.exact.tolist() == [False, False, True, False]
    assert st.grad_samples == 2 * B + (6 - 2) * 1
    got = params_grad((v * up).sum(), model)
    # Per-sample oracle: sample 2 exact, the others JAGG, each from its own B=1 window.
    want = sum(
        params_grad(
            (
                jagg_window(model, lat[:, b : b + 1], t, mode="exact" if b == 2 else "jagg")
                * up[:, b : b + 1]
            ).sum(),
            model,
        )
        for b in range(B)
    )
    assert rel_err(got, want) < 1e-12


def test_jagg_frac_keeps_top_scores():
    B = 5
    lat, t, _ = _case(B=B)
    model = MLPField(4)
    _, st0 = jagg_window(model, lat, t, return_stats=True)
    _, st = jagg_window(model, lat, t, router=CosineRouter(-2.0, jagg_frac=0.4), return_stats=True)
    keep = math.ceil(0.4 * B)
    top = set(torch.argsort(st0.scores, descending=True)[:keep].tolist())
    assert {b for b in range(B) if not st.exact[b]} == top
    _, st_all = jagg_window(
        model, lat, t, router=CosineRouter(-2.0, jagg_frac=0.0), return_stats=True
    )
    assert bool(st_all.exact.all())


def test_w2_scores_one_and_never_routes():
    lat, t, _ = _case(W=2)
    model = MLPField(4)
    _, st = jagg_window(model, lat, t, router=CosineRouter(threshold=5.0), return_stats=True)
    assert torch.equal(st.scores, torch.ones(4, dtype=st.scores.dtype))
    assert not bool(st.exact.any())


def test_nan_scores_route_to_exact():
    scores = torch.tensor([[0.99, float("nan"), 0.95, float("inf")]])
    r = CosineRouter(threshold=0.9)
    assert r.route(scores, torch.tensor([True])).tolist() == [[False, True, False, False]]
    lat, t, _ = _case(B=2)

    def model(z, t):
        out = z.clone()
        out[1] = float("nan")  # sample 1 of the first stacked step
        return out

    _, st = jagg_window(model, lat, t, router=r, return_stats=True)
    assert st.exact.tolist() == [False, True]


def test_trajectory_routing_is_per_window():
    T, B = 10, 3
    lat, t, up = _case(W=T, B=B)
    lat[5, 1] *= 30.0  # window [3..6] of sample 1
    model = MLPField(4)
    v, st = jagg_trajectory(model, lat, t, window=4, router=CosineRouter(0.9), return_stats=True)
    assert st.exact.shape == (3, B)
    assert st.exact[1, 1] and int(st.exact.sum()) == 1
    # Recomputed with grad: exactly the 2 interior steps of that window for that sample.
    assert st.grad_samples == 4 * B + 2


@given(st.integers(1, 6), st.integers(2, 9), st.integers(1, 40), st.integers(0, 10_000))
def test_scores_match_direct_formula(B, W, N, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(W, B, N, generator=g, dtype=F64)
    a = torch.sort(torch.rand(W, B, generator=g, dtype=F64), 0).values
    s = cosine_route_ref(v, a, [0], [W - 1])
    for b in range(B):
        cos = [
            torch.nn.functional.cosine_similarity(
                v[k, b], (1 - a[k, b]) * v[0, b] + a[k, b] * v[-1, b], dim=0, eps=0
            )
            for k in range(1, W - 1)
        ]
        want = min(cos).item() if cos else 1.0
        assert s[0, b].item() == pytest.approx(want, abs=1e-12)


def test_zero_vectors():
    v = torch.zeros(3, 2, 4, dtype=F64)
    v[:, 1, 0] = 1.0
    v[1, 1] = 0.0  # interior zero against a non-zero line
    s = cosine_route_ref(v, torch.full((3, 2), 0.5, dtype=F64), [0], [2])
    assert s.tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "kwargs,exc",
    [
        ({"threshold": float("nan")}, ValueError),
        ({"threshold": float("inf")}, ValueError),
        ({"threshold": "0.9"}, TypeError),
        ({"threshold": True}, TypeError),
        ({"jagg_frac": 1.5}, ValueError),
        ({"jagg_frac": -0.1}, ValueError),
        ({"jagg_frac": float("nan")}, ValueError),
        ({"jagg_frac": "half"}, TypeError),
    ],
)
def test_router_arguments_checked(kwargs, exc):
    with pytest.raises(exc, match="threshold|jagg_frac"):
        CosineRouter(**kwargs)
