"""Triton kernel for JAGG's t-weighted mixing of upstream gradients.

For a trajectory of T steps with anchor steps a_0 = 0 < a_1 < ... < a_{n-1} = T-1, every
step k lies in the span [a_j, a_{j+1}) of exactly one anchor a_j ("current") and the
next one ("next").  The composite gradient of anchor j is

    G_j = sum_{k : cur(k) = j} w_cur[k] * g_k  +  sum_{k : cur(k) = j-1} w_nxt[k] * g_k

(for an anchor step w_cur = 1, w_nxt = 0; for an interpolated step w_cur = 1 - alpha_k,
w_nxt = alpha_k; a step routed to the exact gradient has both weights 0).  One program
owns a (sample, feature block) tile and sweeps the T steps once, so every g_k is read
exactly once and every G_j written exactly once, without atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _jagg_mix_kernel(
    g_ptr,
    w_cur_ptr,
    w_nxt_ptr,
    slot_ptr,
    out_ptr,
    T,
    B,
    N,
    n_anchors,
    stride_gt,
    stride_gb,
    stride_gn,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc_cur = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_nxt = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Walk pointers forward by one step each iteration: 64-bit pointer arithmetic, so large
    # T * stride products never pass through a 32-bit index.
    g_ptrs = g_ptr + b * stride_gb + cols * stride_gn
    wc_ptr = w_cur_ptr + b
    wn_ptr = w_nxt_ptr + b
    for k in range(0, T):
        # slot[k] = j > 0 when step k is anchor j: anchor j-1 is complete, emit it and shift.
        slot = tl.load(slot_ptr + k).to(tl.int64)
        # Broadcast before comparing: a block-shaped predicate keeps the masked store and
        # the selects below uniform on every backend (the interpreter included).
        is_new = (tl.zeros([BLOCK_N], dtype=tl.int64) + slot) > 0
        prev = tl.maximum(slot - 1, 0)
        tl.store(
            out_ptr + (prev * B + b) * N + cols,
            acc_cur.to(out_ptr.dtype.element_ty),
            mask=mask & is_new,
        )
        acc_cur = tl.where(is_new, acc_nxt, acc_cur)
        acc_nxt = tl.where(is_new, 0.0, acc_nxt)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        wc = tl.load(wc_ptr)
        wn = tl.load(wn_ptr)
        # acc_cur += (1 - alpha_k) g_k ; acc_nxt += alpha_k g_k  (fp32 accumulation)
        acc_cur += wc * g
        acc_nxt += wn * g
        g_ptrs += stride_gt
        wc_ptr += B
        wn_ptr += B
    # b is int64, so the whole offset is computed in 64 bits.
    last_off = ((n_anchors - 1) * B + b) * N
    tl.store(out_ptr + last_off + cols, acc_cur.to(out_ptr.dtype.element_ty), mask=mask)


def jagg_mix_triton(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    anchors: torch.Tensor,
    *,
    block_n: int = 1024,
) -> torch.Tensor:
    """Launch ``_jagg_mix_kernel``; same contract as ``jagg_autograd.mix.jagg_mix_ref``.

    grad: (T, B, N) any strides, fp16/bf16/fp32; w_cur, w_nxt: (T, B) float32;
    anchors: (n,) int64, sorted, anchors[0] = 0, anchors[-1] = T - 1.
    Returns (n, B, N) in grad's dtype.
    """
    T, B, N = grad.shape
    n = anchors.numel()
    slot = torch.full((T,), -1, dtype=torch.int32, device=grad.device)
    slot[anchors] = torch.arange(n, dtype=torch.int32, device=grad.device)
    out = torch.empty((n, B, N), dtype=grad.dtype, device=grad.device)
    w_cur = w_cur.to(torch.float32).contiguous()
    w_nxt = w_nxt.to(torch.float32).contiguous()
    block = min(block_n, triton.next_power_of_2(max(N, 16)))
    grid = (B, triton.cdiv(N, block))
    _jagg_mix_kernel[grid](
        grad,
        w_cur,
        w_nxt,
        slot,
        out,
        T,
        B,
        N,
        n,
        grad.stride(0),
        grad.stride(1),
        grad.stride(2),
        BLOCK_N=block,
        num_warps=4 if block >= 512 else 2,
    )
    return out
