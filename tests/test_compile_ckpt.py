"""JAGG with activation checkpointing and torch.compile inside the user's model (CPU).

* Per-block activation checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``,
  the way DanceGRPO/MixGRPO wrap FLUX blocks): JAGG gradients equal JAGG gradients without
  checkpointing, for a window and a trajectory, with the router recomputing some samples.
* ``torch.compile``: a counting backend shows that a model called through ``jagg_window``
  compiles into one graph per (grad mode, shape) with no graph break; the real inductor
  backend (C++ on CPU) gives the eager values and JAGG gradients.
* Determinism: the same seed gives bit-identical JAGG gradients on repeated runs.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from jagg_autograd import CosineRouter, jagg_trajectory, jagg_window

L, D = 4, 8


class Block(nn.Module):
    """adaLN-modulated MLP block with a residual (DiT-style)."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.mod = nn.Linear(d, 2 * d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

        self.calls = 0  # forward executions, recomputations by checkpoint included

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.calls += 1
        shift, scale = self.mod(emb).unsqueeze(1).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale) + shift
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


class TinyDiT(nn.Module):
    """v = f(z, t, y) with optional per-block non-reentrant activation checkpointing."""

    def __init__(self, depth: int = 2, hidden: int = 16, ckpt: bool = False) -> None:
        super().__init__()
        self.t_embed = nn.Linear(1, D)
        self.blocks = nn.ModuleList(Block(D, hidden) for _ in range(depth))
        self.out = nn.Linear(D, D)
        self.ckpt = ckpt

    def forward(self, z: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        emb = torch.nn.functional.silu(self.t_embed(t.view(-1, 1)) + y)
        x = z
        for blk in self.blocks:
            if self.ckpt and torch.is_grad_enabled():
                x = checkpoint(blk, x, emb, use_reentrant=False)
            else:
                x = blk(x, emb)
        return self.out(x)


def make_model(seed: int = 0, **kw: Any) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT(**kw)


def make_data(T: int = 7, B: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    """A pseudo-rollout: latents on a segment plus per-sample off-segment noise, so the
    threshold router sends some samples to the exact gradient and keeps others."""
    g = torch.Generator().manual_seed(seed)
    z0 = torch.randn(B, L, D, generator=g)
    z1 = torch.randn(B, L, D, generator=g)
    t = torch.linspace(1.0, 0.1, T)
    a = ((t - t[0]) / (t[-1] - t[0])).view(T, 1, 1, 1)
    off = torch.linspace(0.0, 3.0, B).view(1, B, 1, 1)
    lat = (1 - a) * z0 + a * z1 + off * torch.randn(T, B, L, D, generator=g)
    return {
        "lat": lat,
        "t": t,
        "y": torch.randn(B, D, generator=g),
        "target": torch.randn(T, B, L, D, generator=g),
    }


def grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def jagg_grads(
    model: Any,
    params_of: nn.Module,
    d: dict[str, torch.Tensor],
    kind: str,
    router: CosineRouter | None,
    **kw: Any,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(velocities, parameter gradient, stats) of a JAGG window (W=4) or trajectory."""
    params_of.zero_grad(set_to_none=True)
    if kind == "window":
        v, st = jagg_window(
            model,
            d["lat"][:4],
            d["t"][:4],
            cond={"y": d["y"]},
            router=router,
            return_stats=True,
            **kw,
        )
        tgt = d["target"][:4]
    else:
        v, st = jagg_trajectory(
            model,
            d["lat"],
            d["t"],
            window=3,
            cond={"y": d["y"]},
            router=router,
            return_stats=True,
            **kw,
        )
        tgt = d["target"]
    ((v - tgt) ** 2).mean().backward()
    return v.detach(), grads(params_of), st


# ----------------------------------------------------------------- activation checkpointing


@pytest.mark.parametrize("kind", ["window", "trajectory"])
@pytest.mark.parametrize("routed", [False, True])
def test_checkpointed_blocks_give_same_jagg_gradients(kind, routed):
    d = make_data()
    router = CosineRouter(threshold=0.97) if routed else None
    plain, ck = make_model(), make_model(ckpt=True)
    v0, g0, st0 = jagg_grads(plain, plain, d, kind, router)
    v1, g1, st1 = jagg_grads(ck, ck, d, kind, router)
    if routed:  # the router really recomputed some samples, not all
        assert st0.exact.any() and not st0.exact.all(), st0.scores
        assert torch.equal(st0.exact, st1.exact)
    assert st0.grad_samples == st1.grad_samples
    assert torch.equal(v0, v1)
    # Recomputation replays the same CPU kernels on the same inputs: bit for bit.
    assert torch.equal(g0, g1), rel(g1, g0)


@pytest.mark.parametrize("kind", ["window", "trajectory"])
def test_deferred_with_checkpointed_blocks_equals_eager(kind):
    # The deferred backward runs the anchors' forward inside the backward; checkpointing
    # inside the model then recomputes within that (nested) backward.
    d = make_data()
    router = CosineRouter(threshold=0.97)
    plain, ck = make_model(), make_model(ckpt=True)
    v0, g0, _ = jagg_grads(plain, plain, d, kind, router)
    v1, g1, _ = jagg_grads(ck, ck, d, kind, router, deferred=True, chunk_size=3)
    # Values differ by batch round-off only (the no-grad forward stacks every step).
    torch.testing.assert_close(v0, v1, rtol=1e-6, atol=1e-6)
    assert rel(g1, g0) < 1e-6
    calls = ck.blocks[0].calls
    jagg_grads(ck, ck, d, kind, None, deferred=True, values=v1)
    assert ck.blocks[0].calls > calls  # anchors ran (and were replayed) in the backward


def test_checkpointing_really_recomputes():
    """Guard against a no-op: the checkpointed model runs its blocks again in backward."""
    d = make_data()
    ck = make_model(ckpt=True)
    blk = ck.blocks[0]
    v = jagg_window(ck, d["lat"][:4], d["t"][:4], cond={"y": d["y"]})
    assert blk.calls == 2  # anchors (with grad) + interior (no grad)
    v.sum().backward()
    assert blk.calls == 3  # one replay of the one anchor forward: nothing else was kept


# ---------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("ckpt", [False, True])
def test_same_seed_bit_identical_gradients(ckpt):
    d = make_data()
    router = CosineRouter(threshold=0.97)
    runs = []
    for _ in range(2):
        m = make_model(ckpt=ckpt)
        runs.append(jagg_grads(m, m, d, "trajectory", router)[1])
    assert torch.equal(runs[0], runs[1])


# ------------------------------------------------------------------------------ compile


class CountingBackend:
    """A torch.compile backend that runs the captured graphs eagerly and counts them."""

    def __init__(self) -> None:
        self.graphs: list[int] = []  # op count of every graph handed to the backend

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.graphs.append(sum(1 for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward


def test_compiled_model_inside_jagg_window_has_no_graph_breaks():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d = make_data(B=2)
    model = make_model()
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    # W=4, B=2: the anchor call (2B, with grad) and the interior call ((W-2)B, no grad)
    # have the same shape: one graph per grad mode, none for anything jagg does around it.
    v, g, _ = jagg_grads(cm, model, d, "window", None)
    assert len(backend.graphs) == 2, backend.graphs
    assert dict(counters["graph_break"]) == {}
    # Calling it again reuses the graphs: no recompilation either.
    jagg_grads(cm, model, d, "window", None)
    assert len(backend.graphs) == 2
    ve, ge, _ = jagg_grads(model, model, d, "window", None)
    assert torch.equal(v, ve) and torch.equal(g, ge)

    # The model on its own, as dynamo's explain sees it: one graph, zero breaks.
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(d["lat"][0], d["t"][:1].expand(2), d["y"])
    assert ex.graph_count == 1 and ex.graph_break_count == 0


def test_compiled_checkpointed_model_inside_jagg_window():
    import torch._dynamo

    torch._dynamo.reset()
    d = make_data(B=2)
    model = make_model(ckpt=True)
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    v, g, _ = jagg_grads(cm, model, d, "window", None)
    ref = make_model()
    ve, ge, _ = jagg_grads(ref, ref, d, "window", None)
    torch.testing.assert_close(v, ve, rtol=1e-6, atol=1e-6)
    assert rel(g, ge) < 1e-6
    assert len(backend.graphs) == 2


def test_compiled_model_in_deferred_mode():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    d = make_data(B=2)
    model = make_model()
    backend = CountingBackend()
    cm = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    ve, ge, _ = jagg_grads(model, model, d, "trajectory", None)
    v, g, _ = jagg_grads(cm, model, d, "trajectory", None, deferred=True, values=ve)
    assert torch.equal(v, ve)
    assert rel(g, ge) < 1e-6
    assert dict(counters["graph_break"]) == {}
    assert 1 <= len(backend.graphs) <= 2  # the B-sample anchor chunks share one graph


def test_inductor_compiled_model_matches_eager_inside_jagg_window():
    """The real backend: inductor generates and builds C++ for the CPU (slow: tiny shapes)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    d = make_data(B=2)
    model = make_model(depth=1)
    t0 = time.monotonic()
    with inductor_config.patch(compile_threads=1):  # no worker pool on a shared 2-core box
        cm = torch.compile(model, backend="inductor", dynamic=False)
        v, g, _ = jagg_grads(cm, model, d, "window", None)
    elapsed = time.monotonic() - t0
    ve, ge, _ = jagg_grads(model, model, d, "window", None)
    torch.testing.assert_close(v, ve, rtol=1e-5, atol=1e-6)
    assert rel(g, ge) < 1e-5, rel(g, ge)
    assert elapsed < 600
