"""Shared helpers: machine description, timers, saved-tensor byte counting."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The repository's HEAD commit (with ``-dirty`` when the tree has changes), or "unknown"."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def machine_info(device: torch.device) -> dict[str, Any]:
    """Host, library versions and accelerator (if any) for the JSON record."""
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except Exception:
        diffusers_version = None
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "diffusers": diffusers_version,
        "git_commit": git_commit(),
        "device": str(device),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
    }
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info["gpu"] = p.name
        info["gpu_memory_bytes"] = p.total_memory
        info["cuda"] = torch.version.cuda
    return info


def sync(device: torch.device) -> None:
    """Wait for queued device work (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stopwatch:
    """Accumulates wall time of labelled phases (synchronising the device around each)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Any:
        """Time the enclosed block and add it to ``times[name]``."""
        sync(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0


def median(xs: Iterable[float]) -> float:
    """Median of a non-empty iterable."""
    return float(statistics.median(list(xs)))


def interleaved_times(
    fns: dict[str, Callable[[int], Any]], reps: int, ref: str
) -> dict[str, Any]:
    """Time ``fns[name](seed)`` (CPU, wall-clock): one warm-up call each, then ``reps``
    repetitions in a rotating order.  Returns per name the seconds (``all_s``), their
    median (``median_s``), the median over repetitions of name / ``ref`` in the same
    repetition (``ratio``: a shared machine's slow stretches hit a repetition's variants
    alike, so it is steadier than a ratio of medians) and the ratio of medians."""
    names = list(fns)
    for n in names:
        fns[n](0)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[n](1 + r)
            times[n].append(time.perf_counter() - t0)
    med = {n: statistics.median(v) for n, v in times.items()}
    paired = {
        n: statistics.median(a / b for a, b in zip(times[n], times[ref], strict=True))
        for n in names
    }
    return {
        "reps": reps,
        "median_s": med,
        "all_s": times,
        "ratio": paired,
        "ratio_of_medians": {n: med[n] / med[ref] for n in names},
    }


def write_report(out: Path | str, stem: str, res: dict[str, Any], md: str) -> None:
    """``<out>/<stem>.json`` (``res``) and ``<out>/<STEM>.md`` (``md``), echoing ``md``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    (out / f"{stem.upper()}.md").write_text(md)
    print(md)


class SavedBytes:
    """Count bytes saved for backward via ``saved_tensors_hooks``, deduplicated by storage.

    ``exclude`` holds storage data pointers not to count (e.g. the parameters, which every
    variant saves once and which are not activations).  ``total`` counts everything,
    ``activations`` everything but the excluded storages.
    """

    def __init__(self, exclude: set[int] | None = None) -> None:
        self.exclude = exclude or set()
        self.seen: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Record the tensor's storage and pass it through unchanged."""
        try:
            st = t.untyped_storage()
            self.seen[st.data_ptr()] = max(self.seen.get(st.data_ptr(), 0), st.nbytes())
        except Exception:  # tensors without storage (e.g. some subclasses)
            pass
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        """Identity unpack."""
        return t

    @contextmanager
    def hooks(self) -> Any:
        """Context manager installing the pack/unpack hooks."""
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self

    @property
    def total(self) -> int:
        """All saved bytes, each storage once."""
        return int(sum(self.seen.values()))

    @property
    def activations(self) -> int:
        """Saved bytes outside the excluded storages."""
        return int(sum(n for p, n in self.seen.items() if p not in self.exclude))


def param_storages(params: Iterable[torch.Tensor]) -> set[int]:
    """Storage data pointers of ``params``."""
    return {p.untyped_storage().data_ptr() for p in params}


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """Concatenate ``.grad`` of ``params`` (zeros where None) into one float64 vector."""
    return torch.cat(
        [
            (p.grad if p.grad is not None else torch.zeros_like(p)).detach().double().flatten()
            for p in params
        ]
    )


def zero_grad(params: list[torch.nn.Parameter]) -> None:
    """Set ``.grad`` of every parameter to None."""
    for p in params:
        p.grad = None


def call_timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall time of one call of ``fn`` (device-synchronised)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0
