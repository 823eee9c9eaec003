"""The model-agnostic trainer: tasks, the general rollout, Flow-GRPO's training structure
(accumulation, inner epochs, timestep_fraction, KL), the values/deferred paths, and runs
that keep their log (issue 11; issue 14 items 10 and 11)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import nn

import jagg_autograd.runlog as runlog_mod
import jagg_autograd.trainer as trainer_mod
from jagg_autograd.estimators import ESTIMATORS, grpo_loss_mean
from jagg_autograd.grpo import (
    flow_match_sigmas,
    scheduler_sigmas,
    sde_step_with_logprob,
    shifted_sigma_schedule,
)
from jagg_autograd.rollout import policy_log_probs, sample_trajectories, select_steps
from jagg_autograd.tasks import GRPOTask, get_task, register_task, task_names
from jagg_autograd.trainer import (
    GRPOConfig,
    GRPOTrainer,
    TrainingDivergedError,
    train,
)

TINY = dict(
    steps=2, prompts_per_step=2, group_size=2, num_steps=4, window=2, eval_per_digit=1,
    progress=False,
)  # fmt: skip


# ---------------------------------------------------------------- a task that is not digits


class _Field(nn.Module):
    """v = MLP([z, t, target]): a toy conditional velocity field on 3-D latents."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(7, 32), nn.Tanh(), nn.Linear(32, 3))

    def forward(self, z: torch.Tensor, t: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([z, t[:, None], target], 1))


class ToyTask(GRPOTask):
    """Prompts are 3-D target points; reward = exp(-|x_T - target|^2)."""

    name = "toy"
    latent_shape = (3,)
    max_prompts = 4

    def __init__(self) -> None:
        self.model = _Field()
        self.points = torch.tensor(
            [[0.5, 0, 0], [0, 0.5, 0], [0, 0, 0.5], [-0.5, -0.5, 0]], dtype=torch.float32
        )

    def velocity_model(self) -> nn.Module:
        return self.model

    def trainable_parameters(self, tuning: str, lora_rank: int) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def sample_prompts(self, n: int, generator: torch.Generator) -> list[Any]:
        return torch.randperm(4, generator=generator)[:n].tolist()

    def cond(self, prompts: Sequence[Any]) -> dict[str, torch.Tensor]:
        return {"target": self.points[list(prompts)]}

    def reward(self, latents: torch.Tensor, prompts: Sequence[Any]) -> torch.Tensor:
        return torch.exp(-((latents - self.points[list(prompts)]) ** 2).sum(1))

    def eval_prompts(self) -> list[Any]:
        return [0, 1, 2, 3] * 2


def _toy(**kw: Any) -> GRPOConfig:
    base = dict(
        steps=3, prompts_per_step=2, group_size=4, num_steps=6, window=3, eval_per_digit=1,
        lr=1e-2, progress=False,
    )  # fmt: skip
    base.update(kw)
    return GRPOConfig(**base)


