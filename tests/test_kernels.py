"""Triton kernels against their PyTorch references (interpreted on CPU).

Odd sizes, every supported dtype, non-contiguous and stride-0 inputs, NaN-poisoned
outputs, and the public API with backend="triton" against backend="torch".
"""

from __future__ import annotations

import os

import pytest
import torch
from fields import MLPField, params_grad, rel_err

from jagg_autograd import jagg_mix, jagg_mix_ref, jagg_trajectory, jagg_window
from jagg_autograd.mix import anchor_slots
from jagg_autograd.router import cosine_route, cosine_route_ref

triton = pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The kernel-vs-reference tests run interpreted on CPU, compiled with JAGG_TEST_DEVICE=cuda.
DEV = torch.device(os.environ.get("JAGG_TEST_DEVICE", "cpu"))


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # Both sides accumulate in fp32; they may differ by one rounding of the output dtype.
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 1.6e-2, "atol": 1.6e-2},
    }[dtype]


def _weights(T: int, B: int, anchors: list[int], g: torch.Generator):
    wc = torch.rand(T, B, generator=g, dtype=torch.float64)
    wn = torch.rand(T, B, generator=g, dtype=torch.float64)
    wc[anchors] = 1.0
    wn[anchors] = 0.0
    return wc, wn


LAYOUTS = [
    (2, [0, 1]),
    (7, [0, 6]),
    (10, [0, 3, 6, 9]),
    (11, [0, 3, 4, 7, 8, 10]),
    (9, [0, 3, 4, 7, 8]),
]


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,anchors", LAYOUTS)
@pytest.mark.parametrize("B,N", [(1, 1), (3, 63), (2, 100), (5, 1025)])
def test_mix_kernel_matches_reference(dtype, T, anchors, B, N):
    g = torch.Generator().manual_seed(T * 100 + N)
    grad = torch.randn(T, B, N, generator=g).to(DEV, dtype)
    wc, wn = (w.to(DEV) for w in _weights(T, B, anchors, g))
    a = torch.tensor(anchors, device=DEV)
    got = jagg_mix(grad, wc, wn, a, backend="triton")
    want = jagg_mix_ref(grad, wc, wn, a)
    assert got.dtype == dtype and got.shape == (len(anchors), B, N)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), **_tol(dtype))


def _mask_weights(T: int, B: int, mask: torch.Tensor, g: torch.Generator):
    """Random interpolation weights consistent with per-sample anchors ``mask``."""
    wc = torch.rand(T, B, generator=g, dtype=torch.float64)
    wn = torch.rand(T, B, generator=g, dtype=torch.float64)
    wc[mask] = 1.0
    wn[mask] = 0.0
    steps = torch.arange(T).unsqueeze(1).expand(T, B)
    first = torch.where(mask, steps, T).amin(0)
    last = torch.where(mask, steps, -1).amax(0)
    outside = (steps < first) | (steps > last)
    wc[outside] = 0.0
    wn[outside] = 0.0
    return wc, wn


def _mix_brute(grad, wc, wn, mask):
    """The mixing op as a loop over samples and steps, in float64."""
    T, B, N = grad.shape
    rows = {}
    for k, b in mask.nonzero().tolist():
        rows[(k, b)] = len(rows)
    out = torch.zeros(len(rows), N, dtype=torch.float64)
    for b in range(B):
        an = [k for k in range(T) if mask[k, b]]
        for k in range(T):
            cur = [a for a in an if a <= k]
            nxt = [a for a in an if a > k]
            if cur:
                out[rows[(cur[-1], b)]] += wc[k, b] * grad[k, b].double()
            if nxt:
                out[rows[(nxt[0], b)]] += wn[k, b] * grad[k, b].double()
    return out


