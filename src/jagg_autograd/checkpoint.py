"""Atomic training checkpoints and exact resume: ``<out>/checkpoint-<step>/``.

A checkpoint holds everything a run needs to continue as if it had never stopped:

* ``weights.safetensors`` -- the trainable tensors by name (exact bytes, any dtype); a peft
  ``PeftModel`` is saved with its own ``save_pretrained`` under ``adapter/`` instead;
* ``optimizer.pt`` -- ``optimizer.state_dict()`` (``torch.save``; loaded ``weights_only``);
* ``rng.pt`` -- every random state: the named ``torch.Generator`` objects the run draws
  from, plus torch's global CPU and CUDA states, Python's ``random`` and numpy's global
  state (:func:`capture_rng_state`); several processes may pass one global state per rank;
* ``extra.safetensors`` -- optional named tensors that are state but not trained (an EMA of
  the weights, a stat tracker's buffers, the first evaluation's grid pictures...);
* ``state.json`` -- the format version, the step, the config, the log so far and ``extra``
  (any JSON: running statistics, an EMA's step...). It is written last: a directory named
  ``checkpoint-<step>`` without a readable ``state.json`` is not a checkpoint.

**Atomic.** Everything is written into ``<out>/.checkpoint-<step>.tmp-<id>/``, each file
and the folder are fsync-ed, then the folder is renamed to ``checkpoint-<step>`` with
``os.replace`` (and the parent folder fsync-ed).  A crash at any point leaves either the
previous set of checkpoints or the new complete one; :func:`latest_checkpoint` ignores the
temporary folders and any ``checkpoint-*`` without ``state.json``.

**Resume refusals.** :func:`load_checkpoint` compares the saved config with the current
one on :data:`RESUME_KEYS` -- the keys whose change would change the meaning of the saved
state (the task and model, what is trained, the estimator, the batch layout, the world
size) -- and raises a ``ValueError`` naming every mismatching key with its old and new
value.  Every other key may change: ``steps``, the evaluation settings, ``out``, logging,
``lr``, ``lr_scheduler_type``, ``warmup_steps``... (Flow-GRPO and the Hugging Face
trainers let a resumed run change those too; the trainer sets the rate before every
optimizer step, so the saved optimizer's lr never overrides a new one).
"""

from __future__ import annotations

import os
import random
import shutil
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from jagg_autograd._checkpoint_io import (
    ADAPTER_DIR,
    EXTRA_FILE,
    MISSING,
    STATE_FILE,
    Snapshot,
    clone_to_cpu,
    complete_checkpoints,
    is_peft_model,
    json_text,
    load_weights,
    named_tensors,
    read_state,
    write_snapshot,
)

__all__ = [
    "FORMAT_VERSION",
    "RESUME_KEYS",
    "AsyncCheckpointer",
    "Checkpoint",
    "capture_rng_state",
    "check_resume_config",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
]

FORMAT_VERSION = 1

#: Config keys that must be equal to resume: a change would make the saved weights,
#: optimizer moments or noise stream mean something else.  ``world_size`` is not a
#: ``GRPOConfig`` field: the trainer adds it to the config it passes.  Keys absent from
#: both configs are skipped; a key present on one side only counts as a mismatch.
# fmt: off
RESUME_KEYS: tuple[str, ...] = (
    "task", "task_options", "tuning", "lora_rank", "precision", "mode", "window",
    "shared_anchors", "threshold", "jagg_frac", "subsample_steps", "timestep_fraction",
    "timestep_selection", "placement", "num_steps", "schedule", "shift", "sde_type",
    "noise_level", "prompts_per_step", "group_size", "optimizer_steps_per_rollout",
    "gradient_accumulation_steps", "num_inner_epochs", "beta", "seed", "world_size",
)
# fmt: on



