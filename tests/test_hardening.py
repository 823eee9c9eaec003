"""Issue 14 ("Hardening"): each fault found by adversarial testing is refused or handled.

One test (or a few) per item; every one of them failed on the code before the fix.  The
DDP items (2, 13) run in ``tests/test_distributed.py``'s gloo processes, plus a
single-process check of ``accumulate_windows``' bookkeeping here.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from jagg_autograd import (
    CosineRouter,
    cosine_route,
    expected_anchor_count,
    jagg_trajectory,
    jagg_window,
    trajectory_layout,
)
from jagg_autograd.distributed import accumulate_windows
from jagg_autograd.grpo import group_advantages, shifted_sigma_schedule
from jagg_autograd.mix import jagg_mix


class Spy:
    """A model that counts its calls: errors must come before the first one."""

    def __init__(self, fn=None):
        self.calls = 0
        self.fn = fn

    def __call__(self, z, t, **cond):
        self.calls += 1
        return z * t.view(-1, *([1] * (z.dim() - 1))) if self.fn is None else self.fn(z, t)


class Field(nn.Module):
    """v = W z + b t: a tiny parametrised model (gradients exist)."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.tw = nn.Parameter(torch.ones(d))

    def forward(self, z, t, **cond):
        return self.lin(z) + t[:, None].to(z.dtype) * self.tw


def _lat(W=4, B=2, d=3, dtype=torch.float32):
    return torch.randn(W, B, d, generator=torch.Generator().manual_seed(0), dtype=dtype)


# ------------------------------------------------------------ 1: integer timesteps wrap


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([100, 200, 50], torch.uint8),  # uint8: 50 - 200 wraps to 106 > 0
        ([0, 20000, -30000], torch.int16),  # int16: -30000 - 20000 wraps to 15536 > 0
        ([0, 100, -100], torch.int8),  # int8: -100 - 100 wraps to 56 > 0
    ],
)
def test_integer_timesteps_not_monotone_are_refused(values, dtype):
    spy = Spy()
    with pytest.raises(ValueError, match="monotone"):
        jagg_window(spy, _lat(W=3), torch.tensor(values, dtype=dtype))
    assert spy.calls == 0


@pytest.mark.parametrize(
    "values, dtype",
    [
        ([-100, 100, 120], torch.int8),  # monotone; 100 - (-100) wraps in int8
        ([-20000, 20000, 30000], torch.int16),  # 20000 - (-20000) wraps to -25536 in int16
        ([250, 128, 3], torch.uint8),  # decreasing uint8 (differences would wrap to > 0)
    ],
)
def test_integer_timesteps_monotone_are_accepted(values, dtype):
    model = Field()
    lat = _lat(W=3)
    t = torch.tensor(values, dtype=dtype)
    v = jagg_window(model, lat, t)
    v.sum().backward()
    # The model still gets the timesteps cast to the latents' dtype.
    want = torch.stack([model(lat[k], t[k].to(lat.dtype).expand(2)) for k in range(3)])
    torch.testing.assert_close(v, want)
    # alpha of the interior step comes from the true (wide) difference: J_1 is interpolated
    # with alpha in [0, 1], so the t-gradient equals the exact one for this affine model.
    g_jagg = model.tw.grad.clone()
    model.zero_grad()
    jagg_window(model, lat, t, mode="exact").sum().backward()
    torch.testing.assert_close(g_jagg, model.tw.grad)


# ----------------------------------------------------------------- 4: output device


def test_model_output_on_another_device_is_an_error():
    lin = nn.Linear(3, 3)

    def on_meta(z, t):
        return lin(z).to("meta")

    with pytest.raises(ValueError, match="meta"):
        jagg_window(on_meta, _lat(), torch.linspace(1, 0.1, 4))


# ------------------------------------------------------------ 5: batch-statistics layers


class BNModel(nn.Module):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.norm = norm

    def forward(self, z, t):
        return self.norm(self.lin(z))


