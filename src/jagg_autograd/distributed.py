"""Gradient synchronisation once per optimizer step, not once per JAGG window.

JAGG already turns a window's W backward passes into one.  Under data parallelism each
backward normally also triggers a gradient all-reduce (DDP) or reduce-scatter (FSDP); when
an optimizer step accumulates several windows (one ``loss.backward()`` per window, to keep
only one window's activations alive), all but the last of those collectives are wasted.
The helpers here make the cheap path the easy one:

* :func:`accumulate_windows` -- iterate over the windows of one optimizer step; every
  window but the last runs with gradient sync off (DDP/FSDP1 ``no_sync()``, FSDP2
  ``set_requires_gradient_sync(False)``), so the step does exactly one sync.
* :func:`sync_last` / :func:`gradient_sync` -- the same as context managers, for loops
  that are not a simple ``range``.
* :class:`AllReduceCounter` -- a DDP communication hook that counts the gradient
  all-reduces (buckets) per backward, to check the claim on your own model.
* :func:`check_ddp_for_jagg` -- flags DDP settings under which JAGG's data-dependent
  forward calls can desynchronise collectives across ranks.

Typical use (DDP; ``windows`` are slices of a rollout, see docs/distributed.md)::

    ddp = DistributedDataParallel(model, forward_sync_buffers=False)
    for lat, ts, adv in loader:
        for i in accumulate_windows(ddp, len(windows)):
            lo, hi = windows[i]
            v = jagg_window(ddp, lat[lo:hi], ts[lo:hi], router=CosineRouter(0.9))
            (loss_fn(v, adv) / len(windows)).backward()   # synced only at i == last
        opt.step(); opt.zero_grad()

The one-backward-per-step alternative needs no helper: ``jagg_trajectory`` over the
whole trajectory (or the sum of several ``jagg_window`` losses) followed by a single
``backward()`` already syncs once.

Why the forward pass matters: DDP decides whether a backward will all-reduce when the
*forward* runs (``no_sync`` is read in the forward).  JAGG calls the model several times per
window (the anchors with grad, the interior steps under ``no_grad``, and -- only on ranks
whose router sent samples to the exact gradient -- a with-grad recomputation), so the
whole ``jagg_window`` call of a non-final window must be inside the ``no_sync`` region, and
the final window's call outside it.  :func:`accumulate_windows` does exactly that.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import sys
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "AllReduceCounter",
    "WindowLoop",
    "accumulate_windows",
    "check_ddp_for_jagg",
    "gradient_sync",
    "sync_last",
]


def _is_ddp(model: object) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def _is_fsdp2(model: object) -> bool:
    # fully_shard() swaps the module's class for an FSDPModule subclass.
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - very old torch
        return False
    return isinstance(model, FSDPModule)


def _is_fsdp1(model: object) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FullyShardedDataParallel)


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Turn gradient synchronisation of ``model``'s backward on or off inside the block.

    ``model`` may be a ``DistributedDataParallel`` or FSDP1 wrapper (uses ``no_sync()``),
    an FSDP2 ``fully_shard``-ed module (uses ``set_requires_gradient_sync``; restored to
    ``True`` on exit), any object with a ``no_sync()`` context manager (e.g. an
    accelerate-prepared model), or a plain module (no-op).  ``enabled=True`` is a no-op.

    DDP reads the flag at *forward* time: run the model's forward (the ``jagg_window`` /
    ``jagg_trajectory`` call) inside the block; the backward may run inside or after it.
    FSDP2 reads it in backward: keep the backward inside the block too.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {enabled!r}")
    if enabled:
        yield
        return
    if _is_fsdp2(model):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    no_sync = getattr(model, "no_sync", None)
    if _is_ddp(model) or _is_fsdp1(model) or callable(no_sync):
        with model.no_sync():
            yield
        return
    yield


def sync_last(model: Any, index: int, n_windows: int) -> contextlib.AbstractContextManager[None]:
    """Context manager for window ``index`` of ``n_windows``: sync only when it is the last.

    Equivalent to ``gradient_sync(model, enabled=(index == n_windows - 1))``.
    """
    _check_count(n_windows)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n_windows:
        raise ValueError(f"index must be an int in [0, {n_windows}), got {index!r}")
    return gradient_sync(model, enabled=index == n_windows - 1)


def accumulate_windows(model: Any, n_windows: int) -> WindowLoop:
    """Yield ``0 .. n_windows-1``; the loop body runs with gradient sync off except the last.

    Put one window's forward (``jagg_window``/``jagg_trajectory`` on ``model``) AND its
    ``backward()`` in the loop body; after the loop the gradients of all windows are
    accumulated and synchronised exactly once (one DDP all-reduce per bucket, one FSDP
    reduce-scatter per parameter group), so the optimizer step can follow.  Both forms work::

        for i in accumulate_windows(ddp, n): ...
        with accumulate_windows(ddp, n) as windows:   # closes the loop on exit
            for i in windows: ...

    Leaving the loop early (``break``, ``return``, an exception) is safe by construction,
    also while the iterator is still referenced: for an ``nn.Module`` (DDP, FSDP1, FSDP2,
    an accelerate-prepared model) sync is switched off by a forward pre-hook, only for
    forwards made from inside the body of a non-last window of the ``for`` loop that
    iterates it (checked on the call stack: the loop's frame must be running an
    instruction of the loop body).  The first forward after leaving the loop switches sync
    back on, so the next step syncs normally.  Gradients accumulated by the abandoned
    windows are then local to each rank and should be zeroed.

    Limits: iterated through a Python generator (e.g. ``tqdm(...)``), the body is not
    recognised and every window syncs (correct, but no saving); iterated with ``next()``,
    sync stays off for forwards of the calling function until the next ``next()`` /
    ``close()``.  For a model that is not an ``nn.Module`` (no hook point), ``no_sync()`` is
    entered at ``next()`` and left at the following ``next()``, at ``close()`` (the ``with``
    form) or when the iterator is garbage-collected.

    Scale each window's loss by ``1 / n_windows`` (or by the step's sample count) yourself:
    this helper changes when gradients are communicated, never their values.
    """
    return WindowLoop(model, n_windows)


# The loop currently driving each model's windows (weak both ways: neither keeps the other
# alive).  A new loop on the same model supersedes an abandoned one.
_ACTIVE_LOOPS: weakref.WeakKeyDictionary[Any, weakref.ref[WindowLoop]] = (
    weakref.WeakKeyDictionary()
)


@functools.lru_cache(maxsize=256)
def _for_loop_body(code: types.CodeType, lasti: int) -> tuple[int, int] | None:
    """(start, end) bytecode offsets of the ``for`` loop whose FOR_ITER is at ``lasti``.

    The body's instructions lie strictly between FOR_ITER and its jump target (where the
    loop ends); ``break``/``return`` leave to offsets outside.  None when the iterator was
    advanced by something else (``next()``, a comprehension in another frame ...).
    """
    for ins in dis.get_instructions(code):
        if ins.offset == lasti:
            if ins.opname == "FOR_ITER" and isinstance(ins.argval, int):
                return lasti, ins.argval
            return None
    return None


class WindowLoop:
    """The iterator of :func:`accumulate_windows` (also a context manager that closes it)."""

    def __init__(self, model: Any, n_windows: int) -> None:
        _check_count(n_windows)
        self._model = model
        self._n = n_windows
        self._next = 0
        self._index: int | None = None  # the window whose body runs
        self._hooked = isinstance(model, nn.Module)
        self._loop: tuple[int, types.CodeType, tuple[int, int] | None] | None = None
        self._hook: Any = None
        self._held: contextlib.AbstractContextManager[None] | None = None

    def __iter__(self) -> WindowLoop:
        return self

    def __enter__(self) -> WindowLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> int:
        if self._next >= self._n:
            self.close()
            raise StopIteration
        i = self._index = self._next
        self._next += 1
        last = i == self._n - 1
        if not self._hooked:
            self._release()
            if not last:
                self._hold()
            return i
        if last:
            self._release()  # the last window syncs; its forwards find nothing to release
        caller = sys._getframe(1)  # the frame iterating us (FOR_ITER runs no Python frame)
        # Identity by id + code, not a reference: holding the frame would keep its locals
        # (tensors) alive after it returns.
        self._loop = (id(caller), caller.f_code, _for_loop_body(caller.f_code, caller.f_lasti))
        del caller
        self._activate()
        return i

    def close(self) -> None:
        """End the loop: sync back on, hook removed.  Idempotent."""
        self._next = self._n
        self._deactivate()

    def __del__(self) -> None:
        try:
            self._deactivate()
        except Exception:  # interpreter shutdown: nothing left to restore
            pass

    # -- internals

    def _activate(self) -> None:
        prev_ref = _ACTIVE_LOOPS.get(self._model)
        prev = prev_ref() if prev_ref is not None else None
        if prev is not None and prev is not self:
            prev._deactivate()
        _ACTIVE_LOOPS[self._model] = weakref.ref(self)
        if self._hook is None:
            self._hook = self._model.register_forward_pre_hook(
                functools.partial(_loop_pre_forward, weakref.ref(self))
            )

    def _deactivate(self) -> None:
        self._release()
        self._index = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        ref = _ACTIVE_LOOPS.get(self._model) if self._hooked else None
        if ref is not None and ref() is self:
            del _ACTIVE_LOOPS[self._model]

    def _hold(self) -> None:
        if self._held is None:
            cm = gradient_sync(self._model, enabled=False)
            cm.__enter__()
            self._held = cm

    def _release(self) -> None:
        if self._held is not None:
            cm, self._held = self._held, None
            cm.__exit__(None, None, None)

    def _in_body(self) -> bool:
        """Is the current call made from inside the loop body (the loop frame on the stack,
        at an instruction of the body)?"""
        if self._loop is None:
            return False
        fid, code, body = self._loop
        f: types.FrameType | None = sys._getframe(1)
        while f is not None:
            if id(f) == fid and f.f_code is code:
                return body is None or body[0] < f.f_lasti < body[1]
            f = f.f_back
        return False

    def _on_forward(self) -> None:
        if self._index is None:
            return
        if not self._in_body():
            # The loop was left (break/return/exception) with the iterator still alive:
            # this forward belongs to something else and syncs normally.
            self._deactivate()
        elif self._index < self._n - 1:
            self._hold()  # kept through the backward (FSDP reads the flag there)
        else:
            self._release()


def _loop_pre_forward(ref: weakref.ref[WindowLoop], module: nn.Module, args: Any) -> None:
    loop = ref()
    if loop is not None:
        loop._on_forward()


def _check_count(n_windows: object) -> None:
    if isinstance(n_windows, bool) or not isinstance(n_windows, int) or n_windows < 1:
        raise ValueError(f"n_windows must be a positive int, got {n_windows!r}")


class AllReduceCounter:
    """A DDP communication hook that all-reduces (mean) like the default and counts buckets.

    ``counter = AllReduceCounter.register(ddp_model)`` installs it (DDP allows one comm hook
    per model, registered before the first backward).  ``counter.calls`` is the total number
    of bucket all-reduces so far; ``counter.numel`` the number of gradient elements sent.
    Compare ``calls`` before and after an optimizer step to measure syncs per step.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.numel = 0

    @classmethod
    def register(cls, ddp_model: nn.parallel.DistributedDataParallel) -> AllReduceCounter:
        """Create a counter and register it as ``ddp_model``'s communication hook."""
        if not _is_ddp(ddp_model):
            raise TypeError(f"expected a DistributedDataParallel, got {type(ddp_model).__name__}")
        counter = cls()
        ddp_model.register_comm_hook(counter, _counting_allreduce_hook)
        return counter

    def reset(self) -> None:
        """Zero the counts."""
        self.calls = 0
        self.numel = 0


