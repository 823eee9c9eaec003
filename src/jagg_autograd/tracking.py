"""Experiment tracking behind one small interface: ``--report-to {none,tensorboard,wandb}``.

``tracker = make_tracker(report_to, log_dir=out, config=cfg)`` returns a :class:`Tracker`:

* ``log_scalars(step, values)`` -- numbers of a log row; nested mappings are flattened with
  ``/`` (``{"eval": {"per_digit": {"3": 0.5}}}`` -> ``eval/per_digit/3``); values that are
  not numbers (lists, strings, None) are skipped, so a whole log row can be passed;
* ``log_image(tag, image, step)`` -- a picture: a file path (PNG ...) or an ``(H, W)`` /
  ``(H, W, C)`` array or tensor (uint8, or floats in [0, 1]);
* ``close()`` -- flush and finish (also as a context manager).

Backends: ``"none"`` (does nothing), ``"tensorboard"`` (``torch.utils.tensorboard``'s
``SummaryWriter`` writing event files under ``log_dir``; needs the ``tensorboard``
package: ``pip install 'jagg-autograd[tensorboard]'``), ``"wandb"`` (``wandb.init`` with
``dir=log_dir``; ``WANDB_MODE=offline`` -- or ``mode="offline"`` -- keeps everything on
disk; needs ``pip install 'jagg-autograd[wandb]'``).

The backend's package is imported at construction on **every** rank, so a missing package
stops all processes at once with an ``ImportError`` naming the extra, before any training;
only the main process (rank 0) then creates a writer -- the others get a no-op tracker.
"""

from __future__ import annotations

import importlib
import math
import numbers
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

__all__ = [
    "REPORT_TO",
    "NullTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "flatten_scalars",
    "make_tracker",
]

REPORT_TO = ("none", "tensorboard", "wandb")
Importer = Callable[[str], ModuleType]
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb"}


