"""Model calls of a JAGG call: whole steps or (step, sample) pairs, batched as asked.

:class:`Caller` runs the model on a call's latents, tiling the per-sample cond
step-major (whole steps) or slicing it (pairs), checks every output and counts the
with-grad calls; the functions below group steps and pairs into calls by ``batching`` and
``chunk_size``.  Used by every executor (``direct``, ``function.run_eager``,
``deferred.run_deferred``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from jagg_autograd.distributed import agree_on_call_count

if TYPE_CHECKING:
    from jagg_autograd.call import JaggCall


class Caller:
    """Runs the model on (step, sample) index pairs, tiling cond step-major."""

    def __init__(self, call: JaggCall) -> None:
        self.model = call.model
        self.latents = call.latents
        self.t_model = call.t_model
        self.cond = call.cond
        self.batched = call.batched
        self.B = call.B
        self.S = tuple(call.latents.shape[2:])
        self.grad_samples = 0
        self.grad_calls = 0
        self.out_dtype: torch.dtype | None = None

    def steps(self, steps: list[int], grad: bool) -> torch.Tensor:
        """Whole steps stacked: (len(steps) * B, *S), step-major."""
        idx = torch.tensor(steps, dtype=torch.long, device=self.latents.device)
        z = self.latents.index_select(0, idx).reshape(len(steps) * self.B, *self.S)
        t = self.t_model.index_select(0, idx).reshape(-1)
        cond = {
            k: (v.repeat(len(steps), *([1] * (v.dim() - 1))) if k in self.batched else v)
            for k, v in self.cond.items()
        }
        return self._call(z, t, cond, grad)

    def pairs(self, ks: torch.Tensor, bs: torch.Tensor, grad: bool) -> torch.Tensor:
        """Arbitrary (step, sample) pairs: (len(ks), *S)."""
        z = self.latents[ks, bs]
        t = self.t_model[ks, bs]
        cond = {k: (v[bs] if k in self.batched else v) for k, v in self.cond.items()}
        return self._call(z, t, cond, grad)

    def all_steps(self, grad: bool, batching: str, chunk_size: int | None) -> torch.Tensor:
        """Every step of the call: (T, B, *S)."""
        T = self.latents.shape[0]
        parts = run_steps(self, list(range(T)), grad, batching, chunk_size)
        return torch.cat([v for _, v in parts]).view(T, self.B, *self.S)

    def _call(
        self, z: torch.Tensor, t: torch.Tensor, cond: dict[str, Any], grad: bool
    ) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            v = self.model(z, t, **cond)
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"model must return a torch.Tensor, got {type(v).__name__}")
        # Checked before the values are copied anywhere: a velocity on another device (meta
        # included) would otherwise be copied into, or left as, uninitialised memory.
        if v.device != z.device:
            raise ValueError(
                f"model returned a tensor on {v.device} for latents on {z.device}; the velocity "
                "must be on the latents' device"
            )
        if v.shape != z.shape:
            raise ValueError(
                f"model returned shape {tuple(v.shape)} for input {tuple(z.shape)}; the "
                "velocity must have the latents' shape"
            )
        if not v.is_floating_point():
            raise TypeError(f"model must return a floating tensor, got {v.dtype}")
        if self.out_dtype is None:
            self.out_dtype = v.dtype
        elif v.dtype != self.out_dtype:
            raise TypeError(f"model returned {v.dtype} after {self.out_dtype} in an earlier call")
        if grad and v.requires_grad:
            self.grad_samples += v.shape[0]
            self.grad_calls += 1
        return v


def chunks(items: list[int], per: int) -> list[list[int]]:
    return [items[i : i + per] for i in range(0, len(items), per)]


def run_steps(
    caller: Caller, steps: list[int], grad: bool, batching: str, chunk_size: int | None
) -> list[tuple[list[int], torch.Tensor]]:
    """Forward whole steps; per_step: one call of B each; stacked: as few as chunk_size allows."""
    if not steps:
        return []
    if batching == "per_step":
        groups = [[k] for k in steps]
    elif chunk_size is not None and chunk_size < caller.B:
        # A chunk smaller than one step's batch: split every step's samples.
        return run_step_pieces(caller, steps, grad, chunk_size)
    else:
        per = len(steps) if chunk_size is None else chunk_size // caller.B
        groups = chunks(steps, per)
    return [(g, caller.steps(g, grad)) for g in groups]


def run_step_pieces(
    caller: Caller, steps: list[int], grad: bool, chunk_size: int
) -> list[tuple[list[int], torch.Tensor]]:
    B = caller.B
    out = []
    for k in steps:
        parts = []
        for lo in range(0, B, chunk_size):
            bs = torch.arange(lo, min(lo + chunk_size, B), device=caller.latents.device)
            parts.append(caller.pairs(torch.full_like(bs, k), bs, grad))
        out.append(([k], torch.cat(parts)))
    return out


def run_pairs_grad(
    caller: Caller,
    ks: torch.Tensor,
    bs: torch.Tensor,
    batching: str,
    chunk_size: int | None,
    collective: bool = False,
) -> torch.Tensor | None:
    """With-grad recomputation of the routed-out (step, sample) pairs, step-major.

    ``collective``: the ranks route differently but must call the model equally often
    (FSDP).  They agree on the largest number of calls with one all-reduce, and a rank
    with fewer pads with one-sample calls of pair (0, 0) whose rows come after the real
    ones and get a zero gradient (``JaggFunction`` gives rows past the plan's none).
    """
    n = ks.numel()
    if batching == "per_step":
        bounds = torch.nonzero(ks[1:] != ks[:-1]).flatten().add(1).tolist() if n else []
        cuts = [0, *bounds, n] if n else [0]
    else:
        per = max(n, 1) if chunk_size is None else chunk_size
        cuts = [*range(0, n, per), n] if n else [0]
    n_calls = len(cuts) - 1
    if collective:
        # Stacked without chunk_size: every rank pads to the largest pair count, so the
        # call count (one) agrees; otherwise pad the count of calls.
        pad = agree_on_call_count(n_calls) - n_calls
    else:
        pad = 0
    parts = [caller.pairs(ks[lo:hi], bs[lo:hi], True) for lo, hi in zip(cuts[:-1], cuts[1:])]
    zero = torch.zeros(1, dtype=torch.long, device=ks.device)
    parts += [caller.pairs(zero, zero, True) for _ in range(pad)]
    if not parts:  # no rank routed anything
        return None
    return torch.cat(parts) if len(parts) > 1 else parts[0]
