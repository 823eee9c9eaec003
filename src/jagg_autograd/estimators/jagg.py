"""JAGG: the trained steps' velocities from one :func:`~jagg_autograd.jagg_trajectory` call
whose backward runs through the window anchors only (``mode="jagg"``), optionally with the
cosine router sending non-linear windows to the exact gradient (``mode="router"``).

The execution path of a minibatch (logged in ``paths``):

* ``"values+deferred"``: on-policy (no optimizer step since the rollout) with
  ``reuse_values``: the rollout's velocities are passed as ``values=`` with
  ``deferred=True``, so no model call is made but the anchors';
* ``"deferred"``: ``deferred=True`` (or ``placement="adaptive"`` / ``"stochastic"``,
  which always run deferred) without values: every step is recomputed, the anchors run
  with grad in the backward, chunk by chunk;
* ``"eager"``: today's library default, one with-grad forward of the anchors.

``placement``/``budget`` apply to ``mode="jagg"`` only (the router uses the uniform layout).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import torch

from jagg_autograd.estimators.base import Estimator, LossContext, Minibatch, MinibatchResult
from jagg_autograd.estimators.exact import fraction_note
from jagg_autograd.layout import causal_layout, expected_anchor_count
from jagg_autograd.rollout import policy_log_probs
from jagg_autograd.router import CosineRouter
from jagg_autograd.window import jagg_trajectory

__all__ = ["JaggEstimator", "RouterEstimator", "core_available"]


def core_available() -> bool:
    """This build's :func:`jagg_trajectory` takes ``values=`` / ``deferred=`` / ``placement=``."""
    return "values" in inspect.signature(jagg_trajectory).parameters


