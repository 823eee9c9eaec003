"""The EMA of the trained weights (``ema_decay``): Flow-GRPO's update rule, evaluation at the
average with the raw weights restored, and the trainer's use of it (training untouched,
evaluations at the average); ``global_std`` reaches the advantages."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from jagg_autograd.advantages import group_advantages
from jagg_autograd.config import GRPOConfig
from jagg_autograd.ema import ParamEMA
from jagg_autograd.trainer import GRPOTrainer


def _flow_grpo_step(ema, theta, optimization_step: int, decay: float, interval: int):
    """Flow-GRPO's ``EMAModuleWrapper.step(params, optimization_step)`` (flow_grpo/ema.py)."""
    if (optimization_step + 1) % interval == 0:
        d = min((1 + optimization_step) / (10 + optimization_step), decay)
        ema = ema + (1 - d) * (theta - ema)
    return ema


def _flow_grpo_ema(history: list[torch.Tensor], decay: float, every: int) -> torch.Tensor:
    """Flow-GRPO's EMAModuleWrapper.step over the weights after each optimizer step."""
    ema = history[0].clone()  # the weights before training
    for s, theta in enumerate(history[1:]):
        ema = _flow_grpo_step(ema, theta, s, decay, every)
    return ema


@pytest.mark.parametrize("decay,every", [(0.9, 1), (0.5, 3), (0.95, 8)])
def test_update_matches_flow_grpo_rule(decay, every):
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=g))
    ema = ParamEMA([p], decay, every)
    history = [p.detach().clone()]
    for _ in range(20):
        with torch.no_grad():
            p.add_(torch.randn(5, 3, generator=g))
        ema.update()
        history.append(p.detach().clone())
    want = _flow_grpo_ema(history, decay, every)
    torch.testing.assert_close(ema.values[0], want, rtol=1e-6, atol=1e-6)
    assert ema.updates == 20
    assert not torch.allclose(ema.values[0], p.detach())


