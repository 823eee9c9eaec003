"""``fold=`` (issue 18): the causal fold's weights, its gradient against a brute-force
reference on every path (eager, deferred, adaptive), its exactness family, the Triton mix
kernel with causal weights, and the group-fair adaptive planner's scale invariance."""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
from fields import MLPField, causal_reference, params_grad, rel_err
from fields import spread_timesteps as _t
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from jagg_autograd import (
    CosineRouter,
    causal_layout,
    jagg_mix,
    jagg_mix_ref,
    jagg_trajectory,
    jagg_window,
    trajectory_layout,
)
from jagg_autograd.planner import (
    FOLDS,
    adaptive_choice,
    interpolation_weights,
    make_plan,
    proxy_cost,
    segment_costs,
)

F64 = torch.float64


def test_folds_and_causal_weights_of_a_mask():
    assert FOLDS == ("linear", "causal")
    t = torch.tensor([1.0, 0.8, 0.5, 0.4, 0.0], dtype=F64).unsqueeze(1).expand(5, 2)
    mask = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.bool)
    wc, wn = interpolation_weights(mask, t, "causal")
    # Every step onto the anchor at or before it, weight 1; before the first anchor 0.
    torch.testing.assert_close(wc[:, 0], torch.tensor([1, 1, 1, 1, 1], dtype=F64))
    torch.testing.assert_close(wc[:, 1], torch.tensor([0, 1, 1, 1, 1], dtype=F64))
    assert not wn.any()
    # The default stays JAGG's linear fold.
    lin = interpolation_weights(mask, t)
    torch.testing.assert_close(lin[1][:, 0], torch.tensor([0, 0.4, 0, 0.2, 0], dtype=F64))


def test_fold_is_validated_before_any_model_call():
    calls = []

    def model(z, t):
        calls.append(1)
        return z * t.view(-1, 1)

    lat = torch.randn(4, 2, 3, dtype=F64)
    t = _t(4)
    for bad in ("cubic", "Linear", None, 1):
        with pytest.raises(ValueError, match="fold"):
            jagg_trajectory(model, lat, t, window=3, fold=bad)
        with pytest.raises(ValueError, match="fold"):
            jagg_window(model, lat, t, fold=bad)
    with pytest.raises(ValueError, match="fold"):
        interpolation_weights(torch.ones(3, 1, dtype=torch.bool), _t(3)[:, None], "nearest")
    assert calls == []


@settings(max_examples=30 if os.environ.get("CI") else 200, deadline=None)
@given(T=st.integers(1, 40), data=st.data())
def test_causal_layout_partitions_the_steps_shorter_segments_last(T, data):
    n = data.draw(st.integers(1, T))
    anchors, windows = causal_layout(T, n)
    assert anchors[0] == 0 and len(anchors) == n
    assert all(a < b for a, b in zip(anchors, anchors[1:]))
    # The windows partition 0..T-1, each starting at its anchor (the steps folded onto it).
    assert [w[0] for w in windows] == anchors and windows[-1][1] == T - 1
    assert all(hi + 1 == lo for (_, hi), (lo, _) in zip(windows, windows[1:]))
    lengths = [hi - lo + 1 for lo, hi in windows]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # the shorter segments last


def test_causal_layout_values_and_bad_input():
    assert causal_layout(5, 2) == ([0, 3], [(0, 2), (3, 4)])
    assert causal_layout(5, 3) == ([0, 2, 4], [(0, 1), (2, 3), (4, 4)])
    assert causal_layout(10, 4) == ([0, 3, 6, 8], [(0, 2), (3, 5), (6, 7), (8, 9)])
    assert causal_layout(7, 1) == ([0], [(0, 6)])
    for T, n in ((5, 0), (5, 6), (0, 1)):
        with pytest.raises(ValueError, match="causal_layout"):
            causal_layout(T, n)
    with pytest.raises(TypeError, match="n_anchors"):
        causal_layout(5, 2.0)


