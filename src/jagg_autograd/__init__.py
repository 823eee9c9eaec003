"""jagg-autograd: Jacobian-aggregated group gradients for GRPO on flow-matching DiTs.

``jagg_window`` / ``jagg_trajectory`` return a rollout's velocities with a gradient that
needs one batched backward through the window anchors instead of one per step.
"""

from jagg_autograd.bias import BiasReport, bias_statistics, gradient_bias
from jagg_autograd.diagnostics import FidelityReport, gradient_fidelity
from jagg_autograd.mix import jagg_mix, jagg_mix_ref
from jagg_autograd.router import CosineRouter, cosine_route, cosine_route_ref
from jagg_autograd.runaway_guard import RunawayGuard
from jagg_autograd.window import (
    JaggStats,
    causal_layout,
    expected_anchor_count,
    jagg_trajectory,
    jagg_window,
    trajectory_layout,
)

__version__ = "0.1.0"

__all__ = [
    "BiasReport",
    "CosineRouter",
    "FidelityReport",
    "JaggStats",
    "RunawayGuard",
    "bias_statistics",
    "causal_layout",
    "cosine_route",
    "cosine_route_ref",
    "expected_anchor_count",
    "gradient_bias",
    "gradient_fidelity",
    "jagg_mix",
    "jagg_mix_ref",
    "jagg_trajectory",
    "jagg_window",
    "trajectory_layout",
]
