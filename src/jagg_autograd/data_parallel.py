"""Data-parallel GRPO rollouts whose result does not depend on the number of processes.

:mod:`jagg_autograd.distributed` syncs gradients once per optimizer step; this module is
the other half of running a trainer under ``torchrun`` / ``accelerate launch``:

* :func:`init_process_group_from_env` -- the process group from the launcher's environment
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``): gloo on CPU,
  NCCL on CUDA, with a finite ``timeout`` so that a dead peer fails the collectives of the
  others with an error instead of a hang.  One process without launcher variables runs
  without a group (world size 1).
* :class:`SampleLayout` -- which samples of a step's global batch this rank owns.  The
  global batch (``prompts_per_step * group_size`` samples, in the single-process order)
  is cut into minibatches as one process would cut it, and **every minibatch is split over
  the ranks** (rank r owns rows ``[r*m/N, (r+1)*m/N)`` of each minibatch of m samples):
  so each optimizer step sees the same samples as on one process, and DDP's mean over
  ranks of per-rank means is the single-process minibatch mean.  Contract: the minibatch
  size must divide by the world size (else ``ValueError``); evaluation sets may split
  unevenly (``even=False``; no gradient is averaged there).
* :class:`ShardedGenerator` -- the rank's rows of the *global* random stream: every rank
  draws the global tensor from the same ``torch.Generator`` (same seed, same call order)
  and keeps its rows, so the draws are bit for bit those of one process.  Cost: each rank
  draws the whole minibatch's noise (N times the random numbers; for the digits task a
  few thousand floats per denoising step, microseconds against the model's forward).
* :func:`all_gather_samples` -- per-sample values (rewards, ...) of all ranks back in the
  global sample order, so that group statistics are the whole group's.
* :func:`reduce_scalars` -- log-row numbers averaged (or min/max) over ranks.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError",
    "DistContext",
    "SampleLayout",
    "ShardedGenerator",
    "all_gather_samples",
    "all_reduce_mean_",
    "destroy_process_group",
    "draw_rand",
    "draw_randn",
    "get_rank",
    "get_world_size",
    "init_process_group_from_env",
    "is_main_process",
    "reduce_scalars",
]

DEFAULT_TIMEOUT_S = 600.0
_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a peer process probably died (see its traceback)."""