class JaggEstimator(Estimator):
    """JAGG windows of ``window`` steps (shared anchors by default) along each sample's
    trained steps; values / deferred / adaptive placement as configured."""

    name = "jagg"
    router: CosineRouter | None = None

    @property
    def planned_in_backward(self) -> bool:
        """Adaptive or stochastic placement: the plan is chosen from g in the backward."""
        return self.config.placement != "uniform"

    def check(self) -> None:
        super().check()
        c = self.config
        if (c.reuse_values or c.deferred or c.placement != "uniform") and not core_available():
            raise ValueError(
                "reuse_values / deferred / placement need jagg_trajectory(values=, deferred=, "
                "placement=), which this build of jagg_autograd.window does not have"
            )

    def fallback(self) -> dict[str, Any] | None:
        # The linear fold's mean error (the later anchor sees the step's own noise) is what
        # runs away; the causal fold has no such term for any advantages and, with the
        # window's anchors kept, costs what the linear fold does (shapes, groups of 16:
        # 0.402 of exact's training phase against 0.415).  Its 2 anchors of 5 still learn
        # less there (-16.5 % at 250 steps; benchmarks/results/shapes/SHAPES.md).  Should
        # the causal fold run away too: exact GRPO.
        if self.config.fold == "linear":
            return {"fold": "causal"}
        # Exact GRPO promotes nothing (GRPOConfig refuses promote_to="exact" for it).
        if self.config.promote_to == "exact":
            return {"mode": "exact", "promote_to": "anchor"}
        return {"mode": "exact"}

    @classmethod
    def places_causal_layout(cls, fold: str, placement: str) -> bool:
        """Whether this estimator gives the causal fold :func:`causal_layout` anchors where
        the trained steps are a prefix: uniform placement (the adaptive planner places its
        own) and no router (its windows are the window layout's).  One rule for the run
        (:meth:`causal_anchors`) and its log line (:meth:`describe`)."""
        return fold == "causal" and placement == "uniform"

    def causal_anchors(self, mb: Minibatch) -> list[int] | None:
        """The causal fold's anchors on a prefix of the sampler's steps, else None (the
        window layout).

        On a prefix (``timestep_fraction`` < 1, trained steps ``0..n-1`` of T) the window
        layout's end anchor n-1 serves only itself: :func:`causal_layout` spreads the same
        count (shapes, 5 of 10 steps, 2 anchors: per-batch cosine 0.822 at {0, 3} vs 0.770
        at {0, 4}).  Where the trained steps reach the sampler's last step, whose upstream
        gradient is the largest, the window layout's end anchor is worth it (digits, all
        10 steps, 4 anchors: 0.916 at {0, 3, 6, 9} vs 0.843 at {0, 3, 6, 8}).  Random
        per-sample steps (DanceGRPO's selection) keep the window layout."""
        c = self.config
        if not self.places_causal_layout(c.fold, c.placement):
            return None
        if not isinstance(mb.steps, tuple) or mb.steps[1] >= mb.traj.num_steps:
            return None
        n = mb.steps[1] - mb.steps[0]
        if n < 2:  # one step: no trajectory call (its gradient is exact)
            return None
        count = expected_anchor_count(n, min(c.window, n), c.shared_anchors)
        return causal_layout(n, count)[0]

    def core_options(
        self,
        ctx: LossContext,
        reuse: bool,
        mb: Minibatch | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[dict[str, Any], str]:
        """The ``jagg_trajectory`` keywords of this minibatch's path, and the path's name;
        ``generator``: the run's stream, which stochastic placement draws from (so a run
        is reproducible and resumes exactly)."""
        c = self.config
        fold: dict[str, Any] = {} if c.fold == "linear" else {"fold": c.fold}  # linear: default
        anchors = None if mb is None else self.causal_anchors(mb)
        if anchors is not None:
            fold["anchors"] = anchors
        if not (reuse or c.deferred or self.planned_in_backward):
            return fold, "eager"
        # Values are only ever used with the deferred backward (no forward at all but the
        # anchors'); off-policy minibatches recompute every step.
        kw: dict[str, Any] = {"deferred": True, "params": ctx.params, **fold}
        if self.planned_in_backward:
            kw["placement"] = c.placement
            if c.budget is not None:
                kw["budget"] = c.budget
            if c.placement == "stochastic":
                kw["generator"] = generator
                if c.promotion != "uniform":
                    kw["promotion"] = c.promotion
                if c.promote_to != "anchor":
                    kw["promote_to"] = c.promote_to
        return kw, "values+deferred" if reuse else "deferred"

    def loss(
        self,
        ctx: LossContext,
        mb: Minibatch,
        *,
        generator: torch.Generator,
        on_policy: bool,
        scale: float = 1.0,
        inline_backward: bool = False,
    ) -> MinibatchResult:
        c = self.config
        reuse = c.reuse_values and on_policy
        kw, path = self.core_options(ctx, reuse, mb, generator)
        res = policy_log_probs(
            ctx.policy, mb.traj, steps=mb.steps, noise_level=c.noise_level, mode="jagg",
            window=c.window, shared_anchors=c.shared_anchors, router=self.router,
            batching=c.batching, chunk_size=c.chunk_size, reuse_values=reuse, core_kwargs=kw,
        )  # fmt: skip
        loss, infos = self.policy_loss(res.log_probs, res.old_log_probs, mb.adv,
                                       self.kl_terms(res, mb))  # fmt: skip
        routed = float(res.stats.exact.float().mean())
        return MinibatchResult(loss, infos, path, res.log_probs.numel(), routed_frac=routed,
                               stats=res.stats)  # fmt: skip

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        anchors = "shared" if cfg["shared_anchors"] else "disjoint"
        txt = f"{cfg['mode']}, window {cfg['window']}, {anchors} anchors" + cls.router_words(cfg)
        extras = []
        if cfg.get("reuse_values"):
            extras.append("on-policy values")
        if cfg.get("deferred"):
            extras.append("deferred backward")
        if cfg.get("placement", "uniform") != "uniform":
            budget = cfg.get("budget")
            extras.append(
                f"{cfg['placement']} placement" + (f" budget {budget:g}" if budget else "")
                + (f", {cfg['promotion']} promotion"
                   if cfg.get("promotion", "uniform") != "uniform" else "")
                + (f" to {cfg['promote_to']}"
                   if cfg.get("promote_to", "anchor") != "anchor" else "")
            )  # fmt: skip
        if cfg.get("fold", "linear") != "linear":
            extras.append(f"{cfg['fold']} fold")
            prefix = cfg.get("timestep_fraction", 1.0) < 1.0 and (
                cfg.get("timestep_selection", "prefix") == "prefix"
            )
            if prefix and cls.places_causal_layout(cfg["fold"], cfg.get("placement", "uniform")):
                extras[-1] += " (causal_layout anchors over the trained prefix)"
        if extras:
            txt += ", " + ", ".join(extras)
        return txt + fraction_note(cfg)

    @classmethod
    def router_words(cls, cfg: dict[str, Any]) -> str:
        return ""


class RouterEstimator(JaggEstimator):
    """JAGG + :class:`~jagg_autograd.CosineRouter` (``threshold``, ``jagg_frac``): samples
    whose velocities are not near-linear on a window get the exact gradient there."""

    name = "router"

    @functools.cached_property
    def router(self) -> CosineRouter:  # type: ignore[override]
        return CosineRouter(self.config.threshold, self.config.jagg_frac)

    @property
    def planned_in_backward(self) -> bool:
        return False  # the router and a placement budget do not combine

    @classmethod
    def places_causal_layout(cls, fold: str, placement: str) -> bool:
        return False  # the router decides on the window layout's windows

    def resolve(self, d: dict[str, Any]) -> None:
        d["placement"] = "uniform"

    @classmethod
    def router_words(cls, cfg: dict[str, Any]) -> str:
        txt = f", router threshold {cfg['threshold']:g}"
        if cfg.get("jagg_frac") is not None:
            txt += f" jagg_frac {cfg['jagg_frac']:g}"
        return txt

    @classmethod
    def summary_note(cls, cfg: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
        routed = sum(r["routed_frac"] for r in rows) / len(rows)
        return f" Mean exact-routed window fraction {routed:.2f}."
