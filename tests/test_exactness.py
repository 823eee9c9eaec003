"""JAGG's gradient equals the exact gradient wherever the Jacobian is affine in t.

Families (issue #2): (a) a field affine in (z, t) with latents on the segment between a
window's anchors; (b) phi(z) + h_theta(t) with h affine in t, any latents.  Plus the
counter-properties that a no-op or a wrong interpolation would fail.
"""

from __future__ import annotations

import pytest
import torch
from fields import AffineField, MLPField, SeparableField, params_grad, rel_err, segment_latents
from hypothesis import given
from hypothesis import strategies as st

from jagg_autograd import jagg_trajectory, jagg_window, trajectory_layout

F64 = torch.float64


def _timesteps(draw, T: int, B: int, per_sample: bool, decreasing: bool) -> torch.Tensor:
    n = B if per_sample else 1
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    # Strictly increasing by construction: positive gaps, cumulated.
    gaps = 0.05 + torch.rand(T, n, generator=g, dtype=F64)
    t = gaps.cumsum(0) / gaps.sum(0)
    if decreasing:
        t = t.flip(0)
    return t if per_sample else t[:, 0]


@st.composite
def window_case(draw):
    W = draw(st.integers(2, 12))
    B = draw(st.integers(1, 4))
    L = draw(st.integers(1, 3))
    D = draw(st.integers(1, 4))
    t = _timesteps(draw, W, B, draw(st.booleans()), draw(st.booleans()))
    seed = draw(st.integers(0, 2**31 - 1))
    return W, B, L, D, t, seed


@st.composite
def trajectory_case(draw):
    T = draw(st.integers(2, 14))
    W = draw(st.integers(2, T))
    B = draw(st.integers(1, 3))
    D = draw(st.integers(1, 4))
    t = _timesteps(draw, T, B, draw(st.booleans()), draw(st.booleans()))
    return T, W, B, D, t, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


def _grads(model, fn, latents, t, upstream, **kw):
    exact = params_grad((fn(model, latents, t, mode="exact", **kw) * upstream).sum(), model)
    jagg = params_grad((fn(model, latents, t, mode="jagg", **kw) * upstream).sum(), model)
    return exact, jagg


@given(window_case())
def test_window_exact_family_a(case):
    W, B, L, D, t, seed = case
    g = torch.Generator().manual_seed(seed)
    model = AffineField(D, seed=seed % 1000)
    z0, z1 = torch.randn(2, B, L, D, generator=g, dtype=F64)
    lat = segment_latents(z0, z1, t)
    up = torch.randn(W, B, L, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_window, lat, t, up)
    assert rel_err(jagg, exact) < 1e-10


@given(window_case())
def test_window_exact_family_b(case):
    W, B, L, D, t, seed = case
    g = torch.Generator().manual_seed(seed)
    model = SeparableField(D, seed=seed % 1000)
    lat = torch.randn(W, B, L, D, generator=g, dtype=F64)  # ANY latents
    up = torch.randn(W, B, L, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_window, lat, t, up)
    assert rel_err(jagg, exact) < 1e-10


def _trajectory_segment_latents(T, W, shared, t, B, D, g):
    """Anchors random; every interior step on the segment between its window's anchors."""
    anchors, windows = trajectory_layout(T, W, shared)
    lat = torch.randn(T, B, D, generator=g, dtype=F64)
    for lo, hi in windows:
        if hi - lo >= 2:
            lat[lo : hi + 1] = segment_latents(lat[lo], lat[hi], t[lo : hi + 1])
    return lat


@given(trajectory_case())
def test_trajectory_exact_family_a(case):
    T, W, B, D, t, shared, seed = case
    g = torch.Generator().manual_seed(seed)
    model = AffineField(D, seed=seed % 1000)
    lat = _trajectory_segment_latents(T, W, shared, t, B, D, g)
    up = torch.randn(T, B, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_trajectory, lat, t, up, window=W, shared_anchors=shared)
    assert rel_err(jagg, exact) < 1e-10


