"""Triton kernel for JAGG's t-weighted mixing of upstream gradients.

Every sample b has its own anchor steps (the (step, sample) pairs run with grad); a
(T, B) slot table gives each anchor pair its output row (-1 elsewhere).  For sample b,
every step k lies between the last anchor at or before it ("current", row cur(k, b)) and
the next one ("next").  The composite gradient of anchor row r is

    G_r = sum_{k : cur(k,b) = r} w_cur[k,b] g_{k,b}  +  sum_{k : nxt(k,b) = r} w_nxt[k,b] g_{k,b}

(anchor: w_cur = 1, w_nxt = 0; interpolated step: 1 - alpha_k and alpha_k; a step outside
the sample's first..last anchor carries zero weights).  One program owns a (sample,
feature block) tile and sweeps the T steps once, so every g is read exactly once and every
G_r written exactly once, without atomics.  The shared layout of a trajectory (anchor
steps a_j, slot j * B + b) is the special case whose output is (n, B, N).
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
    # Row of the current anchor (-1 before the sample's first one), broadcast to the block.
    cur_row = tl.zeros([BLOCK_N], dtype=tl.int64) - 1
    # Walk pointers forward by one step each iteration: 64-bit pointer arithmetic, so large
    # T * stride products never pass through a 32-bit index.
    g_ptrs = g_ptr + b * stride_gb + cols * stride_gn
    wc_ptr = w_cur_ptr + b
    wn_ptr = w_nxt_ptr + b
    sl_ptr = slot_ptr + b
    for _k in range(0, T):
        # slot >= 0: step k is an anchor of sample b.  The previous anchor is complete:
        # emit it (if there was one), then the "next" accumulator becomes the current one.
        # Broadcast before comparing: a block-shaped predicate keeps the masked store and
        # the selects uniform on every backend (the interpreter included).
        slot = tl.zeros([BLOCK_N], dtype=tl.int64) + tl.load(sl_ptr).to(tl.int64)
        is_new = slot >= 0
        tl.store(
            out_ptr + tl.maximum(cur_row, 0) * N + cols,
            acc_cur.to(out_ptr.dtype.element_ty),
            mask=mask & is_new & (cur_row >= 0),
        )
        acc_cur = tl.where(is_new, acc_nxt, acc_cur)
        acc_nxt = tl.where(is_new, 0.0, acc_nxt)
        cur_row = tl.where(is_new, slot, cur_row)
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        wc = tl.load(wc_ptr)
        wn = tl.load(wn_ptr)
        # acc_cur += (1 - alpha_k) g_k ; acc_nxt += alpha_k g_k  (fp32 accumulation)
        acc_cur += wc * g
        acc_nxt += wn * g
        g_ptrs += stride_gt
        wc_ptr += B
        wn_ptr += B
        sl_ptr += B
    # The last anchor of the sample: everything after it has zero weight.
    tl.store(
        out_ptr + tl.maximum(cur_row, 0) * N + cols,
        acc_cur.to(out_ptr.dtype.element_ty),
        mask=mask & (cur_row >= 0),
    )


def jagg_mix_triton(
    grad: torch.Tensor,
    w_cur: torch.Tensor,
    w_nxt: torch.Tensor,
    slots: torch.Tensor,
    n_out: int,
    *,
    block_n: int = 1024,
) -> torch.Tensor:
    """Launch ``_jagg_mix_kernel``; same contract as ``jagg_autograd.mix.jagg_mix_slots_ref``.

    grad: (T, B, N) any strides, fp16/bf16/fp32; w_cur, w_nxt: (T, B) (used in float32);
    slots: (T, B) integer, the output row of each anchor pair, -1 elsewhere, every row in
    [0, n_out) used exactly once.  Returns (n_out, N) in grad's dtype.
    """
    T, B, N = grad.shape
    out = torch.empty((n_out, N), dtype=grad.dtype, device=grad.device)
    if n_out == 0 or N == 0:
        return out
    w_cur = w_cur.to(torch.float32).contiguous()
    w_nxt = w_nxt.to(torch.float32).contiguous()
    slots = slots.to(device=grad.device, dtype=torch.int32).contiguous()
    block = min(block_n, triton.next_power_of_2(max(N, 16)))
    grid = (B, triton.cdiv(N, block))
    _jagg_mix_kernel[grid](
        grad,
        w_cur,
        w_nxt,
        slots,
        out,
        T,
        B,
        N,
        grad.stride(0),
        grad.stride(1),
        grad.stride(2),
        BLOCK_N=block,
        num_warps=4 if block >= 512 else 2,
    )
    return out