def test_explicit_anchors_replace_the_window_layout():
    model = MLPField(3, seed=2)
    gen = torch.Generator().manual_seed(2)
    T, B = 10, 2
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    t = _t(T)
    window_anchors = trajectory_layout(T, 4, True)[0]  # [0, 3, 6, 9]

    def stats(**kw):
        return jagg_trajectory(model, lat, t, window=4, return_stats=True, **kw)[1]

    # Without anchors= every fold runs the window layout (the causal fold too: on a whole
    # trajectory its end anchor holds the largest upstream gradient exactly).
    assert stats().anchors == stats(fold="causal").anchors == window_anchors
    causal = causal_layout(T, 4)[0]  # [0, 3, 6, 8]
    st_ = stats(fold="causal", anchors=causal)
    assert st_.anchors == causal and st_.windows == [(0, 2), (3, 5), (6, 7), (8, 9)]
    assert stats(fold="causal", anchors=torch.tensor(causal)).anchors == causal
    st_ = stats(anchors=[0, 2, 9])  # linear: consecutive anchors bound the windows
    assert st_.anchors == [0, 2, 9] and st_.windows == [(0, 2), (2, 9)]
    # The window layout given explicitly is the window layout: the same gradient.
    up = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    for fold in FOLDS:
        a = jagg_trajectory(model, lat, t, window=4, fold=fold)
        b = jagg_trajectory(model, lat, t, window=4, fold=fold, anchors=window_anchors)
        ga = params_grad((a * up).sum(), model)
        assert rel_err(params_grad((b * up).sum(), model), ga) == 0.0
    # jagg_window: the latents are one window, anchored at both ends, whatever the fold.
    st_ = jagg_window(model, lat[:5], t[:5], fold="causal", return_stats=True)[1]
    assert st_.anchors == [0, 4]


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"anchors": [1, 9]}, ValueError, "starting at 0"),
        ({"anchors": [0, 6, 3, 9]}, ValueError, "strictly increasing"),
        ({"anchors": [0, 3, 3, 9]}, ValueError, "strictly increasing"),
        ({"anchors": [0, 10]}, ValueError, r"\[0, T-1=9\]"),
        ({"anchors": [0, 3, 6]}, ValueError, "ending at T-1=9"),  # linear needs T-1
        ({"anchors": []}, ValueError, "anchors"),
        ({"anchors": [0.0, 9.0]}, TypeError, "anchors"),
        ({"anchors": "09"}, TypeError, "anchors"),
        ({"anchors": torch.tensor([[0, 9]])}, TypeError, "anchors"),
        ({"anchors": torch.tensor([True, False])}, TypeError, "anchors"),
        ({"anchors": [0, True]}, TypeError, "anchors"),  # a bool is not a step
        ({"anchors": [0, 9], "placement": "adaptve"}, ValueError, "placement"),
        ({"anchors": [0, 9], "router": CosineRouter(threshold=0.5)}, ValueError, "router"),
        ({"anchors": [0, 9], "placement": "adaptive", "deferred": True}, ValueError,
         "placement"),
    ],
)  # fmt: skip
def test_explicit_anchors_are_validated_before_any_model_call(kw, err, match):
    calls = []

    def model(z, t):
        calls.append(1)
        return z

    lat = torch.randn(10, 2, 3, dtype=F64)
    with pytest.raises(err, match=match):
        jagg_trajectory(model, lat, _t(10), window=4, **kw)
    assert not calls
    # The causal fold needs no end anchor; numpy and tensor integers are steps.
    assert jagg_trajectory(model, lat, _t(10), window=4, fold="causal", anchors=[0, 3]).shape
    assert jagg_trajectory(model, lat, _t(10), window=4, anchors=np.array([0, 4, 9])).shape
    assert jagg_trajectory(model, lat, _t(10), window=4, anchors=torch.tensor([0, 9])).shape


