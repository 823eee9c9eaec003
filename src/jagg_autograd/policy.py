"""The policy call of the trainer and its KL reference.

:class:`Policy` wraps a task's velocity model: it runs it under the run's precision and
counts the samples it sees.  :func:`build_reference` gives Flow-GRPO's reference policy
for the KL term (``beta > 0``): the policy with its LoRA adapters disabled
(:class:`AdaptersOff`), or a frozen copy of the initial weights for full fine-tuning.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["AdaptersOff", "Policy", "build_reference", "resolve_device"]


class Policy(nn.Module):
    """The task's velocity model under the run's precision, counting the samples it sees.

    ``bf16``: the call runs under ``torch.autocast`` and the velocity is returned in the
    latents' dtype (log-probs and the loss stay fp32).  ``forward_samples`` /
    ``grad_samples`` count the samples of every call (with grad: while grad is enabled).
    """

    def __init__(self, model: nn.Module, precision: str, device: torch.device) -> None:
        super().__init__()
        self.model = model
        self.autocast = precision == "bf16"
        self.device_type = device.type
        self.forward_samples = 0
        self.grad_samples = 0

    def forward(self, z: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        self.forward_samples += z.shape[0]
        if torch.is_grad_enabled():
            self.grad_samples += z.shape[0]
        if not self.autocast:
            return self.model(z, t, **cond)
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            v = self.model(z, t, **cond)
        return v.to(z.dtype)


class AdaptersOff:
    """The reference policy of LoRA training: the policy call with every adapter off."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def __call__(self, z: torch.Tensor, t: torch.Tensor, **cond: Any) -> torch.Tensor:
        from jagg_autograd.integrations.diffusers import adapters_disabled

        with adapters_disabled(self.policy.model):
            return self.policy(z, t, **cond)


def build_reference(
    policy: Policy, tuning: str, precision: str, device: torch.device
) -> Callable[..., torch.Tensor]:
    """Flow-GRPO's reference policy: adapters off (LoRA) or a frozen copy of the weights."""
    if tuning == "lora":
        return AdaptersOff(policy)
    frozen = copy.deepcopy(policy.model).requires_grad_(False)
    return Policy(frozen, precision, device)


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available (use device='cpu')")
    return device
