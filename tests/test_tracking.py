"""jagg_autograd.tracking: --report-to none / tensorboard / wandb behind one interface."""

from __future__ import annotations

import importlib
import types
from typing import Any

import numpy as np
import pytest
import torch

from jagg_autograd.tracking import (
    NullTracker,
    TensorBoardTracker,
    WandbTracker,
    flatten_scalars,
    make_tracker,
)

ROW = {"reward_mean": 0.25, "loss": -0.5, "optimizer_steps": 2, "paths": ["eager"],
       "prompts": [1, 2], "ok": True, "note": "x", "eval": {"per_digit": {"3": 0.75}},
       "t": torch.tensor(1.5)}  # fmt: skip


def missing(name: str) -> types.ModuleType:
    if name.split(".")[0] in ("tensorboard", "wandb") or name == "torch.utils.tensorboard":
        raise ImportError(f"No module named {name!r}")
    return importlib.import_module(name)


def test_flatten_scalars_keeps_numbers_only():
    assert flatten_scalars(ROW) == {"reward_mean": 0.25, "loss": -0.5, "optimizer_steps": 2.0,
                                    "eval/per_digit/3": 0.75, "t": 1.5}  # fmt: skip


@pytest.mark.parametrize("backend,extra", [("tensorboard", "tensorboard"), ("wandb", "wandb")])
@pytest.mark.parametrize("rank", [0, 1])
def test_missing_package_names_the_extra(tmp_path, backend, extra, rank):
    with pytest.raises(ImportError, match=rf"pip install 'jagg-autograd\[{extra}\]'"):
        make_tracker(backend, log_dir=tmp_path, rank=rank, importer=missing)
    assert list(tmp_path.iterdir()) == []


def test_none_does_nothing(tmp_path):
    with make_tracker("none", log_dir=tmp_path, importer=missing) as t:
        assert isinstance(t, NullTracker)
        t.log_scalars(0, ROW)
        t.log_image("grid", np.zeros((4, 4, 3), np.uint8), 0)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="report_to"):
        make_tracker("mlflow", log_dir=tmp_path)
    with pytest.raises(ValueError, match="--out"):
        make_tracker("tensorboard", log_dir=None)


def test_only_rank_zero_reports(tmp_path):
    pytest.importorskip("tensorboard")
    t = make_tracker("tensorboard", log_dir=tmp_path / "tb", rank=1)
    assert isinstance(t, NullTracker)
    t.log_scalars(0, ROW)
    t.close()
    assert not (tmp_path / "tb").exists()


def test_tensorboard_writes_scalars_and_image(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid = tmp_path / "grid.png"
    import matplotlib.pyplot as plt

    plt.imsave(grid, np.linspace(0, 1, 6 * 8 * 3).reshape(6, 8, 3))
    with make_tracker("tensorboard", log_dir=tmp_path / "tb", rank=0) as t:
        assert isinstance(t, TensorBoardTracker)
        t.log_scalars(0, ROW)
        t.log_scalars(1, {"reward_mean": 0.5, "loss": float("nan")})
        t.log_image("grid", grid, 1)
        t.log_image("sample", torch.rand(5, 7), 1)
    with pytest.raises(RuntimeError, match="closed"):
        t.log_scalars(2, {"a": 1})
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    assert tags == {"reward_mean", "loss", "optimizer_steps", "eval/per_digit/3", "t"}
    rm = ea.Scalars("reward_mean")
    assert [(e.step, e.value) for e in rm] == [(0, 0.25), (1, 0.5)]
    assert np.isnan(ea.Scalars("loss")[1].value)
    assert [(e.step, e.value) for e in ea.Scalars("eval/per_digit/3")] == [(0, 0.75)]
    imgs = {tag: ea.Images(tag) for tag in ea.Tags()["images"]}
    assert set(imgs) == {"grid", "sample"}
    assert (imgs["grid"][0].width, imgs["grid"][0].height, imgs["grid"][0].step) == (8, 6, 1)


class FakeWandb(types.ModuleType):
    """Records what a wandb module would be asked (no network, no package)."""

    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple[str, Any]] = []

    def init(self, **kw: Any) -> FakeWandb:
        self.calls.append(("init", kw))
        return self

    def log(self, data: dict[str, Any], step: int) -> None:
        self.calls.append(("log", (data, step)))

    def finish(self) -> None:
        self.calls.append(("finish", None))

    def Image(self, arr: np.ndarray) -> tuple[str, tuple[int, ...]]:
        return ("image", arr.shape)


def test_wandb_through_the_importer_seam(tmp_path):
    fake = FakeWandb()
    t = make_tracker("wandb", log_dir=tmp_path, config={"lr": 1e-4}, run_name="r", rank=0,
                     wandb_mode="offline", importer=lambda name: fake)  # fmt: skip
    assert isinstance(t, WandbTracker)
    t.log_scalars(3, {"reward_mean": 0.5, "loss": float("nan"), "paths": ["x"]})
    t.log_image("grid", np.zeros((2, 3), np.float32), 3)
    t.close()
    t.close()
    kinds = [c[0] for c in fake.calls]
    assert kinds == ["init", "log", "log", "finish"]
    init = fake.calls[0][1]
    assert init["mode"] == "offline" and init["dir"] == str(tmp_path)
    assert init["config"] == {"lr": 1e-4} and init["name"] == "r"
    assert fake.calls[1][1] == ({"reward_mean": 0.5}, 3)
    assert fake.calls[2][1] == ({"grid": ("image", (2, 3, 1))}, 3)
    # mode=None leaves it to WANDB_MODE (wandb reads the variable itself).
    fake2 = FakeWandb()
    make_tracker("wandb", log_dir=tmp_path, rank=0, importer=lambda name: fake2)
    assert "mode" not in fake2.calls[0][1]


def test_image_inputs_checked(tmp_path):
    fake = FakeWandb()
    t = make_tracker("wandb", log_dir=tmp_path, rank=0, importer=lambda name: fake)
    with pytest.raises(ValueError, match="C in 1/3/4"):
        t.log_image("x", np.zeros((2, 3, 5)), 0)
    with pytest.raises(TypeError):
        t.log_image("x", [1, 2], 0)  # type: ignore[arg-type]
