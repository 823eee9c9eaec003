"""The JAGG mixing op: fold per-step upstream gradients onto the anchor steps.

The autograd Function (``function.py``) calls :func:`jagg_mix` in its backward; the
Triton kernel is ``jagg_autograd.kernels.jagg_mix``, and :func:`jagg_mix_ref` here is the
CPU path, the test oracle and the benchmark baseline.
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
    if not isinstance(anchors, torch.Tensor) or anchors.dim() != 1 or anchors.numel() < 1:
        raise ValueError("anchors must be a non-empty 1-D integer tensor")
    a = anchors.tolist()
    if a[0] != 0 or a[-1] != T - 1 or any(x >= y for x, y in zip(a, a[1:])):
        raise ValueError(f"anchors must be strictly increasing from 0 to T-1={T - 1}, got {a}")


def jagg_mix_ref(
    grad: torch.Tensor, w_cur: torch.Tensor, w_nxt: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """Pure-PyTorch reference of the mixing op.

    grad: (T, B, N); w_cur, w_nxt: (T, B); anchors: (n,) sorted steps, 0 and T-1 included.
    With cur(k) the last anchor at or before step k (its index j in ``anchors``):

        G[j] = sum_{k: cur(k)=j} w_cur[k] g[k]  +  sum_{k: cur(k)=j-1} w_nxt[k] g[k]

    Accumulates in float32 (float64 stays float64) and returns (n, B, N) in grad's dtype.
    For one window (anchors = [0, W-1], w_cur = 1-alpha, w_nxt = alpha) this is
    G_0 = sum_k (1-alpha_k) g_k and G_{W-1} = sum_k alpha_k g_k.
    """
    T, B, N = grad.shape
    n = anchors.numel()
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    g = grad.to(acc)
    is_anchor = torch.zeros(T, dtype=torch.long, device=grad.device)
    is_anchor[anchors.to(grad.device)] = 1
    cur = torch.cumsum(is_anchor, 0) - 1
    out = torch.zeros((n + 1, B, N), dtype=acc, device=grad.device)
    out.index_add_(0, cur, w_cur.to(acc).unsqueeze(-1) * g)
    # The last anchor has no "next"; its w_nxt is 0 by construction and lands in row n.
    out.index_add_(0, cur + 1, w_nxt.to(acc).unsqueeze(-1) * g)
    return out[:n].to(grad.dtype)


def jagg_mix(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    anchors: torch.Tensor,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """Fold upstream gradients onto anchors: (T, B, N) -> (n, B, N).

    See :func:`jagg_mix_ref` for the math.  ``backend``: "torch", "triton" or "auto".
    """
    _check_mix_args(grad, w_cur, w_nxt, anchors)
    return _jagg_mix_unchecked(grad, w_cur, w_nxt, anchors, backend)


def _jagg_mix_unchecked(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    anchors: torch.Tensor,
    backend: str,
) -> torch.Tensor:
    # The autograd Function builds its arguments itself; skipping the checks there keeps
    # the backward free of host syncs.
    if resolve_backend(backend, grad.device, grad.dtype) == "triton":
        from jagg_autograd._custom_ops import jagg_mix_op

        return jagg_mix_op(grad, w_cur, w_nxt, anchors.to(grad.device))
    return jagg_mix_ref(grad, w_cur, w_nxt, anchors)
