"""The Triton launchers registered as torch.library custom ops.

torch.compile (dynamo) cannot trace into a Triton launcher's Python; as custom ops with a
fake (meta) implementation the kernels stay one opaque node in a captured graph instead of
a graph break, and their output shapes are known without running them.
"""

from __future__ import annotations

import torch
import triton

# Module references (not names) so the launchers stay patchable in one place.
from jagg_autograd.kernels import cosine_route as _route_kernels
from jagg_autograd.kernels import jagg_mix as _mix_kernels


@torch.library.custom_op("jagg_autograd::jagg_mix", mutates_args=())
def jagg_mix_op(
    grad: torch.Tensor, w_cur: torch.Tensor, w_nxt: torch.Tensor, slots: torch.Tensor, n_out: int
) -> torch.Tensor:
    """(T, B, N) upstream gradients -> (n_out, N) composites (see ``jagg_mix_slots_ref``)."""
    return _mix_kernels.jagg_mix_triton(grad, w_cur, w_nxt, slots, n_out)


@jagg_mix_op.register_fake
def _jagg_mix_fake(grad, w_cur, w_nxt, slots, n_out):
    return grad.new_empty((n_out, grad.shape[2]))


@torch.library.custom_op("jagg_autograd::cosine_route_partials", mutates_args=())
def cosine_route_partials_op(
    velocities: torch.Tensor, alpha: torch.Tensor, left: torch.Tensor, right: torch.Tensor
) -> torch.Tensor:
    """Per-step partial sums (T, B, n_blocks, 3) of the routing score (see the kernel)."""
    return _route_kernels.cosine_route_triton(velocities, alpha, left, right)


@cosine_route_partials_op.register_fake
def _cosine_route_fake(velocities, alpha, left, right):
    T, B, N = velocities.shape
    block = min(1024, triton.next_power_of_2(max(N, 16)))
    return velocities.new_empty((T, B, triton.cdiv(N, block), 3), dtype=torch.float32)
