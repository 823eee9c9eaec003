"""Velocity fields for the tests: families on which JAGG is provably exact, and ones where
it is not, plus a wrapper that counts forward-with-grad samples and backward calls."""

from __future__ import annotations

import torch
from torch import nn


class AffineField(nn.Module):
    """f(z, t) = M(theta) z + t u(theta) + c(theta): affine in (z, t), nonlinear in theta.

    JAGG is exact on latents that lie on the segment between the window's endpoints at
    the timesteps' own interpolation coordinate (family (a)).
    """

    def __init__(self, d: int, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.A = nn.Parameter(0.5 * torch.randn(d, d, generator=g, dtype=dtype))
        self.u = nn.Parameter(torch.randn(d, generator=g, dtype=dtype))
        self.c = nn.Parameter(torch.randn(d, generator=g, dtype=dtype))

    def forward(
        self, z: torch.Tensor, t: torch.Tensor, scale: torch.Tensor | None = None
    ) -> torch.Tensor:
        shape = z.shape
        x = z.reshape(shape[0], -1, self.A.shape[0])
        m = torch.tanh(self.A) @ self.A  # nonlinear in theta, linear in z
        out = x @ m.T + t.view(-1, 1, 1) * torch.sin(self.u) + self.c**2
        if scale is not None:
            out = out * scale.view(-1, 1, 1)
        return out.reshape(shape)


class SeparableField(nn.Module):
    """f(z, t) = phi(z) + a(theta) + t b(theta): phi nonlinear but parameter-free, so the
    parameter Jacobian is affine in t for ANY latents (family (b))."""

    def __init__(self, d: int, *, dtype: torch.dtype = torch.float64, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("R", torch.randn(d, d, generator=g, dtype=dtype))
        self.a = nn.Parameter(torch.randn(d, generator=g, dtype=dtype))
        self.b = nn.Parameter(torch.randn(d, d, generator=g, dtype=dtype) * 0.3)

    def forward(self, z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        shape = z.shape
        x = z.reshape(shape[0], -1, self.R.shape[0])
        phi = torch.tanh(x @ self.R) * x
        h = torch.exp(self.a) + t.view(-1, 1, 1) * (torch.sin(self.b).sum(0))
        return (phi + h).reshape(shape)


class MLPField(nn.Module):
    """A genuinely nonlinear field in (z, t): JAGG is only approximate here."""

    def __init__(
        self, d: int, hidden: int = 16, *, dtype: torch.dtype = torch.float64, seed: int = 0
    ):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(
            nn.Linear(d + 1, hidden, dtype=dtype), nn.SiLU(), nn.Linear(hidden, d, dtype=dtype)
        )

    def forward(self, z: torch.Tensor, t: torch.Tensor, **_: object) -> torch.Tensor:
        shape = z.shape
        x = z.reshape(shape[0], -1, shape[-1])
        tt = t.view(-1, 1, 1).expand(-1, x.shape[1], 1).to(x.dtype)
        return (self.net(torch.cat([x, tt], -1)) * (1 + x)).reshape(shape)


class Counting(nn.Module):
    """Counts forward calls/samples with grad and how many of those outputs backward reached."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.grad_samples = 0
        self.backward_calls = 0
        self.backward_samples = 0

    def forward(self, z: torch.Tensor, t: torch.Tensor, **cond: object) -> torch.Tensor:
        out = self.inner(z, t, **cond)
        self.calls.append((z.shape[0], out.requires_grad))
        if out.requires_grad:
            self.grad_samples += z.shape[0]
            n = z.shape[0]

            def hook(grad: torch.Tensor) -> None:
                self.backward_calls += 1
                self.backward_samples += n

            out.register_hook(hook)
        return out


def params_grad(loss: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Flattened parameter gradient of ``loss``."""
    ps = [p for p in module.parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, ps, allow_unused=True)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(gs, ps)]
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def segment_latents(z0: torch.Tensor, z1: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Latents on the straight segment z0 -> z1 at the timesteps' interpolation coordinate.

    z0, z1: (B, *S); t: (W,) or (W, B).  Returns (W, B, *S).
    """
    W = t.shape[0]
    tt = t if t.dim() == 2 else t.unsqueeze(1).expand(W, z0.shape[0])
    a = (tt - tt[0]) / (tt[-1] - tt[0])
    a = a.view(W, z0.shape[0], *([1] * (z0.dim() - 1))).to(z0.dtype)
    return (1 - a) * z0 + a * z1


def spread_timesteps(T: int) -> torch.Tensor:
    """(T,) float64 timesteps from 1 down to 0 with uneven gaps (seeded by ``T``), so
    that no interpolation weight is accidentally a round number."""
    g = torch.Generator().manual_seed(T)
    gaps = 0.05 + torch.rand(T, generator=g, dtype=torch.float64)
    return (gaps.cumsum(0) / gaps.sum()).flip(0)


def causal_reference(
    model: nn.Module, lat: torch.Tensor, t: torch.Tensor, up: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Brute force of the causal fold: sum_k J_{p(k)}^T g_k, p(k) the sample's last anchor
    at or before k, one VJP per (step, sample) pair through its anchor's own forward.

    lat, up: (T, B, *S); t: (T,); mask: (T, B) bool anchors.  Steps before a sample's
    first anchor, and steps whose g is zero, contribute nothing.
    """
    T, B = mask.shape
    total = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
    total = torch.zeros_like(total)
    for b in range(B):
        anchors = mask[:, b].nonzero().flatten().tolist()
        for k in range(T):
            prev = [a for a in anchors if a <= k]
            if not prev or not bool(up[k, b].ne(0).any()):
                continue
            p = prev[-1]
            v = model(lat[p, b : b + 1], t[p : p + 1])
            total = total + params_grad((v * up[k, b : b + 1]).sum(), model)
    return total
