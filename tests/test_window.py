"""Values, pass counts, batching modes, conditioning and autograd plumbing of the public API."""

from __future__ import annotations

import pytest
import torch
from fields import Counting, MLPField, params_grad, rel_err
from torch import nn

from jagg_autograd import (
    CosineRouter,
    expected_anchor_count,
    jagg_trajectory,
    jagg_window,
)

F64 = torch.float64


def _setup(W=5, B=3, S=(2, 4), dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(W, B, *S, generator=g, dtype=dtype)
    t = torch.linspace(1.0, 0.2, W, dtype=dtype)
    up = torch.randn(W, B, *S, generator=g, dtype=dtype)
    return lat, t, up


@pytest.mark.parametrize("mode", ["jagg", "exact"])
@pytest.mark.parametrize("batching", ["stacked", "per_step"])
def test_values_equal_step_by_step_calls(mode, batching):
    lat, t, _ = _setup(dtype=torch.float32)
    model = MLPField(4, dtype=torch.float32)
    v = jagg_window(model, lat, t, mode=mode, batching=batching)
    ref = torch.stack([model(lat[k], t[k].expand(lat.shape[1])) for k in range(lat.shape[0])])
    if batching == "per_step":
        assert torch.equal(v, ref)  # bit for bit: every call has the rollout's batch
    else:
        torch.testing.assert_close(v, ref, rtol=1e-5, atol=1e-6)


def test_per_step_is_bitwise_with_router_and_trajectory():
    lat, t, _ = _setup(W=9, dtype=torch.float32)
    model = MLPField(4, dtype=torch.float32)
    v = jagg_trajectory(
        model, lat, t, window=4, batching="per_step", router=CosineRouter(threshold=0.999)
    )
    ref = torch.stack([model(lat[k], t[k].expand(lat.shape[1])) for k in range(9)])
    assert torch.equal(v, ref)


def test_jagg_window_pass_counts():
    W, B = 6, 3
    lat, t, up = _setup(W=W, B=B)
    model = Counting(MLPField(4))
    v, st = jagg_window(model, lat, t, return_stats=True)
    assert model.grad_samples == 2 * B and st.grad_samples == 2 * B
    assert [c for c in model.calls if c[1]] == [(2 * B, True)]  # one batched anchor call
    assert sum(n for n, g in model.calls if not g) == (W - 2) * B
    (v * up).sum().backward()
    assert model.backward_calls == 1 == st.backward_calls
    assert model.backward_samples == 2 * B


def test_exact_mode_pass_counts():
    W, B = 6, 3
    lat, t, up = _setup(W=W, B=B)
    model = Counting(MLPField(4))
    v, st = jagg_window(model, lat, t, mode="exact", batching="per_step", return_stats=True)
    (v * up).sum().backward()
    assert model.backward_calls == W == st.backward_calls
    assert st.grad_samples == W * B
    assert bool(st.exact.all())


@pytest.mark.parametrize("T,W", [(10, 4), (10, 3), (16, 4), (7, 7), (9, 2)])
def test_shared_anchor_trajectory_backward_is_anchor_count(T, W):
    B = 2
    lat, t, up = _setup(W=T, B=B)
    model = Counting(MLPField(4))
    v, st = jagg_trajectory(model, lat, t, window=W, return_stats=True)
    n_a = expected_anchor_count(T, W)
    assert len(st.anchors) == n_a
    (v * up).sum().backward()
    assert model.backward_calls == 1
    assert model.backward_samples == n_a * B == st.grad_samples
    assert st.scores.shape == (n_a - 1, B)


def test_disjoint_trajectory_two_anchors_per_window():
    T, W, B = 11, 4, 2  # windows [0..3], [4..7], [8..10]: the last one shorter
    lat, t, up = _setup(W=T, B=B)
    model = Counting(MLPField(4))
    v, st = jagg_trajectory(model, lat, t, window=W, shared_anchors=False, return_stats=True)
    assert st.windows == [(0, 3), (4, 7), (8, 10)]
    assert st.anchors == [0, 3, 4, 7, 8, 10]
    (v * up).sum().backward()
    assert model.backward_samples == 6 * B


def test_disjoint_last_single_step_is_exact():
    T, W, B = 9, 4, 2  # windows [0..3], [4..7] and the single step 8
    lat, t, up = _setup(W=T, B=B)
    model = MLPField(4)
    v, st = jagg_trajectory(model, lat, t, window=W, shared_anchors=False, return_stats=True)
    assert st.windows[-1] == (8, 8) and 8 in st.anchors
    got = params_grad((v * up).sum(), model)
    # Removing the upstream of step 8 changes the gradient by exactly its own VJP.
    up2 = up.clone()
    up2[8] = 0
    got2 = params_grad(
        (jagg_trajectory(model, lat, t, window=W, shared_anchors=False) * up2).sum(), model
    )
    own = params_grad((model(lat[8], t[8].expand(B)) * up[8]).sum(), model)
    assert rel_err(got - got2, own) < 1e-12


def test_chunk_size_bounds_no_grad_calls_and_keeps_gradient():
    W, B = 8, 3
    lat, t, up = _setup(W=W, B=B)
    base = MLPField(4)
    ref = params_grad((jagg_window(base, lat, t) * up).sum(), base)
    model = Counting(base)
    v = jagg_window(model, lat, t, chunk_size=2 * B)
    sizes = [n for n, g in model.calls if not g]
    assert sizes == [2 * B, 2 * B, 2 * B]
    assert rel_err(params_grad((v * up).sum(), model), ref) < 1e-12
    model.reset()
    jagg_window(model, lat, t, chunk_size=2)  # smaller than a step: splits the batch
    assert max(n for n, g in model.calls if not g) <= 2


def test_gradient_accumulation_and_backward_api():
    lat, t, up = _setup()
    model = MLPField(4)
    g1 = params_grad((jagg_window(model, lat, t) * up).sum(), model)
    g2 = params_grad((jagg_window(model, lat * 0.5, t) * up).sum(), model)
    model.zero_grad()
    (jagg_window(model, lat, t) * up).sum().backward()
    (jagg_window(model, lat * 0.5, t) * up).sum().backward()
    acc = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert rel_err(acc, g1 + g2) < 1e-12


def test_no_grad_returns_values_and_stores_nothing():
    lat, t, _ = _setup()
    model = Counting(MLPField(4))
    with torch.no_grad():
        v, st = jagg_window(model, lat, t, return_stats=True, router=CosineRouter())
    assert not v.requires_grad and v.grad_fn is None
    assert st.grad_samples == 0 and st.backward_calls == 0
    assert all(not g for _, g in model.calls)
    torch.testing.assert_close(v, jagg_window(model, lat, t).detach())


def test_sum_loss_with_expanded_upstream():
    """v.sum() sends a stride-0 expanded gradient into the Function."""
    lat, t, _ = _setup()
    model = MLPField(4)
    g = params_grad(jagg_window(model, lat, t).sum(), model)
    ref = params_grad((jagg_window(model, lat, t) * torch.ones_like(lat)).sum(), model)
    assert rel_err(g, ref) < 1e-12


class CondField(nn.Module):
    """v = MLP(z, t) * (1 + scale) + emb: checks cond tiling and gradients into cond."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = MLPField(4)
        self.seen: list[dict[str, torch.Tensor]] = []

    def forward(self, z, t, scale, emb, pos):
        self.seen.append({"scale": scale.detach().clone(), "pos": pos})
        assert pos.shape == (2, 3)  # unbatched: passed unchanged
        return self.inner(z, t) * (1 + scale.view(-1, 1, 1)) + emb.view(-1, 1, 4)


def test_cond_tiled_step_major_and_gets_interpolated_gradient():
    W, B = 5, 3
    lat, t, up = _setup(W=W, B=B)
    model = CondField()
    scale = torch.tensor([0.1, 0.2, 0.3], dtype=F64)
    emb = torch.randn(B, 4, dtype=F64, requires_grad=True)
    pos = torch.randn(2, 3)
    cond = {"scale": scale, "emb": emb, "pos": pos}
    v = jagg_window(model, lat, t, cond=cond)
    anchor_scale = model.seen[0]["scale"]
    assert torch.equal(anchor_scale, torch.cat([scale, scale]))  # step-major tiling
    # emb enters additively: its Jacobian is t-independent, so its JAGG gradient is exact.
    (g_emb,) = torch.autograd.grad((v * up).sum(), emb)
    ve = jagg_window(model, lat, t, cond=cond, mode="exact")
    (g_exact,) = torch.autograd.grad((ve * up).sum(), emb)
    assert rel_err(g_emb, g_exact) < 1e-12


def test_batched_cond_overrides_dim0_rule():
    W, B = 4, 2
    lat, t, _ = _setup(W=W, B=B)
    seen = []

    def model(z, t, ids, lab):
        seen.append((ids.shape, lab.shape))
        return z * lab.view(-1, 1, 1)

    ids = torch.zeros(B, 3)  # dim 0 happens to equal B, but it is not batched
    lab = torch.ones(B, dtype=F64)
    jagg_window(model, lat, t, cond={"ids": ids, "lab": lab}, batched_cond={"lab"})
    assert seen[0] == ((B, 3), (2 * B,))


def test_routed_subset_slices_cond():
    W, B = 6, 4
    lat, t, _ = _setup(W=W, B=B)
    model = CondField()
    scale = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    cond = {"scale": scale, "emb": torch.zeros(B, 4, dtype=F64), "pos": torch.zeros(2, 3)}
    lat = lat.clone()
    lat[2, 1] *= 30.0  # makes sample 1 non-linear
    router = CosineRouter(threshold=0.95)
    # emb is (B, 4) with B = 4: ambiguous for auto-detection (it warns), so name the keys.
    _, st = jagg_window(
        model, lat, t, cond=cond, router=router, return_stats=True, batched_cond=["scale", "emb"]
    )
    routed = st.exact.nonzero().flatten()
    assert routed.numel() >= 1
    last = model.seen[-1]["scale"]
    assert torch.equal(last, scale[routed].repeat(W - 2))


def test_model_output_dtype_follows_model():
    lat, t, up = _setup(dtype=torch.float32)

    def model(z, t):
        return (z * 2).to(torch.float64)

    v = jagg_window(model, lat, t)
    assert v.dtype == torch.float64
