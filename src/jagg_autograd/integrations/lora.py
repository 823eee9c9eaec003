"""LoRA through peft for the diffusers adapters (also importable from
:mod:`jagg_autograd.integrations.diffusers`): :func:`add_lora` injects an adapter and
freezes everything else; :func:`adapters_disabled` / :func:`reference_velocity` give the
reference policy (adapters off) for GRPO's KL term; :func:`lora_parameters` the trained
tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from jagg_autograd.integrations._common import _check_scale

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "adapters_disabled",
    "add_lora",
    "lora_parameters",
    "reference_velocity",
]


# The attention projections of both streams, as Flow-GRPO targets them; peft matches these
# as module-name suffixes, so they cover SD3's JointTransformerBlock and FLUX's double and
# single blocks (single blocks simply have no to_out / add_* projections).
DEFAULT_LORA_TARGETS: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)


def _tuner_layers(module: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def add_lora(
    transformer: nn.Module,
    *,
    rank: int = 8,
    alpha: float | None = None,
    target_modules: Iterable[str] | None = None,
    dropout: float = 0.0,
    adapter_name: str = "default",
    init_lora_weights: bool | str = True,
) -> list[nn.Parameter]:
    """Inject a peft LoRA adapter into ``transformer`` in place and freeze everything else.

    Each targeted linear ``W`` becomes ``W x + (alpha / rank) B A x`` with ``A`` ``(rank, in)``,
    ``B`` ``(out, rank)``; peft's default init has ``B = 0``, so the adapted model starts
    equal to the base (the GRPO reference policy).

    Args:
        transformer: any ``nn.Module`` (a diffusers transformer uses its own ``add_adapter`` so
            diffusers' adapter utilities keep working).
        rank: LoRA rank ``r >= 1``.
        alpha: LoRA alpha (default ``rank``, i.e. scale 1).
        target_modules: module-name suffixes to adapt (default :data:`DEFAULT_LORA_TARGETS`).
        dropout: LoRA dropout in ``[0, 1)``.

    Returns:
        The trainable parameters (exactly the adapter's), for the optimizer.
    """
    if not isinstance(transformer, nn.Module):
        raise TypeError(f"transformer must be an nn.Module, got {type(transformer).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    alpha_v = _check_scale(alpha, "alpha")
    if alpha_v is not None and alpha_v <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    drop = _check_scale(dropout, "dropout", allow_none=False)
    if drop is None or not 0.0 <= drop < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if not isinstance(adapter_name, str) or not adapter_name:
        raise ValueError(f"adapter_name must be a non-empty str, got {adapter_name!r}")
    targets = list(DEFAULT_LORA_TARGETS if target_modules is None else target_modules)
    if not targets or not all(isinstance(s, str) and s for s in targets):
        raise ValueError(f"target_modules must be non-empty strings, got {target_modules!r}")
    names = [name for name, _ in transformer.named_modules()]
    if not any(n == s or n.endswith("." + s) for s in targets for n in names):
        raise ValueError(f"target_modules {targets} match no module of the transformer")

    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha_v if alpha_v is not None else float(rank),
        target_modules=targets,
        lora_dropout=drop,
        init_lora_weights=init_lora_weights,
    )
    transformer.requires_grad_(False)
    if hasattr(transformer, "add_adapter") and hasattr(transformer, "_hf_peft_config_loaded"):
        transformer.add_adapter(config, adapter_name=adapter_name)
    else:
        inject_adapter_in_model(config, transformer, adapter_name=adapter_name)
    params = lora_parameters(transformer, adapter_name=adapter_name)
    # Freeze explicitly: whatever peft marks trainable, only this adapter's weights may train.
    transformer.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    return params


def lora_parameters(module: nn.Module, *, adapter_name: str | None = None) -> list[nn.Parameter]:
    """The LoRA weights in ``module`` (all adapters, or only ``adapter_name``'s)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    out: list[nn.Parameter] = []
    for name, p in module.named_parameters():
        if "lora_" not in name:
            continue
        tag = f".{adapter_name}"
        if adapter_name is not None and not (name.endswith(tag) or tag + "." in name):
            continue
        out.append(p)
    return out


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[nn.Module]:
    """Context manager: every peft adapter in ``module`` is off and autograd is disabled.

    Inside, ``module`` computes the reference policy (the frozen base model). On exit the
    adapters' on/off state and every parameter's ``requires_grad`` are restored exactly
    (peft's own toggle would otherwise re-enable grads on all active adapter weights).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    layers = _tuner_layers(module)
    if not layers:
        raise ValueError(
            "module has no peft adapter layers, so there is no reference policy to switch to "
            "(use add_lora, or keep a frozen copy of the model as the reference)"
        )
    flags = [(p, p.requires_grad) for p in module.parameters()]
    states = [(layer, bool(layer.disable_adapters)) for layer in layers]
    try:
        for layer in layers:
            layer.enable_adapters(False)
        with torch.no_grad():
            yield module
    finally:
        for layer, was_disabled in states:
            layer.enable_adapters(not was_disabled)
        for p, rg in flags:
            p.requires_grad_(rg)


def reference_velocity(
    model: nn.Module,
    z: torch.Tensor,
    t: torch.Tensor,
    *,
    lora_module: nn.Module | None = None,
    **cond: Any,
) -> torch.Tensor:
    """``v_ref = model(z, t, **cond)`` with all LoRA adapters off, under ``no_grad``.

    Args:
        model: the velocity callable (an adapter here, or any module containing the LoRA
            layers).
        lora_module: the module holding the adapters when it is not ``model`` itself.

    Returns:
        The detached reference velocity, shaped like ``z``.
    """
    if not callable(model):
        raise TypeError(f"model must be callable, got {type(model).__name__}")
    target = lora_module if lora_module is not None else model
    if not isinstance(target, nn.Module):
        raise TypeError(
            "lora_module must be given (an nn.Module holding the adapters) when model is not "
            "an nn.Module"
        )
    with adapters_disabled(target):
        return model(z, t, **cond).detach()
