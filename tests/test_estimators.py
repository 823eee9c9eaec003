"""The estimator plug-in seam: a new estimator is one class plus one registry entry.

The toy estimator below lives only in this file; registered (and removed again) by the
fixture, it trains through :class:`GRPOTrainer`, the probe, the run summary and the CLI
(``--mode toy`` is a generated choice) without any other file knowing it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from jagg_autograd.estimators import (
    ESTIMATORS,
    MODES,
    Estimator,
    LossContext,
    Minibatch,
    MinibatchResult,
    get_estimator,
    register_estimator,
)
from jagg_autograd.rollout import policy_log_probs
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

TINY = dict(steps=2, prompts_per_step=2, group_size=2, num_steps=4, window=2,
            eval_per_digit=1, grid_samples=0, progress=False)  # fmt: skip


class LastStepEstimator(Estimator):
    """A toy: the exact GRPO gradient of the last sampler step only."""

    uses_timestep_fraction = False

    def num_train_steps(self) -> int:
        return 1

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
        T = mb.traj.num_steps
        res = policy_log_probs(ctx.policy, mb.traj, steps=(T - 1, T), mode="exact",
                               noise_level=self.config.noise_level)  # fmt: skip
        loss, infos = self.policy_loss(res.log_probs, res.old_log_probs, mb.adv, None)
        return MinibatchResult(loss, infos, "toy", res.log_probs.numel(), stats=res.stats)

    @classmethod
    def describe(cls, cfg: dict[str, Any]) -> str:
        return "toy (the last step, exactly)"


@pytest.fixture
def toy():
    register_estimator("toy", LastStepEstimator)
    try:
        yield LastStepEstimator
    finally:
        ESTIMATORS.pop("toy")


def test_builtin_registry():
    assert MODES == ("exact", "jagg", "router", "subsample", "mixgrpo", "nft")
    assert tuple(ESTIMATORS)[: len(MODES)] == MODES
    for mode in MODES:
        assert get_estimator(mode).__module__.startswith("jagg_autograd.estimators.")
    with pytest.raises(ValueError, match="mode must be one of"):
        get_estimator("nope")
    with pytest.raises(TypeError, match="Estimator subclass"):
        register_estimator("bad", object)  # type: ignore[arg-type]


def test_a_registered_estimator_trains_through_the_trainer(toy):
    tr = GRPOTrainer(GRPOConfig(**TINY, mode="toy", probe_every=1))
    assert isinstance(tr.estimator, toy)
    before = [p.detach().clone() for p in tr.params]
    rows = [tr.step() for _ in range(2)]
    log = tr.finish()
    B = 2 * 2
    for r in rows:
        assert r["paths"] == ["toy"] and r["grad_samples"] == B and r["optimizer_steps"] == 1
        assert r["ratio_min"] == r["ratio_max"] == 1.0  # on-policy, one step
        assert -1.0 <= r["probe_cosine"] <= 1.0
    assert any(not torch.equal(p, q) for p, q in zip(tr.params, before))
    assert log["config"]["mode"] == "toy" and log["config"]["num_train_steps"] == 1
    assert "toy (the last step, exactly)" in log["summary"]


def test_a_registered_estimator_runs_from_the_cli(toy, tmp_path, capsys):
    from jagg_autograd.demo import build_parser, main

    mode = next(a for a in build_parser()._actions if a.dest == "mode")
    assert "toy" in mode.choices
    argv = ["--mode", "toy", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
            "--num-steps", "4", "--window", "2", "--eval-per-digit", "1", "--grid-samples",
            "0", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "finished" and len(log["steps"]) == 2
    assert all(r["paths"] == ["toy"] for r in log["steps"])
    assert "toy (the last step" in capsys.readouterr().out


def test_an_unregistered_mode_is_refused(toy):
    GRPOConfig(mode="toy").validate()
    ESTIMATORS.pop("toy")
    try:
        with pytest.raises(ValueError, match="mode must be one of"):
            GRPOConfig(mode="toy").validate()
    finally:
        register_estimator("toy", toy)  # the fixture removes it


def test_estimator_checks_run_after_the_common_ones():
    # The common table names the field; the estimator adds what only it needs.
    with pytest.raises(ValueError, match="nft_timesteps"):
        GRPOConfig(mode="nft", nft_timesteps=11).validate()
    GRPOConfig(nft_timesteps=11).validate()  # other modes ignore it
    with pytest.raises(ValueError, match="probe_every must be 0 with mode='nft'"):
        GRPOConfig(mode="nft", probe_every=1).validate()
    with pytest.raises(ValueError, match="timestep_fraction"):
        GRPOConfig(mode="mixgrpo", timestep_fraction=0.5).validate()
