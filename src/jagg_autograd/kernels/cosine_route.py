"""Triton kernel for the JAGG router's linearity score.

For a window with anchors L < R and interior steps k (L < k < R), the router compares the
computed velocity v_k with the straight-line interpolation of the anchors' velocities,

    lin_k = (1 - alpha_k) v_L + alpha_k v_R,   cos_k = <v_k, lin_k> / (|v_k| |lin_k|),

and scores a sample by min_k cos_k.  The kernel produces, for every interior step, sample
and feature block, the three partial sums <v, lin>, |v|^2, |lin|^2 in fp32; one program
holds its window's two anchor blocks in registers while it walks the interior steps, so
each velocity element is loaded once.  The tiny (steps, B, blocks, 3) partials are summed
and turned into scores by ``jagg_autograd.router.cosine_scores``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cosine_route_kernel(
    v_ptr,
    alpha_ptr,
    left_ptr,
    right_ptr,
    part_ptr,
    B,
    N,
    n_blocks,
    stride_vt,
    stride_vb,
    stride_vn,
    BLOCK_N: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    blk = tl.program_id(2).to(tl.int64)
    cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    left = tl.load(left_ptr + w).to(tl.int64)
    right = tl.load(right_ptr + w).to(tl.int64)
    base = v_ptr + b * stride_vb + cols * stride_vn
    v_l = tl.load(base + left * stride_vt, mask=mask, other=0.0).to(tl.float32)
    v_r = tl.load(base + right * stride_vt, mask=mask, other=0.0).to(tl.float32)
    # left/right are int64, so the loop index k (and every offset below) is int64 too.
    for k in range(left + 1, right):
        a = tl.load(alpha_ptr + k * B + b)
        v = tl.load(base + k * stride_vt, mask=mask, other=0.0).to(tl.float32)
        lin = (1.0 - a) * v_l + a * v_r
        # partial[k, b, blk] = (<v, lin>, |v|^2, |lin|^2) over this block
        out = part_ptr + ((k * B + b) * n_blocks + blk) * 3
        tl.store(out, tl.sum(v * lin, axis=0))
        tl.store(out + 1, tl.sum(v * v, axis=0))
        tl.store(out + 2, tl.sum(lin * lin, axis=0))


def cosine_route_triton(
    velocities: torch.Tensor,
    alpha: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    *,
    block_n: int = 1024,
) -> torch.Tensor:
    """Launch ``_cosine_route_kernel``.

    velocities: (T, B, N) any strides, fp16/bf16/fp32; alpha: (T, B) float32;
    left, right: (n_w,) int64 anchor steps of each window.
    Returns partial sums (T, B, n_blocks, 3) float32; rows of non-interior steps are 0.
    """
    T, B, N = velocities.shape
    block = min(block_n, triton.next_power_of_2(max(N, 16)))
    n_blocks = triton.cdiv(N, block)
    part = torch.zeros((T, B, n_blocks, 3), dtype=torch.float32, device=velocities.device)
    n_w = left.numel()
    if n_w == 0:
        return part
    alpha = alpha.to(torch.float32).contiguous()
    grid = (n_w, B, n_blocks)
    _cosine_route_kernel[grid](
        velocities,
        alpha,
        left.contiguous(),
        right.contiguous(),
        part,
        B,
        N,
        n_blocks,
        velocities.stride(0),
        velocities.stride(1),
        velocities.stride(2),
        BLOCK_N=block,
        num_warps=4 if block >= 512 else 2,
    )
    return part