def test_trainer_does_not_import_digits():
    code = (
        "import sys, jagg_autograd.trainer, jagg_autograd.demo;"
        "bad = [m for m in sys.modules if 'digits' in m];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registry(monkeypatch):
    import jagg_autograd.tasks as tasks

    monkeypatch.setattr(tasks, "_REGISTRY", dict(tasks._REGISTRY))  # restored afterwards
    assert {"digits", "shapes"} <= set(task_names())
    with pytest.raises(ValueError, match="task must be one of"):
        get_task("nope")
    with pytest.raises(ValueError, match="takes no option"):
        get_task("digits", colour=3)
    register_task("toy", ToyTask)
    assert isinstance(get_task("toy"), ToyTask)
    register_task("toy_path", "tests.test_trainer_task:ToyTask")
    assert "toy_path" in task_names()
    with pytest.raises(ValueError, match="task"):
        GRPOConfig(task="nope").validate()


def test_a_task_that_is_not_digits_trains_through_the_same_path(tmp_path):
    task = ToyTask()
    before = [p.detach().clone() for p in task.model.parameters()]
    log = train(_toy(out=str(tmp_path)), task=task)
    assert log["task"] == "toy" and log["config"]["task"] == "toy"
    assert log["status"] == "finished" and len(log["steps"]) == 3
    assert [e["step"] for e in log["evals"]] == [0, 3]
    assert all("mean_reward" in e and e["samples"] == 8 for e in log["evals"])
    assert any(not torch.equal(a, b) for a, b in zip(before, task.model.parameters()))
    on_disk = json.loads((tmp_path / "log.json").read_text())
    assert on_disk["run_id"] == log["run_id"] and on_disk["status"] == "finished"
    with pytest.raises(ValueError, match="prompts_per_step"):
        GRPOTrainer(_toy(prompts_per_step=5), task=ToyTask())


# ---------------------------------------------------------------- rollout and schedules


def test_sample_trajectories_layout_and_values():
    model = _Field()
    B, T = 3, 5
    cond = {"target": torch.randn(B, 3)}
    sig = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    tr = sample_trajectories(model, torch.randn(B, 3), sig, cond=cond, generator=g)
    assert tr.latents.shape == (T + 1, B, 3) and tr.log_probs.shape == (T, B)
    assert tr.velocities.shape == (T, B, 3)
    g2 = torch.Generator().manual_seed(0)
    x = tr.latents[0]
    for k in range(T):  # the stored velocities are the model's at the stored latents
        with torch.no_grad():
            v = model(tr.latents[k], torch.full((B,), float(sig[k])), **cond)
        assert torch.equal(v, tr.velocities[k])
        x, lp, _, _ = sde_step_with_logprob(
            v, x, float(sig[k]), float(sig[k + 1]), sigma_max=float(sig[1]), generator=g2
        )
        assert torch.equal(x, tr.latents[k + 1]) and torch.equal(lp, tr.log_probs[k])
    # per-sample schedules: (T + 1, B); a (B, T + 1) table is refused with the layout named
    with pytest.raises(ValueError, match=r"\(T \+ 1, B\)"):
        sample_trajectories(model, torch.randn(B, 3), sig[None].expand(B, T + 1).clone(),
                            cond=cond)  # fmt: skip
    with pytest.raises(ValueError, match="1000"):
        sample_trajectories(model, torch.randn(B, 3), sig * 1000, cond=cond)


def test_policy_log_probs_on_policy_and_selection():
    model = _Field()
    B, T = 4, 6
    cond = {"target": torch.randn(B, 3)}
    sig = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    tr = sample_trajectories(model, torch.randn(B, 3), sig, cond=cond,
                             generator=torch.Generator().manual_seed(1))  # fmt: skip
    ks = select_steps(T, B, 3, "random", generator=torch.Generator().manual_seed(2))
    assert ks.shape == (3, B) and bool((ks[1:] > ks[:-1]).all())
    res = policy_log_probs(model, tr, steps=ks, mode="exact", batching="per_step")
    assert res.log_probs.shape == res.old_log_probs.shape == (3, B)
    torch.testing.assert_close(res.log_probs.detach(), res.old_log_probs, rtol=0, atol=1e-6)
    for j in range(3):
        for b in range(B):
            assert res.old_log_probs[j, b] == tr.log_probs[ks[j, b], b]
    assert select_steps(T, B, 4, "prefix") == (0, 4)


class _TableField(_Field):
    """_Field plus a SHARED ``(B, B)`` table (dim 0 == B by coincidence): tiling it per
    stacked step, as an inferred per-sample key would be, changes the velocity."""

    def forward(self, z, t, target, table):  # type: ignore[override]
        return super().forward(z, t, target) + 0.1 * table.sum()


def test_batched_cond_is_kept_with_the_trajectories_and_honoured(recwarn):
    from jagg_autograd.estimators.exact import gathered_log_probs

    model, B, T = _TableField(), 3, 5
    cond = {"target": torch.randn(B, 3), "table": torch.randn(B, B)}
    sig = torch.linspace(1, 0, T + 1, dtype=torch.float64)
    tr = sample_trajectories(model, torch.randn(B, 3), sig, cond=cond, batched_cond=["target"],
                             generator=torch.Generator().manual_seed(3))  # fmt: skip
    assert tr.batched_cond == frozenset({"target"})
    # Stacked recomputation (the core, and the exact loop's gathered steps) on-policy: the
    # rollout's log-probs, only if the table went in as it is.
    for mode in ("exact", "jagg"):
        res = policy_log_probs(model, tr, mode=mode, window=3)
        torch.testing.assert_close(res.log_probs.detach(), tr.log_probs, rtol=0, atol=1e-5)
    lp, old, _ = gathered_log_probs(model, tr, noise_level=0.7, num=3, batching="stacked",
                                    generator=torch.Generator().manual_seed(4))  # fmt: skip
    torch.testing.assert_close(lp.detach(), old, rtol=0, atol=1e-5)
    assert not [w for w in recwarn if "batched_cond" in str(w.message)]
    # Unsaid, the core infers the table as per-sample and says so.
    with pytest.warns(UserWarning, match="batched_cond"):
        policy_log_probs(model, dataclasses.replace(tr, batched_cond=None), mode="exact")
    with pytest.raises(ValueError, match="batched_cond names 'nope'"):
        sample_trajectories(model, torch.randn(B, 3), sig, cond=cond, batched_cond=["nope"])


def test_the_trainer_says_which_cond_keys_are_per_sample():
    # A task's cond(prompts) is per prompt by contract: every tensor key is declared.
    trainer = GRPOTrainer(GRPOConfig(task="shapes", eval_per_digit=0, prompts_per_step=2,
                                     group_size=2, steps=1, threads=1))  # fmt: skip
    prompts = trainer.task.sample_prompts(2, torch.Generator().manual_seed(0))
    tr = trainer._sample(prompts, torch.Generator().manual_seed(0))
    assert tr.batched_cond == frozenset(trainer.task.cond(prompts)) and len(tr.batched_cond) == 4


def test_flow_match_sigmas_equal_diffusers():
    diffusers = pytest.importorskip("diffusers")
    for n in (1, 4, 10, 28):
        for shift in (1.0, 3.0):
            sch = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
            ref = scheduler_sigmas(sch, n)
            assert torch.equal(flow_match_sigmas(n, shift), ref)
            assert ref.dtype == torch.float64 and ref.shape == (n + 1,)
    # The shifted schedule is FLUX / DanceGRPO's, not SD3's (the corrected docstring's 0.24).
    diff = (flow_match_sigmas(10, 3.0) - shifted_sigma_schedule(10, 3.0, dtype=torch.float64))
    assert 0.2 < diff.abs().max().item() < 0.25
    with pytest.raises(TypeError, match="scheduler"):
        scheduler_sigmas(object(), 4)


# ---------------------------------------------------------------- training structure


def test_minibatches_is_an_alias():
    assert GRPOConfig(minibatches=2).optimizer_steps_per_rollout == 2
    with pytest.raises(ValueError, match="minibatches"):
        GRPOConfig(minibatches=2, optimizer_steps_per_rollout=4)
    with pytest.raises(ValueError, match="minibatches"):
        GRPOConfig(**dict(TINY, gradient_accumulation_steps=3)).validate()


def test_on_policy_minibatches_and_optimizer_steps():
    """GA=2: both minibatches before the one optimizer step are on-policy (ratio exactly 1);
    S=2: the second is not; two inner epochs: two optimizer steps per GA group."""
    kw = dict(TINY, steps=1, batching="per_step", prompts_per_step=2, group_size=4)
    ga = train(GRPOConfig(**kw, gradient_accumulation_steps=2))["steps"][0]
    assert ga["optimizer_steps"] == 1 and ga["ratio_min"] == ga["ratio_max"] == 1.0
    s2 = train(GRPOConfig(**kw, optimizer_steps_per_rollout=2))["steps"][0]
    assert s2["optimizer_steps"] == 2 and s2["ratio_max"] - s2["ratio_min"] > 1e-4
    ep = train(GRPOConfig(**kw, num_inner_epochs=2, gradient_accumulation_steps=2))["steps"][0]
    assert ep["optimizer_steps"] == 2 and ep["backward_passes"] == 4


def test_accumulated_gradient_is_the_mean_of_minibatch_gradients(monkeypatch):
    """The optimizer sees sum_i grad(loss_i) / GA (Flow-GRPO's accumulation, one backward
    per minibatch), measured independently of the trainer's own backward."""
    seen, expected = [], []

    class Spy(ESTIMATORS["jagg"]):  # the seam: the estimator registry
        def loss(self, ctx, mb, **kw):
            res = super().loss(ctx, mb, **kw)
            expected.append(torch.autograd.grad(res.loss, ctx.params, retain_graph=True))
            return res

    monkeypatch.setitem(ESTIMATORS, "jagg", Spy)
    tr = GRPOTrainer(_toy(gradient_accumulation_steps=2, max_grad_norm=None), task=ToyTask())

    def step(*a, **k):
        seen.append([p.grad.clone() for p in tr.params])

    monkeypatch.setattr(tr.optimizer, "step", step)
    tr.step()
    assert len(seen) == 1 and len(expected) == 2
    for got, a, b in zip(seen[0], *expected):
        torch.testing.assert_close(got, (a + b) / 2, rtol=1e-6, atol=1e-9)


def test_random_timestep_fraction_is_the_subsample_baseline():
    """mode="exact" + timestep_selection="random" at k/T trains what mode="subsample" does
    (same draw, same loss and gradient up to summation order)."""
    a = train(GRPOConfig(**TINY, mode="subsample", subsample_steps=2))
    # exact_loop=False: one stacked call like subsample's (the per-step loop's own model
    # calls differ from it by round-off; its gradient is checked in test_trainer_baselines).
    b = train(GRPOConfig(**TINY, mode="exact", timestep_fraction=0.5,
                         timestep_selection="random", exact_loop=False))  # fmt: skip
    assert a["config"]["timestep_selection"] == "random"
    assert a["config"]["timestep_fraction"] == 0.5
    assert a["steps"][0]["reward_mean"] == b["steps"][0]["reward_mean"]  # same rollout
    for ra, rb in zip(a["steps"], b["steps"]):
        # later rollouts differ by the round-off of the summation order only
        assert ra["reward_mean"] == pytest.approx(rb["reward_mean"], rel=1e-5)
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-9)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
        assert ra["grad_samples"] == rb["grad_samples"] == 2 * 4