@pytest.mark.parametrize("fold,anchors", [("causal", [0, 3]), ("linear", [0, 2, 9])])
def test_gradient_fidelity_checks_explicit_anchors(fold, anchors):
    """gradient_fidelity(anchors=) compares the gradient the explicit layout gives (the
    trainer's on a prefix) with the exact one; its windows follow the anchors."""
    from jagg_autograd import gradient_fidelity

    model = MLPField(3, seed=2)
    g = torch.Generator().manual_seed(5)
    lat = torch.randn(10, 3, 3, generator=g, dtype=F64)
    up = torch.randn(10, 3, 3, generator=g, dtype=F64)
    t = _t(10)
    ps = [p for p in model.parameters()]

    def grads(**kw):
        v = jagg_trajectory(model, lat, t, window=4, **kw)
        return torch.cat([x.flatten() for x in torch.autograd.grad((v * up).sum(), ps)])

    ex, jg = grads(mode="exact"), grads(fold=fold, anchors=anchors)
    rep = gradient_fidelity(model, lat, t, up, window=4, fold=fold, anchors=anchors)
    want = float(torch.nn.functional.cosine_similarity(ex, jg, dim=0))
    assert rep.cosine == pytest.approx(want, rel=1e-9)
    assert rep.cosine != pytest.approx(
        gradient_fidelity(model, lat, t, up, window=4, fold=fold).cosine, rel=1e-6
    )  # the window layout's is another gradient
    ends = [*anchors[1:], 10] if fold == "causal" else anchors[1:]
    lo = anchors if fold == "causal" else anchors[:-1]
    hi = [e - 1 for e in ends] if fold == "causal" else ends
    assert rep.windows == list(zip(lo, hi))
    calls = []

    def counted(z, tt):
        calls.append(1)
        return model(z, tt)

    with pytest.raises(ValueError, match="window="):
        gradient_fidelity(counted, lat[:4], t[:4], up[:4], params=ps, anchors=[0, 3])
    with pytest.raises(ValueError, match="router"):
        gradient_fidelity(counted, lat, t, up, params=ps, window=4, anchors=anchors,
                          fold=fold, router=CosineRouter(threshold=0.5))  # fmt: skip
    assert not calls


def test_trainer_places_causal_anchors_on_a_prefix_only():
    """The JAGG estimator passes causal_layout's anchors for the causal fold on a prefix of
    the sampler's steps (timestep_fraction < 1), the window layout elsewhere."""
    import dataclasses

    from jagg_autograd.estimators import Minibatch
    from jagg_autograd.runlog import describe_method
    from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

    tiny = dict(steps=1, prompts_per_step=2, group_size=2, num_steps=10, window=4,
                eval_per_digit=0, grid_samples=0, progress=False)  # fmt: skip

    def anchors(steps, **kw):
        tr = GRPOTrainer(GRPOConfig(**tiny, **kw))
        out = tr.estimator.causal_anchors(Minibatch(_Traj(10), torch.zeros(4), steps))
        # The run's log line names the layout exactly where the run uses it.
        words = describe_method(dataclasses.asdict(tr.config))
        assert ("causal_layout anchors" in words) == (out is not None), words
        return out

    # The window layout's count over the trained steps, placed by causal_layout.
    assert anchors((0, 5), fold="causal", timestep_fraction=0.5) == [0, 2, 4]  # 0, 3, 4
    assert anchors((0, 7), fold="causal", timestep_fraction=0.7) == [0, 3, 5]  # 0, 3, 6
    tiny["window"] = 5  # the shapes study's: 2 anchors of 5 steps
    assert anchors((0, 5), fold="causal", timestep_fraction=0.5) == [0, 3]  # 0, 4
    assert anchors((0, 10), fold="causal") is None  # reaches the last step: window layout
    assert anchors((0, 5), timestep_fraction=0.5) is None  # linear fold
    assert anchors((0, 5), fold="causal", mode="router", timestep_fraction=0.5) is None
    assert anchors(torch.zeros(5, 4, dtype=torch.long), fold="causal",
                   timestep_fraction=0.5, timestep_selection="random") is None  # fmt: skip
    assert anchors((0, 5), fold="causal", timestep_fraction=0.5, placement="adaptive") is None


