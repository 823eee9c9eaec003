"""Checkpoints (jagg_autograd.checkpoint): bit-identical round trip, atomicity, refusals."""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from jagg_autograd import checkpoint as ck
from jagg_autograd.checkpoint import (
    RESUME_KEYS,
    check_resume_config,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

CONFIG = {"task": "digits", "mode": "jagg", "tuning": "full", "world_size": 1, "steps": 4,
          "group_size": 4, "eval_every": 0, "out": "a"}  # fmt: skip


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, torch.Generator]]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.SiLU(), nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)  # a frozen tensor: not part of the checkpoint
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    gens = {"train": torch.Generator().manual_seed(seed + 1),
            "eval": torch.Generator().manual_seed(seed + 2)}  # fmt: skip
    return model, opt, gens


def train_step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator) -> None:
    x = torch.randn(9, 5, generator=g)
    noise = torch.randn(9, 3)  # global RNG too (dropout-like draws)
    loss = ((model(x) + 0.01 * noise) ** 2).mean() + random.random() + float(np.random.rand())
    opt.zero_grad()
    loss.backward()
    opt.step()


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_round_trip_is_bit_identical(tmp_path):
    # 4 steps straight vs 2 steps + save + (fresh objects, other seeds) load + 2 steps.
    model, opt, gens = make()
    for _ in range(4):
        train_step(model, opt, gens["train"])
    want = state_of(model)
    want_draws = {k: torch.randn(4, generator=g) for k, g in gens.items()}
    want_global = (torch.randn(3), random.random(), np.random.rand())

    model, opt, gens = make()
    for _ in range(2):
        train_step(model, opt, gens["train"])
    log = {"steps": [{"step": 0, "loss": 1.5}, {"step": 1, "loss": float("nan")}]}
    path = save_checkpoint(
        tmp_path,
        2,
        trainable=trainable(model),
        optimizer=opt,
        generators=gens,
        config=CONFIG,
        log=log,
        extra={"ema": [0.5]},
        extra_tensors={"ema/w": torch.arange(3.0), "grid": torch.ones(2, 2, dtype=torch.uint8)},
    )
    assert path == tmp_path / "checkpoint-2" and (path / "weights.safetensors").is_file()
    torch.randn(100), random.random(), np.random.rand(5)  # disturb the global states

    model2, opt2, gens2 = make()  # fresh objects, then disturbed: load must overwrite all
    with torch.no_grad():
        for prm in trainable(model2).values():
            prm.add_(1.0)
    for g in gens2.values():
        torch.randn(10, generator=g)
    got = load_checkpoint(
        "latest",
        out_dir=tmp_path,
        trainable=model2,
        optimizer=opt2,
        generators=gens2,
        config={**CONFIG, "steps": 8, "out": "b"},
    )
    assert got.step == 2 and got.extra == {"ema": [0.5]} and got.config == CONFIG
    assert got.extra_tensors.keys() == {"ema/w", "grid"}
    assert torch.equal(got.extra_tensors["ema/w"], torch.arange(3.0))
    assert got.extra_tensors["grid"].dtype == torch.uint8
    assert got.log["steps"][0] == log["steps"][0] and np.isnan(got.log["steps"][1]["loss"])
    for _ in range(2):
        train_step(model2, opt2, gens2["train"])
    got_state = state_of(model2)
    for k in want:
        assert torch.equal(want[k], got_state[k]), k
    for k, g in gens2.items():
        assert torch.equal(torch.randn(4, generator=g), want_draws[k]), k
    assert torch.equal(torch.randn(3), want_global[0])
    assert random.random() == want_global[1] and np.random.rand() == want_global[2]


def test_optimizer_state_restored_exactly(tmp_path):
    model, opt, gens = make()
    train_step(model, opt, gens["train"])
    save_checkpoint(tmp_path, 1, trainable=model, optimizer=opt, generators=gens,
                    config=CONFIG, log={})  # fmt: skip
    model2, opt2, gens2 = make(seed=3)
    load_checkpoint(tmp_path / "checkpoint-1", trainable=model2, optimizer=opt2)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        for name in a[k]:
            assert torch.equal(torch.as_tensor(a[k][name]), torch.as_tensor(b[k][name]))


def test_crash_mid_write_is_never_picked(tmp_path, monkeypatch):
    model, opt, gens = make()
    save_checkpoint(tmp_path, 1, trainable=model, optimizer=opt, generators=gens,
                    config=CONFIG, log={})  # fmt: skip

    def crash(*a, **k):
        raise KeyboardInterrupt("killed while writing")

    # Crash after the weights and optimizer are written, before the RNG and state.json.
    monkeypatch.setattr(ck, "capture_rng_state", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 2, trainable=model, optimizer=opt, generators=gens,
                        config=CONFIG, log={})  # fmt: skip
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    # A hard kill leaves the temporary folder behind (no cleanup runs) and possibly a
    # renamed folder without state.json: neither is picked.
    (tmp_path / ".checkpoint-3.tmp-deadbeef").mkdir()
    shutil.copytree(tmp_path / "checkpoint-1", tmp_path / "checkpoint-4")
    os.remove(tmp_path / "checkpoint-4" / "state.json")
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "state.json").write_text("{trunc")
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-1"
    assert load_checkpoint("latest", out_dir=tmp_path).step == 1
    assert load_checkpoint(tmp_path).step == 1  # a run folder: its latest (Flow-GRPO)
    for bad in ("checkpoint-4", "checkpoint-5"):
        with pytest.raises(ValueError, match="not a checkpoint"):
            load_checkpoint(tmp_path / bad)