@pytest.mark.parametrize(
    "norm, train",
    [
        (nn.BatchNorm1d(3), True),
        (nn.BatchNorm1d(3, track_running_stats=False), False),  # batch stats in eval too
        (nn.SyncBatchNorm(3), True),
    ],
)
@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_batch_statistics_layers_are_refused(norm, train, mode):
    model = BNModel(norm).train(train)
    before = norm.running_mean.clone() if norm.running_mean is not None else None
    with pytest.raises(ValueError, match="BatchNorm.*'norm'.*eval"):
        jagg_window(model, _lat(), torch.linspace(1, 0.1, 4), mode=mode)
    if before is not None:  # refused before any call: running stats untouched
        assert torch.equal(norm.running_mean, before)


def test_per_sample_norms_and_eval_batchnorm_are_accepted():
    for norm in (nn.BatchNorm1d(3).eval(), nn.LayerNorm(3), nn.GroupNorm(1, 3)):
        model = BNModel(norm)
        model.lin.train()
        lat, t = _lat(B=4), torch.linspace(1, 0.1, 4)
        stacked = jagg_window(model, lat, t, mode="exact")
        per_step = jagg_window(model, lat, t, mode="exact", batching="per_step")
        torch.testing.assert_close(stacked, per_step)


# ------------------------------------------------------------- 6: ambiguous cond batching


def _cond_model(z, t, **cond):
    return z * t[:, None]


def test_ambiguous_cond_warns_and_batched_cond_silences():
    B = 3
    lat, t = _lat(B=B), torch.linspace(1, 0.1, 4)
    table = torch.randn(B, B)  # (B, B): per-sample rows or a shared table?
    with pytest.warns(UserWarning, match=r"\['table'\].*batched_cond") as rec:
        jagg_window(_cond_model, lat, t, cond={"table": table, "y": torch.arange(B)})
    assert len([w for w in rec if "batched_cond" in str(w.message)]) == 1  # once per call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jagg_window(_cond_model, lat, t, cond={"table": table}, batched_cond=())
        jagg_window(_cond_model, lat, t, cond={"table": table}, batched_cond=["table"])


def test_unambiguous_cond_does_not_warn():
    B = 3
    lat, t = _lat(B=B), torch.linspace(1, 0.1, 4)
    conds = [
        {"labels": torch.arange(B)},  # (B,)
        {"ehs": torch.randn(B, 5, 4), "pooled": torch.randn(B, 7)},  # (B, L, D), (B, D)
        {"shared": torch.randn(4, B)},  # dim 0 != B: not batched, nothing ambiguous
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cond in conds:
            jagg_window(_cond_model, lat, t, cond=cond)
        # B = 1: tiling a (1, 1) tensor only repeats identical rows.
        jagg_window(_cond_model, _lat(B=1), t, cond={"x": torch.ones(1, 1)})


# ------------------------------------------------------------- 7: triton that cannot run


def test_triton_backend_that_cannot_run_is_refused_before_the_model(monkeypatch):
    lat, t = _lat(), torch.linspace(1, 0.1, 4)
    spy = Spy()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        jagg_window(spy, lat, t, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="float64"):
        jagg_window(spy, lat.double(), t.double(), backend="triton")
    assert spy.calls == 0


# ------------------------------------------------------------------- 8: public helpers


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda: expected_anchor_count(10, 1), ValueError, "window"),
        (lambda: expected_anchor_count(10, 0), ValueError, "window"),
        (lambda: expected_anchor_count(10, 0, False), ValueError, "window"),
        (lambda: expected_anchor_count(10, 2.0), TypeError, "window"),
        (lambda: expected_anchor_count(0, 3), ValueError, "T"),
        (lambda: trajectory_layout(10, 1, True), ValueError, "window"),
        (lambda: trajectory_layout(10, 1, False), ValueError, "window"),
        (lambda: trajectory_layout(0, 3, True), ValueError, "T"),
        (lambda: trajectory_layout(10, True, True), TypeError, "window"),
        (lambda: trajectory_layout(10, 3, "yes"), TypeError, "shared_anchors"),
    ],
)
def test_layout_helpers_validate(call, exc, name):
    with pytest.raises(exc, match=rf"^{name} must"):
        call()