def flatten_scalars(values: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of ``values`` (bools excluded), nested mappings flattened with ``/``."""
    out: dict[str, float] = {}
    for k, v in values.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_scalars(v, key + "/"))
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            out[key] = float(v.detach())
        elif isinstance(v, numbers.Real) and not isinstance(v, bool):
            out[key] = float(v)
    return out


def _image_array(image: str | os.PathLike[str] | np.ndarray | torch.Tensor) -> np.ndarray:
    """``(H, W, C)`` uint8 from a file, an array or a tensor (HW, HWC; uint8 or [0, 1])."""
    if isinstance(image, (str, os.PathLike)):
        import matplotlib.image as mpimg

        arr = np.asarray(mpimg.imread(os.fspath(image)))
    elif isinstance(image, torch.Tensor):
        arr = image.detach().cpu().numpy()
    elif isinstance(image, np.ndarray):
        arr = image
    else:
        raise TypeError(f"image must be a path, an array or a tensor, got {type(image)}")
    if arr.ndim == 2:
        arr = arr[:, :, None]
    if arr.ndim != 3 or arr.shape[2] not in (1, 3, 4):
        raise ValueError(f"image must be (H, W) or (H, W, C) with C in 1/3/4, got {arr.shape}")
    if arr.dtype != np.uint8:
        arr = (np.clip(arr.astype(np.float64), 0.0, 1.0) * 255.0).round().astype(np.uint8)
    return arr


class Tracker:
    """The interface; also the ``"none"`` backend (every method does nothing)."""

    name = "none"

    def log_scalars(self, step: int, values: Mapping[str, Any]) -> None:
        """Record the numbers of ``values`` at ``step`` (see :func:`flatten_scalars`)."""

    def log_image(
        self, tag: str, image: str | os.PathLike[str] | np.ndarray | torch.Tensor, step: int
    ) -> None:
        """Record a picture at ``step``."""

    def close(self) -> None:
        """Flush and finish; idempotent."""

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NullTracker(Tracker):
    """``--report-to none``, and every rank but the main one."""


class TensorBoardTracker(Tracker):
    """Event files under ``log_dir`` through ``torch.utils.tensorboard.SummaryWriter``."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike[str], module: ModuleType) -> None:
        self.log_dir = Path(log_dir)
        self._writer: Any = module.SummaryWriter(log_dir=str(self.log_dir))

    def log_scalars(self, step: int, values: Mapping[str, Any]) -> None:
        if self._writer is None:
            raise RuntimeError("the tracker is closed")
        for k, v in flatten_scalars(values).items():
            self._writer.add_scalar(k, v, global_step=step)

    def log_image(
        self, tag: str, image: str | os.PathLike[str] | np.ndarray | torch.Tensor, step: int
    ) -> None:
        if self._writer is None:
            raise RuntimeError("the tracker is closed")
        self._writer.add_image(tag, _image_array(image), global_step=step, dataformats="HWC")

    def close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


class WandbTracker(Tracker):
    """A wandb run (``dir=log_dir``); ``mode=None`` follows ``WANDB_MODE`` (e.g. offline)."""

    name = "wandb"

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        module: ModuleType,
        *,
        project: str,
        run_name: str | None,
        config: Mapping[str, Any] | None,
        mode: str | None,
    ) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self._wandb = module
        kwargs: dict[str, Any] = {"project": project, "name": run_name, "dir": str(log_dir),
                                  "config": dict(config or {})}  # fmt: skip
        if mode is not None:
            kwargs["mode"] = mode
        self._run: Any = module.init(**kwargs)

    def log_scalars(self, step: int, values: Mapping[str, Any]) -> None:
        if self._run is None:
            raise RuntimeError("the tracker is closed")
        scalars = {k: v for k, v in flatten_scalars(values).items() if not math.isnan(v)}
        self._run.log(scalars, step=step)

    def log_image(
        self, tag: str, image: str | os.PathLike[str] | np.ndarray | torch.Tensor, step: int
    ) -> None:
        if self._run is None:
            raise RuntimeError("the tracker is closed")
        self._run.log({tag: self._wandb.Image(_image_array(image))}, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def _import_backend(report_to: str, importer: Importer) -> ModuleType:
    name = "torch.utils.tensorboard" if report_to == "tensorboard" else "wandb"
    try:
        module = importer(name)
        if report_to == "tensorboard":
            importer("tensorboard")  # torch's wrapper imports lazily on some versions
    except ImportError as exc:
        raise ImportError(
            f"--report-to {report_to} needs the {_EXTRA[report_to]} package, which is not "
            f"installed: pip install 'jagg-autograd[{_EXTRA[report_to]}]' ({exc})"
        ) from exc
    return module


def make_tracker(
    report_to: str,
    *,
    log_dir: str | os.PathLike[str] | None,
    config: Mapping[str, Any] | None = None,
    project: str = "jagg-autograd",
    run_name: str | None = None,
    wandb_mode: str | None = None,
    rank: int | None = None,
    importer: Importer = importlib.import_module,
) -> Tracker:
    """The tracker for ``--report-to report_to`` (see the module docstring).

    Args:
        log_dir: where event files / the wandb run folder go (the run's ``out``); required
            for ``tensorboard`` and ``wandb``.
        config: the run's config (wandb records it).
        wandb_mode: ``"offline"``, ``"online"``, ``"disabled"``; None: ``WANDB_MODE``.
        rank: this process's rank (default: :func:`jagg_autograd.data_parallel.get_rank`);
            only rank 0 reports.
        importer: how backend packages are imported (the seam tests use to simulate a
            missing package).

    Raises:
        ValueError: an unknown ``report_to``, or no ``log_dir`` for a real backend.
        ImportError: the backend's package is missing; the message names the extra.
    """
    if report_to not in REPORT_TO:
        raise ValueError(f"report_to must be one of {REPORT_TO}, got {report_to!r}")
    if report_to == "none":
        return NullTracker()
    if log_dir is None:
        raise ValueError(f"--report-to {report_to} needs an output folder (--out)")
    module = _import_backend(report_to, importer)  # on every rank: all fail together
    if rank is None:
        from jagg_autograd.data_parallel import get_rank

        rank = get_rank()
    if rank != 0:
        return NullTracker()
    if report_to == "tensorboard":
        return TensorBoardTracker(log_dir, module)
    return WandbTracker(log_dir, module, project=project, run_name=run_name, config=config,
                        mode=wandb_mode)  # fmt: skip


def eval_scalars(ev: dict[str, Any]) -> dict[str, Any]:
    """An evaluation for the tracker: per-category lists as ``{index: value}``."""
    out: dict[str, Any] = {}
    for k, v in ev.items():
        if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) for x in v):
            out[k] = {str(i): x for i, x in enumerate(v)}
        else:
            out[k] = v
    return out
