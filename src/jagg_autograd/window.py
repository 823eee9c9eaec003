"""Public entry points: :func:`jagg_window` and :func:`jagg_trajectory`.

Notation.  Steps k = 0..T-1 of a rollout carry constant latents z_k (B, *S), timesteps
t_k and velocities v_k = f_theta(z_k, t_k, c).  Anchors a_0 = 0 < ... < a_{n-1} = T-1
split the steps into windows [a_j, a_{j+1}]; an interior step k of window j has

    alpha_k = (t_k - t_{a_j}) / (t_{a_{j+1}} - t_{a_j})
    J_k ~= (1 - alpha_k) J_{a_j} + alpha_k J_{a_{j+1}}

so the parameter gradient sum_k J_k^T g_k becomes sum_j J_{a_j}^T G_j with the composite
gradients G_j of ``jagg_autograd.mix``: one backward through one batched forward of the
anchors.  Forward values are exact: every v_k is computed, interior ones under no_grad.

A call reads check -> plan -> execute (``jagg_autograd.call``): :func:`parse_call` checks
everything and returns a frozen ``JaggCall``, ``planner.choose_plan`` chooses its Plan,
and one of :data:`EXECUTORS` runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch

from jagg_autograd.call import JaggCall, JaggStats, options_from, parse_call
from jagg_autograd.checks import BATCHINGS, MODES, PLACEMENTS
from jagg_autograd.deferred import run_deferred
from jagg_autograd.direct import run_direct
from jagg_autograd.function import run_eager
from jagg_autograd.layout import causal_layout, expected_anchor_count, trajectory_layout
from jagg_autograd.router import CosineRouter

__all__ = [
    "BATCHINGS",
    "MODES",
    "PLACEMENTS",
    "JaggStats",
    "causal_layout",
    "execute",
    "expected_anchor_count",
    "jagg_trajectory",
    "jagg_window",
    "trajectory_layout",
]

# One executor per way a call runs (``JaggCall.executor``), all with the same signature.
EXECUTORS: dict[str, Callable[[JaggCall], tuple[torch.Tensor, JaggStats | None]]] = {
    "direct": run_direct,  # no JAGG Function: values only, or exact through the model's graphs
    "eager": run_eager,  # anchors with grad now, JaggFunction
    "deferred": run_deferred,  # anchors with grad in the backward, DeferredJaggFunction
}


def execute(call: JaggCall) -> tuple[torch.Tensor, JaggStats | None]:
    """Run a parsed call: velocities (T, B, *S) and, with ``return_stats``, its stats
    (scores and exact flags (n_windows, B) for a window as well)."""
    return EXECUTORS[call.executor](call)


def jagg_window(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    cond: Mapping[str, Any] | None = None,
    mode: str = "jagg",
    router: CosineRouter | None = None,
    backend: str = "auto",
    batching: str = "stacked",
    chunk_size: int | None = None,
    return_stats: bool = False,
    batched_cond: Collection[str] | None = None,
    values: torch.Tensor | None = None,
    deferred: bool = False,
    placement: str = "uniform",
    budget: float | None = None,
    params: Sequence[torch.Tensor] | None = None,
    values_tol: float | None = None,
    fold: str = "linear",
    generator: torch.Generator | None = None,
    promotion: str = "uniform",
    promote_to: str = "anchor",
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    """Velocities of one window of W >= 2 sampling steps, with the JAGG gradient.

    Args:
        model: ``model(z, t, **cond) -> v``; z (n*B, *S), t (n*B,) in the latents' dtype,
            v shaped like z, on z's device.  Called with several steps stacked along dim 0,
            so one sample's velocity must not depend on the other samples of the call: an
            ``nn.Module`` containing a BatchNorm that uses batch statistics (training mode,
            or ``track_running_stats=False``) is refused with a ``ValueError``; put such
            layers in eval mode.
        latents: (W, B, *S) rollout latents z_k (constants; must not require grad).
        timesteps: (W,) or (W, B), strictly monotone along dim 0 (either direction).
        cond: keyword arguments for the model; every tensor whose dim 0 is B (or, when
            ``batched_cond`` is given, exactly the keys it names) is tiled step-major to
            n*B and sliced for routed-out subsets; anything else passes unchanged.
            Tensors that require grad get the same interpolated gradient as parameters.
            Auto-detection cannot tell a shared table whose dim 0 equals B by coincidence
            from per-sample data; it warns (``UserWarning``) when a detected tensor also
            has B in another dim (e.g. a (B, B) table).  Name the per-sample keys
            explicitly in such cases, e.g. with B = 8 and a shared (8, 8) ``table``::

                jagg_window(model, lat, ts, cond={"y": labels, "table": table},
                            batched_cond=["y"])   # y tiled/sliced, table passed as is
        mode: "jagg" (two anchors, one backward) or "exact" (every step with grad).
        router: a :class:`CosineRouter` that sends non-linear samples to the exact
            gradient for their interior steps (recomputed with grad in the forward pass).
        backend: "auto", "torch" or "triton" for the mixing and routing ops.
        batching: "stacked" (anchors in ONE model call of 2B samples, interior steps in
            as few no-grad calls as ``chunk_size`` allows) or "per_step" (every call has
            the rollout's batch B, so values are bit-identical to a step-by-step rollout;
            a routed-out recomputation runs only the routed samples of a step).
        chunk_size: max samples per model call for the no-grad interior steps and the
            exact recomputation (the anchor call is never split; in mode="exact" it
            bounds every call).  With ``deferred=True`` it bounds the with-grad anchor
            calls of the backward (None: B, one step's batch: the per-step loop's memory).
        return_stats: also return a :class:`JaggStats`.
        values: (W, B, *S) velocities of these latents at the CURRENT parameters (the
            rollout's, when no optimizer step happened since: on-policy minibatches).  No
            model call is made for non-anchor steps and the output's values are exactly
            ``values`` (with ``deferred=True`` the output shares their storage: do not
            modify it in place).  Their dtype must be the model's output dtype.  The
            anchors, recomputed with grad, are compared with them: a deviation beyond
            ``values_tol`` raises a ``RuntimeError`` ("values look stale") and no gradient
            reaches any parameter.  May be a non-contiguous view.  With ``deferred=True``
            the latents, timesteps, cond and parameters must not change in place before
            the backward (an optimizer step in between is a ``RuntimeError``).
        deferred: run the anchors with grad in the backward, ``chunk_size`` samples at a
            time (None: B), back-propagating and freeing each chunk before the next: peak
            activation memory is one chunk's, Flow-GRPO's per-step loop for
            ``chunk_size=None``.  The forward makes no with-grad call (with ``values``: no
            call at all).  Gradients reach parameters and cond tensors through autograd
            (``backward()``, ``autograd.grad``, hooks, accumulation, GradScaler).
        placement: "uniform" (the layout above; a router's routed-out samples get every
            step of the window as anchors), "stochastic" (deferred, no router; with
            promote_to="anchor", the causal fold: each sample's (floor(budget)+1)-anchor
            causal layout without its last anchor, promoted to the whole layout with
            probability pi = budget - floor(budget) and its rows re-weighted by 1/pi, so
            the gradient's expectation over the draw is the (floor(budget)+1)-anchor causal
            fold for every batch; with promote_to="exact", causal or linear fold: a
            floor(budget)-anchor base promoted to every active step, the expectation the
            exact gradient; an integer budget is the floor(budget)-anchor layout, nothing
            promoted (the B + 1 uniforms are drawn all the same), refused with
            promote_to="exact" below T; a fractional part in (0, 0.01) is refused:
            ``planner.stochastic_choice``) or "adaptive" (deferred only, no router):
            per-sample anchors chosen in the backward from the velocities and the upstream
            gradients, minimising sum_k ||g_k|| ||v_k - v_hat_k|| (v_hat_k: the t-linear
            interpolation between the step's neighbouring anchors) per sample by dynamic
            programming, with round(budget * B) anchors shared group-fairly: every sample
            the same count, the remainder one more each by scale-free proxy gain, nothing
            depending on |g|'s scale (``planner.adaptive_choice``).  Every sample gets
            its first and last step with a non-zero upstream gradient (2 anchors; 1 if
            only one step is non-zero, 0 if none); steps outside that span need none.
        budget: mean anchors per sample for placement="adaptive" or "stochastic"
            (default: the uniform layout's anchor count, 2 for a window).
        params: the trainable tensors, needed by ``deferred=True`` when ``model`` is not an
            ``nn.Module`` (default: the module's parameters that require grad).
        values_tol: absolute tolerance of the ``values`` check (default
            ``rtol * (1 + max|values|)``, rtol 1e-5 in float32, 1e-9 in float64, 4e-3 in
            float16, 3e-2 in bfloat16: anchors recomputed in another batch than the
            rollout's differ by round-off only).
        fold: how each step's g folds onto its anchors (``planner.FOLDS``): "linear"
            (the t-linear weights below; unbiased for GRPO only with zero-mean advantages
            and per-sample decisions that do not depend on them) or "causal" (onto the
            anchor at or before the step only: no noise-driven mean error for any
            advantages, a smaller one from the held Jacobian, less accurate per batch);
            see :func:`jagg_autograd.planner.interpolation_weights`.
            A linear-fold call's output carries its fold on its graph node, and
            :func:`jagg_autograd.grpo.grpo_loss` warns once when advantages of non-zero
            mean (e.g. raw rewards) reach it (:mod:`jagg_autograd.fold_guard`).
        generator: placement="stochastic" only: the ``torch.Generator`` its promotions
            are drawn from in the backward (B + 1 uniforms per call; None: torch's default
            generator).
        promotion: placement="stochastic" only: "uniform" (every promotable sample with
            the same probability: budget - floor(budget) with promote_to="anchor";
            (budget - floor(budget)) n_p / sum_b c_b with promote_to="exact", c_b the
            non-zero-g steps a promotion adds, n_p the promotable samples) or "proxy"
            (probabilities growing with the planner's proxy of the promoted term,
            re-weighted by their inverse: the same expectation, less variance where the
            proxy tracks the term; see
            :func:`jagg_autograd.planner.stochastic_choice`).
        promote_to: placement="stochastic" only: "anchor" (a promoted sample gets the next
            nested causal anchor: the (L+1)-anchor causal fold in expectation) or "exact"
            (a promoted sample gets every active step, re-weighted: the *exact* gradient in
            expectation for every batch, with fold="causal" or "linear" as the base).

    Returns:
        velocities (W, B, *S) whose values equal ``model(latents[k], timesteps[k], **cond)``
        step by step (bit for bit with batching="per_step"; with "stacked" up to the
        model's batch-size-dependent round-off, typically a few ulp of its dtype).
        Backward gives sum_k J_k^T g_k with J_k ~= (1-alpha_k) J_0 + alpha_k J_{W-1},
        alpha_k = (t_k - t_0) / (t_{W-1} - t_0), i.e. J_0^T G_0 + J_{W-1}^T G_{W-1} with
        G_0 = sum_k (1-alpha_k) g_k and G_{W-1} = sum_k alpha_k g_k: exact whenever the
        Jacobian is affine in t on the window's points.
    """
    call = parse_call(model, latents, timesteps, options_from(locals()), trajectory=False)
    out, stats = execute(call)
    if stats is None:
        return out
    stats.scores = stats.scores[0]
    stats.exact = stats.exact[0]
    return out, stats


def jagg_trajectory(
    model: Callable[..., torch.Tensor],
    latents: torch.Tensor,
    timesteps: torch.Tensor,
    *,
    window: int,
    shared_anchors: bool = True,
    cond: Mapping[str, Any] | None = None,
    mode: str = "jagg",
    router: CosineRouter | None = None,
    backend: str = "auto",
    batching: str = "stacked",
    chunk_size: int | None = None,
    return_stats: bool = False,
    batched_cond: Collection[str] | None = None,
    values: torch.Tensor | None = None,
    deferred: bool = False,
    placement: str = "uniform",
    budget: float | None = None,
    params: Sequence[torch.Tensor] | None = None,
    values_tol: float | None = None,
    fold: str = "linear",
    anchors: Sequence[int] | None = None,
    generator: torch.Generator | None = None,
    promotion: str = "uniform",
    promote_to: str = "anchor",
) -> torch.Tensor | tuple[torch.Tensor, JaggStats]:
    """Velocities of a whole T-step trajectory cut into JAGG windows of ``window`` steps.

    latents: (T, B, *S); timesteps: (T,) or (T, B).  With ``shared_anchors=True`` adjacent
    windows share their boundary step: anchors 0, W-1, 2(W-1), ..., T-1, i.e.
    ceil((T-1)/(W-1)) + 1 anchors in ONE batched backward; each anchor's composite
    gradient is its own g plus sum alpha_k g_k of the window on its left plus
    sum (1-alpha_k) g_k of the window on its right.  ``shared_anchors=False`` is the
    paper's layout of disjoint windows (2 anchors each; a last single step is exact).
    ``anchors=`` (uniform placement, no router) replaces that layout with explicit anchor
    steps, strictly increasing from 0 (and ending at T-1 for ``fold="linear"``);
    ``window`` is still checked but places no anchor.  For the
    causal fold on a prefix of the sampler's steps pass
    ``causal_layout(T, n)[0]`` (:func:`~jagg_autograd.layout.causal_layout`: the window
    layout's end anchor would serve only itself there).  Routing is per sample and per
    window.  Other arguments as in :func:`jagg_window`; stats.scores / stats.exact are
    (n_windows, B).

    Which path when (T = 10, W = 4 measured in ``benchmarks/floor.py``):

    * on-policy minibatches (no optimizer step since the rollout): ``values=`` the
      rollout's velocities and ``deferred=True`` -- no forward but the anchors', peak
      memory of the per-step loop; ``placement="adaptive"`` puts the anchors where g needs
      them at the same cost;
    * off-policy minibatches: the eager path (``deferred=False``), or ``deferred=True``
      without ``values`` when memory-bound (one more forward per anchor).

    Example (an on-policy GRPO minibatch)::

        v = jagg_trajectory(model, ro.latents[:-1], ro.sigmas[:-1], window=4,
                            cond=cond, values=ro.velocities, deferred=True,
                            placement="adaptive", budget=4)
        loss = grpo_loss_from(v)   # log-probs of the stored transitions, advantages
        loss.backward()            # anchors run here, B samples at a time
    """
    call = parse_call(model, latents, timesteps, options_from(locals()), trajectory=True)
    out, stats = execute(call)
    return out if stats is None else (out, stats)
