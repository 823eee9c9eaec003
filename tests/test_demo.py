"""The GRPO demo: on-policy reliability, a CI smoke run, and bad input."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import pytest
import torch

from jagg_autograd import CosineRouter
from jagg_autograd.demo import build_parser, config_from_args, main
from jagg_autograd.models.digits import load_digits_dit
from jagg_autograd.trainer import (
    GRPOConfig,
    rollout,
    sigma_schedule,
    trajectory_log_probs,
)


@pytest.fixture(scope="module")
def on_policy_setup():
    """A rollout of 2 prompts x 4 samples, 6 steps, with theta unchanged afterwards."""
    torch.manual_seed(0)
    model = load_digits_dit()
    sigmas = sigma_schedule(GRPOConfig(num_steps=6))
    labels = torch.tensor([3, 7]).repeat_interleave(4)
    ro = rollout(model, labels, sigmas, noise_level=0.7, generator=torch.Generator().manual_seed(1))
    return model, sigmas, ro


@pytest.mark.parametrize("mode", ["exact", "jagg", "router"])
@pytest.mark.parametrize("shared", [True, False])
def test_on_policy_ratio_is_one_per_step(on_policy_setup, mode, shared):
    """theta unchanged since the rollout: every ratio is 1 within 1e-6 (float32, per_step)."""
    model, sigmas, ro = on_policy_setup
    lp, stats = trajectory_log_probs(
        model,
        ro,
        sigmas,
        noise_level=0.7,
        mode=mode,
        window=3,
        shared_anchors=shared,
        router=CosineRouter(0.99),
        batching="per_step",
    )
    assert lp.dtype == torch.float32 and lp.shape == ro.log_probs.shape
    assert lp.requires_grad  # the recomputation carries the gradient
    ratio = torch.exp(lp.detach() - ro.log_probs)
    assert (ratio - 1).abs().max().item() <= 1e-6
    # The per_step mode promises bit-identical model calls, hence identical log-probs.
    assert torch.equal(lp.detach(), ro.log_probs)


def test_on_policy_ratio_stacked(on_policy_setup):
    """Stacked batching changes the model's batch size; its ratio stays within the clip range."""
    model, sigmas, ro = on_policy_setup
    lp, _ = trajectory_log_probs(model, ro, sigmas, noise_level=0.7, window=3, batching="stacked")
    ratio = torch.exp(lp.detach() - ro.log_probs)
    # Batch-size-dependent round-off only: far below Flow-GRPO's clip range of 1e-4.
    assert (ratio - 1).abs().max().item() < 1e-5


def test_ratio_moves_after_an_optimizer_step(on_policy_setup):
    """Counter-check: the on-policy test is not vacuous (changing theta changes the ratio)."""
    _, sigmas, ro = on_policy_setup
    model = load_digits_dit()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    lp, _ = trajectory_log_probs(model, ro, sigmas, noise_level=0.7, batching="per_step")
    assert (torch.exp(lp.detach() - ro.log_probs) - 1).abs().max().item() > 1e-4


def test_smoke_run_writes_json_and_png(tmp_path, capsys):
    """The CI smoke run: 2 GRPO steps with tiny settings through the CLI entry point."""
    out = tmp_path / "run"
    rc = main(
        [
            "--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--num-steps", "4",
            "--window", "3", "--mode", "router", "--eval-per-digit", "1", "--seed", "3",
            "--out", str(out), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    log = json.loads((out / "log.json").read_text())
    assert log["config"]["steps"] == 2 and log["config"]["mode"] == "router"
    assert len(log["steps"]) == 2
    keys = {
        "reward_mean", "reward_std", "loss", "clipfrac", "approx_kl", "routed_frac",
        "rollout_seconds", "train_seconds", "backward_calls", "grad_samples",
    }  # fmt: skip
    for row in log["steps"]:
        assert keys <= set(row)
        assert 0.0 <= row["reward_mean"] <= 1.0 and 0.0 <= row["routed_frac"] <= 1.0
        assert all(isinstance(row[k], (int, float)) for k in keys)
        assert row["backward_calls"] >= 1
    assert {"initial", "final"} <= set(log["eval"])
    png = (out / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    printed = capsys.readouterr().out
    assert "GRPO" in printed and "->" in printed


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--window", "1"], "window"),
        (["--window", "11"], "window"),
        (["--group-size", "1"], "group_size"),
        (["--steps", "0"], "steps"),
        (["--prompts-per-step", "11"], "prompts_per_step"),
        (["--lr", "-1"], "lr"),
        (["--lr", "nan"], "lr"),
        (["--noise-level", "0"], "noise_level"),
        (["--threshold", "inf"], "threshold"),
        (["--minibatches", "3"], "minibatches"),
    ],
)
def test_bad_cli_args(argv, match, capsys):
    with pytest.raises(ValueError, match=match):
        config_from_args(build_parser().parse_args(argv))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_nan_reward_raises(monkeypatch):
    """NaN rewards follow grpo.group_advantages' policy: a clear ValueError, never a NaN loss."""
    import jagg_autograd.tasks.digits as digits
    import jagg_autograd.trainer as trainer

    def nan_reward(images, labels, *, classifier=None):
        r = torch.full((images.shape[0],), 0.5)
        r[1] = float("nan")
        return r

    monkeypatch.setattr(digits, "digit_reward", nan_reward)
    cfg = GRPOConfig(
        steps=1, prompts_per_step=1, group_size=2, num_steps=2, window=2, eval_per_digit=0,
        progress=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="rewards has non-finite values at index \\[1\\]"):
        trainer.train(cfg)


def test_task_demo_defaults_apply_unless_a_flag_is_given(monkeypatch):
    """``--task X`` takes X's ``demo_defaults`` (lr, steps, ...) where no flag is given."""
    import jagg_autograd.demo as demo_mod
    from jagg_autograd.tasks.digits import DigitsTask

    class Tuned(DigitsTask):
        demo_defaults: ClassVar[dict[str, Any]] = {"lr": 3e-4, "steps": 7, "eval_every": 2}

    monkeypatch.setattr(demo_mod, "task_factory", lambda name: Tuned)
    parser = build_parser()
    argv = ["--lr", "1e-5"]
    args = parser.parse_args(argv)
    parser.set_defaults(**demo_mod._task_demo_defaults(args.task))
    cfg = config_from_args(parser.parse_args(argv))
    assert cfg.lr == 1e-5 and cfg.steps == 7 and cfg.eval_every == 2
    Tuned.demo_defaults = {"not_a_flag": 1}
    with pytest.raises(ValueError, match="not_a_flag"):
        demo_mod._task_demo_defaults("digits")


def test_shapes_demo_defaults_are_demo_flags():
    from jagg_autograd.demo import _task_demo_defaults
    from jagg_autograd.tasks.shapes import ShapesTask

    d = _task_demo_defaults("shapes")
    assert d == ShapesTask.demo_defaults and d  # the shapes demo has its own settings
