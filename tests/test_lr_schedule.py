"""The learning-rate schedule (``lr_scheduler_type``, ``warmup_steps``): transformers'
formulas, torch's own schedulers as the oracle where they coincide, the rate each
optimizer step really runs at, and exact resume on the schedule."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from jagg_autograd.config import GRPOConfig
from jagg_autograd.lr_schedule import LR_SCHEDULERS, lr_factor
from jagg_autograd.trainer import GRPOTrainer, train

_EXAMPLES = 20 if os.environ.get("CI") else 100


def _torch_schedule(kind: str, total: int) -> list[float]:
    """The factors of torch's LinearLR / CosineAnnealingLR (no warm-up) over ``total`` steps."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = (torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.0, total_iters=total)
             if kind == "linear" else
             torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total))  # fmt: skip
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("kind", ["linear", "cosine"])
@pytest.mark.parametrize("total", [1, 7, 150])
def test_matches_torch_schedulers_without_warmup(kind, total):
    want = _torch_schedule(kind, total)
    got = [lr_factor(kind, k, total) for k in range(total)]
    assert got == pytest.approx(want, abs=1e-12)


def test_known_values():
    assert lr_factor("constant", 0, 10) == 1.0
    assert lr_factor("linear", 5, 10) == 0.5
    assert lr_factor("cosine", 5, 10) == pytest.approx(0.5)
    # Warm-up: k / w from 0, then the decay over the remaining N - w steps.
    assert [lr_factor("linear", k, 6, warmup=2) for k in range(6)] == [0, 0.5, 1, 0.75, 0.5, 0.25]
    assert [lr_factor("constant", k, 6, warmup=4) for k in range(6)] == [0, .25, .5, .75, 1, 1]
    # Past the end of the run: 0, never negative (nor rising again, for the cosine).
    assert lr_factor("linear", 12, 10) == 0.0 and lr_factor("cosine", 12, 10) == 0.0


@settings(max_examples=_EXAMPLES, deadline=None)
@given(kind=st.sampled_from(LR_SCHEDULERS), total=st.integers(1, 500),
       warmup=st.integers(0, 50), data=st.data())  # fmt: skip
def test_properties(kind, total, warmup, data):
    ks = list(range(total))
    f = [lr_factor(kind, k, total, warmup) for k in ks]
    assert all(0.0 <= x <= 1.0 for x in f)
    # Warm-up rises linearly from 0; afterwards the factor never rises.
    assert all(f[k] == pytest.approx(k / warmup) for k in ks if k < warmup)
    after = f[warmup:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))
    if after:
        assert after[0] == 1.0
    n = total - warmup
    if kind == "linear" and n >= 2:
        # Affine after the warm-up: equal drops of 1 / (N - w), reaching 0 at step N.
        assert all(a - b == pytest.approx(1 / n) for a, b in zip(after, after[1:]))
        assert lr_factor(kind, total, total, warmup) == 0.0
    if kind == "cosine" and n >= 2:
        # Point-symmetric about the middle of the decay: f(w + j) + f(N - j) = 1.
        j = data.draw(st.integers(0, n))
        assert lr_factor(kind, warmup + j, total, warmup) + lr_factor(
            kind, total - j, total, warmup) == pytest.approx(1.0)


@pytest.mark.parametrize("kw", [{"kind": "step"}, {"step": -1}, {"total": 0},
                                {"warmup": -2}, {"step": 1.5}, {"total": True}])  # fmt: skip
def test_bad_arguments(kw):
    args = {"kind": "linear", "step": 0, "total": 10, "warmup": 0, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        lr_factor(**args)


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="lr_scheduler_type must be one of"):
        GRPOConfig(lr_scheduler_type="cosine_with_restarts").validate()
    with pytest.raises(ValueError, match=r"warmup_steps must be an int in \[0, 60\]"):
        GRPOConfig(warmup_steps=-1).validate()
    # Warm-up counts optimizer steps: 60 GRPO steps x 2 epochs x 2 = 240.
    cfg = GRPOConfig(num_inner_epochs=2, optimizer_steps_per_rollout=2, warmup_steps=240)
    cfg.validate()
    with pytest.raises(ValueError, match=r"warmup_steps must be an int in \[0, 240\]"):
        dataclasses.replace(cfg, warmup_steps=241).validate()