@given(trajectory_case())
def test_trajectory_exact_family_b(case):
    T, W, B, D, t, shared, seed = case
    g = torch.Generator().manual_seed(seed)
    model = SeparableField(D, seed=seed % 1000)
    lat = torch.randn(T, B, D, generator=g, dtype=F64)
    up = torch.randn(T, B, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_trajectory, lat, t, up, window=W, shared_anchors=shared)
    assert rel_err(jagg, exact) < 1e-10


@pytest.mark.parametrize("shared", [True, False])
def test_trajectory_equals_hand_computed_composites(shared):
    """The anchor composites match an independent per-window formula."""
    T, W, B, D = 9, 4, 2, 3
    g = torch.Generator().manual_seed(3)
    model = MLPField(D)
    lat = torch.randn(T, B, D, generator=g, dtype=F64)
    t = torch.linspace(1.0, 0.1, T, dtype=F64) ** 1.5
    up = torch.randn(T, B, D, generator=g, dtype=F64)
    got = params_grad(
        (jagg_trajectory(model, lat, t, window=W, shared_anchors=shared) * up).sum(), model
    )
    anchors, windows = trajectory_layout(T, W, shared)
    G = {a: up[a].clone() for a in anchors}
    for lo, hi in windows:
        for k in range(lo + 1, hi):
            a = (t[k] - t[lo]) / (t[hi] - t[lo])
            G[lo] += (1 - a) * up[k]
            G[hi] += a * up[k]
    want = sum(params_grad((model(lat[a], t[a].expand(B)) * G[a]).sum(), model) for a in anchors)
    assert rel_err(got, want) < 1e-12


def _affine_error(delta: float) -> float:
    W, B, D = 6, 3, 4
    g = torch.Generator().manual_seed(0)
    model = AffineField(D)
    t = torch.linspace(0.9, 0.1, W, dtype=F64)
    z0, z1 = torch.randn(2, B, D, generator=g, dtype=F64)
    off = torch.randn(W, B, D, generator=g, dtype=F64)
    off[0] = 0
    off[-1] = 0
    lat = segment_latents(z0, z1, t) + delta * off
    up = torch.randn(W, B, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_window, lat, t, up)
    return float((jagg - exact).norm())


def test_error_is_zero_on_segment_and_grows_off_it():
    errs = [_affine_error(d) for d in (0.0, 0.01, 0.1, 1.0)]
    assert errs[0] < 1e-12
    assert 1e-6 < errs[1] < errs[2] < errs[3]
    # The Jacobian of an affine field is affine in z, so the gradient error (absolute:
    # the exact gradient moves with the latents too) is linear in the offset.
    assert errs[2] / errs[1] == pytest.approx(10.0, rel=1e-6)


def test_nonlinear_field_is_not_exact():
    W, B, D = 5, 2, 3
    g = torch.Generator().manual_seed(1)
    model = MLPField(D)
    lat = torch.randn(W, B, D, generator=g, dtype=F64)
    t = torch.linspace(1.0, 0.0, W, dtype=F64)
    up = torch.randn(W, B, D, generator=g, dtype=F64)
    exact, jagg = _grads(model, jagg_window, lat, t, up)
    assert rel_err(jagg, exact) > 1e-3


def test_wrong_interpolation_would_be_caught():
    """Sanity of the oracle itself: swapping alpha and 1-alpha breaks family (a) exactness."""
    W, B, D = 5, 2, 3
    g = torch.Generator().manual_seed(2)
    model = AffineField(D)
    t = torch.tensor([1.0, 0.8, 0.5, 0.35, 0.1], dtype=F64)
    lat = segment_latents(*torch.randn(2, B, D, generator=g, dtype=F64), t)
    up = torch.randn(W, B, D, generator=g, dtype=F64)
    exact, _ = _grads(model, jagg_window, lat, t, up)
    a = (t - t[0]) / (t[-1] - t[0])
    g0 = ((a).view(-1, 1, 1) * up).sum(0)  # swapped weights
    g1 = ((1 - a).view(-1, 1, 1) * up).sum(0)
    wrong = params_grad((model(lat[0], t[0].expand(B)) * g0).sum(), model) + params_grad(
        (model(lat[-1], t[-1].expand(B)) * g1).sum(), model
    )
    assert rel_err(wrong, exact) > 1e-2