def test_same_step_replaced_and_keep_last(tmp_path):
    model, opt, gens = make()
    for step in (1, 2, 3, 3):
        save_checkpoint(tmp_path, step, trainable=model, optimizer=opt, generators=gens,
                        config=CONFIG, log={"n": step}, keep_last=2)  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-3"


def test_refusals(tmp_path):
    model, opt, gens = make()
    save_checkpoint(tmp_path, 2, trainable=model, optimizer=opt, generators=gens,
                    config=CONFIG, log={})  # fmt: skip
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a checkpoint"):
        load_checkpoint(tmp_path / "empty")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        load_checkpoint("latest", out_dir=tmp_path / "empty")
    new = {**CONFIG, "mode": "exact", "world_size": 2, "steps": 99, "eval_every": 5}
    before = state_of(model)
    with pytest.raises(ValueError) as e:
        load_checkpoint(tmp_path, trainable=make(seed=5)[0], config=new)
    msg = str(e.value)
    assert "mode: 'jagg' -> 'exact'" in msg and "world_size: 1 -> 2" in msg
    assert "steps" not in msg.replace("num_steps", "") and "eval_every" not in msg
    assert all(torch.equal(v, state_of(model)[k]) for k, v in before.items())
    with pytest.raises(ValueError, match="task: 'digits' -> '<absent>'"):
        check_resume_config(CONFIG, {k: v for k, v in CONFIG.items() if k != "task"})
    with pytest.raises(ValueError, match="generators"):
        load_checkpoint(tmp_path, generators={"other": torch.Generator()})
    other = nn.Linear(5, 7)
    with pytest.raises(ValueError, match="missing"):
        load_checkpoint(tmp_path, trainable=other)
    state = json.loads((tmp_path / "checkpoint-2" / "state.json").read_text())
    state["format_version"] = 99
    (tmp_path / "checkpoint-2" / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match="format version 99"):
        load_checkpoint(tmp_path / "checkpoint-2")
    assert {"task", "mode", "tuning", "world_size", "group_size"} <= set(RESUME_KEYS)
    assert not {"steps", "out", "eval_every", "eval_per_digit", "progress"} & set(RESUME_KEYS)


def test_bad_arguments(tmp_path):
    model, opt, gens = make()
    kw = {"trainable": model, "optimizer": opt, "generators": gens, "log": {}}
    with pytest.raises(ValueError, match="step"):
        save_checkpoint(tmp_path, -1, config=CONFIG, **kw)
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path, 1, config={"x": object()}, **kw)
    with pytest.raises(ValueError, match="keep_last"):
        save_checkpoint(tmp_path, 1, config=CONFIG, keep_last=0, **kw)
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_peft_model_saved_with_save_pretrained(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 6), nn.SiLU(), nn.Linear(6, 2))
    cfg = peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False)
    model = peft.get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    path = save_checkpoint(tmp_path, 1, trainable=model, optimizer=opt, generators={},
                           config=CONFIG, log={})  # fmt: skip
    assert list((path / "adapter").rglob("adapter_model.safetensors"))
    want = {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}
    with torch.no_grad():
        for k, p in model.named_parameters():
            if "lora_" in k:
                p.zero_()
    load_checkpoint(path, trainable=model)
    got = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_async_checkpointer_snapshots_at_save_time(tmp_path):
    from jagg_autograd.checkpoint import AsyncCheckpointer

    model, opt, gens = make()
    train_step(model, opt, gens["train"])
    want = {k: v.clone() for k, v in trainable(model).items()}
    want_opt = opt.state_dict()["state"][0]["exp_avg"].clone()
    want_draw = torch.randn(3, generator=torch.Generator().set_state(gens["train"].get_state()))
    with AsyncCheckpointer() as saver:
        saver.save(tmp_path, 1, trainable=trainable(model), optimizer=opt, generators=gens,
                   config=CONFIG, log={"n": 1}, extra_tensors={"e": torch.ones(2)})  # fmt: skip
        # Training goes on while the write runs: the checkpoint keeps the state at save().
        train_step(model, opt, gens["train"])
        saver.save(tmp_path, 2, trainable=trainable(model), optimizer=opt, generators=gens,
                   config=CONFIG, log={"n": 2}, keep_last=1)  # fmt: skip
        assert saver.wait() == tmp_path / "checkpoint-2"
        assert saver.wait() is None
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-2"]  # keep_last=1
    saver2 = AsyncCheckpointer()
    model0, opt0, gens0 = make()
    train_step(model0, opt0, gens0["train"])  # the same state as at the first save
    saver2.save(tmp_path, 1, trainable=trainable(model0), optimizer=opt0, generators=gens0,
                config=CONFIG, log={})  # fmt: skip
    train_step(model0, opt0, gens0["train"])
    assert saver2.close() == tmp_path / "checkpoint-1"
    m, o, g = make(seed=4)
    load_checkpoint(tmp_path / "checkpoint-1", trainable=m, optimizer=o, generators=g)
    assert all(torch.equal(v, trainable(m)[k]) for k, v in want.items())
    assert torch.equal(o.state_dict()["state"][0]["exp_avg"], want_opt)
    assert torch.equal(torch.randn(3, generator=g["train"]), want_draw)
    assert load_checkpoint(tmp_path / "checkpoint-2").log == {"n": 2}