# Every GRPO step: 2 inner epochs x 2 optimizer steps, each over 2 accumulated minibatches.
_TINY = GRPOConfig(steps=3, prompts_per_step=4, group_size=2, num_steps=4, window=2,
                   eval_per_digit=0, grid_samples=0, progress=False, lr=1e-3,
                   optimizer_steps_per_rollout=2, num_inner_epochs=2,
                   gradient_accumulation_steps=2)  # fmt: skip


def test_each_optimizer_step_runs_at_the_scheduled_rate():
    """A scheduled run equals a constant-lr run whose lr is set by hand to the schedule's
    value before every optimizer step (AdamW's moments do not depend on the lr)."""
    cfg = dataclasses.replace(_TINY, lr_scheduler_type="cosine", warmup_steps=1)
    total = cfg.total_optimizer_steps
    assert total == 12
    sched = GRPOTrainer(cfg)
    manual = GRPOTrainer(dataclasses.replace(_TINY, lr=1.0))
    rates = []
    step = manual.optimizer.step

    def stepped(*a, **kw):
        lr = cfg.lr * lr_factor("cosine", len(rates), total, 1)
        rates.append(lr)
        for g in manual.optimizer.param_groups:
            g["lr"] = lr
        return step(*a, **kw)

    # The trainer sets the group's lr from its (constant) schedule just before each step;
    # the hand-set value replaces it at the last moment.
    manual.optimizer.step = stepped
    rows = [(sched.step(), manual.step()) for _ in range(cfg.steps)]
    assert len(rates) == total and rates[0] == 0.0 and rates[1] == cfg.lr
    for a, b in zip(sched.params, manual.params):
        assert torch.equal(a, b)
    # The log row carries the rate of the step's last optimizer step.
    assert [r["lr"] for r, _ in rows] == [rates[3], rates[7], rates[11]]
    assert rows[-1][0]["lr"] == pytest.approx(cfg.lr * 0.5 * (1 + math.cos(math.pi * 10 / 11)))
    # ... and a constant run's moved differently (the schedule is not a no-op).
    const = GRPOTrainer(_TINY)
    for _ in range(cfg.steps):
        const.step()
    assert any(not torch.equal(a, b) for a, b in zip(sched.params, const.params))


def test_resume_continues_the_schedule(tmp_path):
    """4 steps straight equal 2 steps, a checkpoint, and a resume: bit-identical weights."""
    cfg = dataclasses.replace(_TINY, steps=4, save_every=2, lr_scheduler_type="linear",
                              warmup_steps=2)  # fmt: skip
    want = train(dataclasses.replace(cfg, out=str(tmp_path / "straight")))["steps"]
    part = GRPOTrainer(dataclasses.replace(cfg, out=str(tmp_path / "split")))
    part.step()
    part.step()  # writes checkpoint-2 (save_every)
    part.wait_for_checkpoint()
    log = train(dataclasses.replace(cfg, out=str(tmp_path / "split"), resume_from="latest"))
    assert log["resumed_from"][0]["step"] == 2
    assert "lr 0.001, linear lr schedule, 2 warm-up steps" in log["summary"]
    rates = [1e-3 * lr_factor("linear", k, 16, 2) for k in (3, 7, 11, 15)]  # 4 per GRPO step
    assert [r["lr"] for r in log["steps"]] == [r["lr"] for r in want] == pytest.approx(rates)
    wa = load_file(str(tmp_path / "straight" / "checkpoint-4" / "weights.safetensors"))
    wb = load_file(str(tmp_path / "split" / "checkpoint-4" / "weights.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    # A resume with more --steps continues at its optimizer step on the longer curve.
    longer = train(dataclasses.replace(
        cfg, steps=6, out=str(tmp_path / "longer"),
        resume_from=str(tmp_path / "straight" / "checkpoint-2")))["steps"]  # fmt: skip
    assert [r["lr"] for r in longer[:2]] == [r["lr"] for r in want[:2]]
    assert [r["lr"] for r in longer[2:]] == pytest.approx(
        [1e-3 * lr_factor("linear", k, 24, 2) for k in (11, 15, 19, 23)])
