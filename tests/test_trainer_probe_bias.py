"""The trainer's probe in the bias metric (issue 18, item 2) and ``GRPOConfig.fold``.

``probe_batches >= 3`` adds :func:`jagg_autograd.bias.bias_statistics`' figures to the
probe's log keys.  Two toy estimators registered here make the test able to fail: one adds
a constant vector to the exact gradient (a pure bias: systematic share 1), one adds fresh
zero-mean noise per batch (no bias: share at the floor 0, within its spread).
"""

from __future__ import annotations

import math

import pytest
import torch

from jagg_autograd.estimators import ESTIMATORS, ExactEstimator, register_estimator
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

TINY = dict(steps=2, prompts_per_step=2, group_size=2, num_steps=6, window=3,
            eval_per_digit=0, grid_samples=0, progress=False)  # fmt: skip
# Always finite (with an error that is not identically 0):
FINITE_KEYS = ("probe_systematic_share", "probe_systematic_share_floor_sd",
               "probe_signal_fraction", "probe_signal_fraction_floor_sd",
               "probe_mean_cosine", "probe_min_cosine")  # fmt: skip
# NaN when the debiased signal ||E exact||^2 is not positive (a few tiny batches: noise).
BIAS_KEYS = (*FINITE_KEYS, "probe_bias_to_signal", "probe_expected_cosine")


class ShiftedExact(ExactEstimator):
    """The exact gradient plus a constant vector: a pure bias."""

    def loss(self, ctx, mb, *, generator, on_policy, scale=1.0, inline_backward=False):
        res = self.batched(ctx, mb, mb.steps)
        g = torch.Generator().manual_seed(1234)  # the same direction on every call
        shift = sum((p * torch.randn(p.shape, generator=g)).sum() for p in ctx.params)
        res.loss = res.loss + 1e-3 * shift
        return res


class NoisyExact(ExactEstimator):
    """The exact gradient plus fresh zero-mean noise per call: unbiased."""

    def loss(self, ctx, mb, *, generator, on_policy, scale=1.0, inline_backward=False):
        res = self.batched(ctx, mb, mb.steps)
        noise = sum((p * torch.randn(p.shape, generator=generator)).sum() for p in ctx.params)
        res.loss = res.loss + 1e-3 * noise
        return res


@pytest.fixture
def toys():
    register_estimator("toy_shifted", ShiftedExact)
    register_estimator("toy_noisy", NoisyExact)
    try:
        yield
    finally:
        ESTIMATORS.pop("toy_shifted")
        ESTIMATORS.pop("toy_noisy")


def test_probe_bias_keys_appear_and_are_finite():
    tr = GRPOTrainer(GRPOConfig(**TINY, probe_every=1, probe_batches=4))
    rows = [tr.step() for _ in range(2)]
    for i, r in enumerate(rows):
        assert r["probe_batches"] == 4
        assert set(BIAS_KEYS) <= set(r)
        for k in (*FINITE_KEYS, "probe_cosine", "probe_rel_error"):
            assert math.isfinite(r[k]), (i, k, r[k])
        assert r["probe_cosine"] == pytest.approx(r["probe_mean_cosine"], abs=1e-12)
        assert -1.0 <= r["probe_min_cosine"] <= r["probe_cosine"] <= 1.0
    # No AdamW state before the first optimizer step; its metric afterwards.
    assert "probe_systematic_share_adam" not in rows[0]
    assert math.isfinite(rows[1]["probe_systematic_share_adam"])
    assert "probe_bias_to_signal_adam" in rows[1]


def test_one_batch_probe_keeps_the_old_keys_only():
    r = GRPOTrainer(GRPOConfig(**TINY, probe_every=1)).step()
    assert r["probe_batches"] == 1 and -1.0 <= r["probe_cosine"] <= 1.0
    assert not any(k in r for k in BIAS_KEYS)


def test_probe_batches_are_shared_and_leave_the_run_alone():
    """Batch b's prompts and noise depend on eval_seed, the step and b only: two estimators
    see the same exact gradients (signal fraction equal), and probing changes no number of
    the training run."""
    a = GRPOTrainer(GRPOConfig(**TINY, probe_every=1, probe_batches=3))
    b = GRPOTrainer(GRPOConfig(**TINY, probe_every=1, probe_batches=3, fold="causal"))
    c = GRPOTrainer(GRPOConfig(**TINY))
    ra, rb, rc = a.step(), b.step(), c.step()
    assert ra["probe_signal_fraction"] == pytest.approx(rb["probe_signal_fraction"], rel=1e-9)
    assert ra["probe_mean_cosine"] != rb["probe_mean_cosine"]  # the fold matters
    assert ra["reward_mean"] == rc["reward_mean"] and ra["loss"] == rc["loss"]


def test_a_biased_estimator_has_a_high_share_an_unbiased_one_the_floor(toys):
    n = 8
    shifted = GRPOTrainer(GRPOConfig(**TINY, mode="toy_shifted", probe_batches=n)).probe()
    noisy = GRPOTrainer(GRPOConfig(**TINY, mode="toy_noisy", probe_batches=n)).probe()
    exact = GRPOTrainer(GRPOConfig(**TINY, mode="exact", probe_batches=n)).probe()
    # A constant error is all systematic.
    assert shifted["probe_systematic_share"] > 0.9
    # Fresh zero-mean noise: 0 within a few floor SDs (a fixed seed; the margin is wide).
    sd = noisy["probe_systematic_share_floor_sd"]
    assert sd > 0
    assert abs(noisy["probe_systematic_share"]) < 4 * sd + 0.02
    # The same exact gradients for all three: the same signal fraction.
    assert shifted["probe_signal_fraction"] == pytest.approx(
        noisy["probe_signal_fraction"], rel=1e-9
    )
    # Exact has no error at all: its share is 0 / 0 (NaN), its cosines 1.
    assert math.isnan(exact["probe_systematic_share"])
    assert exact["probe_mean_cosine"] == exact["probe_expected_cosine"] == 1.0


def test_fold_field_reaches_jagg_and_is_checked():
    lin = GRPOTrainer(GRPOConfig(**TINY, probe_batches=3)).probe()
    cau = GRPOTrainer(GRPOConfig(**TINY, probe_batches=3, fold="causal")).probe()
    eag = GRPOTrainer(GRPOConfig(**TINY, probe_batches=3, fold="causal", reuse_values=False,
                                 deferred=False)).probe()  # fmt: skip
    assert lin["probe_mean_cosine"] != cau["probe_mean_cosine"]
    # The eager path folds the same way as the deferred one.
    assert eag["probe_mean_cosine"] == pytest.approx(cau["probe_mean_cosine"], abs=1e-6)
    with pytest.raises(ValueError, match="fold must be one of"):
        GRPOConfig(fold="anticausal").validate()
    with pytest.raises(ValueError, match="probe_batches must be an int >= 1"):
        GRPOConfig(probe_batches=0).validate()


def test_fold_and_probe_batches_are_cli_flags():
    from jagg_autograd.demo import build_parser

    ns = build_parser().parse_args(["--fold", "causal", "--probe-batches", "24"])
    assert ns.fold == "causal" and ns.probe_batches == 24
