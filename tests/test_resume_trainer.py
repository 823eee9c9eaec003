"""Checkpoints and exact resume through the real CLI (``jagg_autograd.demo.main``), and the
refusals of a resume that would change the meaning of the saved state.

A 4-step run equals 2 steps + ``--resume-from latest`` + 2 steps: the same log rows and
evaluations (timings aside) and bit-identical final weights and optimizer state, read from
the final checkpoint.  Ctrl-C stops after the current step with a checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from jagg_autograd.config import GRPOConfig
from jagg_autograd.demo import main
from jagg_autograd.trainer import GRPOTrainer
from jagg_autograd.trainer_parallel import check_world_size

# Small digits runs: 2 prompts x 2 samples, 4 SDE steps, one sample per digit evaluated.
TINY = ["--prompts-per-step", "2", "--group-size", "2", "--num-steps", "4", "--window", "2",
        "--eval-per-digit", "1", "--grid-samples", "2", "--no-progress"]  # fmt: skip


def _no_time(row: dict) -> dict:
    """A log row or evaluation without its timings (wall_seconds, train_seconds ...)."""
    return {k: v for k, v in row.items() if "seconds" not in k}


def _log(out: Path) -> dict:
    return json.loads((out / "log.json").read_text())


def _run(out: Path, *args: str) -> int:
    return main([*TINY, "--out", str(out), *args])


@pytest.mark.parametrize(
    "extra",
    [
        # KL reference, 2 optimizer steps per rollout (off-policy minibatches, ratios != 1),
        # a periodic evaluation on the resume step, the gradient probe after the resume.
        ["--beta", "0.01", "--optimizer-steps-per-rollout", "2", "--eval-every", "2",
         "--probe-every", "3"],
        # LoRA; no periodic evaluation (the first run's final one is dropped at the resume);
        # random timesteps (the estimator's draws from the restored generator).
        ["--tuning", "lora", "--lora-rank", "2", "--lr", "1e-3", "--timestep-fraction", "0.5",
         "--timestep-selection", "random", "--mode", "exact"],
        # Evaluations at the EMA of the weights (its average and step count restored), and
        # Flow-GRPO's global-std advantages.
        ["--ema-decay", "0.5", "--ema-every", "1", "--global-std", "--eval-every", "1"],
        # The runaway guard trips at step 2, after the resume, on a baseline of steps 0-1
        # that only the replayed log gives it; then the causal fold trains step 3.
        ["--beta", "0.01", "--optimizer-steps-per-rollout", "2", "--guard-ratio", "1.000001",
         "--guard-window", "2"],
    ],
    ids=["full-beta-probe", "lora-exact-random", "ema-global-std", "guard-trips-after-resume"],
)  # fmt: skip
def test_four_steps_equal_two_plus_resume_plus_two(tmp_path, extra):
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _run(straight, "--steps", "4", "--save-every", "2", *extra) == 0
    assert _run(split, "--steps", "2", "--save-every", "2", *extra) == 0
    assert (split / "checkpoint-2" / "state.json").is_file()
    first = _log(split)
    assert _run(split, "--steps", "4", "--save-every", "2", "--resume-from", "latest", *extra) == 0

    want, got = _log(straight), _log(split)
    assert got["status"] == "finished" and got["run_id"] == first["run_id"]
    assert got["resumed_from"][0]["step"] == 2
    assert [_no_time(r) for r in want["steps"]] == [_no_time(r) for r in got["steps"]]
    assert [_no_time(e) for e in want["evals"]] == [_no_time(e) for e in got["evals"]]
    if "--guard-ratio" in extra:
        assert [e["step"] for e in want["guard"]] == [2] and got["guard"] == want["guard"]
    every = int(extra[extra.index("--eval-every") + 1]) if "--eval-every" in extra else 4
    assert [e["step"] for e in got["evals"]] == list(range(0, 5, every))
    # The timing totals continue the first run's.
    assert got["train_seconds"] > first["train_seconds"]
    # Bit-identical weights and optimizer moments in the final checkpoints.
    wa = load_file(str(straight / "checkpoint-4" / "weights.safetensors"))
    wb = load_file(str(split / "checkpoint-4" / "weights.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    if "lora" in extra:
        assert all("lora" in k for k in wa)
    oa = torch.load(straight / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
    ob = torch.load(split / "checkpoint-4" / "optimizer.pt", weights_only=True)["state"]
    assert all(torch.equal(oa[i]["exp_avg_sq"], ob[i]["exp_avg_sq"]) for i in oa)
    # The grid's top row (the first evaluation) came back from the checkpoint.
    assert (split / "grid.png").is_file() and got.get("grid")
    state = json.loads((split / "checkpoint-4" / "state.json").read_text())
    assert state["extra"]["grid_first"]["step"] == 0
    if "--ema-decay" in extra:
        assert state["extra"]["ema_updates"] == 4
        ea = load_file(str(straight / "checkpoint-4" / "extra.safetensors"))
        eb = load_file(str(split / "checkpoint-4" / "extra.safetensors"))
        ema = [k for k in ea if k.startswith("ema.")]
        assert len(ema) == len(wa) and all(torch.equal(ea[k], eb[k]) for k in ema)
        # The average is not the raw weights (the evaluations saw something else).
        assert any(not torch.equal(ea[f"ema.{i}"], w) for i, w in enumerate(wa.values()))


def _one_step_checkpoint(out: Path) -> None:
    assert _run(out, "--steps", "1", "--save-every", "1") == 0
    assert (out / "checkpoint-1" / "state.json").is_file()


def test_resume_refusals_leave_the_run_folder_alone(tmp_path, capsys):
    out = tmp_path / "run"
    _one_step_checkpoint(out)
    before = (out / "log.json").read_text()
    # A changed estimator: refused, naming the key with its old and new value.
    assert _run(out, "--steps", "2", "--resume-from", "latest", "--mode", "exact") == 1
    err = capsys.readouterr().err
    assert "cannot resume" in err and "mode: 'jagg' -> 'exact'" in err
    assert (out / "log.json").read_text() == before  # nothing clobbered
    assert (out / "grid.png").is_file()
    # A changed model (task option) / world size: the same refusal.
    state_file = out / "checkpoint-1" / "state.json"
    state = json.loads(state_file.read_text())
    state["config"]["world_size"] = 2
    state_file.write_text(json.dumps(state))
    assert _run(out, "--steps", "2", "--resume-from", "latest") == 1
    assert "world_size: 2 -> 1" in capsys.readouterr().err
    # A folder that is not a checkpoint.
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "checkpoint-3").mkdir()  # no state.json: incomplete, never picked
    assert _run(out, "--steps", "2", "--resume-from", str(tmp_path / "junk")) == 1
    assert "is not a checkpoint" in capsys.readouterr().err
    # 'latest' in a folder without checkpoints.
    assert _run(tmp_path / "empty", "--steps", "2", "--resume-from", "latest") == 1
    assert "no complete checkpoint" in capsys.readouterr().err
    assert (out / "log.json").read_text() == before


def test_allowed_changes_on_resume(tmp_path):
    """--steps, the evaluation settings and the learning rate may change."""
    out = tmp_path / "run"
    _one_step_checkpoint(out)
    assert _run(out, "--steps", "2", "--resume-from", str(out), "--eval-every", "1",
                "--lr", "3e-4") == 0  # fmt: skip
    log = _log(out)
    assert [r["step"] for r in log["steps"]] == [0, 1] and log["config"]["lr"] == 3e-4
    # ... and the new rate is the one the resumed step ran at (the saved optimizer's is not).
    assert [r["lr"] for r in log["steps"]] == [1e-4, 3e-4]


def test_world_size_refusals():
    base = GRPOConfig(prompts_per_step=2, group_size=2, num_steps=4, window=2)
    check_world_size(dataclasses_replace(base, placement="adaptive"), 1)  # fine alone
    with pytest.raises(ValueError, match="placement='adaptive' with 2 processes"):
        check_world_size(dataclasses_replace(base, placement="adaptive"), 2)
    with pytest.raises(ValueError, match="jagg_frac=0.5 with 2 processes"):
        check_world_size(dataclasses_replace(base, mode="router", jagg_frac=0.5), 2)
    check_world_size(dataclasses_replace(base, mode="router", jagg_frac=None), 2)
    with pytest.raises(ValueError, match="does not split over 3 processes"):
        check_world_size(base, 3)


def dataclasses_replace(cfg: GRPOConfig, **kw: object) -> GRPOConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_missing_tracker_package_fails_before_training(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    built = []
    monkeypatch.setattr(GRPOTrainer, "_build", lambda self, task: built.append(1))
    cfg = GRPOConfig(report_to="wandb", out=str(tmp_path / "o"), progress=False, steps=1)
    with pytest.raises(ImportError, match=r"jagg-autograd\[wandb\]"):
        GRPOTrainer(cfg)
    assert not built


def test_tensorboard_gets_the_log_rows_evals_and_grid(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb"
    assert _run(out, "--steps", "2", "--report-to", "tensorboard") == 0
    files = list(out.glob("events.out.tfevents.*"))
    assert files
    acc = EventAccumulator(str(out), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    log = _log(out)
    loss = [e.value for e in acc.Scalars("loss")]
    assert loss == pytest.approx([r["loss"] for r in log["steps"]])
    assert [e.step for e in acc.Scalars("eval/mean_reward")] == [0, 2]
    assert "eval/per_digit/3" in tags["scalars"]
    assert "grid" in tags["images"]


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_ctrl_c_stops_after_the_step_with_a_checkpoint(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jagg_autograd.demo", *TINY, "--out", str(out), "--steps", "200",
         "--save-every", "1000", "--eval-per-digit", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            try:
                if len(_log(out)["steps"]) >= 1:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    log = _log(out)
    assert log["status"] == "interrupted"
    n = len(log["steps"])
    assert 1 <= n < 200
    assert (out / f"checkpoint-{n}" / "state.json").is_file()
    assert "--resume-from latest" in err
    # And it continues from there.
    assert _run(out, "--steps", str(n + 1), "--eval-per-digit", "0", "--resume-from",
                "latest") == 0  # fmt: skip
    assert [r["step"] for r in _log(out)["steps"]] == list(range(n + 1))