def test_prefix_fraction_trains_the_first_steps():
    kw = dict(TINY, num_steps=6, window=3, timestep_fraction=0.5)
    log = train(GRPOConfig(**kw, reuse_values=False, deferred=False))  # the eager path
    r = log["steps"][0]
    assert log["config"]["num_train_steps"] == 3
    assert r["forward_samples"] == 3 * 4  # 3 steps x B=4, nothing else forwarded
    assert r["grad_samples"] == 2 * 4  # anchors 0 and 2 of the 3-step window
    # the defaults (rollout velocities reused on-policy): only the anchors are forwarded
    r = train(GRPOConfig(**kw))["steps"][0]
    assert r["paths"] == ["values+deferred"]
    assert r["forward_samples"] == r["grad_samples"] == 2 * 4


def test_kl_reference_once_per_rollout_and_zero_at_start():
    tr = GRPOTrainer(_toy(beta=0.5, num_inner_epochs=3, steps=2), task=ToyTask())
    assert tr.reference is not None and tr.reference is not tr.policy
    row = tr.step()
    # once per rollout: T' steps x B samples however many inner epochs
    assert tr.reference.forward_samples == 6 * 8
    assert row["kl"] >= 0.0
    first = tr.step()
    assert first["kl"] > 0.0  # the policy moved away from the frozen reference


