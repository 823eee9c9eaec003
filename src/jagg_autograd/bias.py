"""Is an estimator's gradient *biased* against the expected GRPO gradient?  :func:`gradient_bias`.

The per-batch cosine of :func:`~jagg_autograd.gradient_fidelity` says how well an
estimator reproduces one batch's exact gradient, which is mostly noise: in GRPO the signal
``||E g||^2 / E||g||^2`` is a few percent of a batch gradient's energy (digits DiT: 0.5-2.6 %
at the start, 0.3 % after 15 steps).  Learning follows the *expected* update, and an
optimizer's momentum keeps a mean error that per-batch noise averages away.  This module
measures that mean error over several batches.

With per-batch exact gradients x_i and estimates y_i (i = 1..n, flattened, P entries) and
errors e_i = y_i - x_i, all figures come from the (2n, 2n) Gram matrix of the x_i and e_i:

* **systematic share** of the error energy, ``||E e||^2 / E||e||^2``.  For iid e_i with mean
  mu and covariance Sigma, ``E||mean e||^2 = ||mu||^2 + tr Sigma / n`` and
  ``S = sum_i ||e_i - mean e||^2 / (n - 1)`` is unbiased for ``tr Sigma``, so
  ``||mean e||^2 - S / n`` is unbiased for ``||mu||^2`` and ``mean_i ||e_i||^2`` for
  ``E||e||^2``.  Their ratio simplifies to ``(n q - 1) / (n - 1)`` with
  ``q = ||mean e||^2 / mean_i ||e_i||^2``: 0 in expectation for zero-mean errors at any n
  (the naive ``q`` is 1/n there), 1 for a constant error.  Its random floor's spread is
  the standard deviation that statistic would have for zero-mean errors with the measured
  covariance, ``sqrt(2 tr(Sigma^2) / (n (n - 1))) / tr Sigma`` (both traces estimated
  free of the mean, :func:`_floor_sd`).
* **bias to signal** ``||E e|| / ||E x||`` with both squared norms debiased as above
  (clamped at 0 before the square root; NaN when the signal's estimate is not positive).
* **expected cosine** ``cos(E y, E x)``: the cross term debiased with the sample
  covariance, ``mean y . mean x - S_xy / n``, over the debiased norms (clipped to [-1, 1]).
* **signal fraction** ``||E x||^2 / E||x||^2`` of the exact gradient, with the same floor
  SD computed from the x_i (``signal_fraction_floor_sd``; shapes at groups of 16: 1.17 %
  over 12 batches, 0.035 % over 40 -- an unresolved signal makes every ratio to it noise),
  and **bias to RMS**
  ``||E e|| / sqrt(E||x||^2)`` (the bias against a whole batch gradient: the figure that
  stays defined when the signal is 0, e.g. with unit advantages).
* the **per-batch cosine** cos(y_i, x_i): mean and min.

Each comes with a jackknife (leave-one-batch-out) standard error and a normal 95 %
interval.  ``precondition`` (P,) multiplies every gradient elementwise first: pass
``1 / (sqrt(v_hat) + eps)`` of an AdamW state (:func:`adamw_precondition`) to measure in the
metric of the update AdamW would make.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from jagg_autograd.deferred import resolve_params
from jagg_autograd.window import jagg_trajectory

__all__ = ["BiasReport", "adamw_precondition", "bias_statistics", "gradient_bias"]

_Z95 = 1.959963984540054


@dataclass(frozen=True)
class Estimate:
    """A statistic, its jackknife standard error and normal 95 % interval (lo, hi)."""

    value: float
    se: float
    lo: float
    hi: float

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "se": self.se, "lo": self.lo, "hi": self.hi}

    def __format__(self, spec: str) -> str:
        spec = spec or ".4f"
        return f"{self.value:{spec}} [{self.lo:{spec}}, {self.hi:{spec}}]"


@dataclass(frozen=True)
class BiasReport:
    """Result of :func:`bias_statistics` / :func:`gradient_bias`; ``str(report)`` summarises.

    n_batches, n_params: n and P.  preconditioned: whether ``precondition`` was applied.
    systematic_share: debiased ``||E e||^2 / E||e||^2`` (floor 0); systematic_share_floor_sd:
        the SD it would have for zero-mean errors of the measured covariance (the floor's).
    bias_to_signal: ``||E e|| / ||E x||``; expected_cosine: ``cos(E y, E x)``;
    signal_fraction: ``||E x||^2 / E||x||^2``; bias_to_rms: ``||E e|| / sqrt(E||x||^2)``;
        mean_cosine: mean per-batch cos(y_i, x_i);
        each an :class:`Estimate` (value, jackknife SE, 95 % interval).
    signal_fraction_floor_sd: the SD the signal fraction would have for zero-mean exact
        gradients of the measured covariance (the share's floor, for x): a ratio to the
        signal (``bias_to_signal``, ``expected_cosine``) means something only where the
        signal is resolved, :attr:`signal_resolved`.
    min_cosine: the smallest per-batch cosine; cosines: all of them, in batch order.
    grad_samples: with-grad (step, sample) evaluations per batch, mean over batches,
        keyed "exact" and "estimate" (None from :func:`bias_statistics`).
    """

    n_batches: int
    n_params: int
    preconditioned: bool
    systematic_share: Estimate
    systematic_share_floor_sd: float
    bias_to_signal: Estimate
    expected_cosine: Estimate
    signal_fraction: Estimate
    signal_fraction_floor_sd: float
    bias_to_rms: Estimate
    mean_cosine: Estimate
    min_cosine: float
    cosines: tuple[float, ...]
    grad_samples: dict[str, float] | None = None

    @property
    def signal_resolved(self) -> bool:
        """Whether the signal fraction exceeds 2 of its floor SDs (False when NaN)."""
        return bool(self.signal_fraction.value > 2 * self.signal_fraction_floor_sd)

    def to_dict(self) -> dict[str, Any]:
        """Plain python values only (floats may be NaN, which ``json.dumps`` accepts)."""
        return {
            "n_batches": self.n_batches,
            "n_params": self.n_params,
            "preconditioned": self.preconditioned,
            "systematic_share": self.systematic_share.to_dict(),
            "systematic_share_floor_sd": self.systematic_share_floor_sd,
            "bias_to_signal": self.bias_to_signal.to_dict(),
            "expected_cosine": self.expected_cosine.to_dict(),
            "signal_fraction": self.signal_fraction.to_dict(),
            "signal_fraction_floor_sd": self.signal_fraction_floor_sd,
            "bias_to_rms": self.bias_to_rms.to_dict(),
            "mean_cosine": self.mean_cosine.to_dict(),
            "min_cosine": self.min_cosine,
            "cosines": list(self.cosines),
            "grad_samples": None if self.grad_samples is None else dict(self.grad_samples),
        }

    def summary(self) -> str:
        pre = ", AdamW-preconditioned" if self.preconditioned else ""
        lines = [
            f"gradient bias over {self.n_batches} batches (P={self.n_params}{pre}; "
            "value [95 % jackknife interval])",
            f"  systematic share      {self.systematic_share:+.4f}  "
            f"(noise floor 0 +- {self.systematic_share_floor_sd:.4f})",
            f"  bias / signal         {self.bias_to_signal:.4f}",
            f"  cos(E est, E exact)   {self.expected_cosine:+.4f}",
            f"  signal fraction       {self.signal_fraction:.4f}  "
            f"(noise floor 0 +- {self.signal_fraction_floor_sd:.4f}"
            + ("" if self.signal_resolved else "; NOT resolved: the ratios to it are noise")
            + ")",
            f"  bias / RMS(exact)     {self.bias_to_rms:.4f}",
            f"  per-batch cosine      {self.mean_cosine:.4f}  (min {self.min_cosine:.4f})",
        ]
        if self.grad_samples is not None:
            cost = ", ".join(f"{k} {v:g}" for k, v in self.grad_samples.items())
            lines.append(f"  with-grad samples per batch: {cost}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# -------------------------------------------------------------------------------- maths


def _debiased_dot(G: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Unbiased estimate of E[u] . E[w] from the Gram block G[a][:, b] of iid pairs (u_i, w_i):
    mean u . mean w - S_uw / n with S_uw the sample covariance (trace)."""
    n = a.numel()
    blk = G[a][:, b]
    mean_dot = blk.sum() / n**2
    cross = blk.diagonal().sum() / n
    s_uw = (cross - mean_dot) * n / (n - 1)
    return mean_dot - s_uw / n


def _stats(G: torch.Tensor, idx: torch.Tensor, n_all: int) -> torch.Tensor:
    """(share, bias_to_signal, expected_cosine, signal_fraction, bias_to_rms, mean_cosine)
    on the batches idx.

    G: (2 n_all, 2 n_all) float64 Gram of [x_1..x_n, e_1..e_n]."""
    x, e = idx, idx + n_all
    n = idx.numel()
    nan = torch.tensor(math.nan, dtype=G.dtype)
    Gee = G[e][:, e]
    m2e = Gee.diagonal().mean()
    q = Gee.sum() / n**2 / m2e
    share = (n * q - 1) / (n - 1) if m2e > 0 else nan
    mu_e = _debiased_dot(G, e, e)
    mu_x = _debiased_dot(G, x, x)
    m2x = G[x][:, x].diagonal().mean()
    b2s = mu_e.clamp_min(0).sqrt() / mu_x.sqrt() if mu_x > 0 else nan
    # y = x + e: E y . E x = mu_x + E e . E x ;  ||E y||^2 = mu_x + 2 E e . E x + mu_e.
    ex = _debiased_dot(G, e, x)
    mu_y = mu_x + 2 * ex + mu_e
    ecos = ((mu_x + ex) / (mu_x * mu_y).sqrt()).clamp(-1, 1) if mu_x > 0 and mu_y > 0 else nan
    frac = mu_x / m2x if m2x > 0 else nan
    b2rms = mu_e.clamp_min(0).sqrt() / m2x.sqrt() if m2x > 0 else nan
    xx = G[x, x]
    yy = xx + 2 * G[e, x] + G[e, e]
    xy = xx + G[e, x]
    cos = xy / (xx * yy).clamp_min(1e-300).sqrt()
    return torch.stack([share, b2s, ecos, frac, b2rms, cos.mean()])


def _floor_sd(Gee: torch.Tensor) -> float:
    """SD of the systematic share of zero-mean errors with the errors' own covariance.

    With no mean, share = sum_{i!=j} e_i.e_j / (n (n-1) tr Sigma), whose terms are
    uncorrelated with variance tr(Sigma^2): SD = sqrt(2 tr(Sigma^2) / (n (n-1))) / tr Sigma.
    Both traces are estimated without the mean: tr Sigma by the sample covariance, and
    tr(Sigma^2) from differences of disjoint pairs d_k = e_2k - e_2k+1 (covariance 2 Sigma,
    so E (d_k.d_l)^2 = 4 tr(Sigma^2) for k != l).  NaN with fewer than 4 batches.
    """
    n = Gee.shape[0]
    m = n // 2
    if m < 2:
        return math.nan
    a, b = torch.arange(0, 2 * m, 2), torch.arange(1, 2 * m, 2)
    D = Gee[a][:, a] - Gee[a][:, b] - Gee[b][:, a] + Gee[b][:, b]
    off = D - torch.diag(D.diagonal())
    tr2 = float(off.square().sum()) / (m * (m - 1)) / 4
    tr1 = (float(Gee.diagonal().sum()) - float(Gee.sum()) / n) / (n - 1)
    return math.sqrt(2 * tr2 / (n * (n - 1))) / tr1 if tr1 > 0 else math.nan


def _jackknife(G: torch.Tensor, n: int, full: torch.Tensor) -> list[Estimate]:
    loo = torch.stack(
        [_stats(G, torch.cat([torch.arange(i), torch.arange(i + 1, n)]), n) for i in range(n)]
    )
    se = ((n - 1) / n * (loo - loo.mean(0)).square().sum(0)).sqrt()
    return [
        Estimate(float(v), float(s), float(v - _Z95 * s), float(v + _Z95 * s))
        for v, s in zip(full, se)
    ]


def _gram(rows: torch.Tensor, block: int = 1 << 20) -> torch.Tensor:
    """rows @ rows.T in float64, accumulated over column blocks (no float64 copy of rows)."""
    m = rows.shape[0]
    G = torch.zeros((m, m), dtype=torch.float64, device=rows.device)
    for lo in range(0, rows.shape[1], block):
        r = rows[:, lo : lo + block].to(torch.float64)
        G += r @ r.T
    return G.cpu()


def bias_statistics(
    exact: torch.Tensor | Sequence[torch.Tensor],
    estimate: torch.Tensor | Sequence[torch.Tensor],
    *,
    precondition: torch.Tensor | None = None,
    grad_samples: Mapping[str, float] | None = None,
) -> BiasReport:
    """Bias figures of per-batch gradient estimates against the exact gradients.

    exact, estimate: (n, P) -- row i the flattened parameter gradient of batch i (or a
    sequence of n such vectors), n >= 3 batches drawn independently from the same
    distribution (fresh prompts and noise at fixed parameters).  precondition: optional
    (P,) elementwise weights applied to both first, e.g. :func:`adamw_precondition`.
    grad_samples: optional cost figures to carry into the report.

    See the module docstring for the math.  Returns a :class:`BiasReport`.

    Example::

        rep = bias_statistics(torch.stack(exact_grads), torch.stack(jagg_grads))
        rep.systematic_share.value   # ~0 (within +- 2 floor SDs) for an unbiased estimator
    """
    X = exact if isinstance(exact, torch.Tensor) else torch.stack([r.reshape(-1) for r in exact])
    Y = (
        estimate
        if isinstance(estimate, torch.Tensor)
        else torch.stack([r.reshape(-1) for r in estimate])
    )
    if X.dim() != 2 or X.shape != Y.shape:
        raise ValueError(
            f"exact and estimate must both be (n, P), got {tuple(X.shape)} and {tuple(Y.shape)}"
        )
    n, P = X.shape
    if n < 3:
        raise ValueError(
            f"bias statistics need n >= 3 batches (a jackknife of n - 1 >= 2), got {n}"
        )
    if not (X.is_floating_point() and Y.is_floating_point()):
        raise TypeError("exact and estimate must be floating tensors")
    if precondition is not None:
        if tuple(precondition.shape) != (P,):
            raise ValueError(f"precondition must be ({P},), got {tuple(precondition.shape)}")
        d = precondition.detach().to(X.device, torch.float64)
        X = X.detach().to(torch.float64) * d
        Y = Y.detach().to(torch.float64) * d
    E = Y.detach().to(torch.float64) - X.detach().to(torch.float64)
    G = _gram(torch.cat([X.detach().to(torch.float64), E]))
    if not bool(torch.isfinite(G).all()):
        raise ValueError("exact and estimate must be finite")
    full = _stats(G, torch.arange(n), n)
    share, b2s, ecos, frac, b2rms, mcos = _jackknife(G, n, full)
    floor_sd = _floor_sd(G[n:, n:])
    xx, ee, ex = G.diagonal()[:n], G[n:, n:].diagonal(), G[n:, :n].diagonal()
    cos = (xx + ex) / (xx * (xx + 2 * ex + ee)).clamp_min(1e-300).sqrt()
    return BiasReport(
        n_batches=n,
        n_params=P,
        preconditioned=precondition is not None,
        systematic_share=share,
        systematic_share_floor_sd=floor_sd,
        bias_to_signal=b2s,
        expected_cosine=ecos,
        signal_fraction=frac,
        # The same floor for the exact gradients: the signal fraction is the same debiased
        # statistic of the x_i as the share is of the e_i.
        signal_fraction_floor_sd=_floor_sd(G[:n, :n]),
        bias_to_rms=b2rms,
        mean_cosine=mcos,
        min_cosine=float(cos.min()),
        cosines=tuple(float(c) for c in cos),
        grad_samples=None if grad_samples is None else dict(grad_samples),
    )


def adamw_precondition(
    optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], eps: float | None = None
) -> torch.Tensor | None:
    """(P,) float64 ``1 / (sqrt(v_hat) + eps)`` of an Adam/AdamW state over ``params``, flattened.

    v_hat = exp_avg_sq / (1 - beta2^step) (the bias-corrected second moment AdamW divides
    by); eps: the optimizer's (default).  None when some parameter has no state yet (no
    optimizer step so far).
    """
    parts = []
    for p in params:
        st = optimizer.state.get(p)
        if not st or "exp_avg_sq" not in st:
            return None
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        beta2 = group["betas"][1]
        e = group["eps"] if eps is None else eps
        step = float(st["step"])
        v_hat = st["exp_avg_sq"].detach().to(torch.float64) / (1 - beta2**step)
        parts.append((1.0 / (v_hat.sqrt() + e)).reshape(-1).cpu())
    return torch.cat(parts)


# ------------------------------------------------------------------------------- driver


Batch = Sequence[Any] | Mapping[str, Any]


def _unpack(batch: Batch, i: int) -> tuple[Any, Any, torch.Tensor, Any, Any]:
    if isinstance(batch, Mapping):
        try:
            return (batch["latents"], batch["timesteps"], batch["upstream"],
                    batch.get("cond"), batch.get("values"))  # fmt: skip
        except KeyError as exc:
            raise ValueError(f"batch {i} lacks {exc.args[0]!r}") from None
    if not isinstance(batch, (tuple, list)) or len(batch) not in (3, 4):
        raise ValueError(
            f"batch {i} must be (latents, timesteps, upstream[, cond]) or a mapping with those "
            "keys (and optional 'values')"
        )
    lat, ts, up, *rest = batch
    return lat, ts, up, (rest[0] if rest else None), None


def _flat_grad(v: torch.Tensor, up: torch.Tensor, ps: list[torch.Tensor]) -> torch.Tensor:
    if not v.requires_grad:
        return torch.cat([torch.zeros(p.numel(), dtype=torch.float32) for p in ps])
    gs = torch.autograd.grad(v, ps, grad_outputs=up.to(v.dtype), allow_unused=True)
    return torch.cat(
        [
            (torch.zeros(p.numel(), device=p.device) if g is None else g.detach().reshape(-1))
            .to(torch.float32)
            .cpu()
            for g, p in zip(gs, ps)
        ]
    )


def gradient_bias(
    model: Callable[..., torch.Tensor],
    batches: Sequence[Batch] | Callable[[int], Batch],
    *,
    window: int,
    n_batches: int | None = None,
    params: Sequence[torch.Tensor] | None = None,
    precondition: torch.Tensor | None = None,
    **jagg_options: Any,
) -> BiasReport:
    """Bias of a JAGG configuration against the exact gradient over several batches.

    For every batch i (latents (T, B, *S), timesteps (T,) or (T, B), upstream (T, B, *S)
    g_k = dL/dv_k at the rollout's velocities, optional cond mapping, and in a mapping
    optional ``values`` (T, B, *S) for ``values=``), computes by ``torch.autograd.grad``
    (``.grad`` fields untouched):

        exact_i    = sum_k J_k^T g_k    (``jagg_trajectory(mode="exact")``: every step)
        estimate_i = the VJP of ``jagg_trajectory(..., window=window, **jagg_options)``

    and returns :func:`bias_statistics` of the two (n, P) stacks, with the with-grad
    sample counts of both.  ``batches``: a sequence, or a callable ``batches(i)`` drawing
    batch i (then ``n_batches`` is required); they must be independent draws at fixed
    parameters (fresh prompts and noise), and the upstream gradients should be the ones
    training uses (e.g. GRPO's ``A_b * dlogp/dv``: a zero-mean advantage hides a fold's
    bias that unit advantages reveal).  ``jagg_options``: any keyword of
    :func:`~jagg_autograd.jagg_trajectory` (``fold``, ``placement``, ``budget``,
    ``deferred``, ``router``, ``shared_anchors``, ``batching``, ...); ``deferred=True``
    gets ``params`` passed.  Memory: the 2 n flattened gradients are kept (float32, CPU).

    Example::

        def draw(i):                     # a fresh batch at the current parameters
            lat, ts, up, cond = my_rollout_and_upstream(seed=i)
            return lat, ts, up, cond
        rep = gradient_bias(model, draw, n_batches=24, window=4, deferred=True,
                            placement="adaptive", budget=4, fold="linear")
        print(rep)   # systematic share ~0 for a group-fair placement with GRPO advantages
    """
    if callable(batches) and not isinstance(batches, Sequence):
        if n_batches is None:
            raise ValueError("n_batches is required when batches is a callable")
        draw = batches
        n = int(n_batches)
    else:
        seq = list(batches)  # type: ignore[arg-type]
        n = len(seq) if n_batches is None else int(n_batches)
        if n > len(seq):
            raise ValueError(f"n_batches={n} but only {len(seq)} batches were given")
        draw = seq.__getitem__
    if n < 3:
        raise ValueError(f"gradient_bias needs n_batches >= 3, got {n}")
    ps = resolve_params(model, params, who="gradient_bias", require=True)
    opts = dict(jagg_options)
    for k in ("mode", "return_stats", "values"):
        if k in opts:
            raise ValueError(f"{k} is set by gradient_bias (values: per batch, in a mapping)")
    if opts.get("deferred"):
        opts.setdefault("params", ps)
    xs, ys = [], []
    cost = {"exact": 0.0, "estimate": 0.0}
    with torch.enable_grad():
        for i in range(n):
            lat, ts, up, cond, vals = _unpack(draw(i), i)
            common = {"window": window, "cond": cond, "return_stats": True}
            v, st = jagg_trajectory(model, lat, ts, mode="exact", **common)
            xs.append(_flat_grad(v, up, ps))
            cost["exact"] += st.grad_samples
            del v
            extra = {} if vals is None else {"values": vals}
            v, st = jagg_trajectory(model, lat, ts, **common, **extra, **opts)
            ys.append(_flat_grad(v, up, ps))
            cost["estimate"] += st.grad_samples  # deferred: filled in by the backward
            del v
    return bias_statistics(
        torch.stack(xs),
        torch.stack(ys),
        precondition=precondition,
        grad_samples={k: c / n for k, c in cost.items()},
    )
