"""One JAGG call, checked once: options -> :func:`parse_call` -> a frozen :class:`JaggCall`.

A call reads check -> plan -> execute:

1. :func:`parse_call` runs every check (``jagg_autograd.checks``) before any model call,
   in the order a mistake is best explained -- the latents and timesteps' ``(T, B, ...)``
   layout, the window, the options, the model, the cond, the trainable tensors -- and
   records what the executors need: float64 and model-dtype timesteps, the uniform
   layout, the cond split, the values tolerance, the tensor versions a deferred backward
   re-checks, and which executor runs the call;
2. ``planner.choose_plan`` chooses the :class:`~jagg_autograd.planner.Plan` (exact,
   uniform + routed, or adaptive) from the call;
3. one executor runs it: ``direct.run_direct`` (no JAGG Function: values only, or the
   exact gradient through the model's own graphs), ``function.run_eager`` (anchors with
   grad now, :class:`~jagg_autograd.function.JaggFunction`) or ``deferred.run_deferred``
   (anchors with grad in the backward, ``DeferredJaggFunction``).

``jagg_window``, ``jagg_trajectory`` and ``gradient_fidelity`` share one option set,
:class:`JaggOptions`: a new option is one field here, one check in :func:`check_options`
and the place that reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from jagg_autograd._backend import check_backend_runnable
from jagg_autograd.checks import (
    BATCHINGS,
    MODES,
    autocast_state,
    check_bool,
    check_budget,
    check_choice,
    check_chunk_size,
    check_cond,
    check_generator,
    check_latents,
    check_model,
    check_placement,
    check_promote_to,
    check_promoting_budget,
    check_promotion,
    check_router,
    check_timesteps,
    check_tol,
    check_values,
    record_versions,
    resolve_params,
    values_tolerance,
)
from jagg_autograd.distributed import ddp_for_deferred
from jagg_autograd.layout import check_anchors, check_window
from jagg_autograd.planner import check_fold
from jagg_autograd.router import CosineRouter

if TYPE_CHECKING:
    from jagg_autograd.caller import Caller


@dataclass(frozen=True, eq=False)
class JaggOptions:
    """The keyword options of ``jagg_window``, ``jagg_trajectory`` and ``gradient_fidelity``.

    Field names and defaults are those of the public functions (documented in
    ``jagg_window``); ``window=None`` means the latents are one window (``jagg_window``).
    """

    window: int | None = None
    shared_anchors: bool = True
    cond: Mapping[str, Any] | None = None
    batched_cond: Collection[str] | None = None
    mode: str = "jagg"
    router: CosineRouter | None = None
    backend: str = "auto"
    batching: str = "stacked"
    chunk_size: int | None = None
    return_stats: bool = False
    values: torch.Tensor | None = None
    deferred: bool = False
    placement: str = "uniform"
    budget: float | None = None
    params: Sequence[torch.Tensor] | None = None
    values_tol: float | None = None
    fold: str = "linear"
    anchors: Sequence[int] | None = None
    generator: torch.Generator | None = None
    promotion: str = "uniform"
    promote_to: str = "anchor"


OPTION_NAMES = tuple(f.name for f in fields(JaggOptions))


def options_from(arguments: Mapping[str, Any]) -> JaggOptions:
    """The options among a public function's arguments (its ``locals()``); an option the
    function does not take keeps its default."""
    return JaggOptions(**{k: arguments[k] for k in OPTION_NAMES if k in arguments})


@dataclass
class JaggStats:
    """What a call did.

    scores: (B,) for a window, (n_windows, B) for a trajectory: the router's score
        (1.0 for a window with no interior step).  Computed whenever stats are asked for.
    exact: bool, same shape: True where that sample's window got the exact gradient
        (mode="exact": everywhere, but nowhere under ``torch.no_grad()`` where no gradient
        exists; mode="jagg": where the router sent it -- also computed under no_grad, as a
        preview of what a call with grad would route; placement="adaptive" or
        "stochastic": all False, also for the samples a promotion to exact gives every
        step -- ``anchor_mask`` shows those).
    grad_samples: samples the model was run on with grad.
    grad_forward_calls: model calls made with grad (their graphs are what the backward
        goes through); ``backward_calls`` is its former name, kept as an alias.
    windows: (first, last) step of each window of the uniform layout.
    anchors: the anchor steps (placement="adaptive": the union over samples).
    anchor_mask: (T, B) bool, the (step, sample) pairs run with grad.
    plan_seconds: time the backward spent choosing the adaptive placement.

    For ``deferred=True`` the with-grad work happens in the backward, which completes
    ``grad_samples``, ``grad_forward_calls``, ``plan_seconds`` and, for adaptive
    placement, ``anchors`` and ``anchor_mask`` (in place); until then the counts are 0.
    """

    scores: torch.Tensor
    exact: torch.Tensor
    grad_samples: int
    grad_forward_calls: int
    windows: list[tuple[int, int]] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)
    anchor_mask: torch.Tensor | None = None
    plan_seconds: float = 0.0

    @property
    def backward_calls(self) -> int:
        """Deprecated alias of ``grad_forward_calls`` (it counted forward calls with grad)."""
        return self.grad_forward_calls

    @backward_calls.setter
    def backward_calls(self, value: int) -> None:
        self.grad_forward_calls = value


@dataclass(frozen=True, eq=False)
class JaggCall:
    """A checked call (built by :func:`parse_call` only).

    model: as given; latents: (T, B, *S).
    t64: (T, B) float64 timesteps (plans, routing); t_model: (T, B) in the latents'
        dtype, what the model is called with.
    anchors, windows: the uniform layout (steps; (first, last) per window): the window
        layout, or the call's explicit ``anchors=`` (:func:`~jagg_autograd.layout.check_anchors`).
    opts: the checked options: mode, batching, placement, backend (runnable on the
        latents), chunk_size, router, deferred, values, values_tol; budget a float
        (default: the layout's anchor count).
    cond: the cond mapping as a dict; batched: its per-sample keys (tiled / sliced).
    targets: the tensors a deferred call differentiates: the parameters, then the cond
        tensors named by ``grad_cond_keys`` (empty for the other executors).
    needs_grad: the call produces a gradient (grad mode on, and something to
        differentiate); executor: "direct", "eager" or "deferred".
    values_limit: absolute tolerance (0-d) of recomputed velocities against ``values``
        when a recomputation is compared with them, else None.
    versions: (name, tensor, version) of every input a deferred backward re-reads.
    autocast: the autocast state of the call (re-entered by the deferred backward).
    """

    model: Callable[..., torch.Tensor]
    latents: torch.Tensor
    t64: torch.Tensor
    t_model: torch.Tensor
    anchors: tuple[int, ...]
    windows: tuple[tuple[int, int], ...]
    opts: JaggOptions
    cond: dict[str, Any]
    batched: frozenset[str]
    targets: tuple[torch.Tensor, ...]
    grad_cond_keys: tuple[str, ...]
    needs_grad: bool
    executor: str
    values_limit: torch.Tensor | None
    versions: tuple[tuple[str, torch.Tensor, int], ...]
    autocast: tuple[bool, torch.dtype] | None

    @property
    def T(self) -> int:
        return self.latents.shape[0]

    @property
    def B(self) -> int:
        return self.latents.shape[1]

    @property
    def budget_total(self) -> int:
        """Anchors over the batch for placement="adaptive" (stochastic: per sample)."""
        return round(self.opts.budget * self.B)

    def stats(
        self, caller: Caller, scores: torch.Tensor, exact: torch.Tensor, mask: torch.Tensor
    ) -> JaggStats:
        """The call's :class:`JaggStats` with ``caller``'s with-grad counts so far."""
        return JaggStats(
            scores,
            exact,
            caller.grad_samples,
            caller.grad_calls,
            list(self.windows),
            list(self.anchors),
            mask,
        )


def check_options(options: JaggOptions, latents: torch.Tensor, n_anchors: int) -> JaggOptions:
    """The options checked (layout options aside): see :class:`JaggCall`'s ``opts``."""
    o = options
    mode = check_choice("mode", o.mode, MODES)
    backend = check_backend_runnable(o.backend, latents.device, latents.dtype)
    batching = check_choice("batching", o.batching, BATCHINGS)
    chunk_size = check_chunk_size(o.chunk_size)
    router = check_router(o.router)
    deferred = check_bool("deferred", o.deferred)
    fold = check_fold(o.fold)
    placement = check_placement(o.placement, deferred, router, mode, fold, o.promote_to)
    budget = check_budget(o.budget, placement, latents.shape[0], float(n_anchors), fold)
    values = check_values(o.values, latents)
    values_tol = check_tol(o.values_tol)
    generator = check_generator(o.generator, placement)
    promotion = check_promotion(o.promotion, placement)
    promote_to = check_promote_to(o.promote_to, placement)
    check_promoting_budget(budget, promote_to, latents.shape[0])
    return replace(
        o,
        mode=mode,
        backend=backend,
        batching=batching,
        chunk_size=chunk_size,
        router=router,
        deferred=deferred,
        placement=placement,
        budget=budget,
        values=values,
        values_tol=values_tol,
        fold=fold,
        generator=generator,
        promotion=promotion,
        promote_to=promote_to,
    )


def parse_call(
    model: Callable[..., torch.Tensor],
    latents: object,
    timesteps: object,
    options: JaggOptions,
    *,
    trajectory: bool,
) -> JaggCall:
    """Check a call and record what its plan and executor need; no model call.

    trajectory: ``jagg_trajectory`` (``options.window`` steps per window) rather than
    ``jagg_window`` (the latents are one window; ``options.window`` is ignored).
    """
    latents = check_latents(latents, "T" if trajectory else "W")
    T, B = latents.shape[:2]
    device = latents.device
    # The layout first: a (B, T, ...) buffer is named as such, not as a bad window.
    t64 = check_timesteps(timesteps, latents)
    anchors, windows = check_window(T, options.window, options.shared_anchors, trajectory)
    opts = check_options(options, latents, len(anchors))
    if options.anchors is not None:
        # Explicit anchors replace the window layout (the window's anchor count stays the
        # default budget, which only the planned placements read, refused here).
        if opts.router is not None or opts.placement != "uniform":
            raise ValueError(
                "anchors= is the uniform placement's layout without a router (a router tests "
                "the window layout; placement='adaptive' / 'stochastic' choose their own), got "
                f"router={opts.router!r}, placement={opts.placement!r}"
            )
        anchors, windows = check_anchors(T, options.anchors, opts.fold)
    check_model(model, device, opts.router)
    # Called from here directly: its warning's stacklevel names the public function's caller.
    cond, batched = check_cond(opts.cond, B, device, opts.batched_cond)
    targets, grad_keys = _targets(model, cond, opts)
    needs_grad = torch.is_grad_enabled() and (bool(targets) or not opts.deferred)
    if not needs_grad or (opts.mode == "exact" and not opts.deferred):
        executor = "direct"
    else:
        executor = "deferred" if opts.deferred else "eager"
    if executor == "deferred":
        ddp_for_deferred(model)  # refuses FSDP
    t_model = (
        timesteps.detach().to(latents.dtype)
        if isinstance(timesteps, torch.Tensor)
        else t64.to(latents.dtype)
    )
    return JaggCall(
        model=model,
        latents=latents,
        t64=t64,
        t_model=t_model.unsqueeze(1).expand(T, B) if t_model.dim() == 1 else t_model,
        anchors=tuple(anchors),
        windows=tuple(windows),
        opts=opts,
        cond=cond,
        batched=batched,
        targets=tuple(targets),
        grad_cond_keys=tuple(grad_keys),
        needs_grad=needs_grad,
        executor=executor,
        values_limit=(
            values_tolerance(opts.values, opts.values_tol)
            if opts.values is not None and needs_grad
            else None
        ),
        versions=(
            tuple(_versions(latents, timesteps, cond, targets)) if executor == "deferred" else ()
        ),
        autocast=autocast_state(device),
    )


def _targets(
    model: object, cond: dict[str, Any], opts: JaggOptions
) -> tuple[list[torch.Tensor], list[str]]:
    """A deferred call's differentiated inputs: parameters, then cond tensors with grad."""
    if not opts.deferred:
        if opts.params is not None:
            raise ValueError("params is used by deferred=True only (the eager path uses autograd)")
        return [], []
    targets = resolve_params(model, opts.params, who="deferred=True", require=False)
    keys = [k for k, v in cond.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    return targets + [cond[k] for k in keys], keys


def _versions(
    latents: torch.Tensor, timesteps: object, cond: dict[str, Any], targets: list[torch.Tensor]
) -> list[tuple[str, torch.Tensor, int]]:
    return record_versions(
        [("latents", latents)]
        + ([("timesteps", timesteps)] if isinstance(timesteps, torch.Tensor) else [])
        + [(f"cond[{k!r}]", v) for k, v in cond.items() if isinstance(v, torch.Tensor)]
        + [(f"parameter {i} of the deferred call", p) for i, p in enumerate(targets)]
    )
