"""The JAGG mixing op: fold per-step upstream gradients onto the anchor (step, sample) pairs.

The autograd Functions (``function.py``, ``deferred.py``) call it in their backward; the
Triton kernel is ``jagg_autograd.kernels.jagg_mix``, and :func:`jagg_mix_slots_ref` here
is the CPU path, the test oracle and the benchmark baseline.

Anchors are given either as shared steps (a 1-D tensor: every sample has the same anchor
steps, today's uniform layout) or per sample (a (T, B) bool mask: the adaptive placement,
a router's routed-out steps).  Internally both become a (T, B) *slot table*: the output
row of each anchor pair, -1 elsewhere.
"""

from __future__ import annotations

import torch

from jagg_autograd._backend import resolve_backend


def _check_mix_args(
    grad: torch.Tensor, w_cur: torch.Tensor, w_nxt: torch.Tensor, anchors: torch.Tensor
) -> None:
    if not isinstance(grad, torch.Tensor) or grad.dim() != 3 or not grad.is_floating_point():
        raise ValueError("grad must be a floating (T, B, N) tensor")
    T, B, _ = grad.shape
    for name, w in (("w_cur", w_cur), ("w_nxt", w_nxt)):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (T, B):
            raise ValueError(f"{name} must be a ({T}, {B}) tensor, got {getattr(w, 'shape', w)}")
    if not isinstance(anchors, torch.Tensor):
        raise TypeError(f"anchors must be a tensor, got {type(anchors).__name__}")
    if anchors.dtype == torch.bool:
        if tuple(anchors.shape) != (T, B):
            raise ValueError(
                f"a bool anchors mask must be ({T}, {B}), got {tuple(anchors.shape)}"
            )
        return
    if anchors.is_floating_point() or anchors.is_complex():
        raise TypeError(
            f"anchors must be integer steps (or a (T, B) bool mask), got {anchors.dtype}"
        )
    if anchors.dim() != 1 or anchors.numel() < 1:
        raise ValueError("anchors must be a non-empty 1-D integer tensor or a (T, B) bool mask")
    a = anchors.tolist()
    if a[0] != 0 or a[-1] != T - 1 or any(x >= y for x, y in zip(a, a[1:])):
        raise ValueError(f"anchors must be strictly increasing from 0 to T-1={T - 1}, got {a}")


def anchor_slots(anchors: torch.Tensor, T: int, B: int) -> tuple[torch.Tensor, int]:
    """(T, B) int64 slot table and row count for shared anchor steps or a (T, B) mask.

    Shared steps a_0 < ... < a_{n-1}: slot[a_j, b] = j * B + b, so the (n * B, N) output is
    the (n, B, N) layout of one stacked anchor call.  A mask: rows in step-major order of
    ``mask.nonzero()`` (all samples of a step, steps in order).
    """
    if anchors.dtype == torch.bool:
        slots = torch.full((T, B), -1, dtype=torch.long, device=anchors.device)
        n = int(anchors.sum())
        slots[anchors] = torch.arange(n, device=anchors.device)
        return slots, n
    n = anchors.numel()
    slots = torch.full((T, B), -1, dtype=torch.long, device=anchors.device)
    rows = torch.arange(n * B, device=anchors.device).view(n, B)
    slots[anchors.to(torch.long)] = rows
    return slots, n * B