@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read (weights, optimizer and RNG are already restored)."""

    path: Path
    step: int
    config: dict[str, Any]
    log: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)


# ------------------------------------------------------------------------------ RNG state


def capture_rng_state() -> dict[str, Any]:
    """This process's global random states: torch CPU, every CUDA device (if initialised),
    Python ``random`` and numpy, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (CUDA states only if CUDA is initialised here)."""
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _snapshot(
    out_dir: str | os.PathLike[str],
    step: int,
    *,
    trainable: Mapping[str, torch.Tensor] | nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: Mapping[str, torch.Generator],
    config: Mapping[str, Any],
    log: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    global_rng: Sequence[Mapping[str, Any]] | None = None,
    keep_last: int | None = None,
) -> Snapshot:
    """Check the arguments and copy the state (a peft adapter is written into the
    temporary folder now); see :func:`save_checkpoint`."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int)
                                  or keep_last < 1):  # fmt: skip
        raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
    for name, g in generators.items():
        if not isinstance(g, torch.Generator):
            raise TypeError(f"generators[{name!r}] must be a torch.Generator, got {type(g)}")
    state_text = json_text(
        {"format_version": FORMAT_VERSION, "step": step, "config": dict(config),
         "log": dict(log), "extra": dict(extra or {})}, "config, log and extra"
    )  # fmt: skip
    peft = is_peft_model(trainable)
    weights = None if peft else clone_to_cpu(named_tensors(trainable))  # type: ignore[arg-type]
    rng = {
        "generators": {k: g.get_state() for k, g in generators.items()},
        "global": [dict(s) for s in global_rng] if global_rng else [capture_rng_state()],
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".checkpoint-{step}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        if peft:
            trainable.save_pretrained(str(tmp / ADAPTER_DIR), safe_serialization=True)  # type: ignore[union-attr]
        snap = Snapshot(tmp, out / f"checkpoint-{step}", weights,
                         clone_to_cpu(optimizer.state_dict()),
                         clone_to_cpu(named_tensors(extra_tensors or {})), rng, state_text,
                         keep_last)  # fmt: skip
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return snap


def save_checkpoint(
    out_dir: str | os.PathLike[str],
    step: int,
    *,
    trainable: Mapping[str, torch.Tensor] | nn.Module,
    optimizer: torch.optim.Optimizer,
    generators: Mapping[str, torch.Generator],
    config: Mapping[str, Any],
    log: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    extra_tensors: Mapping[str, torch.Tensor] | None = None,
    global_rng: Sequence[Mapping[str, Any]] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write ``<out_dir>/checkpoint-<step>/`` atomically; return its path.

    Args:
        trainable: the trained tensors by name, a module (its ``requires_grad`` parameters)
            or a peft ``PeftModel`` (saved with ``save_pretrained``).
        optimizer: its ``state_dict()`` is saved.
        generators: every ``torch.Generator`` the run draws from, by name.
        config, log: JSON-serialisable dicts; extra (optional): JSON (running statistics).
        extra_tensors: optional named tensors to keep exactly (``extra.safetensors``).
        global_rng: one :func:`capture_rng_state` per rank (rank order) when several
            processes save; default: this process's state only.
        keep_last: if set, delete the oldest complete checkpoints so that this many remain.

    ``step`` is the number of finished steps.  A checkpoint of the same step is replaced.
    Call it from one process only (rank 0).  :class:`AsyncCheckpointer` writes in the
    background instead.
    """
    return write_snapshot(_snapshot(
        out_dir, step, trainable=trainable, optimizer=optimizer, generators=generators,
        config=config, log=log, extra=extra, extra_tensors=extra_tensors,
        global_rng=global_rng, keep_last=keep_last,
    ))  # fmt: skip


class AsyncCheckpointer:
    """:func:`save_checkpoint` with the writing (files, fsync, rename) in a background
    thread: :meth:`save` only copies the state (weights, optimizer moments, RNG states) to
    CPU memory and returns, so the next step runs while the disk works.  One write is in
    flight at a time (a second :meth:`save` first waits for the previous one).  A write's
    error is raised by the next :meth:`save`, :meth:`wait` or :meth:`close`.  Call
    :meth:`close` (or use ``with``) before the process exits -- an unfinished write leaves
    only a temporary folder, which is never picked.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jagg-checkpoint")
        self._pending: Any = None

    def save(self, out_dir: str | os.PathLike[str], step: int, **state: Any) -> None:
        """Snapshot now, write in the background (arguments of :func:`save_checkpoint`)."""
        self.wait()
        snap = _snapshot(out_dir, step, **state)
        self._pending = self._pool.submit(write_snapshot, snap)

    def wait(self) -> Path | None:
        """Wait for the write in flight; return its path (None if there was none)."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> Path | None:
        """Wait for the write in flight and stop the thread; idempotent."""
        try:
            return self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------ reading


def latest_checkpoint(out_dir: str | os.PathLike[str]) -> Path | None:
    """The complete ``checkpoint-<N>`` with the highest N in ``out_dir``, or None."""
    found = complete_checkpoints(Path(out_dir))
    return found[-1][1] if found else None


def resolve_checkpoint(
    path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None
) -> Path:
    """``path`` as a checkpoint folder: ``"latest"`` (the latest in ``out_dir``), a
    checkpoint folder, or a run folder holding ``checkpoint-*`` (its latest, as Flow-GRPO's
    ``resume_from``).  Raises ``ValueError`` when there is none."""
    if str(path) == "latest":
        if out_dir is None:
            raise ValueError("resume from 'latest' needs the run's out folder")
        found = latest_checkpoint(out_dir)
        if found is None:
            raise ValueError(f"resume from 'latest': no complete checkpoint-<step> in {out_dir}")
        return found
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{p} is not a checkpoint: no such folder")
    if read_state(p) is not None:
        return p
    found = latest_checkpoint(p)
    if found is not None:
        return found
    raise ValueError(
        f"{p} is not a checkpoint: no readable {STATE_FILE} (an incomplete or foreign folder), "
        "and no complete checkpoint-<step> inside it"
    )


def check_resume_config(
    saved: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str] = RESUME_KEYS
) -> None:
    """Raise ``ValueError`` naming every key of ``keys`` whose value differs (old -> new)."""
    diffs = []
    for k in keys:
        if k not in saved and k not in current:
            continue
        old, new = saved.get(k, MISSING), current.get(k, MISSING)
        if old != new:
            diffs.append(f"{k}: {old!r} -> {new!r}")
    if diffs:
        raise ValueError(
            "cannot resume: the checkpoint was saved with a different "
            + ", ".join(diffs)
            + " (these change the meaning of the saved state; start a new run instead)"
        )


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    out_dir: str | os.PathLike[str] | None = None,
    trainable: Mapping[str, torch.Tensor] | nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    generators: Mapping[str, torch.Generator] | None = None,
    config: Mapping[str, Any] | None = None,
    resume_keys: Iterable[str] = RESUME_KEYS,
    rank: int | None = 0,
) -> Checkpoint:
    """Read a checkpoint (``path`` as :func:`resolve_checkpoint`) and restore into the given
    objects: the weights in place, the optimizer's state, each named generator's state and,
    unless ``rank`` is None, the global RNG state saved for ``rank`` (rank 0's when only one
    was saved).  With ``config`` the saved config is checked first (:func:`check_resume_config`
    on ``resume_keys``), before anything is modified.

    Raises:
        ValueError: not a checkpoint, a newer format, a config mismatch, generators or
            tensors that differ from the saved ones.
    """
    p = resolve_checkpoint(path, out_dir)
    state = read_state(p)
    assert state is not None
    if int(state["format_version"]) > FORMAT_VERSION:
        raise ValueError(
            f"{p} has format version {state['format_version']}; this jagg_autograd reads "
            f"up to {FORMAT_VERSION}: upgrade the package"
        )
    if config is not None:
        check_resume_config(state["config"], config, resume_keys)
    rng = torch.load(p / "rng.pt", weights_only=True)
    if generators is not None:
        missing = sorted(set(generators) - set(rng["generators"]))
        if missing:
            raise ValueError(f"{p} has no state for the generators {missing}")
    if trainable is not None:
        load_weights(trainable, p)
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(p / "optimizer.pt", weights_only=True))
    for name, g in (generators or {}).items():
        g.set_state(rng["generators"][name])
    if rank is not None:
        states = rng["global"]
        restore_rng_state(states[rank] if rank < len(states) else states[0])
    extra_tensors: dict[str, torch.Tensor] = {}
    if (p / EXTRA_FILE).is_file():
        from safetensors.torch import load_file

        extra_tensors = load_file(str(p / EXTRA_FILE))
    return Checkpoint(p, int(state["step"]), state["config"], state["log"],
                      state.get("extra", {}), int(state["format_version"]),
                      extra_tensors)  # fmt: skip
