"""Peak activation memory without a GPU: live bytes saved for backward, packs AND frees.

``torch.cuda.max_memory_allocated`` answers on a GPU; on a CPU the activations a backward
needs are exactly the tensors autograd saves.  :class:`SavedTensorTracker` installs
``saved_tensors_hooks`` whose packed handles count their storage while alive: a storage
is counted once however many ops save it, from its first pack until the last handle of
it is freed (the graph that saved it is released).  ``peak`` is then the largest amount
of saved memory alive at once, through the forward AND the backward — which is what
separates Flow-GRPO's per-step loop (one step alive at a time) from a batched backward,
and what the deferred path's chunk-by-chunk backward is built to match.

Example::

    tracker = SavedTensorTracker(exclude=model.parameters())
    with tracker:
        loss = loss_fn(jagg_trajectory(model, lat, ts, window=4, deferred=True))
        loss.backward()
    print(tracker.peak)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _Handle:
    """What a pack returns: the tensor, counted until this handle is freed."""

    __slots__ = ("key", "t", "tracker")

    def __init__(self, tracker: SavedTensorTracker, t: torch.Tensor) -> None:
        self.t = t
        self.tracker = tracker
        self.key = tracker._add(t)

    def __del__(self) -> None:
        if self.key is not None:
            self.tracker._remove(self.key)


class SavedTensorTracker:
    """Live and peak bytes of tensors saved for backward (see the module docstring).

    exclude: tensors whose storage is not counted (the parameters: every variant saves
    them and they are not activations).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.packed = 0
        self._ctx: Any = None

    def _add(self, t: torch.Tensor) -> int | None:
        try:
            st = t.untyped_storage()
        except Exception:  # tensors without storage (some subclasses)
            return None
        key = st.data_ptr()
        if key in self.exclude:
            return None
        if self.refs.get(key, 0) == 0:
            self.sizes[key] = st.nbytes()
            self.live += st.nbytes()
            self.packed += st.nbytes()
            self.peak = max(self.peak, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        return key

    def _remove(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= self.sizes.pop(key)

    def _pack(self, t: torch.Tensor) -> _Handle:
        return _Handle(self, t)

    @staticmethod
    def _unpack(h: _Handle) -> torch.Tensor:
        return h.t

    def __enter__(self) -> SavedTensorTracker:
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None