def anchor_neighbours(anchor_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (step, sample): the last anchor step at or before k (-1: none) and the first
    anchor step at or after k (T: none), both (T, B) int64, for a (T, B) bool mask."""
    T, B = anchor_mask.shape
    steps = torch.arange(T, device=anchor_mask.device).unsqueeze(1).expand(T, B)
    last = torch.where(anchor_mask, steps, -1).cummax(0).values
    first = torch.where(anchor_mask, steps, T).flip(0).cummin(0).values.flip(0)
    return last, first


def jagg_mix_slots_ref(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    slots: torch.Tensor,
    n_out: int,
) -> torch.Tensor:
    """Pure-PyTorch reference of the mixing op on a slot table.

    grad: (T, B, N); w_cur, w_nxt: (T, B); slots: (T, B) integer output row of every
    anchor pair (-1 elsewhere).  For sample b let cur(k) be the row of the last anchor at
    or before step k and nxt(k) the row of the first anchor after it:

        G[r] = sum_{k: cur(k)=r} w_cur[k] g[k]  +  sum_{k: nxt(k)=r} w_nxt[k] g[k]

    Steps before a sample's first anchor contribute nothing (their weights must be 0, and
    after its last anchor w_nxt must be 0).  Accumulates in float32 (float64 stays float64)
    and returns (n_out, N) in grad's dtype.
    """
    T, B, N = grad.shape
    dev = grad.device
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    slots = slots.to(dev, torch.long)
    # Last anchor step at or before k (-1: none) and first anchor step after k (T: none).
    last, after = anchor_neighbours(slots >= 0)
    nxt_step = torch.cat([after[1:], torch.full((1, B), T, device=dev, dtype=torch.long)])
    cols = torch.arange(B, device=dev).unsqueeze(0).expand(T, B)
    pad = torch.cat([slots, torch.full((1, B), -1, device=dev, dtype=torch.long)])
    cur_row = pad[last.clamp(min=0).masked_fill(last < 0, T), cols]
    nxt_row = pad[nxt_step, cols]
    g = grad.to(acc)
    out = torch.zeros((n_out + 1, N), dtype=acc, device=dev)
    # Rows -1 (no anchor on that side) land in the scratch row n_out.
    sink = torch.full_like(cur_row, n_out)
    out.index_add_(
        0,
        torch.where(cur_row >= 0, cur_row, sink).flatten(),
        (w_cur.to(acc).unsqueeze(-1) * g).reshape(T * B, N),
    )
    out.index_add_(
        0,
        torch.where(nxt_row >= 0, nxt_row, sink).flatten(),
        (w_nxt.to(acc).unsqueeze(-1) * g).reshape(T * B, N),
    )
    return out[:n_out].to(grad.dtype)


def jagg_mix_ref(
    grad: torch.Tensor, w_cur: torch.Tensor, w_nxt: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Reference of :func:`jagg_mix`.

    grad: (T, B, N); w_cur, w_nxt: (T, B); anchors: (n,) sorted steps, 0 and T-1 included
    (every sample's anchors), or a (T, B) bool mask of per-sample anchor pairs.
    With cur(k) the last anchor at or before step k (index j) and the next one j + 1:

        G[j] = sum_{k: cur(k)=j} w_cur[k] g[k]  +  sum_{k: cur(k)=j-1} w_nxt[k] g[k]

    Returns (n, B, N) for shared steps, (n_pairs, N) in step-major order for a mask, in
    grad's dtype.  For one window (anchors = [0, W-1], w_cur = 1-alpha, w_nxt = alpha)
    this is G_0 = sum_k (1-alpha_k) g_k and G_{W-1} = sum_k alpha_k g_k.
    """
    T, B, N = grad.shape
    slots, n_out = anchor_slots(anchors.to(grad.device), T, B)
    out = jagg_mix_slots_ref(grad, w_cur, w_nxt, slots, n_out)
    return out if anchors.dtype == torch.bool else out.view(-1, B, N)


def jagg_mix(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    anchors: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Fold upstream gradients onto anchors: (T, B, N) -> (n, B, N) or (n_pairs, N).

    See :func:`jagg_mix_ref` for the math.  ``backend``: "torch", "triton" or "auto".
    """
    _check_mix_args(grad, w_cur, w_nxt, anchors)
    T, B, N = grad.shape
    slots, n_out = anchor_slots(anchors.to(grad.device), T, B)
    out = mix_slots(grad, w_cur, w_nxt, slots, n_out, backend)
    return out if anchors.dtype == torch.bool else out.view(-1, B, N)


def mix_slots(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    slots: torch.Tensor,
    n_out: int,
    backend: str,
) -> torch.Tensor:
    """Unchecked dispatch on a slot table: (T, B, N) -> (n_out, N).

    The autograd Functions build their arguments themselves; skipping the checks there
    keeps the backward free of host syncs.
    """
    if resolve_backend(backend, grad.device, grad.dtype) == "triton":
        from jagg_autograd._custom_ops import jagg_mix_op

        return jagg_mix_op(grad, w_cur, w_nxt, slots.to(grad.device), n_out)
    return jagg_mix_slots_ref(grad, w_cur, w_nxt, slots, n_out)