def test_call_sees_the_average_and_restores_the_raw_weights():
    p = torch.nn.Parameter(torch.zeros(4))
    ema = ParamEMA([p], 0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()  # d_0 = 0.1: the average moves 0.9 of the way
    seen = ema.call(lambda: p.detach().clone())
    torch.testing.assert_close(seen, torch.full((4,), 0.9))
    assert torch.equal(p.detach(), torch.ones(4))
    with pytest.raises(RuntimeError, match="boom"):  # restored on error too
        ema.call(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    assert torch.equal(p.detach(), torch.ones(4))


@pytest.mark.parametrize("kw", [{"decay": 1.0}, {"decay": 0.0}, {"decay": True},
                                {"decay": 0.9, "every": 0}])  # fmt: skip
def test_bad_arguments(kw):
    with pytest.raises(ValueError, match="decay|every"):
        ParamEMA([torch.nn.Parameter(torch.zeros(1))], **kw)


def test_config_refuses_bad_ema_decay():
    with pytest.raises(ValueError, match="ema_decay"):
        GRPOConfig(ema_decay=1.0).validate()
    with pytest.raises(ValueError, match="ema_every"):
        GRPOConfig(ema_every=0).validate()


_TINY = GRPOConfig(steps=3, prompts_per_step=2, group_size=2, num_steps=4, window=2,
                   eval_per_digit=1, grid_samples=0, progress=False, lr=1e-3)  # fmt: skip


def test_trainer_trains_the_raw_weights_and_evaluates_the_average():
    plain = GRPOTrainer(_TINY)
    ema = GRPOTrainer(dataclasses.replace(_TINY, ema_decay=0.8))
    history = [[p.detach().clone() for p in ema.params]]
    for _ in range(_TINY.steps):
        a, b = plain.step(), ema.step()
        history.append([p.detach().clone() for p in ema.params])
        # The average never feeds back into training: every step is the plain run's.
        assert {k: v for k, v in a.items() if "seconds" not in k} == {
            k: v for k, v in b.items() if "seconds" not in k
        }
    for i, v in enumerate(ema.ema.values):
        want = _flow_grpo_ema([h[i] for h in history], 0.8, 1)
        torch.testing.assert_close(v, want, rtol=1e-6, atol=1e-6)
    # The final evaluation is the evaluation at the averaged weights.
    ev = ema.finish()["evals"][-1]
    with torch.no_grad():
        raw = [p.detach().clone() for p in ema.params]
        for p, v in zip(ema.params, ema.ema.values):
            p.copy_(v)
        at_avg = ema.evaluate()
        for p, r in zip(ema.params, raw):
            p.copy_(r)
    assert ev["mean_reward"] == at_avg["mean_reward"]
    # ... and it carries the raw weights' score too (what the rollouts use).
    assert ev["raw_mean_reward"] == ema.evaluate()["mean_reward"]
    assert plain.finish()["evals"][-1]["mean_reward"] == plain.evaluate()["mean_reward"]


def test_global_std_reaches_the_advantages():
    tr = GRPOTrainer(dataclasses.replace(_TINY, global_std=True, prompts_per_step=3,
                                         eval_per_digit=0))  # fmt: skip
    batch = tr.rollout()
    rewards, adv = tr.advantages(batch)
    torch.testing.assert_close(adv, group_advantages(rewards, batch.groups, global_std=True))
    per_group = group_advantages(rewards, batch.groups)
    assert not torch.allclose(adv, per_group)


def _flow_grpo_geneval_epoch_averages(epochs: int) -> list[float]:
    """The EMA of Flow-GRPO's GenEval run (``scripts/train_sd3.py``, ``config/grpo.py``
    ``geneval_sd3``) after each epoch, with the weights' value set to their age in epochs.

    Each epoch trains ``num_batches_per_epoch = 4`` minibatches at
    ``gradient_accumulation_steps = 2``: two optimizer steps, ``global_step`` counting them.
    ``ema.step(params, global_step)`` runs after *every minibatch* (outside the
    ``sync_gradients`` branch), so while ``global_step % 8 == 7`` it fires twice, on the
    same weights."""
    ema, global_step, decay, out = 0.0, 0, 0.9, []
    for epoch in range(epochs):
        for minibatch in range(4):
            if minibatch % 2 == 1:
                global_step += 1  # the optimizer step at the end of an accumulation
            theta = epoch + (global_step - 2 * epoch) / 2  # epochs of training the weights saw
            ema = _flow_grpo_step(ema, theta, global_step, decay, 8)
        out.append(ema)
    return out


def _ours_epoch_averages(epochs: int, decay: float, every: int, per_epoch: int) -> list[float]:
    """Our EMA after each epoch at ``per_epoch`` optimizer steps per rollout, the weights'
    value set to their age in epochs as in the replay above."""
    p = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))
    ema, out = ParamEMA([p], decay, every), []
    for epoch in range(epochs):
        for k in range(per_epoch):
            with torch.no_grad():
                p.fill_(epoch + (k + 1) / per_epoch)
            ema.update()
        out.append(float(ema.values[0]))
    return out


@pytest.mark.parametrize(
    ("overrides", "per_rollout", "within"),
    [({}, 1, 2.5), ({"optimizer_steps_per_rollout": 2, "ema_every": 4}, 2, 1.6)],
    ids=["demo", "two_optimizer_steps_per_rollout"],
)
def test_shapes_demo_ema_averages_as_flow_grpos_geneval_run(overrides, per_rollout, within):
    """The demo's ``ema_every`` counts optimizer steps, one per rollout; Flow-GRPO's GenEval
    run makes two updates every 4 epochs (above).  Both must weigh the same past: from
    epoch 100 to 300 the mean age of the averaged weights agrees to 2.5 epochs (it is
    17-21), where an interval of 8 per rollout averages weights 47-77 epochs old.  (At
    epoch 50 the warm-ups differ: 9 against 16.)  The lever of two optimizer steps per
    rollout (Flow-GRPO's own count, SHAPES.md) keeps that past at ``ema_every=4``, to 1.6."""
    from jagg_autograd.tasks.shapes import ShapesTask

    d = {**ShapesTask.demo_defaults, **overrides}
    assert GRPOConfig(**d).optimizer_steps_per_grpo_step == per_rollout
    n = 300
    theirs = _flow_grpo_geneval_epoch_averages(n)
    ours = _ours_epoch_averages(n, d["ema_decay"], d["ema_every"], per_rollout)
    stale = _ours_epoch_averages(n, 0.9, 8, 1)
    for e in range(100, n + 1):  # after e epochs
        age_theirs, age_ours, age_stale = (e - v[e - 1] for v in (theirs, ours, stale))
        assert 17 < age_theirs < 21, (e, age_theirs)
        assert abs(age_ours - age_theirs) < within, (e, age_ours, age_theirs)
        assert age_stale - age_theirs > 25, (e, age_stale, age_theirs)