def test_layout_helpers_accept_integer_scalars():
    assert expected_anchor_count(np.int64(10), torch.tensor(4)) == 4
    assert trajectory_layout(np.int32(10), np.int64(4), True)[0] == [0, 3, 6, 9]


def _route_inputs(T=6, B=2, N=3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(T, B, N, generator=g), torch.rand(T, B, generator=g)


@pytest.mark.parametrize(
    "left, right, exc, match",
    [
        ([3], [0], ValueError, "left <= right"),
        ([0, 2], [2], ValueError, "left and right"),
        ([-1], [3], ValueError, "0 <= left"),
        ([0], [6], ValueError, "right < T"),
        ([0.0], [3], TypeError, "left"),
        ([0], [True], TypeError, "right"),
        (0, [3], TypeError, "left"),
    ],
)
def test_cosine_route_validates_windows(left, right, exc, match):
    v, a = _route_inputs()
    with pytest.raises(exc, match=match):
        cosine_route(v, a, left, right, backend="torch")


def test_cosine_route_validates_dtypes():
    v, a = _route_inputs()
    with pytest.raises(TypeError, match="velocities"):
        cosine_route(v.round().long(), a, [0], [3], backend="torch")
    with pytest.raises(TypeError, match="alpha"):
        cosine_route(v, (a * 3).long(), [0], [3], backend="torch")
    # single-step windows (left == right, the paper layout's last step) still score 1
    s = cosine_route(v, a, [0, 5], [5, 5], backend="torch")
    assert torch.equal(s[1], torch.ones(2))


def test_jagg_mix_float_anchors_is_a_type_error():
    g = torch.randn(4, 2, 3)
    w = torch.zeros(4, 2)
    with pytest.raises(TypeError, match="anchors"):
        jagg_mix(g, w, w, torch.tensor([0.0, 3.0]), backend="torch")


# ---------------------------------------------------------------------- 9: odds and ends


def test_sigma_schedule_too_coarse_dtype_is_refused():
    with pytest.raises(ValueError, match="bfloat16.*distinct"):
        shifted_sigma_schedule(100, dtype=torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        s = shifted_sigma_schedule(20, dtype=dtype)
        assert bool((s[1:] < s[:-1]).all())  # the documented contract, where it is kept


def test_window_accepts_integer_scalars_but_not_bool_or_float():
    lat, t = _lat(W=7), torch.linspace(1, 0.1, 7)
    model = Field()
    want = jagg_trajectory(model, lat, t, window=3)
    for w in (np.int64(3), torch.tensor(3)):
        torch.testing.assert_close(jagg_trajectory(model, lat, t, window=w), want)
    for w in (True, 3.0, np.float64(3)):
        with pytest.raises(TypeError, match="window"):
            jagg_trajectory(model, lat, t, window=w)


@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_single_step_trajectory_message(mode):
    spy = Spy()
    with pytest.raises(ValueError, match="T >= 2"):
        jagg_trajectory(spy, _lat(W=1), torch.tensor([1.0]), window=2, mode=mode)
    assert spy.calls == 0


def test_exact_stats_under_no_grad_say_no_gradient():
    lat, t = _lat(), torch.linspace(1, 0.1, 4)
    model = Field()
    with torch.no_grad():
        _, st = jagg_window(model, lat, t, mode="exact", return_stats=True)
    assert not st.exact.any() and st.backward_calls == 0 and st.grad_samples == 0
    _, st = jagg_window(model, lat, t, mode="exact", return_stats=True)
    assert st.exact.all() and st.backward_calls >= 1
    # mode="jagg" + router under no_grad still previews the routing (threshold > 1: all)
    with torch.no_grad():
        _, st = jagg_window(model, lat, t, router=CosineRouter(2.0), return_stats=True)
    assert st.exact.all()


def test_group_advantages_of_huge_rewards():
    base = [1.0, -1.0, 0.5, 0.0, 2.0, 2.5]
    ids = [0, 0, 0, 0, 1, 1]
    want = group_advantages(base, ids, eps=1e-300)  # eps negligible, as it is at 1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning either
        got = group_advantages([x * 1e300 for x in base], ids)
        got_global = group_advantages([x * 1e300 for x in base], ids, global_std=True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(
        got_global, group_advantages(base, ids, eps=1e-300, global_std=True)
    )
    assert got.abs().max() > 0.5


def test_group_advantages_scaling_is_bit_exact():
    # The power-of-two scaling leaves ordinary rewards' advantages bit for bit unchanged.
    r = np.random.default_rng(0).normal(size=16) * 7.3
    ids = np.arange(16) % 4
    got = group_advantages(torch.tensor(r), torch.tensor(ids))
    counts = np.bincount(ids).astype(np.float64)
    means = np.bincount(ids, weights=r) / counts
    c = r - means[ids]
    std = np.sqrt(np.bincount(ids, weights=c**2) / counts)[ids]
    assert torch.equal(got, torch.tensor(c / (std + 1e-4)))


# ------------------------------------- 2: accumulate_windows left with break (single process)


class FakeDDP(nn.Module):
    """DDP's contract without a process group: ``no_sync()`` flips the flag that the forward
    reads; every forward records it (True = this forward's backward would all-reduce)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.require_backward_grad_sync = True
        self.seen: list[bool] = []

    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def forward(self, x):
        self.seen.append(self.require_backward_grad_sync)
        return self.lin(x)


def _step(m: FakeDDP) -> None:
    m(torch.ones(1, 2)).sum().backward()


def test_accumulate_windows_syncs_only_the_last_window():
    m = FakeDDP()
    for _i in accumulate_windows(m, 3):
        _step(m)  # a forward from a function called in the body counts as in the body
        m(torch.ones(1, 2))  # and one made directly in the body
    assert m.seen == [False, False, False, False, True, True]
    assert m.require_backward_grad_sync
    m.seen.clear()
    with accumulate_windows(m, 2) as windows:
        for _i in windows:
            _step(m)
    assert m.seen == [False, True] and m.require_backward_grad_sync


@pytest.mark.parametrize("where", ["after_backward", "before_forward"])
def test_accumulate_windows_break_with_live_iterator_then_normal_step_syncs(where):
    m = FakeDDP()
    it = accumulate_windows(m, 3)  # still referenced after the break: no GC rescue
    for i in it:
        if where == "before_forward" and i == 1:
            break
        _step(m)
        if where == "after_backward":
            break
    m.seen.clear()
    _step(m)  # the next, normal step
    _step(m)
    assert m.seen == [True, True]
    assert m.require_backward_grad_sync
    del it


def test_accumulate_windows_abandoned_loop_does_not_leak_into_the_next_one():
    m = FakeDDP()
    kept = []
    for _ in range(2):  # the same for statement, a new iterator each time
        it = accumulate_windows(m, 3)
        kept.append(it)
        m.seen.clear()
        for _i in it:
            _step(m)
        assert m.seen == [False, False, True]
    m.seen.clear()
    for _i in kept[0]:  # exhausted: nothing more
        _step(m)
    assert m.seen == []
    old = accumulate_windows(m, 3)
    for _i in old:
        break
    new = accumulate_windows(m, 2)
    m.seen.clear()
    for _i in new:
        _step(m)
    _step(m)
    assert m.seen == [False, True, True]


def _loop_in_a_function(m: FakeDDP) -> object:
    it = accumulate_windows(m, 4)
    for i in it:
        _step(m)
        if i == 1:
            return it  # leaves the loop and the function; the caller keeps the iterator


def test_accumulate_windows_return_from_the_loop_function():
    m = FakeDDP()
    it = _loop_in_a_function(m)
    m.seen.clear()
    _step(m)
    assert m.seen == [True] and it is not None


def test_accumulate_windows_unrecognised_iteration_errs_towards_sync():
    # Through a Python generator the loop body cannot be recognised: every window syncs
    # (no saving, but never a missed all-reduce).
    m = FakeDDP()
    for _i in (j for j in accumulate_windows(m, 3)):
        _step(m)
    assert m.seen == [True, True, True]
    # next(): sync stays off for this function's forwards until the following next().
    m.seen.clear()
    it = accumulate_windows(m, 2)
    next(it)
    _step(m)
    next(it)
    _step(m)
    it.close()
    _step(m)
    assert m.seen == [False, True, True]