def test_trainer_runs_the_causal_anchors_it_places(monkeypatch):
    """The anchors the estimator decides reach the core call of a real minibatch (window 5
    over the first 5 of 10 steps: {0, 3}); training every step passes none."""
    import jagg_autograd.rollout as rollout
    from jagg_autograd.estimators import Minibatch
    from jagg_autograd.grpo import group_advantages
    from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

    seen = []
    real = rollout.jagg_trajectory  # the estimator's core call goes through rollout

    @functools.wraps(real)
    def spy(*args, **kw):
        seen.append(kw.get("anchors"))
        return real(*args, **kw)

    monkeypatch.setattr(rollout, "jagg_trajectory", spy)
    for frac, want in ((0.5, [0, 3]), (1.0, None)):
        tr = GRPOTrainer(GRPOConfig(steps=1, prompts_per_step=2, group_size=2, num_steps=10,
                                    window=5, fold="causal", timestep_fraction=frac,
                                    eval_per_digit=0, grid_samples=0, progress=False))  # fmt: skip
        g = torch.Generator().manual_seed(0)
        prompts, groups = tr._group(tr.task.sample_prompts(2, g))
        traj = tr._sample(prompts, g)
        adv = group_advantages(tr.task.reward(traj.latents[-1], prompts), groups)
        mb = Minibatch(traj, adv, tr.estimator.train_steps(traj.batch_size, g))
        seen.clear()
        res = tr.estimator.loss(tr, mb, generator=g, on_policy=True, inline_backward=True)
        if not res.backward_done:
            res.loss.backward()
        assert seen and all(a == want for a in seen), (frac, seen)


class _Traj:
    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps


# adaptive placement chooses its own anchors (anchors= is refused with it)
@pytest.mark.parametrize(
    ("path", "layout"),
    [(p, lay) for p in ("eager", "deferred", "values+deferred") for lay in ("window", "causal")]
    + [("adaptive", "window")],
)
def test_causal_fold_equals_brute_force(path, layout):
    model = MLPField(3, seed=4)
    gen = torch.Generator().manual_seed(4)
    T, B = 9, 3
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    up = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    t = _t(T)
    kw: dict = {}
    if path != "eager":
        kw["deferred"] = True
    if path in ("values+deferred", "adaptive"):
        with torch.no_grad():
            kw["values"] = jagg_trajectory(model, lat, t, window=4)
    if path == "adaptive":
        kw.update(placement="adaptive", budget=3.5)
    # The window layout (0, 3, 6, 8) or its count placed for the causal fold (0, 3, 5, 7).
    want_anchors = [0, 3, 6, 8] if layout == "window" else causal_layout(T, 4)[0]
    extra = {"anchors": want_anchors} if layout == "causal" else {}
    v, st_ = jagg_trajectory(model, lat, t, window=4, fold="causal", return_stats=True, **kw,
                             **extra)  # fmt: skip
    got = params_grad((v * up).sum(), model)
    mask = st_.anchor_mask
    if path != "adaptive":
        assert st_.anchors == want_anchors
        assert mask[want_anchors].all() and int(mask.sum()) == 4 * B
    if layout == "causal":
        assert st_.windows == [(0, 2), (3, 4), (5, 6), (7, 8)]
    want = causal_reference(model, lat, t, up, mask)
    assert rel_err(got, want) < 1e-12
    # ... and it is not the linear fold's gradient (linear: the window layout).
    v = jagg_trajectory(model, lat, t, window=4, **kw)
    assert rel_err(params_grad((v * up).sum(), model), want) > 1e-3


