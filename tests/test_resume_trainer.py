"""The integration plan's resume recipe, checked against today's GRPOTrainer (no trainer
change): saving the trainable tensors, the AdamW state, the one training generator and the
log, then restoring them with the step index into a freshly built trainer, continues the
run bit for bit (2 steps + resume + 2 steps == 4 steps: log rows without timings, weights).

When the trainer gains --save-every / --resume-from, its own end-to-end test replaces this.
"""

from __future__ import annotations

import pytest
import torch

from jagg_autograd.checkpoint import load_checkpoint, save_checkpoint
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer


def _named(tr: GRPOTrainer) -> dict[str, torch.Tensor]:
    ids = {id(p) for p in tr.params}
    return {n: p for n, p in tr.model.named_parameters() if id(p) in ids}


def _no_time(row: dict) -> dict:
    """A log row or evaluation without its timings (wall_seconds, train_seconds ...)."""
    return {k: v for k, v in row.items() if "seconds" not in k}


@pytest.mark.parametrize("tuning", ["full", "lora"])
def test_two_plus_two_steps_equal_four(tmp_path, tuning):
    cfg = GRPOConfig(prompts_per_step=2, group_size=2, num_steps=4, window=2, steps=4,
                     optimizer_steps_per_rollout=2, beta=0.01, tuning=tuning,
                     eval_per_digit=1, eval_every=2, probe_every=3, progress=False)  # fmt: skip
    straight = GRPOTrainer(cfg)
    rows = [straight.step() for _ in range(4)]

    first = GRPOTrainer(cfg)
    for _ in range(2):
        first.step()
    path = save_checkpoint(tmp_path, first.step_index, trainable=_named(first),
                           optimizer=first.optimizer, generators={"train": first.generator},
                           config=first.config.resolved(), log=first.log)  # fmt: skip
    resumed = GRPOTrainer(cfg)  # built like a new run: same seed, same reference weights
    ck = load_checkpoint(path, trainable=_named(resumed), optimizer=resumed.optimizer,
                         generators={"train": resumed.generator},
                         config=resumed.config.resolved())  # fmt: skip
    resumed.step_index, resumed.log = ck.step, ck.log
    rows_resumed = [resumed.step() for _ in range(2)]

    assert [_no_time(r) for r in rows[2:]] == [_no_time(r) for r in rows_resumed]
    assert all(torch.equal(a, b) for a, b in zip(straight.params, resumed.params))
    want_log, got_log = straight.finish(), resumed.finish()
    assert [_no_time(e) for e in want_log["evals"]] == [_no_time(e) for e in got_log["evals"]]
    assert [e["step"] for e in got_log["evals"]] == [0, 2, 4]
    assert [_no_time(r) for r in want_log["steps"]] == [_no_time(r) for r in got_log["steps"]]
