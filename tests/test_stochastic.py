"""placement="stochastic": nested causal layouts with random promotion.

Its gradient against a brute-force reference (one VJP per (step, sample) pair with the
1/pi weights), its expectation over the draw (exactly the next layout's causal fold, for
one fixed batch), the planner's decisions (counts, spans, the draw alone deciding who is
promoted), the validation of its arguments, and the trainer's use of the run's generator.
"""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from fields import MLPField, causal_reference, params_grad, rel_err
from fields import spread_timesteps as _t
from hypothesis import given, settings
from hypothesis import strategies as st

from jagg_autograd import CosineRouter, causal_layout, jagg_trajectory
from jagg_autograd.config import GRPOConfig
from jagg_autograd.planner import (
    PROXY_FLOOR,
    apply_promotion,
    base_layout,
    make_plan,
    promotion_probabilities,
    stochastic_choice,
    systematic_sample,
)

F64 = torch.float64


def _case(T: int, B: int, seed: int, zero: dict[int, slice] | None = None):
    model = MLPField(3, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    up = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    for b, sl in (zero or {}).items():
        up[sl, b] = 0.0
    with torch.no_grad():
        values = jagg_trajectory(model, lat, _t(T), window=2)
    return model, lat, up, values


def _run(model, lat, up, values, budget, seed, promotion="uniform"):
    """The stochastic call's parameter gradient of sum(v * up), its anchors, and every
    sample's promotion probability (the planner's, re-drawn from the same stream and
    checked to give the same anchors)."""
    T, B = lat.shape[:2]
    v, stats = jagg_trajectory(
        model, lat, _t(T), window=2, fold="causal", deferred=True, values=values,
        placement="stochastic", budget=budget, return_stats=True, promotion=promotion,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    grad = params_grad((v * up).sum(), model)  # the plan, and stats.anchor_mask, come here
    draw = torch.rand(B + 1, generator=torch.Generator().manual_seed(seed))
    ch = stochastic_choice(up, budget, draw, promotion=promotion, values=values,
                           t64=_t(T)[:, None].expand(T, B))  # fmt: skip
    assert torch.equal(ch.mask, stats.anchor_mask)
    return grad, stats.anchor_mask, ch.pi


def _reference(model, lat, up, mask, budget, pi=None):
    """Brute force from the definition: per sample, the base layout's held Jacobians, plus
    for the promoted samples (1/pi_b) (F - F_base) on the promoted anchor's segment (pi:
    (B,), default budget - floor(budget) for all); which samples are promoted is read off
    the mask."""
    T, B = mask.shape
    t = _t(T)
    L = int(budget)
    frac = budget - L
    nz = up.flatten(2).ne(0).any(-1)  # (T, B)
    act = [nz[:, b].nonzero().flatten().tolist() for b in range(B)]
    spans = [(a[0], a[-1] - a[0] + 1) if a else (0, 0) for a in act]
    promotable = [n > L and frac > 0 for _, n in spans]
    promoted = [p and int(mask[:, b].sum()) == L + 1 for b, p in enumerate(promotable)]
    pis = [frac] * B if pi is None else pi.tolist()

    def vjp(a, k, b, w):
        v = model(lat[a, b : b + 1], t[a : a + 1])
        return w * params_grad((v * up[k, b : b + 1]).sum(), model)

    total = torch.zeros_like(params_grad((model(lat[0, :1], t[:1]) * 0).sum(), model))
    for b, (f, n) in enumerate(spans):
        if n == 0:
            continue
        if n <= L:  # every active step an anchor: exact
            for k in range(f, f + n):
                total += vjp(k, k, b, 1.0)
            continue
        if frac == 0:  # an integer budget: the L-anchor layout, nothing promoted
            full = [f + a for a in causal_layout(n, L)[0]] + [T]
        else:
            full = [f + a for a in causal_layout(n, L + 1)[0]]
        base, extra = full[:-1], full[-1]
        for k in range(f, f + n):
            p = max(a for a in base if a <= k)
            if promoted[b] and k >= extra:
                inv_pi = 1.0 / pis[b]
                total += vjp(p, k, b, 1.0 - inv_pi) + vjp(extra, k, b, inv_pi)
            else:
                total += vjp(p, k, b, 1.0)
    return total


@pytest.mark.parametrize(
    ("T", "B", "budget", "zero"),
    [
        (5, 4, 2.5, None),
        (7, 5, 2.4, {1: slice(4, None), 3: slice(None, None)}),  # a short and an empty sample
        (9, 3, 3.7, {0: slice(0, 2)}),  # a sample whose active span starts late
        (6, 6, 1.5, {2: slice(1, None)}),  # one active step: exact
        (5, 1, 2.5, None),  # frac * n_p < 1: promoted with probability 0.5
        (7, 4, 3.0, {0: slice(5, None)}),  # an integer budget: the 3-anchor layout
        (8, 3, 2.5, {1: slice(2, 4)}),  # a gap of zero g inside a span
    ],
)
@pytest.mark.parametrize("promotion", ["uniform", "proxy"])
def test_stochastic_gradient_equals_brute_force(T, B, budget, zero, promotion):
    model, lat, up, values = _case(T, B, seed=T + B, zero=zero)
    if promotion == "proxy":  # advantages of very different sizes: the proxy follows them
        up = up * torch.linspace(0.1, 3.0, B, dtype=F64).view(1, B, 1, 1)
    for seed in (0, 1, 2):
        got, mask, pi = _run(model, lat, up, values, budget, seed, promotion)
        if promotion == "uniform":
            assert torch.all((pi == 0) | (pi == budget - int(budget)))
            pi = None
        want = _reference(model, lat, up, mask, budget, pi)
        assert rel_err(got, want) < 1e-12


@pytest.mark.parametrize(
    ("T", "B", "budget", "zero"),
    [(5, 4, 2.5, None), (7, 4, 1.5, None), (8, 4, 3.25, {1: slice(0, 2)}), (5, 1, 2.5, None),
     (6, 3, 2.4, {2: slice(3, 4)})],
)  # fmt: skip
def test_expectation_over_the_draw_is_the_next_causal_layout(T, B, budget, zero):
    """Over the draw -- every promoted subset, weighted by its probability (m = floor or
    ceil of frac * n_p, the subset uniform given m) -- the gradient is the (L+1)-anchor
    causal fold's for this batch, to round-off; no single draw is."""
    model, lat, up, values = _case(T, B, seed=3, zero=zero)
    L, frac = int(budget), budget - int(budget)
    nz = up.flatten(2).ne(0).any(-1)
    spans = [nz[:, b].nonzero().flatten().tolist() for b in range(B)]
    promotable = [b for b in range(B) if spans[b] and spans[b][-1] - spans[b][0] + 1 > L]
    lo = int(frac * len(promotable))
    p_hi = frac * len(promotable) - lo
    by_subset: dict[tuple[int, ...], torch.Tensor] = {}
    for seed in range(120):
        g, mask, _ = _run(model, lat, up, values, budget, seed)
        key = tuple(b for b in promotable if int(mask[:, b].sum()) == L + 1)
        by_subset.setdefault(key, g)
    want_keys = [c for m in (lo, lo + 1) if (m == lo or p_hi > 0) and m <= len(promotable)
                 for c in itertools.combinations(promotable, m)]  # fmt: skip
    assert sorted(by_subset) == sorted(want_keys)
    mean = sum(
        ((1 - p_hi) if len(k) == lo else p_hi) / math.comb(len(promotable), len(k)) * g
        for k, g in by_subset.items()
    )
    # The (L+1)-anchor causal fold over each sample's own active steps, brute force.
    full = torch.zeros((T, B), dtype=torch.bool)
    for b in range(B):
        if spans[b]:
            n = spans[b][-1] - spans[b][0] + 1
            for a in causal_layout(n, min(L + 1, n))[0]:
                full[spans[b][0] + a, b] = True
    want = causal_reference(model, lat, _t(lat.shape[0]), up, full)
    assert rel_err(mean, want) < 1e-12
    assert min(rel_err(g, want) for g in by_subset.values()) > 1e-4


def test_an_integer_budget_is_the_causal_layout_with_nothing_drawn():
    model, lat, up, values = _case(7, 3, seed=5)
    g0, m0, _ = _run(model, lat, up, values, 3.0, 0)
    g1, m1, _ = _run(model, lat, up, values, 3.0, 1)
    assert torch.equal(m0, m1) and torch.equal(g0, g1)
    assert m0.nonzero()[:, 0].unique().tolist() == causal_layout(7, 3)[0]
    v = jagg_trajectory(model, lat, _t(7), window=2, fold="causal", deferred=True,
                        values=values, anchors=causal_layout(7, 3)[0])  # fmt: skip
    assert rel_err(g0, params_grad((v * up).sum(), model)) < 1e-12


@settings(max_examples=25 if os.environ.get("CI") else 150, deadline=None)
@given(T=st.integers(1, 12), B=st.integers(1, 9), data=st.data())
def test_planner_counts_spans_and_scale_freedom(T, B, data):
    budget = data.draw(st.floats(1.0, float(T)))
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    up = torch.randn(T, B, 3, generator=gen, dtype=F64)
    for b in range(B):  # random active spans, some empty
        lo = data.draw(st.integers(0, T))
        hi = data.draw(st.integers(lo, T))
        up[:lo, b] = 0.0
        up[hi:, b] = 0.0
    draw = torch.rand(B + 1, generator=gen)
    ch = stochastic_choice(up, budget, draw)
    L = int(budget)
    frac = budget - L
    nz = up.ne(0).any(-1)
    n_p = 0
    for b in range(B):
        act = nz[:, b].nonzero().flatten().tolist()
        anchors = ch.mask[:, b].nonzero().flatten().tolist()
        if not act:
            assert anchors == []
            continue
        assert anchors[0] == act[0] and anchors[-1] <= act[-1]
        n = act[-1] - act[0] + 1
        if n <= L:
            assert anchors == list(range(act[0], act[-1] + 1))
        elif frac == 0:
            assert anchors == [act[0] + a for a in causal_layout(n, L)[0]]
        else:
            n_p += 1
            full = [act[0] + a for a in causal_layout(n, L + 1)[0]]
            assert anchors in (full[:-1], full)  # nested: the base is the full minus its last
    promoted = ch.b.tolist()
    assert len(promoted) in (int(frac * n_p), int(frac * n_p) + 1)
    assert len(promoted) <= n_p and len(set(promoted)) == len(promoted)
    assert torch.equal(ch.pi, torch.where(ch.pi > 0, torch.full_like(ch.pi, frac), 0.0))
    assert int((ch.pi > 0).sum()) == (n_p if frac else 0)
    assert torch.all(ch.inv_pi == 1.0 / frac) if frac else ch.inv_pi.numel() == 0
    assert torch.equal(ch.fold_k, ch.k) and torch.equal(ch.fold_b, ch.b)
    assert torch.all(ch.fold_w == 1.0)
    for b, k, base in zip(promoted, ch.k.tolist(), ch.fold_dst.tolist()):
        anchors = ch.mask[:, b].nonzero().flatten().tolist()
        assert len(anchors) == L + 1 and anchors[-1] == k and anchors[-2] == base
    # The promoted subset is the draw's alone: rescaling any sample's g (an advantage)
    # changes nothing.
    scale = torch.exp(torch.randn(B, generator=gen, dtype=F64) * 3)
    ch2 = stochastic_choice(up * scale[None, :, None], budget, draw)
    assert torch.equal(ch.mask, ch2.mask) and torch.equal(ch.b, ch2.b)


def test_apply_promotion_reweights_rows():
    T, B = 5, 2
    up = torch.ones(T, B, 1, dtype=F64)
    # pi = 0.5 each, order (0, 1), offset 0.25: the point 0.25 falls in sample 0's [0, 0.5)
    ch = stochastic_choice(up, 2.5, torch.tensor([0.1, 0.9, 0.25]))
    assert ch.b.tolist() == [0] and ch.inv_pi.tolist() == [2.0]
    plan = make_plan(ch.mask, _t(T)[:, None].expand(T, B), fold="causal", promoted=ch)
    rows = torch.arange(plan.n_rows, dtype=F64)[:, None] + 1.0
    out = apply_promotion(rows, plan)
    src, _, fsrc, dst, fw, finv = plan.promotion
    assert torch.equal(fsrc, src) and fw.tolist() == [1.0] and finv.tolist() == [2.0]
    torch.testing.assert_close(out[src], 2.0 * rows[src])
    torch.testing.assert_close(out[dst], rows[dst] - rows[src])
    keep = torch.ones(plan.n_rows, dtype=torch.bool)
    keep[src] = keep[dst] = False
    torch.testing.assert_close(out[keep], rows[keep])
    # Nothing promoted: the rows themselves.
    none = make_plan(ch.mask, _t(T)[:, None].expand(T, B), fold="causal")
    assert apply_promotion(rows, none) is rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_apply_promotion_reweights_low_precision_rows_in_float32(dtype):
    """1/pi in bfloat16 would be one rounded factor shared by every promotion of a call (a
    bias of the correction, not noise): the re-weighting runs in float32, cast once."""
    T, B = 5, 3
    up = torch.ones(T, B, 1, dtype=F64)
    # pi = 0.35 / 3 per promotion to exact: 1/pi = 8.571..., not a bfloat16 number (at 2.4,
    # 7.5 is); the offset 0.05 falls in the first sample's span
    ch = stochastic_choice(up, 2.35, torch.tensor([0.1, 0.5, 0.9, 0.05]), promote_to="exact")
    assert ch.b.numel() > 0
    plan = make_plan(ch.mask, _t(T)[:, None].expand(T, B), fold="causal", promoted=ch)
    rows = torch.randn(plan.n_rows, 7, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = apply_promotion(rows, plan)
    assert got.dtype == dtype
    want = apply_promotion(rows.float(), plan).to(dtype)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("kw", "err", "match"),
    [
        ({"fold": "linear"}, ValueError, "needs fold='causal'"),
        ({"deferred": False}, ValueError, "needs deferred=True"),
        ({"budget": 0.5}, ValueError, r"budget .* \[1, T=5\]"),
        ({"budget": 5.5}, ValueError, r"budget .* \[1, T=5\]"),
        ({"budget": float("nan")}, ValueError, "budget"),
        ({"generator": 3}, TypeError, "generator must be None or a torch.Generator"),
        ({"mode": "exact"}, ValueError, "approximates"),
        ({"router": CosineRouter(0.7)}, ValueError, "do not combine"),
        ({"anchors": [0, 2]}, ValueError, "anchors= is the uniform placement's"),
        ({"placement": "uniform", "budget": None, "generator": torch.Generator()},
         ValueError, "generator applies to placement='stochastic'"),
        ({"promotion": "size"}, ValueError, "promotion must be one of"),
        ({"placement": "adaptive", "fold": "linear", "promotion": "proxy"}, ValueError,
         "promotion='proxy' applies to placement='stochastic' only"),
    ],
)  # fmt: skip
def test_bad_arguments_refused_before_any_model_call(kw, err, match):
    calls = []

    def model(z, t):
        calls.append(1)
        return z * t.view(-1, 1)

    lat = torch.randn(5, 2, 3, dtype=F64)
    base = dict(window=2, fold="causal", deferred=True, placement="stochastic", budget=2.5)
    with pytest.raises(err, match=match):
        jagg_trajectory(model, lat, _t(5), **{**base, **kw})
    assert calls == []


def test_config_refuses_stochastic_without_the_causal_jagg_fold():
    GRPOConfig(placement="stochastic", fold="causal", budget=2.5).validate()
    for budget in (0.5, 10.5):  # refused before the first rollout, not at its minibatch
        with pytest.raises(ValueError, match=r"in \[1 \(causal fold\) or 2 \(linear\), T'=10\]"):
            GRPOConfig(placement="stochastic", fold="causal", budget=budget).validate()
    for bad in ({"fold": "linear"}, {"mode": "nft"}):
        with pytest.raises(ValueError, match="'stochastic' needs"):
            GRPOConfig(**{"placement": "stochastic", "fold": "causal", **bad}).validate()


def test_config_refuses_proxy_promotion_without_stochastic_placement():
    GRPOConfig(placement="stochastic", fold="causal", budget=2.5, promotion="proxy").validate()
    with pytest.raises(ValueError, match="promotion must be 'uniform' unless"):
        GRPOConfig(placement="adaptive", budget=2.5, promotion="proxy").validate()


def test_trainer_draws_promotions_from_the_run_generator():
    """The promotions come from the run's own stream: torch's global generator in another
    state changes nothing, and every sample's anchors are the stochastic plan's."""
    from jagg_autograd.estimators import ESTIMATORS
    from jagg_autograd.trainer import train

    kw = dict(steps=2, prompts_per_step=2, group_size=4, num_steps=5, window=2,
              eval_per_digit=1, progress=False, fold="causal", placement="stochastic",
              budget=2.5, seed=0)  # fmt: skip
    torch.manual_seed(123)
    a = train(GRPOConfig(**kw))
    torch.manual_seed(456)
    b = train(GRPOConfig(**kw))
    ra, rb = a["steps"][-1], b["steps"][-1]
    assert ra["paths"] == ["values+deferred"]
    assert ra["grad_norm"] == rb["grad_norm"] and ra["loss"] == rb["loss"]
    # 8 samples x 5 steps, every sample active: 2 anchors each, 4 of them promoted
    assert ra["grad_samples"] == 8 * 2 + 4
    assert "stochastic placement budget 2.5" in ESTIMATORS["jagg"].describe(
        kw | {"mode": "jagg", "shared_anchors": True}
    )


# ----------------------------------------------------------- probability-weighted promotion


def _pieces(pi: torch.Tensor, order: torch.Tensor):
    """The offsets u in [0, 1) on which systematic sampling is constant: (midpoint,
    length) of each piece, from the breakpoints frac(S_j)."""
    s = pi[order].cumsum(0)
    cuts = sorted({0.0, 1.0, *(float(x - torch.floor(x)) for x in s)})
    return [((a + b) / 2, b - a) for a, b in zip(cuts, cuts[1:]) if b > a]


@settings(max_examples=25 if os.environ.get("CI") else 200, deadline=None)
@given(B=st.integers(1, 12), data=st.data())
def test_systematic_sample_includes_every_sample_with_its_probability(B, data):
    """Integrated exactly over the offset, every sample's inclusion probability is its
    pi_b, for any order; the count is floor or ceil of sum(pi)."""
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    pi = torch.rand(B, generator=gen, dtype=F64)
    pi[torch.rand(B, generator=gen) < 0.2] = 0.0
    pi[torch.rand(B, generator=gen) < 0.2] = 1.0
    order = torch.randperm(B, generator=gen)
    incl = torch.zeros(B, dtype=F64)
    total = float(pi.sum())
    for u, w in _pieces(pi, order):
        chosen = systematic_sample(pi, order, u)
        assert int(chosen.sum()) in (math.floor(total + 1e-9), math.ceil(total - 1e-9))
        assert not bool(chosen[pi == 0].any()) and bool(chosen[pi == 1].all())
        incl += w * chosen.to(F64)
    torch.testing.assert_close(incl, pi, rtol=0, atol=1e-12)


@settings(max_examples=25 if os.environ.get("CI") else 200, deadline=None)
@given(B=st.integers(1, 16), data=st.data())
def test_promotion_probabilities_sum_cap_floor_and_order(B, data):
    seed = data.draw(st.integers(0, 2**16))
    frac = data.draw(st.floats(0.01, 0.99))
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(B, generator=gen, dtype=F64) ** 4 * 10  # skewed: some capped at 1
    w[torch.rand(B, generator=gen) < 0.2] = 0.0
    promotable = torch.rand(B, generator=gen) < 0.8
    pi = promotion_probabilities(w, promotable, frac)
    n_p = int(promotable.sum())
    assert abs(float(pi.sum()) - frac * n_p) < 1e-9
    assert bool((pi[~promotable] == 0).all())
    p = pi[promotable]
    assert bool((p >= PROXY_FLOOR * frac - 1e-12).all() and (p <= 1 + 1e-12).all())
    # A larger weight never gets a smaller probability; a common scale changes nothing.
    wp = w[promotable]
    for i in range(len(wp)):
        for j in range(len(wp)):
            if wp[i] > wp[j]:
                assert p[i] >= p[j] - 1e-12
    torch.testing.assert_close(promotion_probabilities(w * 7.5, promotable, frac), pi)
    even = promotion_probabilities(torch.ones(B, dtype=F64), promotable, frac)
    assert torch.equal(even, torch.where(promotable, torch.full((B,), frac, dtype=F64), 0.0))


def test_proxy_promotion_follows_the_advantage_and_keeps_the_expectation():
    """pi_b grows with |A_b|; integrated exactly over the offset (for a fixed order) the
    re-weighted gradient is the (L+1)-anchor causal fold's, although who is promoted
    depends on the advantages."""
    T, B, budget = 5, 5, 2.4
    model, lat, up, values = _case(T, B, seed=11)
    up = up * torch.tensor([0.05, 0.5, 1.0, 2.0, 6.0], dtype=F64).view(1, B, 1, 1)
    t64 = _t(T)[:, None].expand(T, B)
    order_draw = torch.rand(B, generator=torch.Generator().manual_seed(0))
    ch = stochastic_choice(up, budget, torch.cat([order_draw, torch.zeros(1)]),
                           promotion="proxy", values=values, t64=t64)  # fmt: skip
    assert ch.pi[-1] > ch.pi[0] and abs(float(ch.pi.sum()) - 0.4 * B) < 1e-9
    mean = 0.0
    pieces = _pieces(ch.pi.cpu(), order_draw.to(F64).argsort())
    for u, w in pieces:
        c = stochastic_choice(up, budget, torch.cat([order_draw, torch.tensor([u])]),
                              promotion="proxy", values=values, t64=t64)  # fmt: skip
        mean = mean + w * _reference(model, lat, up, c.mask, budget, c.pi)
    full = torch.zeros((T, B), dtype=torch.bool)
    full[causal_layout(T, 3)[0]] = True
    want = causal_reference(model, lat, _t(T), up, full)
    assert len(pieces) > 2 and rel_err(mean, want) < 1e-12


def test_proxy_promotion_needs_the_velocities():
    up = torch.ones(5, 2, 1, dtype=F64)
    with pytest.raises(ValueError, match="needs the velocities"):
        stochastic_choice(up, 2.5, torch.rand(3), promotion="proxy")


@pytest.mark.parametrize(
    ("extra", "grad_samples", "words"),
    [
        # 8 samples x 5 steps: 2 anchors each and sum(pi) = 4 promotions (floor or ceil)
        ({"fold": "causal", "promotion": "proxy"}, (8 * 2 + 4, 8 * 2 + 3, 8 * 2 + 5),
         "stochastic placement budget 2.5, proxy promotion"),
        # 2 base anchors each; a promotion adds 3, sum(pi) = 8 / 6
        ({"fold": "linear", "promote_to": "exact"}, (8 * 2 + 3, 8 * 2 + 6),
         "stochastic placement budget 2.5 to exact"),
    ],
)  # fmt: skip
def test_trainer_runs_promotions_reproducibly(extra, grad_samples, words):
    """--promotion proxy and --promote-to exact through the trainer: the run's own stream,
    promotions counted in the with-grad samples, and the description names them."""
    from jagg_autograd.estimators import ESTIMATORS
    from jagg_autograd.trainer import train

    kw = dict(steps=2, prompts_per_step=2, group_size=4, num_steps=5, window=2,
              eval_per_digit=1, progress=False, placement="stochastic", budget=2.5,
              seed=0, **extra)  # fmt: skip
    torch.manual_seed(1)
    a = train(GRPOConfig(**kw))
    torch.manual_seed(2)
    b = train(GRPOConfig(**kw))
    ra, rb = a["steps"][-1], b["steps"][-1]
    assert ra["grad_norm"] == rb["grad_norm"] and ra["loss"] == rb["loss"]
    assert ra["grad_samples"] in grad_samples
    desc = ESTIMATORS["jagg"].describe(kw | {"mode": "jagg", "shared_anchors": True})
    assert words in desc


# ------------------------------------------------------------------- promotion to exact


def _base_weights(base: list[int], k: int, t: torch.Tensor, fold: str):
    """(anchor, weight) pairs the base layout's fold puts step k's g onto."""
    if k in base:
        return [(k, 1.0)]
    prev = [a for a in base if a < k]
    nxt = [a for a in base if a > k]
    if fold == "causal":
        return [(prev[-1], 1.0)]
    if not nxt:  # after the last base anchor: the linear fold drops it
        return []
    p, q = prev[-1], nxt[0]
    alpha = float((t[k] - t[p]) / (t[q] - t[p]))
    return [(p, 1.0 - alpha), (q, alpha)]


def _exact_reference(model, lat, up, mask, budget, fold, pi):
    """Brute force of promote_to="exact" from the definition: per sample the base layout's
    fold of its g, plus for a promoted sample (1/pi_b) (exact - base fold); a sample is
    promoted when the mask holds more than its base layout's anchors (then every active
    step with a non-zero g)."""
    T, B = mask.shape
    t = _t(T)
    L = int(budget)
    nz = up.flatten(2).ne(0).any(-1)

    def vjp(a, k, b, w):
        v = model(lat[a, b : b + 1], t[a : a + 1])
        return w * params_grad((v * up[k, b : b + 1]).sum(), model)

    total = torch.zeros_like(params_grad((model(lat[0, :1], t[:1]) * 0).sum(), model))
    for b in range(B):
        act = nz[:, b].nonzero().flatten().tolist()
        if not act:
            continue
        f, n = act[0], act[-1] - act[0] + 1
        if n <= L:
            base = list(range(f, f + n))
        elif fold == "causal":
            base = [f + a for a in causal_layout(n, L)[0]]
        else:  # the ends and L - 2 steps evenly between (L >= 2)
            base = [f + round(i * (n - 1) / (L - 1)) for i in range(L)]
        anchors = mask[:, b].nonzero().flatten().tolist()
        promoted = len(anchors) > len(base)
        want = set(base) | {k for k in range(f, f + n) if promoted and bool(nz[k, b])}
        assert set(anchors) == want  # a zero-g step is never promoted
        inv = 1.0 / float(pi[b]) if promoted else 0.0
        for k in range(f, f + n):
            for a, w in _base_weights(base, k, t, fold):
                total += vjp(a, k, b, w * (1.0 - inv) if promoted else w)
            if promoted:
                total += vjp(k, k, b, inv)
    return total


def test_base_layout():
    assert base_layout(5, 2, "causal") == causal_layout(5, 2)[0] == [0, 3]
    assert base_layout(5, 2, "linear") == [0, 4]
    assert base_layout(5, 3, "linear") == [0, 2, 4]
    assert base_layout(8, 3, "linear") == [0, 4, 7]  # round(3.5) = 4
    assert base_layout(4, 4, "linear") == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="needs 2 <= L <= n"):
        base_layout(6, 1, "linear")  # one anchor would drop every later step's g


@pytest.mark.parametrize(
    ("T", "B", "budget", "zero"),
    [
        (5, 4, 2.4, None),
        (7, 5, 2.5, {1: slice(4, None), 3: slice(None, None)}),  # a short and an empty sample
        (9, 3, 3.7, {0: slice(0, 2)}),  # a late span
        (6, 4, 1.5, {2: slice(1, None)}),  # L = 1 (causal only); one active step
        (5, 1, 2.5, None),  # sum(c pi) < 1
        (7, 3, 3.0, {0: slice(5, None)}),  # an integer budget promotes nothing: refused
        (8, 3, 2.5, {1: slice(2, 4)}),  # a gap of zero g inside a span: never promoted
        (6, 6, 4.9, None),  # several samples promoted in one draw
    ],
)
@pytest.mark.parametrize("fold", ["causal", "linear"])
@pytest.mark.parametrize("promotion", ["uniform", "proxy"])
def test_promotion_to_exact_gradient_equals_brute_force(T, B, budget, zero, fold, promotion):
    model, lat, up, values = _case(T, B, seed=T + 2 * B, zero=zero)
    if promotion == "proxy":
        up = up * torch.linspace(0.1, 3.0, B, dtype=F64).view(1, B, 1, 1)
    t64 = _t(T)[:, None].expand(T, B)
    if fold == "linear" and budget < 2:
        with pytest.raises(ValueError, match=r"budget .* \[2, T=6\] .* fold='linear'"):
            jagg_trajectory(model, lat, _t(T), window=2, fold=fold, deferred=True,
                            placement="stochastic", budget=budget, promote_to="exact")  # fmt: skip
        return
    if budget == int(budget):  # the base layout, not E in expectation (check_promoting_budget)
        with pytest.raises(ValueError, match="budget must be fractional"):
            jagg_trajectory(model, lat, _t(T), window=2, fold=fold, deferred=True,
                            placement="stochastic", budget=budget, promote_to="exact")  # fmt: skip
        return
    n_promoted = []
    for seed in range(6):
        v, stats = jagg_trajectory(
            model, lat, _t(T), window=2, fold=fold, deferred=True, values=values,
            placement="stochastic", budget=budget, return_stats=True, promotion=promotion,
            promote_to="exact", generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        got = params_grad((v * up).sum(), model)
        draw = torch.rand(B + 1, generator=torch.Generator().manual_seed(seed))
        ch = stochastic_choice(up, budget, draw, promotion=promotion, promote_to="exact",
                               fold=fold, values=values, t64=t64)  # fmt: skip
        assert torch.equal(ch.mask, stats.anchor_mask)
        want = _exact_reference(model, lat, up, stats.anchor_mask, budget, fold, ch.pi)
        assert rel_err(got, want) < 1e-12
        n_promoted.append(int(ch.b.unique().numel()))
    if budget != int(budget):  # the promoted path ran (several samples at once at 4.9)
        assert max(n_promoted) >= (2 if budget == 4.9 else 1)


@pytest.mark.parametrize("fold", ["causal", "linear"])
@pytest.mark.parametrize("promotion", ["uniform", "proxy"])
def test_promotion_to_exact_expectation_is_the_exact_gradient(fold, promotion):
    """Integrated exactly over the offset (a fixed order), the estimator is the exact
    gradient of this batch -- whatever the base fold's error, the linear fold's
    noise-driven one included -- while no single draw is, and the expected anchor count is
    the budget's."""
    T, B, budget = 6, 5, 2.5
    model, lat, up, values = _case(T, B, seed=17, zero={4: slice(0, 2)})  # a shorter span
    up = up * torch.tensor([0.05, 0.5, 1.0, 2.0, 6.0], dtype=F64).view(1, B, 1, 1)
    t64 = _t(T)[:, None].expand(T, B)
    order_draw = torch.rand(B, generator=torch.Generator().manual_seed(0))

    def choice(u):
        return stochastic_choice(up, budget, torch.cat([order_draw, torch.tensor([u])]),
                                 promotion=promotion, promote_to="exact", fold=fold,
                                 values=values, t64=t64)  # fmt: skip

    ch = choice(0.0)
    costs = torch.tensor([T - 2] * 4 + [T - 2 - 2], dtype=F64)  # n_b - L
    assert abs(float((ch.pi * costs).sum()) - 0.5 * B) < 1e-9
    if promotion == "proxy":
        assert ch.pi[3] > ch.pi[0]
    mean, anchors, draws = 0.0, 0.0, []
    pieces = _pieces(ch.pi.cpu(), order_draw.to(F64).argsort())
    for u, w in pieces:
        c = choice(u)
        g = _exact_reference(model, lat, up, c.mask, budget, fold, c.pi)
        mean = mean + w * g
        anchors += w * float(c.mask.sum())
        draws.append(g)
    exact = causal_reference(model, lat, _t(T), up, torch.ones((T, B), dtype=torch.bool))
    assert len(pieces) > 2 and rel_err(mean, exact) < 1e-12
    assert min(rel_err(g, exact) for g in draws) > 1e-4
    assert abs(anchors - budget * B) < 1e-9


@settings(max_examples=25 if os.environ.get("CI") else 200, deadline=None)
@given(B=st.integers(1, 16), data=st.data())
def test_promotion_probabilities_with_costs(B, data):
    """With costs c_b (the anchors a promotion adds): sum c pi = frac n_p, every pi in
    [PROXY_FLOOR pi_even, 1], equal weights give pi_even = frac n_p / sum c, unit costs
    are costs=None bit for bit, and at equal cost a larger weight never gets less."""
    seed = data.draw(st.integers(0, 2**16))
    frac = data.draw(st.floats(0.01, 0.99))
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(B, generator=gen, dtype=F64) ** 4 * 10
    w[torch.rand(B, generator=gen) < 0.2] = 0.0
    promotable = torch.rand(B, generator=gen) < 0.8
    c = torch.randint(1, 5, (B,), generator=gen).to(F64)
    pi = promotion_probabilities(w, promotable, frac, c)
    n_p = int(promotable.sum())
    assert abs(float((pi * c).sum()) - frac * n_p) < 1e-9
    assert bool((pi[~promotable] == 0).all())
    if n_p:
        even = frac * n_p / float(c[promotable].sum())
        p = pi[promotable]
        assert bool((p >= PROXY_FLOOR * even - 1e-12).all() and (p <= 1 + 1e-12).all())
        flat = promotion_probabilities(torch.ones(B, dtype=F64), promotable, frac, c)
        torch.testing.assert_close(flat[promotable], torch.full((n_p,), even, dtype=F64))
        idx = promotable.nonzero().flatten().tolist()
        for i in idx:
            for j in idx:
                if c[i] == c[j] and w[i] > w[j]:
                    assert pi[i] >= pi[j] - 1e-12
    with pytest.raises(ValueError, match="costs must be >= 1"):
        promotion_probabilities(w, torch.ones(B, dtype=torch.bool), frac,
                                torch.full((B,), 0.5, dtype=F64))  # fmt: skip


def test_promotion_probabilities_by_hand():
    """Water-filling worked by hand: unit costs (one sample capped at 1) and costs."""
    w = torch.tensor([1.0, 3.0, 0.0, 6.0], dtype=F64)
    every = torch.ones(4, dtype=torch.bool)
    # Unit costs, frac 0.5: total 2; prop 2w/10 caps sample 3 at 1, the other 1 goes to w
    # 1, 3, 0 as 1/4, 3/4, 0; pi = 0.75 prop + 0.25 * 0.5.
    want = torch.tensor([0.3125, 0.6875, 0.125, 0.875], dtype=F64)
    torch.testing.assert_close(promotion_probabilities(w, every, 0.5), want, rtol=0, atol=1e-15)
    # Costs 1, 2, 1, 3: r = w / sqrt(c), prop = r * 2 / sum(c r) (none capped), pi_even 2/7.
    c = torch.tensor([1.0, 2.0, 1.0, 3.0], dtype=F64)
    r = torch.tensor([1.0, 3.0 / 2**0.5, 0.0, 6.0 / 3**0.5], dtype=F64)
    want = 0.75 * r * 2.0 / float((c * r).sum()) + 0.25 * 2.0 / 7.0
    torch.testing.assert_close(promotion_probabilities(w, every, 0.5, c), want, rtol=0,
                               atol=1e-15)  # fmt: skip
    assert abs(float((want * c).sum()) - 2.0) < 1e-12


def test_promote_to_refusals():
    lat = torch.randn(5, 2, 3, dtype=F64)
    base = dict(window=2, deferred=True, placement="stochastic", budget=2.5)
    model = MLPField(3, seed=0)
    with pytest.raises(ValueError, match="promote_to must be one of"):
        jagg_trajectory(model, lat, _t(5), fold="causal", promote_to="all", **base)
    with pytest.raises(ValueError, match="promote_to='exact' applies to placement='stochastic'"):
        jagg_trajectory(model, lat, _t(5), window=2, fold="causal", deferred=True,
                        placement="adaptive",
                        budget=2.5, promote_to="exact")  # fmt: skip
    with pytest.raises(ValueError, match="needs fold='causal'"):  # the anchor target nests
        jagg_trajectory(model, lat, _t(5), fold="linear", **base)
    with pytest.raises(ValueError, match="promote_to must be one of"):
        stochastic_choice(torch.ones(5, 2, 1), 2.5, torch.rand(3), promote_to="all")
    with pytest.raises(ValueError, match="promote_to='anchor' needs fold='causal'"):
        stochastic_choice(torch.ones(5, 2, 1), 2.5, torch.rand(3), fold="linear")
    for fold, budget in (("causal", 0.5), ("linear", 1.5)):  # direct calls too
        with pytest.raises(ValueError, match=f"budget must be >= {1 if fold == 'causal' else 2}"):
            stochastic_choice(torch.ones(5, 2, 1), budget, torch.rand(3), promote_to="exact",
                              fold=fold, t64=torch.rand(5, 2))  # fmt: skip
    GRPOConfig(placement="stochastic", fold="linear", budget=2.5, promote_to="exact").validate()
    with pytest.raises(ValueError, match=r"budget must be None or in \[1 \(causal fold\)"):
        GRPOConfig(placement="stochastic", fold="linear", budget=1.5,
                   promote_to="exact").validate()  # fmt: skip
    with pytest.raises(ValueError, match="promote_to must be 'anchor' unless"):
        GRPOConfig(placement="adaptive", budget=2.5, promote_to="exact").validate()
    # An integer budget (None: the layout's count) promotes nothing: the base layout's
    # fold, not the exact gradient in expectation -- refused, by the config and the call.
    for budget in (None, 2, 3.0):
        with pytest.raises(ValueError, match="budget must be fractional"):
            GRPOConfig(placement="stochastic", fold="causal", budget=budget,
                       promote_to="exact").validate()  # fmt: skip
        with pytest.raises(ValueError, match="budget must be fractional"):
            # window 5: the layout's 2 anchors {0, 4} are None's budget
            jagg_trajectory(model, lat, _t(5), window=5, deferred=True, fold="causal",
                            placement="stochastic", budget=budget, promote_to="exact")  # fmt: skip
    GRPOConfig(placement="stochastic", fold="causal", budget=2.0).validate()  # the 2-anchor fold
    # The router (which resolves the placement to uniform), exact, subsample and mixgrpo
    # would drop the promotion silently: a run asked to be exact in expectation would not be.
    for mode in ("router", "exact", "subsample", "mixgrpo"):
        with pytest.raises(ValueError, match="promote_to must be 'anchor' unless"):
            GRPOConfig(mode=mode, placement="stochastic", fold="linear", budget=2.4,
                       promote_to="exact").validate()  # fmt: skip
    # A fraction below 0.01: probabilities the float32 draw cannot realise, 1/pi exploding.
    for promote_to in ("anchor", "exact"):
        with pytest.raises(ValueError, match="fractional part is 0 or >= 0.01"):
            GRPOConfig(placement="stochastic", fold="causal", budget=2.001,
                       promote_to=promote_to).validate()  # fmt: skip
        with pytest.raises(ValueError, match=r"budget - floor\(budget\) must be 0 or >= 0.01"):
            jagg_trajectory(model, lat, _t(5), window=5, deferred=True, fold="causal",
                            placement="stochastic", budget=2.001, promote_to=promote_to)  # fmt: skip
    GRPOConfig(placement="stochastic", fold="causal", budget=2.01).validate()
    GRPOConfig(placement="stochastic", fold="causal", budget=5, num_steps=10,
               timestep_fraction=0.5, promote_to="exact").validate()  # every step: exact


def test_promotion_to_exact_is_not_marked_as_the_linear_fold():
    """The fold guard warns about non-zero-mean advantages on the linear fold's graphs;
    promotion to exact from a linear base is unbiased for any advantages."""
    from jagg_autograd.fold_guard import folds_in_graph

    model, lat, up, values = _case(5, 3, seed=2)
    kw = dict(window=2, deferred=True, values=values, placement="stochastic", budget=2.5)
    v = jagg_trajectory(model, lat, _t(5), fold="linear", promote_to="exact", **kw)
    assert "linear" not in folds_in_graph(v)
    v = jagg_trajectory(model, lat, _t(5), window=2, deferred=True, values=values)
    assert folds_in_graph(v) == {"linear"}  # the guard still sees the plain linear fold