class ConstantJacobianField(nn.Module):
    """f(z, t) = phi(z, t) + c(theta): nonlinear in (z, t) but parameter-free there, so
    J = dc/dtheta is the same at every step: the causal fold is exact (any anchors)."""

    def __init__(self, d: int, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("R", torch.randn(d, d, generator=g, dtype=F64))
        self.a = nn.Parameter(torch.randn(d, generator=g, dtype=F64))
        self.M = nn.Parameter(0.3 * torch.randn(d, d, generator=g, dtype=F64))

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shape = z.shape
        x = z.reshape(shape[0], -1, self.R.shape[0])
        phi = torch.tanh(x @ self.R + t.view(-1, 1, 1)) * x
        c = torch.sin(self.M) @ torch.exp(self.a)
        return (phi + c).reshape(shape)


@settings(max_examples=25, deadline=None)
@given(st.integers(3, 9), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_causal_fold_is_exact_where_the_jacobian_is_constant(T, B, seed):
    f = ConstantJacobianField(3, seed=seed % 997)
    gen = torch.Generator().manual_seed(seed)
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    up = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    t = _t(T)
    ex = params_grad((jagg_trajectory(f, lat, t, window=2, mode="exact") * up).sum(), f)
    for kw in ({}, {"deferred": True}, {"deferred": True, "placement": "adaptive", "budget": 2}):
        got = params_grad(
            (jagg_trajectory(f, lat, t, window=min(3, T), fold="causal", **kw) * up).sum(), f
        )
        assert rel_err(got, ex) < 1e-10, kw


def test_causal_fold_is_not_exact_on_the_linear_family():
    # f = phi(z) + a + t b: J affine in t. The linear fold is exact, the causal one not:
    # the test above cannot pass by ignoring the fold.
    from fields import SeparableField

    f = SeparableField(3, seed=1)
    gen = torch.Generator().manual_seed(1)
    T, B = 8, 2
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    up = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    t = _t(T)
    ex = params_grad((jagg_trajectory(f, lat, t, window=2, mode="exact") * up).sum(), f)
    lin = params_grad((jagg_trajectory(f, lat, t, window=4) * up).sum(), f)
    cau = params_grad((jagg_trajectory(f, lat, t, window=4, fold="causal") * up).sum(), f)
    assert rel_err(lin, ex) < 1e-10 < 1e-3 < rel_err(cau, ex)


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("T,B,N,seed", [(2, 1, 1, 0), (9, 3, 63, 1), (10, 5, 100, 2)])
def test_mix_kernel_with_causal_weights(dtype, T, B, N, seed):
    pytest.importorskip("triton")
    dev = torch.device(os.environ.get("JAGG_TEST_DEVICE", "cpu"))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, B, generator=g) < 0.4
    mask[0, 0] = True
    wc, wn = interpolation_weights(mask, _t(T)[:, None].expand(T, B), "causal")
    grad = torch.randn(T, B, N, generator=g).to(dtype)
    # Brute force: each anchor pair gets its own g plus every later step's up to the next.
    want = torch.zeros(int(mask.sum()), N, dtype=F64)
    rows = torch.full((T, B), -1, dtype=torch.long)
    rows[mask] = torch.arange(int(mask.sum()))
    for b in range(B):
        r = -1
        for k in range(T):
            r = int(rows[k, b]) if mask[k, b] else r
            if r >= 0:
                want[r] += grad[k, b].double()
    ref = jagg_mix_ref(grad, wc, wn, mask)
    got = jagg_mix(grad.to(dev), wc.to(dev), wn.to(dev), mask.to(dev), backend="triton")
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(ref.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol)


def test_causal_proxy_matches_direct_residuals():
    gen = torch.Generator().manual_seed(2)
    T, B, N = 7, 3, 5
    v = torch.randn(T, B, N, generator=gen, dtype=F64).cumsum(0) + 3.0
    g = torch.randn(T, B, N, generator=gen, dtype=F64)
    t = _t(T)[:, None].expand(T, B)
    C = segment_costs(v, g, t, "causal")
    for p, q in [(0, 6), (1, 4), (2, 5)]:
        mask = torch.zeros(T, B, dtype=torch.bool)
        mask[[p, q]] = True
        sub = slice(p, q + 1)
        want = proxy_cost(v[sub], g[sub], t[sub], mask[sub], "causal")
        torch.testing.assert_close(C[:, p, q], want, rtol=1e-9, atol=1e-9)
    ch = adaptive_choice(v, g, t, total=3 * B + 1, fold="causal")
    torch.testing.assert_close(
        proxy_cost(v, g, t, ch.mask, "causal"), ch.cost, rtol=1e-9, atol=1e-9
    )


# ------------------------------------------------------------- group-fair: scale invariance


def _planner_case(T: int, B: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(T, B, 6, generator=gen, dtype=F64).cumsum(0)
    g = torch.randn(T, B, 6, generator=gen, dtype=F64) * torch.rand(
        T, B, 1, generator=gen, dtype=F64
    )
    g = g * torch.exp(2 * torch.randn(1, B, 1, generator=gen, dtype=F64))  # |A|-like scales
    t = _t(T)[:, None].expand(T, B).contiguous()
    return v, g, t


@pytest.mark.parametrize("c", [1e-3, 1e3])
@pytest.mark.parametrize("fold", FOLDS)
def test_scaling_one_samples_gradient_changes_no_decision(c, fold):
    T, B = 10, 8
    v, g, t = _planner_case(T, B, 5)
    for total in (2 * B, 3 * B, 3 * B + 3, 4 * B + 5, 7 * B + 1):
        base = adaptive_choice(v, g, t, total, fold=fold)
        assert int(base.counts.sum()) == total
        assert int(base.counts.max() - base.counts.min()) <= 1  # equal counts (+ remainder)
        for j in range(B):
            g2 = g.clone()
            g2[:, j] *= c
            ch = adaptive_choice(v, g2, t, total, fold=fold)
            assert torch.equal(ch.counts, base.counts), (total, j)
            assert torch.equal(ch.mask, base.mask), (total, j)


def test_the_old_greedy_split_did_depend_on_the_scale():
    # The reason for the change (and proof that the test above can fail).
    T, B = 10, 8
    v, g, t = _planner_case(T, B, 5)
    base = adaptive_choice(v, g, t, 4 * B, _greedy=True)
    g2 = g.clone()
    j = int(base.counts.argmin())
    g2[:, j] *= 1e3
    ch = adaptive_choice(v, g2, t, 4 * B, _greedy=True)
    assert int(ch.counts[j]) > int(base.counts[j])


@settings(max_examples=40, deadline=None)
@given(
    st.integers(3, 9),
    st.integers(1, 6),
    st.floats(2.0, 9.0),
    st.integers(0, 2**31 - 1),
    st.floats(-3.0, 3.0),
    st.sampled_from(FOLDS),
)
def test_adaptive_decisions_are_scale_free(T, B, budget, seed, log_c, fold):
    v, g, t = _planner_case(T, B, seed)
    # Some samples start later / end earlier / have no gradient: the active ranges.
    gen = torch.Generator().manual_seed(seed + 1)
    for b in range(B):
        r = int(torch.randint(0, 4, (1,), generator=gen))
        if r == 1:
            g[0, b] = 0
        elif r == 2:
            g[-1, b] = 0
        elif r == 3 and B > 1 and b == 0:
            g[:, b] = 0
    total = round(min(budget, T) * B)
    base = adaptive_choice(v, g, t, total, fold=fold)
    j = seed % B
    g2 = g.clone()
    g2[:, j] *= 10.0**log_c
    ch = adaptive_choice(v, g2, t, total, fold=fold)
    assert torch.equal(ch.counts, base.counts)
    assert torch.equal(ch.mask, base.mask)
    # Samples with the same active span get the same count, up to the remainder's one.
    act = g.reshape(T, B, -1).ne(0).any(-1).sum(0)
    for n in act.unique().tolist():
        same = base.counts[act == n]
        assert int(same.max() - same.min()) <= 1
    # The plan of the choice is well formed: every anchor pair has a row.
    plan = make_plan(base.mask, t, fold=fold)
    assert plan.n_rows == int(base.mask.sum())
