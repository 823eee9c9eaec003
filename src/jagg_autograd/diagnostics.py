"""How close is JAGG's gradient to the exact one on *your* model?  :func:`gradient_fidelity`.

JAGG is exact only where the parameter Jacobian is affine in t on a window's points; on a
real DiT it is an approximation whose quality depends on the model, the schedule and the
window length.  This module runs one rollout both ways and reports how far apart the two
parameter gradients are, so the approximation can be validated before it is trusted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch

from jagg_autograd.call import JaggCall, JaggOptions, JaggStats, options_from, parse_call
from jagg_autograd.checks import check_placement, check_router, resolve_params
from jagg_autograd.router import CosineRouter
from jagg_autograd.window import execute

__all__ = ["FidelityReport", "compare_grads", "gradient_fidelity"]

Grads = tuple[torch.Tensor | None, ...]


class WindowFidelity(NamedTuple):
    """One window's JAGG gradient against its exact gradient (see ``per_window``)."""

    first: int
    last: int
    cosine: float
    rel_error: float


@dataclass(frozen=True)
class FidelityReport:
    """Result of :func:`gradient_fidelity`; ``str(report)`` is a readable summary.

    cosine, rel_error, norm_ratio: cos(g_jagg, g_exact), ||g_jagg - g_exact|| / ||g_exact||
        and ||g_jagg|| / ||g_exact|| over all ``params`` flattened into one vector.  NaN
        when ||g_exact|| == 0 (cosine also when ||g_jagg|| == 0): undefined, not an error.
    exact_norm: ||g_exact||.
    routed_cosine, routed_rel_error: the same figures for JAGG with the router; None
        without a router.
    exact_fraction: fraction of the (window, sample) pairs the router sent to the exact
        gradient (windows without an interior step are never routed and count as not
        sent); None without a router.
    scores: the router's score of every (window, sample), (n_windows, B) nested lists
        ((1, B) for a single window), computed with or without a router; score_min,
        score_median (the mean of the two middle values for an even count).
    windows: (first, last) step of every window, the rows of ``scores``.
    value_max_abs_diff: max |v - v_exact| over the JAGG (and routed) forward values: a
        sanity check, round-off only (exactly 0 needs batching="per_step").
    grad_samples, backward_calls: JaggStats' cost figures of each way run, keyed
        "exact", "jagg" and (with a router) "routed".
    router: repr of the router, or None.
    per_window: with ``per_window=True``, one :class:`WindowFidelity` per window; else None.
    """

    cosine: float
    rel_error: float
    norm_ratio: float
    exact_norm: float
    routed_cosine: float | None
    routed_rel_error: float | None
    exact_fraction: float | None
    scores: list[list[float]]
    score_min: float
    score_median: float
    windows: list[tuple[int, int]]
    value_max_abs_diff: float
    grad_samples: dict[str, int]
    backward_calls: dict[str, int]
    router: str | None = None
    per_window: tuple[WindowFidelity, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain python values only (floats may be NaN, which ``json.dumps`` accepts)."""
        return {
            "cosine": self.cosine,
            "rel_error": self.rel_error,
            "norm_ratio": self.norm_ratio,
            "exact_norm": self.exact_norm,
            "routed_cosine": self.routed_cosine,
            "routed_rel_error": self.routed_rel_error,
            "exact_fraction": self.exact_fraction,
            "scores": [list(row) for row in self.scores],
            "score_min": self.score_min,
            "score_median": self.score_median,
            "windows": [list(w) for w in self.windows],
            "value_max_abs_diff": self.value_max_abs_diff,
            "grad_samples": dict(self.grad_samples),
            "backward_calls": dict(self.backward_calls),
            "router": self.router,
            "per_window": None
            if self.per_window is None
            else [w._asdict() for w in self.per_window],
        }

    def summary(self) -> str:
        n_w, B = len(self.scores), len(self.scores[0]) if self.scores else 0
        lines = [
            f"JAGG gradient fidelity ({n_w} window(s), B={B})",
            f"  cosine(jagg, exact)   {self.cosine:.6f}",
            f"  rel_error             {self.rel_error:.3e}",
            f"  norm ratio            {self.norm_ratio:.6f}  (exact norm {self.exact_norm:.3e})",
            f"  forward max |diff|    {self.value_max_abs_diff:.3e}",
            f"  router scores         min {self.score_min:.6f}  median {self.score_median:.6f}",
        ]
        if self.router is not None:
            lines.append(
                f"  routed {self.router}: cosine {self.routed_cosine:.6f}, "
                f"rel_error {self.routed_rel_error:.3e}, exact fraction {self.exact_fraction:.3f}"
            )
        cost = ", ".join(
            f"{k} {self.grad_samples[k]}/{self.backward_calls[k]}" for k in self.grad_samples
        )
        lines.append(f"  cost (grad samples / backward calls): {cost}")
        if self.per_window is not None:
            lines.append("  per window:")
            lines.extend(
                f"    [{w.first}..{w.last}]  cosine {w.cosine:.6f}  rel_error {w.rel_error:.3e}"
                for w in self.per_window
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


# --------------------------------------------------------------------------- validation


def _check_upstream(upstream: object, latents: torch.Tensor) -> torch.Tensor:
    if not isinstance(upstream, torch.Tensor):
        raise TypeError(f"upstream must be a torch.Tensor, got {type(upstream).__name__}")
    if not upstream.is_floating_point():
        raise TypeError(f"upstream must be a floating tensor, got {upstream.dtype}")
    if upstream.shape != latents.shape:
        raise ValueError(
            f"upstream must have the latents' shape {tuple(latents.shape)} (one dL/dv_k per "
            f"step), got {tuple(upstream.shape)}"
        )
    if upstream.device != latents.device:
        raise ValueError(f"upstream is on {upstream.device} but latents on {latents.device}")
    if not bool(torch.isfinite(upstream).all()):
        raise ValueError("upstream must be finite")
    return upstream.detach()


# -------------------------------------------------------------------------------- maths


def _acc_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else the comparison runs in float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _grads(v: torch.Tensor, up: torch.Tensor, params: list[torch.Tensor], retain: bool) -> Grads:
    """Parameter VJP of ``up`` without touching any ``.grad`` field."""
    if not v.requires_grad:  # no param reaches the output: every gradient is zero
        return (None,) * len(params)
    return torch.autograd.grad(
        v, params, grad_outputs=up.to(v.dtype), allow_unused=True, retain_graph=retain
    )


def compare_grads(
    ref: Sequence[torch.Tensor | None],
    got: Sequence[torch.Tensor | None],
    params: Sequence[torch.Tensor],
) -> tuple[float, float, float, float]:
    """(cosine, rel_error, norm_ratio, ||ref||) of two parameter gradients, flattened.

    ``ref`` / ``got``: one gradient (or None: zero) per tensor of ``params``, as
    ``torch.autograd.grad(..., allow_unused=True)`` returns them.  NaN figures when
    ||ref|| == 0 (the cosine also when ||got|| == 0).

    Accumulated parameter by parameter, so no flat copy of the whole gradient is made (a
    DiT's would not fit), and ||got - ref|| is summed directly rather than expanded, so
    nearly equal gradients keep their small difference.
    """
    dev = params[0].device
    acc = _acc_dtype(dev)
    parts = []
    for r, g, p in zip(ref, got, params):
        if r is None and g is None:
            continue
        r64 = torch.zeros(p.numel(), dtype=acc, device=p.device) if r is None else r
        g64 = torch.zeros(p.numel(), dtype=acc, device=p.device) if g is None else g
        r64 = r64.detach().reshape(-1).to(acc)
        g64 = g64.detach().reshape(-1).to(acc)
        sums = torch.stack([r64 @ g64, r64 @ r64, g64 @ g64, (g64 - r64).square().sum()])
        parts.append(sums.to(dev))
    dot, rr, gg, dd = torch.stack(parts).sum(0).tolist() if parts else (0.0,) * 4
    nan = math.nan
    if rr == 0.0:
        return nan, nan, nan, 0.0
    rn, gn = math.sqrt(rr), math.sqrt(gg)
    cos = min(1.0, max(-1.0, dot / (rn * gn))) if gg > 0.0 else nan
    return cos, math.sqrt(dd) / rn, gn / rn, rn


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    acc = _acc_dtype(a.device)
    return float((a.detach().to(acc) - b.detach().to(acc)).abs().max())


# --------------------------------------------------------------------------------- public


def gradient_fidelity(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    upstream: torch.Tensor,
    *,
    cond: Mapping[str, Any] | None = None,
    params: Sequence[torch.Tensor] | None = None,
    window: int | None = None,
    shared_anchors: bool = True,
    router: CosineRouter | None = None,
    batching: str = "stacked",
    batched_cond: Collection[str] | None = None,
    per_window: bool = False,
    values: torch.Tensor | None = None,
    deferred: bool = False,
    placement: str = "uniform",
    budget: float | None = None,
    fold: str = "linear",
    anchors: Sequence[int] | None = None,
) -> FidelityReport:
    """Compare JAGG's parameter gradient with the exact one on one rollout of your model.

    Validate JAGG on your own model before trusting it: on a few real rollouts (real
    latents, schedule, conditioning and loss) the cosine should be close to 1 and the
    rel_error small.  The scores tell which windows (and samples) a :class:`CosineRouter`
    would send to the exact gradient, and the routed figures what that buys.

    With upstream gradients g_k = dL/dv_k and J_k = d f_theta(z_k, t_k, c) / d theta:

        exact:  sum_k J_k^T g_k                           (every step with grad)
        JAGG:   J_0^T G_0 + J_{W-1}^T G_{W-1},  G_0 = sum_k (1 - alpha_k) g_k,
                G_{W-1} = sum_k alpha_k g_k,  alpha_k = (t_k - t_0) / (t_{W-1} - t_0)

    per window (a trajectory sums these over its windows, shared anchors adding their own
    g once).  Both are VJPs through ``torch.autograd.grad``: the ``.grad`` fields of the
    parameters are left untouched, unused parameters count as zero gradient.

    Args:
        model: ``model(z, t, **cond) -> v`` as in :func:`jagg_window`.
        latents: (W, B, *S) rollout latents of one window, or (T, B, *S) with ``window``.
        timesteps: (W,) / (T,) or with a per-sample column (W, B) / (T, B), strictly
            monotone.
        upstream: (W, B, *S) / (T, B, *S) floating, finite: g_k, e.g. the gradient of
            your loss with respect to the (detached) velocities of the rollout.
        cond, batching, batched_cond: as in :func:`jagg_window`.
        params: the tensors whose gradient is compared (e.g. the LoRA parameters); None
            takes every parameter of ``model`` that requires grad (``model`` must then be
            an ``nn.Module``).
        window: None: ``latents`` is one window (:func:`jagg_window`); an int: a
            trajectory cut into windows of that many steps (:func:`jagg_trajectory`).
        shared_anchors: the trajectory layout (ignored for a single window, where both
            layouts coincide).
        router: if given, JAGG is also run with this router.
        per_window: also compare every window on its own: ``upstream`` is zeroed outside
            the window's steps [first..last] (both anchors included, so with shared
            anchors a boundary step counts in both its windows: a diagnostic
            decomposition, not a partition of the total).  Costs one extra backward per
            window each way, the exact one through the whole rollout's graph.
        values, deferred, placement, budget, fold: the JAGG run's, as in
            :func:`jagg_window` (the routed run keeps uniform anchors).
        anchors: explicit anchor steps of a trajectory (``window`` given), as in
            :func:`jagg_trajectory` (e.g. the trainer's ``causal_layout`` anchors on a
            prefix); the exact run's windows (``per_window``) follow them.  No router.

    Returns:
        a :class:`FidelityReport`.  One batch's cosine mostly measures how well the
        estimator reproduces that batch's noise; for the bias that learning follows use
        :func:`jagg_autograd.bias.gradient_bias` over many batches.

    Cost: the exact run keeps the activations of all T steps for its backward, as exact
    training would; use a short rollout and a small batch on a large model.  The model is
    called as in training (its train/eval mode is not changed): dropout makes the runs
    differ (``value_max_abs_diff`` shows it), so use ``model.eval()`` or no dropout.
    Runs with grad enabled even inside ``torch.no_grad()``.

    Example::

        # model(z, t, **cond) -> velocity; for diffusers wrap the transformer with
        # jagg_autograd.integrations.diffusers.velocity_adapter.
        with torch.no_grad():
            v = model_rollout_velocities(...)          # (T, B, *S) from your sampler
        v = v.detach().requires_grad_()
        (upstream,) = torch.autograd.grad(loss_fn(v), v)
        report = gradient_fidelity(
            model, latents, timesteps, upstream, cond=cond, params=lora_params,
            window=4, router=CosineRouter(),
        )
        print(report)                 # cosine, rel_error, scores, cost
        json.dump(report.to_dict(), f)
    """
    # Everything is checked before the first model call: the arguments of
    # gradient_fidelity's own, then every run's call (parse_call), in the order of the runs.
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise TypeError(f"window must be None or an int, got {window!r}")
    if not isinstance(shared_anchors, bool):
        raise TypeError(f"shared_anchors must be a bool, got {shared_anchors!r}")
    if not isinstance(per_window, bool):
        raise TypeError(f"per_window must be a bool, got {per_window!r}")
    if anchors is not None and window is None:
        raise ValueError("anchors= is a trajectory's layout: pass window= as well (an int)")
    with torch.enable_grad():
        runs = _parse_runs(model, latents, timesteps, upstream, options_from(locals()))
        upstream, ps = runs.upstream, runs.params
        v_ex, st_ex = execute(runs.exact)
        windows = [tuple(w) for w in st_ex.windows]
        # Per-window VJPs reuse the graphs: a single window is its own decomposition.
        split = per_window and len(windows) > 1
        g_ex = _grads(v_ex, upstream, ps, retain=split)
        v_jg, st_jg = execute(runs.jagg)
        g_jg = _grads(v_jg, upstream, ps, retain=split)
        cos, rel, ratio, exact_norm = compare_grads(g_ex, g_jg, ps)
        value_diff = _max_abs_diff(v_jg, v_ex)
        del g_jg
        windows_report: tuple[WindowFidelity, ...] | None = None
        if per_window and not split:
            windows_report = (WindowFidelity(*windows[0], cos, rel),)
        elif split:
            windows_report = _per_window(v_ex, v_jg, upstream, ps, windows)
        # Free both graphs before the routed run builds its own.
        v_ex = v_ex.detach()
        del v_jg
        routed: tuple[float, float, float, JaggStats] | None = None
        if runs.routed is not None:
            v_rt, st_rt = execute(runs.routed)
            g_rt = _grads(v_rt, upstream, ps, retain=False)
            routed_cos, routed_rel, _, _ = compare_grads(g_ex, g_rt, ps)
            value_diff = max(value_diff, _max_abs_diff(v_rt, v_ex))
            routed = (routed_cos, routed_rel, float(st_rt.exact.float().mean()), st_rt)
            del v_rt, g_rt
    return FidelityReport(
        cosine=cos,
        rel_error=rel,
        norm_ratio=ratio,
        exact_norm=exact_norm,
        routed_cosine=None if routed is None else routed[0],
        routed_rel_error=None if routed is None else routed[1],
        exact_fraction=None if routed is None else routed[2],
        **_score_summary(st_jg.scores),
        windows=[(int(lo), int(hi)) for lo, hi in windows],
        value_max_abs_diff=value_diff,
        **_costs(st_ex, st_jg, None if routed is None else routed[3]),
        router=None if router is None else repr(router),
        per_window=windows_report,
    )


class _Runs(NamedTuple):
    """The checked calls of one :func:`gradient_fidelity`, and its checked arguments."""

    exact: JaggCall
    jagg: JaggCall
    routed: JaggCall | None
    upstream: torch.Tensor
    params: list[torch.Tensor]


def _parse_runs(
    model: Callable[..., torch.Tensor],
    latents: object,
    timesteps: object,
    upstream: object,
    options: JaggOptions,
) -> _Runs:
    """The exact run, the JAGG run (``values``, ``deferred``, ``placement``, ``budget`` as
    given) and, with a router, the routed run (uniform placement), each parsed."""
    options = replace(options, return_stats=True)
    traj = options.window is not None
    if not callable(model):
        raise TypeError(
            f"model must be callable as model(z, t, **cond), got {type(model).__name__}"
        )
    router = check_router(options.router)
    exact = parse_call(
        model,
        latents,
        timesteps,
        replace(
            options,
            mode="exact",
            router=None,
            values=None,
            deferred=False,
            placement="uniform",
            budget=None,
            params=None,
        ),
        trajectory=traj,
    )
    up = _check_upstream(upstream, exact.latents)
    ps = resolve_params(model, options.params, who="gradient_fidelity", require=True)
    # The deferred runs differentiate the compared tensors (a non-module model has no others).
    options = replace(options, params=ps if options.deferred is True else None)
    jagg = parse_call(model, latents, timesteps, replace(options, router=None), trajectory=traj)
    routed = None
    if router is not None:
        # The options as given: a router and adaptive placement do not combine.
        check_placement(options.placement, jagg.opts.deferred, router, "jagg")
        routed = parse_call(
            model,
            latents,
            timesteps,
            replace(options, placement="uniform", budget=None),
            trajectory=traj,
        )
    return _Runs(exact, jagg, routed, up, ps)


def _per_window(
    v_ex: torch.Tensor,
    v_jg: torch.Tensor,
    upstream: torch.Tensor,
    ps: list[torch.Tensor],
    windows: list[tuple[int, int]],
) -> tuple[WindowFidelity, ...]:
    """Every window compared on its own: upstream zeroed outside [first..last]."""
    entries = []
    for lo, hi in windows:
        up_w = torch.zeros_like(upstream)
        up_w[lo : hi + 1] = upstream[lo : hi + 1]
        e = _grads(v_ex, up_w, ps, retain=True)
        j = _grads(v_jg, up_w, ps, retain=True)
        w_cos, w_rel, _, _ = compare_grads(e, j, ps)
        entries.append(WindowFidelity(lo, hi, w_cos, w_rel))
    return tuple(entries)


def _score_summary(scores: torch.Tensor) -> dict[str, Any]:
    # Scores are tiny: summarise them on the CPU, where float64 always exists.
    s = scores.detach().cpu().to(torch.float64)
    flat = s.flatten()
    return {
        "scores": s.tolist(),
        "score_min": float(flat.min()),
        "score_median": float(flat.quantile(0.5)),
    }


def _costs(
    exact: JaggStats, jagg: JaggStats, routed: JaggStats | None
) -> dict[str, dict[str, int]]:
    named = {"exact": exact, "jagg": jagg, **({} if routed is None else {"routed": routed})}
    return {
        "grad_samples": {k: st.grad_samples for k, st in named.items()},
        "backward_calls": {k: st.backward_calls for k, st in named.items()},
    }