@dataclass(frozen=True)
class DistContext:
    """What :func:`init_process_group_from_env` set up."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None  # None: a single process without a group
    device: torch.device
    timeout_s: float

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def get_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_world_size() -> int:
    """The number of processes (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0: the process that writes logs, checkpoints, pictures and reports."""
    return get_rank() == 0


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except (KeyError, ValueError) as exc:
        raise ValueError(
            f"{name}={env.get(name)!r}: start several processes with torchrun or accelerate "
            f"launch, which set {', '.join(_ENV)}"
        ) from exc


def init_process_group_from_env(
    *,
    backend: str | None = None,
    device: str | torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> DistContext:
    """Join the process group described by the launcher's environment variables.

    Args:
        backend: default ``"nccl"`` when ``device`` is CUDA, else ``"gloo"``.
        device: default ``cuda:LOCAL_RANK`` if CUDA is available, else CPU.  A CUDA
            device is made current (``torch.cuda.set_device``).
        timeout_s: bound on every collective: a rank whose peer died gets an error after
            at most this long (NCCL: with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, on by default).
        env: the variables (default ``os.environ``).

    Without ``WORLD_SIZE`` (a plain ``python -m ...``) or with ``WORLD_SIZE=1`` no group is
    created.  An already initialised group is reused.  Raises ``ValueError`` on a partial
    or inconsistent launcher environment.
    """
    env = os.environ if env is None else env
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    world = _env_int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else 1
    rank = _env_int(env, "RANK") if world > 1 else 0
    local = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent")
    if device is None:
        device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if world > 1 and not dist.is_initialized():
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ValueError(f"{name} is not set: launch with torchrun or accelerate launch")
        dist.init_process_group(
            backend,
            init_method=f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        backend = dist.get_backend()
    else:
        backend = None
    return DistContext(rank, world, local, backend, dev, float(timeout_s))


def destroy_process_group() -> None:
    """Leave the process group, if any (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------ layout


@dataclass(frozen=True)
class SampleLayout:
    """Rank ``rank``'s share of a global batch of ``global_size`` samples cut into
    minibatches of ``minibatch`` samples (the single-process cut), each split over ranks.

    ``even=True`` (training) requires ``minibatch % world_size == 0``; ``even=False``
    (evaluation) gives the first ``minibatch % world_size`` ranks one extra row.
    """

    global_size: int
    minibatch: int
    rank: int = 0
    world_size: int = 1
    even: bool = True

    def __post_init__(self) -> None:
        g, m, r, w = self.global_size, self.minibatch, self.rank, self.world_size
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (g, m, r, w)):
            raise TypeError("global_size, minibatch, rank and world_size must be ints")
        if w < 1 or not 0 <= r < w or m < 1 or g < 1:
            raise ValueError(f"bad layout: global_size={g}, minibatch={m}, rank={r}, world={w}")
        if g % m:
            raise ValueError(f"the global batch ({g}) must divide into minibatches of {m}")
        if self.even and m % w:
            raise ValueError(
                f"a minibatch of {m} samples does not split over {w} processes: choose "
                "prompts_per_step * group_size / num_minibatches divisible by the world size"
            )
        if m < w:
            raise ValueError(f"a minibatch of {m} samples cannot feed {w} processes")

    def rows(self, rank: int | None = None) -> tuple[int, int]:
        """``(lo, hi)``: the rows of each minibatch owned by ``rank`` (default: this rank)."""
        r = self.rank if rank is None else rank
        base, extra = divmod(self.minibatch, self.world_size)
        lo = r * base + min(r, extra)
        return lo, lo + base + (1 if r < extra else 0)

    @property
    def local_minibatch(self) -> int:
        lo, hi = self.rows()
        return hi - lo

    @property
    def num_minibatches(self) -> int:
        return self.global_size // self.minibatch

    def indices(self, rank: int | None = None) -> torch.Tensor:
        """Global sample indices owned by ``rank``, in its local order (minibatch-major)."""
        lo, hi = self.rows(rank)
        starts = torch.arange(self.num_minibatches) * self.minibatch
        return (starts[:, None] + torch.arange(lo, hi)[None, :]).reshape(-1)

    def take(self, x: torch.Tensor | Sequence[T]) -> torch.Tensor | list[T]:
        """This rank's rows of a global tensor (dim 0) or list, in local order."""
        if len(x) != self.global_size:
            raise ValueError(f"expected {self.global_size} global rows, got {len(x)}")
        idx = self.indices()
        if isinstance(x, torch.Tensor):
            return x[idx.to(x.device)]
        return [x[i] for i in idx.tolist()]


# ------------------------------------------------------------------------------ noise


class ShardedGenerator:
    """This rank's rows of the draws one process would make from ``generator``.

    ``randn(shape)`` / ``rand(shape)`` take the *local* shape (``shape[0]`` = this rank's
    rows of one minibatch, :attr:`SampleLayout.local_minibatch`), draw the global tensor
    ``(layout.minibatch, *shape[1:])`` from ``generator`` on its device, exactly as the
    single-process call with the global batch would, and return rows ``layout.rows()``
    (moved to ``device``).  All ranks must make the same calls in the same order; the
    generator's state then stays identical on every rank (checkpoint it from rank 0).
    With one process it is the plain draw.  Draws not along the sample dimension (prompts,
    a per-step scalar) are made on :attr:`generator` directly, identically on every rank.
    """

    def __init__(self, generator: torch.Generator, layout: SampleLayout) -> None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator)}")
        self.generator = generator
        self.layout = layout

    def _draw(
        self, fn: Callable[..., torch.Tensor], shape: Sequence[int], dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> torch.Tensor:  # fmt: skip
        shape = tuple(int(s) for s in shape)
        if not shape or shape[0] != self.layout.local_minibatch:
            raise ValueError(
                f"shape {shape}: dim 0 must be this rank's {self.layout.local_minibatch} "
                f"rows of a minibatch of {self.layout.minibatch}"
            )
        full = fn((self.layout.minibatch, *shape[1:]), generator=self.generator, dtype=dtype,
                  device=self.generator.device)  # fmt: skip
        lo, hi = self.layout.rows()
        out = full[lo:hi]
        return out.to(device) if device is not None else out

    def randn(
        self, shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Standard normal draws: this rank's rows of the global ``torch.randn``."""
        return self._draw(torch.randn, shape, dtype, device)

    def rand(
        self, shape: Sequence[int], *, dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Uniform draws: this rank's rows of the global ``torch.rand``."""
        return self._draw(torch.rand, shape, dtype, device)


def draw_randn(
    shape: Sequence[int], generator: torch.Generator | ShardedGenerator | None, *,
    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> torch.Tensor:  # fmt: skip
    """``torch.randn(shape)`` from a ``torch.Generator`` (drawn on the generator's device,
    then moved to ``device``, as diffusers' ``randn_tensor``), a :class:`ShardedGenerator`
    (this rank's rows of the global draw) or None (the global RNG).  Every per-sample draw
    site of the library goes through this (or :func:`draw_rand`)."""
    if isinstance(generator, ShardedGenerator):
        return generator.randn(shape, dtype=dtype, device=device)
    if generator is None:
        return torch.randn(tuple(shape), dtype=dtype, device=device)
    if not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or a ShardedGenerator, got {type(generator)}"
        )
    out = torch.randn(tuple(shape), generator=generator, dtype=dtype, device=generator.device)
    return out.to(device) if device is not None else out


def draw_rand(
    shape: Sequence[int], generator: torch.Generator | ShardedGenerator | None, *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """``torch.rand(shape)`` on the CPU from a generator, a :class:`ShardedGenerator` or
    None (see :func:`draw_randn`)."""
    if isinstance(generator, ShardedGenerator):
        return generator.rand(shape, dtype=dtype)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or a ShardedGenerator, got {type(generator)}"
        )
    return torch.rand(tuple(shape), generator=generator, dtype=dtype)


def is_generator(generator: object) -> bool:
    """A ``torch.Generator`` or a :class:`ShardedGenerator` (what the draw sites accept)."""
    return isinstance(generator, (torch.Generator, ShardedGenerator))


# ------------------------------------------------------------------------------ collectives


def _collective(what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except RuntimeError as exc:  # DistBackendError / DistNetworkError subclass it
        raise CollectiveError(
            f"rank {get_rank()}/{get_world_size()}: {what} failed ({type(exc).__name__}: "
            f"{str(exc)[:300]}); another process probably died or stopped answering: look "
            "for its traceback above; the process group's timeout bounds this wait"
        ) from exc


def all_gather_samples(local: torch.Tensor, layout: SampleLayout) -> torch.Tensor:
    """Every rank's ``local`` rows (its samples, local order) as the global tensor, in the
    global sample order; the same tensor on every rank.  Without a group: ``local``.

    ``local`` has ``len(layout.indices())`` rows and the same trailing shape / dtype on
    every rank.  Uneven layouts are padded for the collective and trimmed.
    """
    n_local = len(layout.indices())
    if local.shape[0] != n_local:
        raise ValueError(f"rank {layout.rank} owns {n_local} samples, got {local.shape[0]} rows")
    if layout.world_size == 1:
        return local
    if get_world_size() != layout.world_size:
        raise ValueError(f"the layout is for {layout.world_size} ranks, the group has "
                         f"{get_world_size()}")  # fmt: skip
    counts = [len(layout.indices(r)) for r in range(layout.world_size)]
    pad = max(counts)
    x = local.contiguous()
    if n_local < pad:
        x = torch.cat([x, x.new_zeros((pad - n_local, *x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in counts]
    _collective("all_gather of per-sample values", lambda: dist.all_gather(parts, x))
    out = local.new_empty((layout.global_size, *local.shape[1:]))
    for r, (part, n) in enumerate(zip(parts, counts)):
        out[layout.indices(r).to(out.device)] = part[:n]
    return out


def all_reduce_mean_(tensors: Sequence[torch.Tensor]) -> None:
    """Average ``tensors`` over ranks in place with **one** collective (flattened into one
    buffer per dtype and device, like one DDP bucket): the gradient sync of an optimizer
    step.  Every rank must pass tensors of the same shapes in the same order.  No-op
    without a group."""
    world = get_world_size()
    if world == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for ts in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        _collective("all_reduce of the gradients", lambda flat=flat: dist.all_reduce(flat))
        flat /= world
        offset = 0
        for t in ts:
            n = t.numel()
            t.detach().copy_(flat[offset : offset + n].view_as(t))
            offset += n


_OPS = {"mean": dist.ReduceOp.SUM, "sum": dist.ReduceOp.SUM,
        "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}  # fmt: skip


def reduce_scalars(
    values: Mapping[str, float], op: str = "mean", device: torch.device | str = "cpu"
) -> dict[str, float]:
    """``values`` combined over ranks (``"mean"``, ``"sum"``, ``"min"``, ``"max"``), in
    float64, one collective for all keys; every rank must pass the same keys in the same
    order.  The mean of per-rank means is the global mean when ranks own equal counts."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    world = get_world_size()
    if world == 1 or not values:
        return {k: float(v) for k, v in values.items()}
    t = torch.tensor([float(v) for v in values.values()], dtype=torch.float64, device=device)
    _collective(f"all_reduce ({op}) of {list(values)[:4]}",
                lambda: dist.all_reduce(t, op=_OPS[op]))  # fmt: skip
    if op == "mean":
        t = t / world
    return dict(zip(values, t.tolist()))
