"""The trainer's gradient estimators, one module per family, behind one interface.

``ESTIMATORS`` maps a ``GRPOConfig.mode`` to its :class:`Estimator` class; the trainer
builds ``ESTIMATORS[config.mode](config)`` once and asks it everything that depends on
the mode.  A new estimator is one module (a subclass of :class:`Estimator` overriding
:meth:`Estimator.loss`, and the hooks it needs) plus one line here (or a call of
:func:`register_estimator` from anywhere): the config's checks, the CLI's ``--mode``
choices, the trainer and the run summary pick it up.

=============  ==========================================================================
``exact``      Flow-GRPO's per-step loop (``exact_loop``) or the batched oracle
``jagg``       JAGG windows; on-policy values, deferred backward, adaptive or stochastic
               placement
``router``     JAGG + the cosine router (non-linear windows get the exact gradient)
``subsample``  DanceGRPO: the exact gradient of random steps per sample
``mixgrpo``    MixGRPO: a sliding SDE window, trained exactly
``nft``        DiffusionNFT's forward-process loss: their loop, or one JAGG call (shared noise)
=============  ==========================================================================
"""

from __future__ import annotations

from jagg_autograd.estimators.base import (
    Estimator,
    EstimatorShim,
    LossContext,
    Minibatch,
    MinibatchResult,
    grpo_loss_mean,
    timed_backward,
)
from jagg_autograd.estimators.exact import ExactEstimator, SubsampleEstimator
from jagg_autograd.estimators.jagg import JaggEstimator, RouterEstimator
from jagg_autograd.estimators.mixgrpo import MixGRPOEstimator, mix_window_start
from jagg_autograd.estimators.nft import NFTEstimator

__all__ = [
    "ESTIMATORS",
    "MODES",
    "Estimator",
    "EstimatorShim",
    "ExactEstimator",
    "JaggEstimator",
    "LossContext",
    "Minibatch",
    "MinibatchResult",
    "MixGRPOEstimator",
    "NFTEstimator",
    "RouterEstimator",
    "SubsampleEstimator",
    "get_estimator",
    "grpo_loss_mean",
    "mix_window_start",
    "register_estimator",
    "timed_backward",
]

ESTIMATORS: dict[str, type[Estimator]] = {
    "exact": ExactEstimator,
    "jagg": JaggEstimator,
    "router": RouterEstimator,
    "subsample": SubsampleEstimator,
    "mixgrpo": MixGRPOEstimator,
    "nft": NFTEstimator,
}

#: The built-in modes (``ESTIMATORS`` is the live registry).
MODES = tuple(ESTIMATORS)


def register_estimator(name: str, cls: type[Estimator]) -> type[Estimator]:
    """Register ``cls`` as ``GRPOConfig(mode=name)`` (replacing a registered one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an estimator name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Estimator)):
        raise TypeError(f"an estimator must be an Estimator subclass, got {cls!r}")
    ESTIMATORS[name] = cls
    return cls


def get_estimator(name: str) -> type[Estimator]:
    """The estimator class registered as ``name`` (``ValueError`` if none is)."""
    if name not in ESTIMATORS:
        raise ValueError(f"mode must be one of {tuple(ESTIMATORS)}, got {name!r}")
    return ESTIMATORS[name]
