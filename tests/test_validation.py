"""Bad input is a clear ValueError/TypeError naming the argument, before any model call."""

from __future__ import annotations

import re

import pytest
import torch

from jagg_autograd import CosineRouter, jagg_trajectory, jagg_window


class Spy:
    def __init__(self, out=None):
        self.calls = 0
        self.out = out

    def __call__(self, z, t, **cond):
        self.calls += 1
        return z * 2 if self.out is None else self.out(z)


def _ok(W=4, B=2):
    return torch.randn(W, B, 3), torch.linspace(1.0, 0.1, W)


CASES = [
    (
        "W < 2",
        lambda m: jagg_window(m, torch.randn(1, 2, 3), torch.tensor([1.0])),
        ValueError,
        "W >= 2",
    ),
    (
        "1-D latents",
        lambda m: jagg_window(m, torch.randn(4), torch.linspace(1, 0, 4)),
        ValueError,
        "latents",
    ),
    (
        "shape mismatch",
        lambda m: jagg_window(m, _ok()[0], torch.linspace(1, 0, 5)),
        ValueError,
        "timesteps",
    ),
    (
        "per-sample mismatch",
        lambda m: jagg_window(m, _ok()[0], torch.rand(4, 3)),
        ValueError,
        "timesteps",
    ),
    (
        "non-monotone",
        lambda m: jagg_window(m, _ok()[0], torch.tensor([1.0, 0.5, 0.7, 0.1])),
        ValueError,
        "monotone",
    ),
    (
        "repeated",
        lambda m: jagg_window(m, _ok()[0], torch.tensor([1.0, 0.5, 0.5, 0.1])),
        ValueError,
        "monotone",
    ),
    (
        "mixed directions per sample is fine but not within one",
        lambda m: jagg_window(
            m, _ok()[0], torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.7, 0.6], [0.1, 1.0]])
        ),
        ValueError,
        "monotone",
    ),
    (
        "nan timestep",
        lambda m: jagg_window(m, _ok()[0], torch.tensor([1.0, float("nan"), 0.3, 0.1])),
        ValueError,
        "finite",
    ),
    (
        "inf timestep",
        lambda m: jagg_window(m, _ok()[0], torch.tensor([float("inf"), 0.5, 0.3, 0.1])),
        ValueError,
        "finite",
    ),
    (
        "bool timesteps",
        lambda m: jagg_window(m, _ok()[0], torch.tensor([True, False, True, False])),
        TypeError,
        "timesteps",
    ),
    (
        "int latents",
        lambda m: jagg_window(m, torch.ones(4, 2, 3, dtype=torch.long), _ok()[1]),
        TypeError,
        "latents",
    ),
    (
        "latents require grad",
        lambda m: jagg_window(m, _ok()[0].requires_grad_(), _ok()[1]),
        ValueError,
        "latents",
    ),
    ("latents not a tensor", lambda m: jagg_window(m, [[1.0]], _ok()[1]), TypeError, "latents"),
    ("unknown mode", lambda m: jagg_window(m, *_ok(), mode="fast"), ValueError, "mode"),
    ("unknown backend", lambda m: jagg_window(m, *_ok(), backend="cuda"), ValueError, "backend"),
    (
        "unknown batching",
        lambda m: jagg_window(m, *_ok(), batching="chunked"),
        ValueError,
        "batching",
    ),
    ("chunk_size 0", lambda m: jagg_window(m, *_ok(), chunk_size=0), ValueError, "chunk_size"),
    ("chunk_size float", lambda m: jagg_window(m, *_ok(), chunk_size=2.0), TypeError, "chunk_size"),
    ("router type", lambda m: jagg_window(m, *_ok(), router=0.9), TypeError, "router"),
    ("cond type", lambda m: jagg_window(m, *_ok(), cond=[1, 2]), TypeError, "cond"),
    (
        "batched_cond unknown key",
        lambda m: jagg_window(m, *_ok(), cond={}, batched_cond={"x"}),
        ValueError,
        "batched_cond",
    ),
    (
        "batched_cond wrong dim 0",
        lambda m: jagg_window(m, *_ok(), cond={"x": torch.ones(5)}, batched_cond={"x"}),
        ValueError,
        "batched_cond",
    ),
    ("window too big", lambda m: jagg_trajectory(m, *_ok(W=5), window=6), ValueError, "window"),
    ("window 1", lambda m: jagg_trajectory(m, *_ok(W=5), window=1), ValueError, "window"),
    ("window float", lambda m: jagg_trajectory(m, *_ok(W=5), window=3.0), TypeError, "window"),
    ("window bool", lambda m: jagg_trajectory(m, *_ok(W=5), window=True), TypeError, "window"),
    (
        "trajectory of one step",
        lambda m: jagg_trajectory(m, torch.randn(1, 2), torch.ones(1), window=2),
        ValueError,
        "window",
    ),
    (
        "shared_anchors type",
        lambda m: jagg_trajectory(m, *_ok(W=5), window=3, shared_anchors=1),
        TypeError,
        "shared_anchors",
    ),
]


