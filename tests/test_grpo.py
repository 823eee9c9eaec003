"""Tests for jagg_autograd.grpo against independent float64 re-derivations of each formula.

The references below are written per element in plain Python ``math`` (or with
``torch.distributions``) on purpose, so that they share no code path with the vectorised
implementation.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from jagg_autograd.grpo import (
    dance_sde_step_with_logprob,
    group_advantages,
    grpo_loss,
    kl_to_reference,
    ode_step,
    sde_step_with_logprob,
    shift_sigmas,
    shifted_sigma_schedule,
)

SETTINGS = settings(
    max_examples=200 if not os.environ.get("CI") else 25,
    deadline=None,
    derandomize=bool(os.environ.get("CI")),
)


# --------------------------------------------------------------------------------------------
# per-element references
# --------------------------------------------------------------------------------------------


def ref_flow_step(v, x, xp, sig, sig_next, eta, sigma_max=None):
    """Flow-GRPO step, one element at a time. Returns (mean, log_prob, eps_t) as numpy."""
    v, x, xp = (np.asarray(a, dtype=np.float64) for a in (v, x, xp))
    B = v.shape[0]
    mean = np.zeros_like(v)
    lp = np.zeros(B)
    eps_out = np.zeros(B)
    for b in range(B):
        s, sn = float(sig[b]), float(sig_next[b])
        dt = sn - s
        if s == 1.0:
            tilde = sn if sigma_max is None else sigma_max
        else:
            tilde = s
        eps = eta * math.sqrt(s / (1.0 - tilde))
        std = eps * math.sqrt(-dt)
        eps_out[b] = eps
        flat_v, flat_x, flat_xp = v[b].ravel(), x[b].ravel(), xp[b].ravel()
        total = 0.0
        mb = np.zeros(flat_v.size)
        for i in range(flat_v.size):
            m = (
                flat_x[i] * (1 + eps * eps / (2 * s) * dt)
                + flat_v[i] * (1 + eps * eps * (1 - s) / (2 * s)) * dt
            )
            mb[i] = m
            z = (flat_xp[i] - m) / std
            total += -0.5 * z * z - math.log(std) - 0.5 * math.log(2 * math.pi)
        mean[b] = mb.reshape(v.shape[1:])
        lp[b] = total / flat_v.size
    return mean, lp, eps_out


def ref_dance_step(v, x, xp, sig, sig_next, eta):
    v, x, xp = (np.asarray(a, dtype=np.float64) for a in (v, x, xp))
    B = v.shape[0]
    mean = np.zeros_like(v)
    lp = np.zeros(B)
    for b in range(B):
        s, sn = float(sig[b]), float(sig_next[b])
        dt = sn - s
        std = eta * math.sqrt(s - sn)
        fv, fx, fxp = v[b].ravel(), x[b].ravel(), xp[b].ravel()
        mb = np.zeros(fv.size)
        total = 0.0
        for i in range(fv.size):
            x0 = fx[i] - s * fv[i]
            score = -(fx[i] - (1 - s) * x0) / (s * s)
            m = fx[i] + dt * fv[i] - 0.5 * eta * eta * score * dt
            mb[i] = m
            total += (
                -((fxp[i] - m) ** 2) / (2 * std * std)
                - math.log(std)
                - math.log(math.sqrt(2 * math.pi))
            )
        mean[b] = mb.reshape(v.shape[1:])
        lp[b] = total / fv.size
    return mean, lp


def ref_grpo_loss(lp, old, adv, clip_range, adv_clip_max, kl=None, beta=0.0):
    terms, clipped_count = [], 0
    for a, b, c in zip(lp, old, adv, strict=True):
        a_hat = min(max(c, -adv_clip_max), adv_clip_max)
        r = math.exp(a - b)
        r_c = min(max(r, 1 - clip_range), 1 + clip_range)
        terms.append(max(-a_hat * r, -a_hat * r_c))
        clipped_count += abs(r - 1) > clip_range
    loss = sum(terms) / len(terms)
    if kl is not None:
        loss += beta * sum(kl) / len(kl)
    return loss, clipped_count / len(terms)


def ref_group_advantages(rewards, ids, global_std=False, eps=1e-4):
    groups: dict = {}
    for r, g in zip(rewards, ids, strict=True):
        groups.setdefault(g, []).append(r)
    all_std = float(np.std(np.asarray(rewards, dtype=np.float64)))
    out = []
    for r, g in zip(rewards, ids, strict=True):
        vals = groups[g]
        mu = sum(vals) / len(vals)
        sd = all_std if global_std else math.sqrt(sum((u - mu) ** 2 for u in vals) / len(vals))
        out.append((r - mu) / (sd + eps))
    return out


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------

shapes = st.sampled_from([(3,), (2, 3), (1, 2, 2), (2, 1, 3)])


@st.composite
def sigma_pairs(draw, batch):
    sig, sig_next = [], []
    for _ in range(batch):
        s = draw(st.one_of(st.just(1.0), st.floats(0.05, 0.98)))
        frac = draw(st.floats(0.0, 0.9))
        sig.append(s)
        sig_next.append(s * frac)
    return sig, sig_next


@st.composite
def step_case(draw):
    batch = draw(st.integers(1, 3))
    shape = draw(shapes)
    sig, sig_next = draw(sigma_pairs(batch))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    full = (batch, *shape)
    v = torch.randn(full, generator=g, dtype=torch.float64)
    x = torch.randn(full, generator=g, dtype=torch.float64)
    noise = torch.randn(full, generator=g, dtype=torch.float64)
    eta = draw(st.floats(0.1, 1.5))
    per_sample = draw(st.booleans())
    return v, x, noise, sig, sig_next, eta, per_sample


def _sig_arg(vals, per_sample):
    return torch.tensor(vals, dtype=torch.float64) if per_sample else vals[0]


# --------------------------------------------------------------------------------------------
# Flow-GRPO step
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case=step_case(), use_sigma_max=st.booleans())
def test_flow_step_matches_elementwise_reference(case, use_sigma_max):
    v, x, noise, sig, sig_next, eta, per_sample = case
    if not per_sample:
        sig = [sig[0]] * len(sig)
        sig_next = [sig_next[0]] * len(sig_next)
    sigma_max = 0.9 if use_sigma_max else None
    xp = x + 0.3 * noise  # an arbitrary fixed x'
    prev, lp, mean, std_dev_t = sde_step_with_logprob(
        v,
        x,
        _sig_arg(sig, per_sample),
        _sig_arg(sig_next, per_sample),
        noise_level=eta,
        sigma_max=sigma_max,
        prev_sample=xp,
    )
    r_mean, r_lp, r_eps = ref_flow_step(v, x, xp, sig, sig_next, eta, sigma_max)
    assert lp.shape == (v.shape[0],) and lp.dtype == torch.float64
    assert std_dev_t.shape == (v.shape[0],) + (1,) * (v.ndim - 1)
    np.testing.assert_allclose(mean.numpy(), r_mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lp.numpy(), r_lp, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(std_dev_t.reshape(-1).numpy(), r_eps, rtol=1e-12)
    torch.testing.assert_close(prev, xp, rtol=0, atol=0)


@SETTINGS
@given(case=step_case())
def test_flow_log_prob_matches_torch_normal(case):
    v, x, noise, sig, sig_next, eta, _ = case
    sig_t = torch.tensor(sig, dtype=torch.float64)
    sig_next_t = torch.tensor(sig_next, dtype=torch.float64)
    xp = x + noise
    _, lp, mean, std_dev_t = sde_step_with_logprob(
        v, x, sig_t, sig_next_t, noise_level=eta, prev_sample=xp
    )
    dt = (sig_next_t - sig_t).reshape(std_dev_t.shape)
    normal = torch.distributions.Normal(mean, std_dev_t * torch.sqrt(-dt))
    expected = normal.log_prob(xp).flatten(1).mean(1)
    torch.testing.assert_close(lp, expected, rtol=1e-10, atol=1e-10)


def test_flow_sampling_uses_generator_and_log_prob_of_own_sample():
    v = torch.randn(4, 2, 3, dtype=torch.float64)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    sigma, sigma_next, eta = 0.6, 0.45, 0.7
    prev, lp, mean, _ = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=eta, generator=torch.Generator().manual_seed(7)
    )
    xi = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    s = eta * math.sqrt(sigma / (1 - sigma)) * math.sqrt(sigma - sigma_next)
    torch.testing.assert_close(prev, mean + s * xi)
    expected = (-0.5 * xi**2).flatten(1).mean(1) - math.log(s) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(lp, expected)
    # same seed, same draw
    prev2, *_ = sde_step_with_logprob(
        v, x, sigma, sigma_next, noise_level=eta, generator=torch.Generator().manual_seed(7)
    )
    torch.testing.assert_close(prev, prev2, rtol=0, atol=0)


def test_sigma_one_branch_uses_sigma_max_and_defaults_to_sigma_next():
    v = torch.randn(2, 5, dtype=torch.float64)
    x = torch.randn(2, 5, dtype=torch.float64)
    xp = torch.randn(2, 5, dtype=torch.float64)
    eta = 0.7
    _, lp, _, eps = sde_step_with_logprob(
        v, x, 1.0, 0.8, noise_level=eta, sigma_max=0.9, prev_sample=xp
    )
    torch.testing.assert_close(
        eps.reshape(-1), torch.full((2,), eta * math.sqrt(1 / (1 - 0.9)), dtype=torch.float64)
    )
    _, _, _, eps_default = sde_step_with_logprob(v, x, 1.0, 0.8, noise_level=eta, prev_sample=xp)
    torch.testing.assert_close(
        eps_default.reshape(-1), torch.full((2,), eta * math.sqrt(5.0), dtype=torch.float64)
    )
    # The flow formula at sigma=1 would otherwise divide by zero: everything stays finite.
    assert torch.isfinite(lp).all()


def test_sigma_max_only_used_at_sigma_one():
    v = torch.randn(3, 4, dtype=torch.float64)
    x = torch.randn(3, 4, dtype=torch.float64)
    xp = torch.randn(3, 4, dtype=torch.float64)
    sig = torch.tensor([1.0, 0.7, 0.3], dtype=torch.float64)
    sig_next = torch.tensor([0.9, 0.5, 0.0], dtype=torch.float64)
    out_a = sde_step_with_logprob(v, x, sig, sig_next, sigma_max=0.95, prev_sample=xp)
    out_b = sde_step_with_logprob(v, x, sig, sig_next, sigma_max=0.5, prev_sample=xp)
    assert not torch.allclose(out_a[1][0], out_b[1][0])
    torch.testing.assert_close(out_a[1][1:], out_b[1][1:], rtol=0, atol=0)
    torch.testing.assert_close(out_a[3][1:], out_b[3][1:], rtol=0, atol=0)


def test_per_sample_sigma_equals_separate_float_calls():
    B = 4
    v = torch.randn(B, 2, 3, dtype=torch.float64)
    x = torch.randn(B, 2, 3, dtype=torch.float64)
    xp = torch.randn(B, 2, 3, dtype=torch.float64)
    sig = torch.tensor([1.0, 0.8, 0.5, 0.2], dtype=torch.float64)
    sig_next = torch.tensor([0.85, 0.6, 0.2, 0.0], dtype=torch.float64)
    for fn, kw in [(sde_step_with_logprob, {"sigma_max": 0.85}), (dance_sde_step_with_logprob, {})]:
        _, lp, mean, std = fn(v, x, sig, sig_next, prev_sample=xp, **kw)
        for b in range(B):
            _, lp_b, mean_b, std_b = fn(
                v[b : b + 1],
                x[b : b + 1],
                float(sig[b]),
                float(sig_next[b]),
                prev_sample=xp[b : b + 1],
                **kw,
            )
            torch.testing.assert_close(lp[b : b + 1], lp_b)
            torch.testing.assert_close(mean[b : b + 1], mean_b)
            torch.testing.assert_close(std[b : b + 1], std_b)


def test_sigma_as_zero_dim_tensor_equals_float():
    v, x, xp = (torch.randn(2, 3, dtype=torch.float64) for _ in range(3))
    a = sde_step_with_logprob(v, x, 0.5, 0.25, prev_sample=xp)
    b = sde_step_with_logprob(v, x, torch.tensor(0.5), torch.tensor(0.25), prev_sample=xp)
    for u, w in zip(a, b, strict=True):
        torch.testing.assert_close(u, w)


@pytest.mark.parametrize("sde_type", ["flow", "dance"])
@pytest.mark.parametrize("sigma", [1.0, 0.6])
def test_gradcheck_log_prob_wrt_velocity(sde_type, sigma):
    g = torch.Generator().manual_seed(0)
    v = torch.randn(2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    xp = torch.randn(2, 2, 3, generator=g, dtype=torch.float64)
    sig_next = torch.tensor([0.4, 0.0], dtype=torch.float64)

    def f(vel, smp):
        return sde_step_with_logprob(
            vel, smp, sigma, sig_next, prev_sample=xp, sde_type=sde_type, noise_level=0.8
        )[1]

    assert torch.autograd.gradcheck(f, (v, x))
    assert torch.autograd.gradgradcheck(f, (v, x))


@pytest.mark.parametrize("fn", [sde_step_with_logprob, dance_sde_step_with_logprob])
def test_no_gradient_into_prev_sample(fn):
    v = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 4, dtype=torch.float64)
    xp = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    prev, lp, _, _ = fn(v, x, 0.7, 0.5, prev_sample=xp)
    assert not prev.requires_grad
    lp.sum().backward()
    assert xp.grad is None
    assert v.grad is not None and v.grad.abs().sum() > 0


def test_sampled_step_score_gradient_is_nonzero():
    # x' enters the log-prob detached: the gradient w.r.t. v is (x' - mu)/s^2 * dmu/dv.
    v = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    x = torch.randn(3, 4, dtype=torch.float64)
    _, lp, _, _ = sde_step_with_logprob(v, x, 0.5, 0.3, generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(lp.sum(), v)
    assert grad.abs().sum() > 0


def test_on_policy_ratio_is_one_float32():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(8, 4, 8, 8, generator=g)
    x = torch.randn(8, 4, 8, 8, generator=g)
    sigmas = shifted_sigma_schedule(10, 3.0)
    for i in range(10):
        prev, lp_old, _, _ = sde_step_with_logprob(
            v, x, float(sigmas[i]), float(sigmas[i + 1]), sigma_max=float(sigmas[1]), generator=g
        )
        _, lp_new, _, _ = sde_step_with_logprob(
            v,
            x,
            float(sigmas[i]),
            float(sigmas[i + 1]),
            sigma_max=float(sigmas[1]),
            prev_sample=prev,
        )
        ratio = torch.exp(lp_new - lp_old)
        assert (ratio - 1).abs().max() <= 1e-6
        x = prev


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_compute_in_float32(dtype):
    v = torch.randn(2, 3, 4).to(dtype)
    x = torch.randn(2, 3, 4).to(dtype)
    for fn in (sde_step_with_logprob, dance_sde_step_with_logprob):
        prev, lp, mean, std = fn(v, x, 0.5, 0.4, generator=torch.Generator().manual_seed(0))
        assert prev.dtype == lp.dtype == mean.dtype == std.dtype == torch.float32
        assert torch.isfinite(lp).all()
        _, lp64, _, _ = fn(v.double(), x.double(), 0.5, 0.4, prev_sample=prev.double())
        torch.testing.assert_close(lp.double(), lp64, rtol=1e-5, atol=1e-5)
    assert ode_step(v, x, 0.5, 0.4).dtype == torch.float32


def test_float64_stays_float64_and_mixed_promotes():
    v = torch.randn(2, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float32)
    out = sde_step_with_logprob(v, x, 0.5, 0.4)
    assert all(t.dtype == torch.float64 for t in out)


# --------------------------------------------------------------------------------------------
# DanceGRPO step, ODE step, schedule
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(case=step_case())
def test_dance_step_matches_elementwise_reference(case):
    v, x, noise, sig, sig_next, eta, _ = case
    xp = x + 0.2 * noise
    sig_t = torch.tensor(sig, dtype=torch.float64)
    sig_next_t = torch.tensor(sig_next, dtype=torch.float64)
    _, lp, mean, std_dev_t = dance_sde_step_with_logprob(
        v, x, sig_t, sig_next_t, noise_level=eta, prev_sample=xp
    )
    r_mean, r_lp = ref_dance_step(v, x, xp, sig, sig_next, eta)
    np.testing.assert_allclose(mean.numpy(), r_mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lp.numpy(), r_lp, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(std_dev_t.reshape(-1).numpy(), eta)
    # dispatch through sde_type gives the same
    out = sde_step_with_logprob(
        v, x, sig_t, sig_next_t, noise_level=eta, prev_sample=xp, sde_type="dance"
    )
    torch.testing.assert_close(out[1], lp, rtol=0, atol=0)


def test_dance_sampling_std():
    v = torch.randn(2, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    prev, _, mean, _ = dance_sde_step_with_logprob(
        v, x, 0.8, 0.3, noise_level=0.5, generator=torch.Generator().manual_seed(5)
    )
    xi = torch.randn(2, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    torch.testing.assert_close(prev, mean + 0.5 * math.sqrt(0.5) * xi)


def test_ode_step_formula_and_sde_limit():
    v = torch.randn(3, 2, 2, dtype=torch.float64)
    x = torch.randn(3, 2, 2, dtype=torch.float64)
    sig = torch.tensor([1.0, 0.5, 0.1], dtype=torch.float64)
    sig_next = torch.tensor([0.7, 0.2, 0.0], dtype=torch.float64)
    out = ode_step(v, x, sig, sig_next)
    for b in range(3):
        for idx in np.ndindex(2, 2):
            want = x[b][idx].item() + (sig_next[b].item() - sig[b].item()) * v[b][idx].item()
            assert math.isclose(out[b][idx].item(), want, rel_tol=1e-12, abs_tol=1e-12)
    # eta -> 0 limit of both SDE means is the ODE step
    _, _, m_flow, _ = sde_step_with_logprob(v, x, sig, sig_next, noise_level=1e-7, sigma_max=0.7)
    _, _, m_dance, _ = dance_sde_step_with_logprob(v, x, sig, sig_next, noise_level=1e-7)
    torch.testing.assert_close(m_flow, out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(m_dance, out, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("n", [1, 2, 10, 37])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5, 2.7])
def test_shifted_sigma_schedule(n, shift):
    sig = shifted_sigma_schedule(n, shift, dtype=torch.float64)
    assert sig.shape == (n + 1,)
    assert sig[0].item() == 1.0 and sig[-1].item() == 0.0
    assert (sig[1:] < sig[:-1]).all()
    for i in range(n + 1):
        u = 1.0 - i / n
        assert math.isclose(sig[i].item(), shift * u / (1 + (shift - 1) * u), abs_tol=1e-14)
    if shift == 1.0:
        torch.testing.assert_close(sig, torch.linspace(1, 0, n + 1, dtype=torch.float64))
    f32 = shifted_sigma_schedule(n, shift)
    assert f32.dtype == torch.float32 and f32[0].item() == 1.0 and f32[-1].item() == 0.0


def test_shift_sigmas_float_and_tensor():
    assert math.isclose(shift_sigmas(0.5, 3.0), 1.5 / 2.0)
    t = torch.tensor([0.0, 0.25, 1.0], dtype=torch.float64)
    torch.testing.assert_close(
        shift_sigmas(t, 3.0), torch.tensor([0.0, 0.75 / 1.5, 1.0], dtype=torch.float64)
    )


def test_schedule_drives_a_full_sampler_run():
    sig = shifted_sigma_schedule(10, 3.0)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for i in range(10):
        v = -x  # any velocity field
        x, lp, _, _ = sde_step_with_logprob(
            v, x, sig[i].item(), sig[i + 1].item(), sigma_max=sig[1].item()
        )
        assert torch.isfinite(lp).all() and torch.isfinite(x).all()


# --------------------------------------------------------------------------------------------
# grpo_loss
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(
    data=st.lists(
        st.tuples(st.floats(-0.3, 0.3), st.floats(-0.3, 0.3), st.floats(-8.0, 8.0)),
        min_size=1,
        max_size=8,
    ),
    clip_range=st.sampled_from([0.0, 1e-4, 0.05, 0.2]),
    adv_clip_max=st.sampled_from([0.5, 5.0]),
    beta=st.sampled_from([0.0, 0.04]),
)
def test_grpo_loss_matches_reference(data, clip_range, adv_clip_max, beta):
    lp, old, adv = (list(c) for c in zip(*data, strict=True))
    kl = [abs(a) * 0.1 for a in lp]
    loss, info = grpo_loss(
        torch.tensor(lp, dtype=torch.float64),
        torch.tensor(old, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        clip_range=clip_range,
        adv_clip_max=adv_clip_max,
        kl=torch.tensor(kl, dtype=torch.float64),
        beta=beta,
    )
    r_loss, r_clipfrac = ref_grpo_loss(lp, old, adv, clip_range, adv_clip_max, kl, beta)
    assert math.isclose(loss.item(), r_loss, rel_tol=1e-12, abs_tol=1e-12)
    assert math.isclose(info["clipfrac"].item(), r_clipfrac, abs_tol=1e-12)
    ratios = [math.exp(a - b) for a, b in zip(lp, old, strict=True)]
    assert math.isclose(info["ratio_min"].item(), min(ratios), rel_tol=1e-12)
    assert math.isclose(info["ratio_max"].item(), max(ratios), rel_tol=1e-12)
    assert math.isclose(info["ratio_mean"].item(), sum(ratios) / len(ratios), rel_tol=1e-12)
    approx = 0.5 * sum((a - b) ** 2 for a, b in zip(lp, old, strict=True)) / len(lp)
    assert math.isclose(info["approx_kl"].item(), approx, rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(info["kl"].item(), sum(kl) / len(kl), rel_tol=1e-12)


# (advantage, log ratio, expected loss, expected d loss / d log_prob) with clip_range 0.2.
# Gradient of -A*r w.r.t. log_prob is -A*r; a clipped term has gradient 0.
_CLIP_CASES = [
    (2.0, math.log(1.5), -2.0 * 1.2, 0.0),  # A>0, r above 1+eps: clipped, no push
    (2.0, math.log(0.5), -2.0 * 0.5, -2.0 * 0.5),  # A>0, r below 1-eps: unclipped, pushes up
    (-2.0, math.log(1.5), 2.0 * 1.5, 2.0 * 1.5),  # A<0, r above: unclipped, pushes down
    (-2.0, math.log(0.5), 2.0 * 0.8, 0.0),  # A<0, r below 1-eps: clipped
    (2.0, math.log(1.1), -2.0 * 1.1, -2.0 * 1.1),  # inside the trust region: plain PG
]


@pytest.mark.parametrize(("adv", "log_ratio", "want_loss", "want_grad"), _CLIP_CASES)
def test_grpo_loss_clip_behaviour(adv, log_ratio, want_loss, want_grad):
    # Fails if max/min were swapped (cases 1-4 change value) or the clip were dropped.
    lp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
    loss, info = grpo_loss(
        lp,
        torch.zeros(1, dtype=torch.float64),
        torch.tensor([adv], dtype=torch.float64),
        clip_range=0.2,
    )
    assert math.isclose(loss.item(), want_loss, rel_tol=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    assert math.isclose(grad.item(), want_grad, rel_tol=1e-12, abs_tol=1e-15)
    assert info["clipfrac"].item() == float(abs(math.exp(log_ratio) - 1) > 0.2)


def test_grpo_loss_advantage_clip_and_clipfrac():
    lp = torch.tensor([0.0, 0.0, math.log(1.5), math.log(0.9)])
    old = torch.zeros(4)
    adv = torch.tensor([100.0, -100.0, 1.0, 1.0])
    loss, info = grpo_loss(lp, old, adv, clip_range=0.2, adv_clip_max=5.0)
    # r = [1, 1, 1.5, 0.9]: terms -5, 5, -1.2, -0.9
    assert math.isclose(loss.item(), (-5 + 5 - 1.2 - 0.9) / 4, rel_tol=1e-6)
    assert math.isclose(info["clipfrac"].item(), 0.25)
    assert all(t.ndim == 0 and not t.requires_grad for t in info.values())
    assert set(info) == {
        "policy_loss",
        "approx_kl",
        "clipfrac",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
    }


def test_grpo_loss_gradients_only_into_log_prob_and_kl():
    lp = torch.randn(4, requires_grad=True)
    old = torch.randn(4, requires_grad=True)
    adv = torch.randn(4, requires_grad=True)
    kl = torch.rand(4, requires_grad=True)
    loss, _ = grpo_loss(lp, old, adv, kl=kl, beta=0.1, clip_range=10.0)
    loss.backward()
    assert old.grad is None and adv.grad is None
    torch.testing.assert_close(kl.grad, torch.full((4,), 0.1 / 4))
    assert lp.grad is not None


# --------------------------------------------------------------------------------------------
# kl_to_reference
# --------------------------------------------------------------------------------------------


def test_kl_to_reference_formula_and_gaussian_kl_identity():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    v = torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    v_ref = v + 0.1 * torch.randn(3, 2, 4, generator=g, dtype=torch.float64)
    sig = torch.tensor([1.0, 0.6, 0.3], dtype=torch.float64)
    sig_next = torch.tensor([0.8, 0.4, 0.0], dtype=torch.float64)
    for fn, kw in [(sde_step_with_logprob, {"sigma_max": 0.8}), (dance_sde_step_with_logprob, {})]:
        _, _, mu, eps = fn(v, x, sig, sig_next, **kw)
        _, _, mu_ref, _ = fn(v_ref, x, sig, sig_next, **kw)
        kl = kl_to_reference(mu, mu_ref, eps)
        assert kl.shape == (3,)
        # element loop
        for b in range(3):
            e = eps.reshape(-1)[b].item()
            terms = [
                (mu[b][i].item() - mu_ref[b][i].item()) ** 2 / (2 * e * e) for i in np.ndindex(2, 4)
            ]
            assert math.isclose(kl[b].item(), sum(terms) / len(terms), rel_tol=1e-12)
        # (-dt) x per-step Gaussian KL, averaged over elements
        s = eps * torch.sqrt(sig - sig_next).reshape(eps.shape)
        step_kl = torch.distributions.kl_divergence(
            torch.distributions.Normal(mu, s), torch.distributions.Normal(mu_ref, s)
        )
        torch.testing.assert_close(kl, (sig - sig_next) * step_kl.flatten(1).mean(1))


def test_kl_to_reference_std_forms_and_detached_reference():
    mu = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    a = kl_to_reference(mu, ref, 0.5)
    b = kl_to_reference(mu, ref, torch.tensor(0.5, dtype=torch.float64))
    c = kl_to_reference(mu, ref, torch.full((2,), 0.5))
    d = kl_to_reference(mu, ref, torch.full((2, 1, 1), 0.5))
    for t in (b, c, d):
        torch.testing.assert_close(a, t)
    a.sum().backward()
    assert ref.grad is None and mu.grad is not None


# --------------------------------------------------------------------------------------------
# group advantages
# --------------------------------------------------------------------------------------------


@SETTINGS
@given(
    rewards=st.lists(st.floats(-10, 10), min_size=1, max_size=12),
    n_groups=st.integers(1, 4),
    global_std=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_group_advantages_matches_reference(rewards, n_groups, global_std, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_groups, size=len(rewards)).tolist()
    out = group_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(ids), global_std=global_std
    )
    want = ref_group_advantages(rewards, ids, global_std=global_std)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-9, atol=1e-9)
    # string ids (prompts) give the same
    out_str = group_advantages(
        torch.tensor(rewards, dtype=torch.float64),
        [f"prompt {i}" for i in ids],
        global_std=global_std,
    )
    torch.testing.assert_close(out, out_str, rtol=0, atol=0)


def test_group_advantages_worked_example():
    rewards = torch.tensor([1.0, 3.0, 10.0, 10.0, 5.0])
    ids = ["a", "a", "b", "b", "c"]
    out = group_advantages(rewards, ids)
    # group a: mean 2, std 1; b: constant -> 0; c: singleton -> 0
    torch.testing.assert_close(out, torch.tensor([-1 / 1.0001, 1 / 1.0001, 0.0, 0.0, 0.0]))
    assert out.dtype == torch.float32
    g = group_advantages(rewards, ids, global_std=True)
    sd = float(np.std([1.0, 3.0, 10.0, 10.0, 5.0]))
    torch.testing.assert_close(g, torch.tensor([-1.0, 1.0, 0.0, 0.0, 0.0]) / (sd + 1e-4))
    out64 = group_advantages(rewards.double(), np.array([0, 0, 1, 1, 2]), eps=1e-2)
    assert out64.dtype == torch.float64
    assert math.isclose(out64[0].item(), -1 / 1.01, rel_tol=1e-12)
    assert group_advantages([1.0, 2.0], [0, 0]).dtype == torch.float32


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------

V = torch.randn(2, 3)
X = torch.randn(2, 3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"sigma": 1.5}, ValueError, "sigma must satisfy 0 < sigma <= 1"),
        ({"sigma": 0.0, "sigma_next": 0.0}, ValueError, "sigma must satisfy"),
        ({"sigma": -0.2}, ValueError, "sigma must satisfy"),
        ({"sigma": float("nan")}, ValueError, "sigma must satisfy"),
        ({"sigma_next": 0.6}, ValueError, "sigma_next must satisfy"),
        ({"sigma_next": 0.5}, ValueError, "sigma_next must satisfy"),
        ({"sigma_next": -0.1}, ValueError, "sigma_next must satisfy"),
        ({"sigma": torch.tensor([0.5, 0.5, 0.5])}, ValueError, "sigma has 3 entries"),
        ({"sigma_next": torch.tensor([0.1])}, ValueError, "sigma_next has 1 entries"),
        ({"sigma": torch.full((2, 1), 0.5)}, ValueError, "sigma must be a float"),
        ({"sigma": torch.tensor([0.5, 1.2])}, ValueError, r"sigma must satisfy.*index \[1\]"),
        ({"sigma": "0.5"}, TypeError, "sigma must be a float"),
        ({"sigma": True}, TypeError, "sigma must be a float"),
        ({"noise_level": -0.1}, ValueError, "noise_level must be a finite number > 0"),
        ({"noise_level": float("inf")}, ValueError, "noise_level"),
        ({"noise_level": 0.0}, ValueError, "ode_step"),
        ({"noise_level": "0.7"}, TypeError, "noise_level"),
        ({"sigma_max": 1.0}, ValueError, "sigma_max must satisfy"),
        ({"sigma_max": -0.1}, ValueError, "sigma_max must satisfy"),
        ({"velocity": V.long()}, TypeError, "velocity must be a floating-point"),
        ({"velocity": V.numpy()}, TypeError, "velocity must be a torch.Tensor"),
        ({"sample": torch.randn(2, 4)}, ValueError, "sample must have the same shape"),
        ({"velocity": torch.randn(()), "sample": torch.randn(())}, ValueError, "velocity must"),
        ({"prev_sample": torch.randn(3, 3)}, ValueError, "prev_sample must have the same shape"),
        ({"generator": 0}, TypeError, "generator must be a torch.Generator"),
        ({"sde_type": "ddim"}, ValueError, "sde_type"),
    ],
)
def test_sde_step_bad_input(kwargs, exc, match):
    args = {"velocity": V, "sample": X, "sigma": 0.5, "sigma_next": 0.3}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        sde_step_with_logprob(**args)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"sigma": 1.01}, ValueError, "sigma must satisfy"),
        ({"sigma_next": torch.tensor([0.1, 0.2, 0.3])}, ValueError, "sigma_next has 3"),
        ({"noise_level": 0.0}, ValueError, "ode_step"),
        ({"noise_level": -1.0}, ValueError, "noise_level"),
    ],
)
def test_dance_step_bad_input(kwargs, exc, match):
    args = {"velocity": V, "sample": X, "sigma": 0.5, "sigma_next": 0.3}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        dance_sde_step_with_logprob(**args)


def test_sigmas_that_collide_in_float32_are_rejected():
    # Distinct in float64, equal after rounding to the float32 compute dtype: dt would be 0.
    with pytest.raises(ValueError, match="sigma_next must satisfy.*float32"):
        sde_step_with_logprob(V, X, 0.5, 0.5 - 1e-12)
    with pytest.raises(ValueError, match="sigma must satisfy.*float32"):
        dance_sde_step_with_logprob(V, X, 1e-50, 0.0)
    # The same sigmas are fine for a float64 step.
    _, lp, _, _ = sde_step_with_logprob(V.double(), X.double(), 0.5, 0.5 - 1e-12)
    assert torch.isfinite(lp).all()


def test_ode_step_bad_input():
    with pytest.raises(ValueError, match="sigma_next must satisfy"):
        ode_step(V, X, 0.3, 0.5)
    with pytest.raises(ValueError, match="sigma has 3 entries"):
        ode_step(V, X, torch.tensor([0.5, 0.4, 0.3]), 0.1)


@pytest.mark.parametrize(
    ("args", "kwargs", "exc", "match"),
    [
        ((0, 3.0), {}, ValueError, "num_steps must be >= 1"),
        ((2.5, 3.0), {}, TypeError, "num_steps must be an int"),
        ((10, 0.0), {}, ValueError, "shift must be a finite number > 0"),
        ((10, -1.0), {}, ValueError, "shift"),
        ((10, 3.0), {"dtype": torch.int64}, TypeError, "dtype"),
    ],
)
def test_schedule_bad_input(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        shifted_sigma_schedule(*args, **kwargs)


_LP = torch.zeros(3)


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"log_prob": torch.zeros(3, 1)}, ValueError, r"log_prob must have shape \(B,\)"),
        ({"old_log_prob": torch.zeros(4)}, ValueError, r"old_log_prob must have shape \(3,\)"),
        ({"advantages": torch.zeros(2)}, ValueError, "advantages must have shape"),
        ({"advantages": torch.zeros(3, dtype=torch.long)}, TypeError, "advantages must be a"),
        ({"log_prob": [0.0, 0.0, 0.0]}, TypeError, "log_prob must be a torch.Tensor"),
        ({"log_prob": torch.tensor([0.0, float("nan"), 0.0])}, ValueError, r"log_prob .*\[1\]"),
        ({"old_log_prob": torch.tensor([0.0, 0.0, float("inf")])}, ValueError, "old_log_prob"),
        ({"advantages": torch.tensor([float("nan"), 0.0, 0.0])}, ValueError, "advantages has"),
        ({"kl": torch.tensor([0.0, float("nan"), 0.0])}, ValueError, "kl has non-finite"),
        ({"kl": torch.zeros(2)}, ValueError, "kl must have shape"),
        ({"beta": 0.1}, ValueError, "needs kl"),
        ({"beta": -0.1, "kl": _LP}, ValueError, "beta must be"),
        ({"clip_range": -1e-4}, ValueError, "clip_range must be"),
        ({"clip_range": float("nan")}, ValueError, "clip_range must be"),
        ({"adv_clip_max": 0.0}, ValueError, "adv_clip_max must be"),
    ],
)
def test_grpo_loss_bad_input(kwargs, exc, match):
    args = {"log_prob": _LP, "old_log_prob": _LP, "advantages": _LP}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        grpo_loss(**args)


def test_nan_velocity_cannot_become_a_silent_nan_loss():
    v = V.clone()
    v[1, 0] = float("nan")
    _, lp, _, _ = sde_step_with_logprob(v, X, 0.5, 0.3, prev_sample=X)
    with pytest.raises(ValueError, match=r"log_prob has non-finite entries at batch index \[1\]"):
        grpo_loss(lp, lp.detach(), torch.ones(2))


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"mean": torch.randn(2, 4)}, ValueError, "ref_mean must have the same shape"),
        ({"std_dev_t": 0.0}, ValueError, "std_dev_t must be finite and > 0"),
        ({"std_dev_t": torch.tensor([0.5, float("nan")])}, ValueError, "std_dev_t must be fin"),
        ({"std_dev_t": torch.ones(3)}, ValueError, "std_dev_t must be a float"),
        ({"std_dev_t": torch.ones(2, 3)}, ValueError, "std_dev_t must be a float"),
        ({"std_dev_t": "1"}, TypeError, "std_dev_t must be a float"),
        ({"ref_mean": None}, TypeError, "ref_mean must be a torch.Tensor"),
    ],
)
def test_kl_to_reference_bad_input(kwargs, exc, match):
    args = {"mean": V, "ref_mean": X, "std_dev_t": 0.5}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        kl_to_reference(**args)


@pytest.mark.parametrize(
    ("rewards", "ids", "kwargs", "exc", "match"),
    [
        ([1.0, float("nan"), 2.0], [0, 0, 1], {}, ValueError, r"rewards has non-finite.*\[1\]"),
        (torch.tensor([1.0, float("inf")]), [0, 0], {}, ValueError, "rewards has non-finite"),
        ([1.0, 2.0], [0, 0, 1], {}, ValueError, "group_ids has 3 entries but rewards has 2"),
        ([], [], {}, ValueError, "rewards must have shape"),
        ([[1.0], [2.0]], [0, 1], {}, ValueError, "rewards must have shape"),
        (torch.tensor([1, 2]), [0, 1], {}, TypeError, "rewards must be a floating-point"),
        ([1.0, 2.0], torch.tensor([0.0, 1.0]), {}, TypeError, "group_ids must be an integer"),
        ([1.0, 2.0], "ab", {}, TypeError, "group_ids must be"),
        ([1.0, 2.0], [[0], [1]], {}, TypeError, "group_ids entries must be hashable"),
        ([1.0, 2.0], [0, 1], {"eps": 0.0}, ValueError, "eps must be a finite number > 0"),
        ([1.0, 2.0], [0, 1], {"global_std": 1}, TypeError, "global_std must be a bool"),
    ],
)
def test_group_advantages_bad_input(rewards, ids, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        group_advantages(rewards, ids, **kwargs)