@pytest.mark.usefixtures("nan_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,B,N,seed", [(2, 1, 1, 0), (9, 3, 63, 1), (10, 5, 100, 2), (7, 2, 1025, 3)])
def test_mix_kernel_per_sample_anchors(dtype, T, B, N, seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(T, B, generator=g) < 0.4
    mask[0, 0] = True  # at least one anchor pair; some samples may have none or one
    wc, wn = _mask_weights(T, B, mask, g)
    grad = torch.randn(T, B, N, generator=g).to(dtype)
    want = _mix_brute(grad, wc, wn, mask)
    ref = jagg_mix_ref(grad, wc, wn, mask)
    got = jagg_mix(grad.to(DEV), wc.to(DEV), wn.to(DEV), mask.to(DEV), backend="triton")
    assert got.shape == ref.shape == (int(mask.sum()), N) and got.dtype == dtype
    assert not torch.isnan(got).any()
    torch.testing.assert_close(ref.double(), want, **_tol(dtype))
    torch.testing.assert_close(got.cpu().float(), ref.float(), **_tol(dtype))


def test_mix_shared_steps_equal_the_same_mask():
    T, B, N = 10, 3, 17
    g = torch.Generator().manual_seed(5)
    a = [0, 3, 6, 9]
    wc, wn = _weights(T, B, a, g)
    grad = torch.randn(T, B, N, generator=g, dtype=torch.float64)
    mask = torch.zeros(T, B, dtype=torch.bool)
    mask[a] = True
    shared = jagg_mix_ref(grad, wc, wn, torch.tensor(a))
    per = jagg_mix_ref(grad, wc, wn, mask)
    torch.testing.assert_close(shared.reshape(-1, N), per, rtol=0, atol=1e-15)
    torch.testing.assert_close(per, _mix_brute(grad, wc, wn, mask), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mix_kernel_non_contiguous_and_expanded(dtype):
    T, B, N = 6, 3, 123
    g = torch.Generator().manual_seed(0)
    wc, wn = _weights(T, B, [0, 2, 5], g)
    wc, wn = wc.to(DEV), wn.to(DEV)
    a = torch.tensor([0, 2, 5], device=DEV)
    permuted = torch.randn(B, N, T, generator=g).to(DEV, dtype).permute(2, 0, 1)
    expanded = torch.randn(1, 1, 1, generator=g).to(DEV, dtype).expand(T, B, N)
    sliced = torch.randn(T, B, 2 * N, generator=g).to(DEV, dtype)[..., ::2]
    for grad in (permuted, expanded, sliced):
        assert not grad.is_contiguous()
        got = jagg_mix(grad, wc, wn, a, backend="triton")
        torch.testing.assert_close(
            got.float(), jagg_mix_ref(grad, wc, wn, a).float(), **_tol(dtype)
        )


def test_mix_reference_formula():
    """The reference itself against the window formula G_0 = sum (1-a) g, G_1 = sum a g."""
    T, B, N = 5, 2, 3
    g = torch.randn(T, B, N, dtype=torch.float64)
    alpha = torch.rand(T, B, dtype=torch.float64)
    alpha[0], alpha[-1] = 0.0, 1.0
    wc, wn = 1 - alpha, alpha.clone()
    wc[-1], wn[-1] = 1.0, 0.0  # the last anchor's own gradient counts once, on itself
    out = jagg_mix_ref(g, wc, wn, torch.tensor([0, T - 1]))
    torch.testing.assert_close(out[0], ((1 - alpha[:-1, :, None]) * g[:-1]).sum(0))
    torch.testing.assert_close(out[1], (alpha[1:, :, None] * g[1:]).sum(0))


def test_mix_float64_stays_on_reference():
    g = torch.randn(3, 2, 4, dtype=torch.float64)
    wc, wn = torch.ones(3, 2, dtype=torch.float64), torch.zeros(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='triton'"):
        jagg_mix(g, wc, wn, torch.tensor([0, 1, 2]), backend="triton")
    out = jagg_mix(g, wc, wn, torch.tensor([0, 1, 2]), backend="auto")
    assert out.dtype == torch.float64 and torch.equal(out, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,N", [(1, 1), (3, 63), (2, 1030)])
def test_route_kernel_matches_reference(dtype, B, N):
    T = 10
    g = torch.Generator().manual_seed(N)
    base = torch.randn(2, B, N, generator=g)
    a = torch.rand(T, B, generator=g)
    # Near-linear velocities plus noise: scores spread over (0, 1].
    v = ((1 - a[..., None]) * base[0] + a[..., None] * base[1]) + 0.3 * torch.randn(
        T, B, N, generator=g
    )
    v, a = v.to(DEV, dtype), a.to(DEV)
    left, right = [0, 3, 4, 8], [3, 4, 8, 9]
    got = cosine_route(v, a, left, right, backend="triton")
    want = cosine_route_ref(v, a, left, right)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    perm = v.permute(1, 2, 0).contiguous().permute(2, 0, 1)
    torch.testing.assert_close(
        cosine_route(perm, a, left, right, backend="triton"), want, rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shared", [True, False])
def test_public_api_triton_equals_torch(dtype, shared):
    T, B = 9, 3
    g = torch.Generator().manual_seed(1)
    model = MLPField(5, dtype=dtype)
    lat = torch.randn(T, B, 3, 5, generator=g).to(dtype)
    t = torch.linspace(1.0, 0.05, T).to(dtype)
    up = torch.randn(T, B, 3, 5, generator=g).to(dtype)
    from jagg_autograd import CosineRouter

    out = {}
    for backend in ("torch", "triton"):
        v, st = jagg_trajectory(
            model,
            lat,
            t,
            window=4,
            shared_anchors=shared,
            backend=backend,
            router=CosineRouter(0.5),
            return_stats=True,
        )
        out[backend] = (params_grad((v.float() * up.float()).sum(), model), v.detach(), st)
    gt, vt, st_t = out["triton"]
    gr, vr, st_r = out["torch"]
    assert torch.equal(vt, vr)
    assert torch.equal(st_t.exact, st_r.exact)
    torch.testing.assert_close(st_t.scores, st_r.scores, rtol=1e-5, atol=1e-5)
    assert rel_err(gt.float(), gr.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_auto_on_cpu_uses_reference(monkeypatch):
    import jagg_autograd.kernels.jagg_mix as km

    def boom(*a, **k):
        raise AssertionError("auto must not run the interpreted kernel on CPU")

    monkeypatch.setattr(km, "jagg_mix_triton", boom)
    lat = torch.randn(4, 2, 3)
    model = MLPField(3, dtype=torch.float32)
    jagg_window(model, lat, torch.linspace(1, 0, 4), backend="auto").sum().backward()


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        jagg_mix(
            torch.randn(2, 1, 3),
            torch.ones(2, 1),
            torch.zeros(2, 1),
            torch.tensor([0, 1]),
            backend="triton",
        )


def test_kernels_are_custom_ops_that_compile_without_graph_breaks():
    """Registered as torch.library ops: fake shapes check out, and a compiled caller
    captures the kernel as one node (fullgraph=True fails on any graph break)."""
    from jagg_autograd._custom_ops import cosine_route_partials_op, jagg_mix_op

    T, B, N = 7, 2, 37
    grad = torch.randn(T, B, N)
    wc, wn = _weights(T, B, [0, 3, 6], torch.Generator().manual_seed(0))
    a = torch.tensor([0, 3, 6])
    slots, n_out = anchor_slots(a, T, B)
    torch.library.opcheck(jagg_mix_op, (grad, wc.float(), wn.float(), slots, n_out))
    v, alpha = torch.randn(T, B, N), torch.rand(T, B)
    lr = (torch.tensor([0, 3]), torch.tensor([3, 6]))
    torch.library.opcheck(cosine_route_partials_op, (v, alpha, *lr))

    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=counting, fullgraph=True)
    def step(g, w1, w2, slots):
        return jagg_mix_op(g * 2, w1, w2, slots, n_out) + 1

    out = step(grad, wc.float(), wn.float(), slots)
    assert len(graphs) == 1
    want = jagg_mix_ref(grad * 2, wc, wn, a).reshape(n_out, N) + 1
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
