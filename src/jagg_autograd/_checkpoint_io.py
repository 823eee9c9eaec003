"""File mechanics of :mod:`jagg_autograd.checkpoint`: tensor snapshots, the atomic write
(temporary folder, fsync, rename), completeness, and loading weights into live tensors."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE_FILE = "state.json"
WEIGHTS_FILE = "weights.safetensors"
ADAPTER_DIR = "adapter"
EXTRA_FILE = "extra.safetensors"
MISSING = "<absent>"


def is_peft_model(obj: object) -> bool:
    return hasattr(obj, "peft_config") and callable(getattr(obj, "save_pretrained", None))


def named_tensors(trainable: Mapping[str, torch.Tensor] | nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(trainable, nn.Module):
        named = {n: p for n, p in trainable.named_parameters() if p.requires_grad}
    elif isinstance(trainable, Mapping):
        named = dict(trainable)
    else:
        raise TypeError(
            "trainable must be a dict of tensors, an nn.Module or a peft model, got "
            f"{type(trainable).__name__}"
        )
    for k, v in named.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise TypeError(f"trainable must map names to tensors; {k!r} -> {type(v).__name__}")
    return named


def clone_to_cpu(x: Any) -> Any:
    """Tensors copied to the CPU (a snapshot the training can no longer change)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, dict):
        return {k: clone_to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone_to_cpu(v) for v in x)
    return x


def load_weights(trainable: Any, folder: Path) -> None:
    from safetensors.torch import load_file

    if is_peft_model(trainable):
        from peft import set_peft_model_state_dict

        files = sorted((folder / ADAPTER_DIR).rglob("adapter_model.safetensors"))
        if not files:
            raise ValueError(f"{folder} has no peft adapter (saved without a peft model?)")
        set_peft_model_state_dict(trainable, load_file(str(files[0])))
        return
    if not (folder / WEIGHTS_FILE).is_file():
        raise ValueError(f"{folder} has no {WEIGHTS_FILE} (saved from a peft model?)")
    saved = load_file(str(folder / WEIGHTS_FILE))
    named = named_tensors(trainable)
    missing, unexpected = sorted(set(named) - set(saved)), sorted(set(saved) - set(named))
    if missing or unexpected:
        raise ValueError(
            f"{folder}: the trainable tensors differ from the checkpoint's: missing "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}, unexpected "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for k, t in named.items():
            s = saved[k]
            if s.shape != t.shape or s.dtype != t.dtype:
                raise ValueError(
                    f"{folder}: {k} is {tuple(s.shape)} {s.dtype} in the checkpoint, "
                    f"{tuple(t.shape)} {t.dtype} here"
                )
            t.copy_(s)


# ------------------------------------------------------------------------------ files


def fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def json_text(obj: Any, what: str) -> str:
    try:
        return json.dumps(obj, indent=1, allow_nan=True)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what} must be JSON-serialisable: {exc}") from exc


def install(tmp: Path, final: Path) -> None:
    """Rename the finished ``tmp`` folder to ``final`` (replacing a checkpoint of the same
    step, e.g. when --save-every and the end coincide), then fsync the parent."""
    if final.exists():
        old = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(final.parent)


@dataclass
class Snapshot:
    """Everything a checkpoint writes, copied: writing it needs no live object."""

    tmp: Path
    final: Path
    weights: dict[str, torch.Tensor] | None  # None: a peft adapter already in tmp
    optimizer: dict[str, Any]
    extra_tensors: dict[str, torch.Tensor]
    rng: dict[str, Any]
    state_text: str
    keep_last: int | None


def write_snapshot(snap: Snapshot) -> Path:
    """Write a snapshot's files, fsync, rename into place, apply the retention."""
    from safetensors.torch import save_file

    tmp = snap.tmp
    try:
        if snap.weights is not None:
            save_file({k: v.contiguous() for k, v in snap.weights.items()}, str(tmp / WEIGHTS_FILE))
        torch.save(snap.optimizer, tmp / "optimizer.pt")
        if snap.extra_tensors:
            save_file({k: v.contiguous() for k, v in snap.extra_tensors.items()},
                      str(tmp / EXTRA_FILE))  # fmt: skip
        torch.save(snap.rng, tmp / "rng.pt")
        (tmp / STATE_FILE).write_text(snap.state_text, encoding="utf-8")  # last: completion
        for f in tmp.rglob("*"):
            if f.is_file():
                fsync_file(f)
        fsync_dir(tmp)
        install(tmp, snap.final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if snap.keep_last is not None:
        for _, old_ckpt in complete_checkpoints(snap.final.parent)[: -snap.keep_last]:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    return snap.final


def read_state(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and "format_version" in state else None


def complete_checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for p in out_dir.iterdir() if out_dir.is_dir() else ():
        m = CHECKPOINT_NAME.match(p.name)
        if m and p.is_dir() and read_state(p) is not None:
            found.append((int(m.group(1)), p))
    return sorted(found)