def test_kl_is_zero_for_the_reference_itself(monkeypatch):
    """At the start (policy == reference) the first minibatch's KL is exactly 0."""
    kls = []

    class Spy(ESTIMATORS["jagg"]):  # the seam: the estimator's loss hook
        def policy_loss(self, lp, old, adv, kl):
            kls.append(kl.detach().clone())
            return super().policy_loss(lp, old, adv, kl)

    monkeypatch.setitem(ESTIMATORS, "jagg", Spy)
    cfg = _toy(beta=1.0, optimizer_steps_per_rollout=2, steps=1, batching="per_step")
    tr = GRPOTrainer(cfg, task=ToyTask())
    tr.step()
    assert torch.equal(kls[0], torch.zeros_like(kls[0]))
    assert float(kls[1].abs().max()) > 0.0


# ---------------------------------------------------------------- values / deferred paths


def _core() -> bool:
    from jagg_autograd.estimators.jagg import core_available

    return core_available()


@pytest.mark.skipif(not _core(), reason="jagg_trajectory has no values= in this build")
def test_values_path_on_policy_ratio_one_and_forward_count():
    kw = dict(TINY, steps=1, batching="per_step", group_size=4, reuse_values=True, deferred=True)
    r = train(GRPOConfig(**kw, optimizer_steps_per_rollout=2))["steps"][0]
    assert r["paths"] == ["values+deferred", "deferred"]
    r1 = train(GRPOConfig(**kw))["steps"][0]
    assert r1["paths"] == ["values+deferred"]
    assert r1["ratio_min"] == r1["ratio_max"] == 1.0
    # with values only the anchors are forwarded: T=6, W=3 -> anchors 0, 2, 4, 5 of B=8
    r3 = train(GRPOConfig(**dict(kw, num_steps=6, window=3)))["steps"][0]
    assert r3["forward_samples"] == r3["grad_samples"] == 4 * 8
    assert r3["anchor_frac"] == pytest.approx(4 / 6)
    ex = train(GRPOConfig(**dict(kw, mode="exact")))["steps"][0]
    assert ex["paths"] == ["exact"]  # mode="exact" never takes the new paths
    off = train(GRPOConfig(**dict(kw, deferred=False), num_inner_epochs=2))["steps"][0]
    assert off["paths"] == ["values+deferred", "eager"]
    # adaptive placement needs the deferred backward: off-policy minibatches run deferred
    ad = dict(kw, deferred=False, placement="adaptive", budget=3.0)
    r4 = train(GRPOConfig(**ad, num_inner_epochs=2))["steps"][0]
    assert r4["paths"] == ["values+deferred", "deferred"]
    # round(budget * B) = 24 anchors on-policy; off-policy, clipped ratios have zero upstream
    # gradient and their steps need no anchor
    assert 0 < r4["grad_samples"] <= 2 * 3 * 8
    assert r4["plan_seconds"] > 0.0  # the planner ran (in the backward) and was timed
    assert r1["plan_seconds"] >= 0.0
    # the gradient probe measures the same estimator (values from the probe's own rollout)
    pr = train(GRPOConfig(**dict(kw, num_steps=6, window=3), probe_every=1))["steps"][0]
    assert 0.5 < pr["probe_cosine"] <= 1.0