def _counting_allreduce_hook(
    state: AllReduceCounter, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    state.calls += 1
    state.numel += bucket.buffer().numel()
    return allreduce_hook(None, bucket)


# DDP inspects the hook's annotations and rejects the strings that
# ``from __future__ import annotations`` leaves there: give it the real objects.
_counting_allreduce_hook.__annotations__ = {
    "state": AllReduceCounter,
    "bucket": torch.distributed.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


BUFFER_SYNC_WITH_ROUTER = (
    "DDP buffer sync (forward_sync_buffers/broadcast_buffers) with module buffers and "
    "a JAGG router: ranks that recompute routed-out samples make an extra forward, "
    "which can desynchronise the buffer broadcast; pass forward_sync_buffers=False "
    "(broadcast_buffers=False before torch 2.13; with accelerate: "
    "DistributedDataParallelKwargs(broadcast_buffers=False)) to DistributedDataParallel"
)


def ddp_syncs_buffers(model: object) -> bool:
    """True for a DDP model that broadcasts module buffers in its forward (and has some).

    DDP decides whether a forward broadcasts from whether the *previous* forward ran with
    grad; a router's with-grad recomputation on only some ranks makes the ranks disagree,
    so the broadcasts stop pairing up (a hang, or buffers received by the wrong
    collective).  ``jagg_window``/``jagg_trajectory`` refuse such a model with a router.
    """
    if not _is_ddp(model):
        return False
    # torch >= 2.13 calls it forward_sync_buffers (broadcast_buffers is deprecated).
    sync_bufs = getattr(model, "forward_sync_buffers", None)
    if sync_bufs is None:
        sync_bufs = getattr(model, "broadcast_buffers", True)
    return bool(sync_bufs) and any(True for _ in model.module.buffers())


def check_ddp_for_jagg(
    model: nn.parallel.DistributedDataParallel, *, router: object = None
) -> list[str]:
    """Warn about DDP settings that can desynchronise ranks under JAGG; return the messages.

    * buffer sync on (``forward_sync_buffers=True``, formerly ``broadcast_buffers``) with
      buffers and a router (``jagg_window``/``jagg_trajectory`` refuse it with a
      ``ValueError``): DDP broadcasts buffers in a
      forward that follows a with-grad forward.  The router's exact recomputation is an extra
      with-grad forward on only the ranks that routed samples, so ranks disagree on
      whether the next forward broadcasts: a collective mismatch (hang or wrong buffers).
      Use ``forward_sync_buffers=False`` (``broadcast_buffers=False`` before torch 2.13;
      DiT buffers are usually constants) or no router.
    * ``static_graph=True``: JAGG may call the model a data-dependent number of times
      with grad before one backward; DDP's static-graph mode assumes a fixed graph.
    """
    msgs: list[str] = []
    if not _is_ddp(model):
        return msgs
    if router is not None and ddp_syncs_buffers(model):
        msgs.append(BUFFER_SYNC_WITH_ROUTER)
    if getattr(model, "static_graph", False):
        msgs.append(
            "DDP(static_graph=True): JAGG's number of with-grad forwards per backward is "
            "data dependent with a router; use static_graph=False"
        )
    for m in msgs:
        warnings.warn(m, RuntimeWarning, stacklevel=2)
    return msgs


# ----------------------------------------------------- what a JAGG call needs of a wrapper


def ddp_for_deferred(model: object) -> Any:
    """The DDP wrapper (None for other models); FSDP is refused for deferred=True."""
    if _is_fsdp2(model) or _is_fsdp1(model):
        raise ValueError(
            "deferred=True does not support FSDP-sharded models yet (their parameters are "
            "gathered and reduced by hooks the deferred backward bypasses): use "
            "deferred=False with FSDP, or DDP"
        )
    return model if _is_ddp(model) else None


def ddp_pre_forward(ddp: nn.parallel.DistributedDataParallel) -> nn.Module:
    """DDP's own forward bookkeeping, once, for a deferred call; returns the module to run.

    The deferred backward runs its chunks on ``ddp.module``; what a forward of ``ddp``
    does before its module call (its pre-hooks -- ``accumulate_windows``' sync switch --
    and the reducer's preparation) happens here instead.
    """
    for hook in list(ddp._forward_pre_hooks.values()):
        hook(ddp, ())
    ddp._pre_forward()
    return ddp.module


def ddp_post_forward(ddp: nn.parallel.DistributedDataParallel, out: torch.Tensor) -> torch.Tensor:
    """What DDP's forward does after its module call: with sync on, the reducer expects
    this iteration's gradients, which reach the parameters when the deferred Function
    returns them (the chunks run on ``ddp.module``, outside the reducer)."""
    return ddp._post_forward(out) if out.requires_grad else out


def fsdp_collective(model: object) -> bool:
    """FSDP in a multi-rank group: every rank must make the same sequence of model calls
    (each call all-gathers parameters, each backward through it reduce-scatters)."""
    import torch.distributed as dist

    return (
        (_is_fsdp2(model) or _is_fsdp1(model))
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def agree_on_call_count(n_calls: int) -> int:
    """The largest call count over the ranks (one all-reduce): a collective call pads to it."""
    import torch.distributed as dist

    agree = torch.tensor([n_calls], dtype=torch.long)
    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
    return int(agree)