@pytest.mark.parametrize("name,call,exc,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_before_model_call(name, call, exc, match):
    spy = Spy()
    with pytest.raises(exc, match=match):
        call(spy)
    assert spy.calls == 0


@pytest.mark.parametrize("per_sample", [False, True])
def test_flow_grpo_layout_is_named_before_the_window(per_sample):
    """A Flow-GRPO (B, T, ...) buffer, B = 3 and T = 10, with window=4: read as (T, B, ...)
    it has "T" = 3 < window, but the message must name the (T, B, ...) layout, not the
    window range."""
    B, T = 3, 10
    lat = torch.randn(B, T, 4)  # Flow-GRPO's layout, passed as is
    sig = torch.linspace(1.0, 0.1, T)
    spy = Spy()
    ts = sig.expand(B, T) if per_sample else sig
    with pytest.raises(ValueError, match=re.escape("(T, B, ...)")) as exc:
        jagg_trajectory(spy, lat, ts, window=4)
    assert "window must be" not in str(exc.value)
    assert "transpose" in str(exc.value)
    assert spy.calls == 0
    jagg_trajectory(spy, lat.transpose(0, 1), ts.T if per_sample else ts, window=4)  # the fix
    assert spy.calls > 0


def test_model_not_callable():
    with pytest.raises(TypeError, match="model"):
        jagg_window(42, *_ok())


def test_router_range_checked_at_construction():
    with pytest.raises(ValueError, match="jagg_frac"):
        CosineRouter(jagg_frac=2.0)


@pytest.mark.parametrize("mode", ["jagg", "exact"])
def test_model_returning_wrong_shape_or_type(mode):
    with pytest.raises(ValueError, match="shape"):
        jagg_window(Spy(out=lambda z: z[:, :1]), *_ok(), mode=mode)
    with pytest.raises(TypeError, match="torch.Tensor"):
        jagg_window(Spy(out=lambda z: z.tolist()), *_ok(), mode=mode)
    spy = Spy(out=lambda z: z[:-1])
    with pytest.raises(ValueError, match="shape"):
        jagg_window(spy, *_ok(), mode=mode)
    assert spy.calls == 1  # caught at the first model call


def test_timesteps_validated_at_given_precision():
    """Distinct in float64 but equal once cast to the latents' bf16: accepted, and the model
    sees the cast copy."""
    lat = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    t = torch.tensor([1.0, 1.0 - 1e-6, 0.5], dtype=torch.float64)
    seen = []

    def model(z, t):
        seen.append(t)
        return z

    jagg_window(model, lat, t)
    assert all(s.dtype == torch.bfloat16 for s in seen)
    assert seen[0].shape == (4,)


def test_integer_timesteps_accepted():
    lat = torch.randn(4, 2, 3)
    v = jagg_window(lambda z, t: z * t.view(-1, 1), lat, torch.tensor([999, 750, 500, 250]))
    assert v.shape == lat.shape


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch():
    lat = torch.randn(4, 2, 3, device="cuda")
    with pytest.raises(ValueError, match="timesteps"):
        jagg_window(Spy(), lat, torch.linspace(1, 0, 4))


def test_device_mismatch_of_model_and_cond_on_meta():
    """The meta device stands in for a second device on a CPU-only machine."""
    lat, t = _ok()
    with pytest.raises(ValueError, match="timesteps"):
        jagg_window(Spy(), lat, t.to("meta"))
    with pytest.raises(ValueError, match="cond"):
        jagg_window(Spy(), lat, t, cond={"c": torch.ones(2, device="meta")})
    lin = torch.nn.Linear(3, 3, device="meta")
    with pytest.raises(ValueError, match="model"):
        jagg_window(lin, lat, t)


def test_per_sample_directions_may_differ():
    """Monotone per sample: one sample's schedule rises while the other's falls."""
    lat = torch.randn(4, 2, 3, dtype=torch.float64)
    t = torch.tensor([[1.0, 0.0], [0.6, 0.2], [0.5, 0.7], [0.1, 0.9]], dtype=torch.float64)
    w = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))

    def model(z, t):
        return torch.tanh(z) + t.view(-1, 1) * w**2 + w

    def grad(mode):
        return torch.autograd.grad((jagg_window(model, lat, t, mode=mode) * lat).sum(), w)[0]

    # Family (b): parameter Jacobian affine in t, so JAGG is exact for both samples.
    assert torch.allclose(grad("jagg"), grad("exact"), rtol=1e-12, atol=0)