def test_core_options_validated():
    with pytest.raises(ValueError, match="budget"):
        GRPOConfig(budget=-1.0).validate()
    with pytest.raises(ValueError, match="timestep_fraction"):
        GRPOConfig(timestep_fraction=0.0).validate()
    with pytest.raises(ValueError, match="timestep_fraction"):
        GRPOConfig(mode="subsample", timestep_fraction=0.5).validate()
    with pytest.raises(ValueError, match="precision"):
        GRPOConfig(precision="fp16").validate()
    with pytest.raises(ValueError, match="device"):
        GRPOConfig(device="tpu").validate()


# ---------------------------------------------------------------- device and precision


def test_bf16_autocast_runs_on_cpu():
    log = train(GRPOConfig(**TINY, precision="bf16"))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in log["steps"])
    assert log["config"]["precision"] == "bf16"
    if _core():  # the anchors are recomputed in one step's batch, like the rollout's calls
        r = train(GRPOConfig(**TINY, precision="bf16", reuse_values=True, deferred=True))
        assert all(x["ratio_min"] == x["ratio_max"] == 1.0 for x in r["steps"][:1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="device"):
        GRPOTrainer(GRPOConfig(**TINY, device="cuda"))


# ---------------------------------------------------------------- runs that keep their log


def test_log_written_after_every_step_and_stale_files_replaced(tmp_path):
    (tmp_path / "log.json").write_text('{"run_id": "old", "steps": [1, 2, 3]}')
    (tmp_path / "reward.png").write_bytes(b"old plot")
    (tmp_path / "grid.png").write_bytes(b"old grid")
    seen = []

    def on_step(row):
        disk = json.loads((tmp_path / "log.json").read_text())
        seen.append((disk["run_id"], disk["status"], len(disk["steps"])))
        assert not (tmp_path / "reward.png").exists()  # the old plot is gone at the start
        assert not (tmp_path / "grid.png").exists()

    log = train(GRPOConfig(**TINY, out=str(tmp_path)), on_step=on_step)
    assert seen == [(log["run_id"], "running", 1), (log["run_id"], "running", 2)]
    assert log["run_id"] != "old" and log["started_at"]
    assert (tmp_path / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "grid.png").read_bytes()[:4] == b"\x89PNG"
    assert log["grid"] == str(tmp_path / "grid.png")


def test_grid_keeps_the_same_evaluation_samples_before_and_after(tmp_path, monkeypatch):
    """grid.png: k evenly spread evaluation samples of the first and the last evaluation,
    captioned with the step, the prompt and that sample's own reward."""
    saved = {}

    def fake_save_grid(path, images, captions, *, ncols=None, title=None):
        saved.update(images=images, captions=list(captions), ncols=ncols)
        return path

    monkeypatch.setattr(runlog_mod, "save_grid", fake_save_grid)

    class Known(ToyTask):
        """Reward 0.2 * prompt + 0.01 * position: every caption's score is known."""

        def reward(self, latents, prompts):
            return 0.2 * torch.tensor(prompts, dtype=torch.float32) + 0.01 * torch.arange(
                len(prompts), dtype=torch.float32
            )

        def decode(self, latents):
            return (latents.clamp(-1, 1) + 1).div(2).reshape(-1, 1, 3, 1)

    tr = GRPOTrainer(_toy(out=str(tmp_path), grid_samples=3), task=Known())
    while tr.step_index < tr.config.steps:
        tr.step()
    tr.finish()
    prompts = tr.task.eval_prompts()
    idx = [0, 4, 7]  # 3 evenly spread samples of 8
    assert saved["ncols"] == 3 and tuple(saved["images"].shape) == (6, 1, 3, 1)
    for cap, i, st in zip(saved["captions"], idx + idx, [0, 0, 0, 3, 3, 3]):
        assert cap == f"step {st}: {prompts[i]}\nscore {0.2 * prompts[i] + 0.01 * i:.2f}"
    # A task whose latents are not pictures (decode -> None) runs and writes no grid.
    monkeypatch.undo()
    log = train(_toy(out=str(tmp_path / "nogrid")), task=ToyTask())
    assert log["status"] == "finished" and "grid" not in log
    assert not (tmp_path / "nogrid" / "grid.png").exists()
    with pytest.raises(ValueError, match="grid_samples"):
        GRPOConfig(grid_samples=-1).validate()


def test_unwritable_out_fails_before_training(tmp_path, monkeypatch):
    from jagg_autograd import tasks

    (tmp_path / "log.json").mkdir()
    built = []
    monkeypatch.setattr(tasks, "_REGISTRY", dict(tasks._REGISTRY))  # the task registry seam
    register_task("spy", lambda **kw: built.append(1))
    with pytest.raises(ValueError, match="out="):
        GRPOTrainer(GRPOConfig(**TINY, task="spy", out=str(tmp_path)))
    assert not built  # nothing was loaded or trained


def test_interrupt_keeps_a_valid_partial_log(tmp_path):
    def stop(row):
        if row["step"] == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train(GRPOConfig(**dict(TINY, steps=3), out=str(tmp_path)), on_step=stop)
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "interrupted" and len(log["steps"]) == 1
    for key in ("config", "steps", "evals", "eval", "train_seconds", "total_seconds", "summary"):
        assert key in log
    assert "interrupted after 1 steps" in log["summary"]
    assert (tmp_path / "reward.png").exists()


def test_demo_ctrl_c_exits_non_zero(tmp_path, monkeypatch, capsys):
    from jagg_autograd.demo import main

    calls = []
    orig = GRPOTrainer.step

    def step(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return orig(self)

    monkeypatch.setattr(GRPOTrainer, "step", step)
    argv = ["--steps", "3", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3",
            "--window", "2", "--eval-per-digit", "1", "--no-progress", "--out", str(tmp_path)]
    assert main(argv) == 130  # fmt: skip
    assert "interrupted after 1 of 3 steps" in capsys.readouterr().err
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "interrupted" and len(log["steps"]) == 1


def test_non_finite_loss_names_the_step_and_keeps_the_log(tmp_path, monkeypatch):
    calls = []

    class InfLoss(ESTIMATORS["jagg"]):  # the seam: the estimator's loss hook
        def policy_loss(self, *a, **k):
            loss, infos = super().policy_loss(*a, **k)
            calls.append(1)
            return (loss + float("inf") if len(calls) == 2 else loss), infos

    monkeypatch.setitem(ESTIMATORS, "jagg", InfLoss)
    with pytest.raises(TrainingDivergedError, match="GRPO step 1: the loss is inf"):
        train(GRPOConfig(**dict(TINY, steps=3), out=str(tmp_path)))
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "failed" and len(log["steps"]) == 1
    assert "TrainingDivergedError" in log["error"]


def test_non_finite_grad_norm_stops_before_the_optimizer_step(monkeypatch):
    tr = GRPOTrainer(GRPOConfig(**TINY))
    before = [p.detach().clone() for p in tr.params]
    tr.params[0].register_hook(lambda g: g * float("nan"))
    with pytest.raises(TrainingDivergedError, match="GRPO step 0: the gradient norm is nan"):
        tr.step()
    assert all(torch.equal(a, b) for a, b in zip(before, tr.params))


# ---------------------------------------------------------------- newcomer fixes


def test_summary_names_only_what_applies():
    base = {"steps": [], "total_seconds": 0, "rollout_seconds": 0, "train_seconds": 0}
    cfg = GRPOConfig().resolved()
    exact = trainer_mod.summarize({**base, "config": {**cfg, "mode": "exact"}})
    assert "window" not in exact and "threshold" not in exact and "anchors" not in exact
    jagg = trainer_mod.summarize({**base, "config": cfg})
    assert "window 4" in jagg and "threshold" not in jagg
    router = trainer_mod.summarize({**base, "config": {**cfg, "mode": "router"}})
    assert "threshold" in router
    sub = trainer_mod.summarize({**base, "config": GRPOConfig(mode="subsample").resolved()})
    assert "4 random steps" in sub and "window" not in sub
    # the held-out figures, and GenEval's strict accuracy where the task logs it (shapes)
    ev = {"initial": {"mean_reward": 0.4, "samples": 96}, "final": {"mean_reward": 0.5}}
    txt = trainer_mod.summarize({**base, "config": cfg, "eval": ev})
    assert "0.400 -> 0.500 (+0.100)." in txt and "strict" not in txt
    ev["initial"]["strict_accuracy"], ev["final"]["strict_accuracy"] = 0.25, 0.3
    txt = trainer_mod.summarize({**base, "config": cfg, "eval": ev})
    assert "0.400 -> 0.500 (+0.100), strict accuracy 0.250 -> 0.300 (+0.050)." in txt


def test_every_flag_has_help_and_its_default_once():
    from jagg_autograd.demo import build_parser

    parser = build_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help, action.option_strings
        fmt = parser._get_formatter()
        fmt.add_argument(action)
        entry = fmt.format_help()
        assert entry.count("(default:") == 1, (action.option_strings, entry)


def test_demo_lora_runs(tmp_path):
    pytest.importorskip("peft")
    from jagg_autograd.demo import main

    argv = ["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "3",
            "--window", "2", "--eval-per-digit", "0", "--tuning", "lora", "--lr", "1e-3",
            "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["config"]["tuning"] == "lora" and log["num_trainable_parameters"] < 100_000


def test_loss_mean_is_over_trained_steps():
    """The 1/T' of Flow-GRPO's accumulation lives in the loss: the mean over slots."""
    lp = torch.randn(3, 4)
    adv = torch.randn(4)
    cfg = GRPOConfig(clip_range=10.0)
    loss, _ = grpo_loss_mean(lp, lp.detach(), adv, cfg)
    torch.testing.assert_close(loss, -(adv.clamp(-5, 5)).mean())


def test_a_failure_while_building_is_logged(tmp_path):
    class Broken(ToyTask):
        def trainable_parameters(self, tuning, lora_rank):
            raise RuntimeError("no weights")

    with pytest.raises(RuntimeError, match="no weights"):
        GRPOTrainer(_toy(out=str(tmp_path)), task=Broken())
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "failed" and "no weights" in log["error"] and log["steps"] == []
