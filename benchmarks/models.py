"""Benchmark model presets: diffusers SD3 MMDiT at a CPU size, a tiny test size and an
SD3.5-medium-like GPU size, wrapped as ``model(z, t, **cond) -> v``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SD3Preset:
    """Dimensions of an SD3Transformer2DModel and of its benchmark inputs."""

    name: str
    latent: int  # H = W of the latent
    channels: int
    num_layers: int
    heads: int
    head_dim: int
    text_tokens: int
    joint_attention_dim: int
    pooled_dim: int
    dual_attention_layers: tuple[int, ...] = ()
    qk_norm: str | None = None
    dtype: str = "float32"

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly fields."""
        d = asdict(self)
        d["dual_attention_layers"] = list(self.dual_attention_layers)
        return d


PRESETS: dict[str, SD3Preset] = {
    # Tests and smoke runs: seconds.
    "tiny": SD3Preset("tiny", 8, 16, 1, 2, 16, 4, 32, 16),
    # CPU timing: latent 32x32x16 (256 image tokens), ~0.1 s per step forward at B=2.
    "cpu": SD3Preset("cpu", 32, 16, 2, 6, 64, 16, 256, 64),
    # SD3.5-medium-like (24 MMDiT blocks, 1536 wide, dual attention in the first 13, RMS
    # qk-norm) at a 512 px image's latent 64x64x16, bf16.  GPU only.
    "gpu": SD3Preset(
        "gpu", 64, 16, 24, 24, 64, 154, 4096, 2048, tuple(range(13)), "rms_norm", "bfloat16"
    ),
}


def build_sd3(
    preset: SD3Preset, batch: int, device: torch.device, seed: int = 0
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A randomly initialised SD3 velocity model and its conditioning for ``batch`` samples."""
    from diffusers import SD3Transformer2DModel

    from jagg_autograd.integrations.diffusers import SD3Velocity

    torch.manual_seed(seed)
    dtype = getattr(torch, preset.dtype)
    kw: dict[str, Any] = {}
    if preset.dual_attention_layers:
        kw["dual_attention_layers"] = preset.dual_attention_layers
    if preset.qk_norm:
        kw["qk_norm"] = preset.qk_norm
    tr = SD3Transformer2DModel(
        sample_size=preset.latent,
        patch_size=2,
        in_channels=preset.channels,
        num_layers=preset.num_layers,
        attention_head_dim=preset.head_dim,
        num_attention_heads=preset.heads,
        joint_attention_dim=preset.joint_attention_dim,
        caption_projection_dim=preset.heads * preset.head_dim,
        pooled_projection_dim=preset.pooled_dim,
        out_channels=preset.channels,
        pos_embed_max_size=max(preset.latent, 32),
        **kw,
    )
    model = SD3Velocity(tr.to(device=device, dtype=dtype)).train()
    g = torch.Generator().manual_seed(seed + 1)
    cond = {
        "encoder_hidden_states": torch.randn(
            batch, preset.text_tokens, preset.joint_attention_dim, generator=g
        ).to(device, dtype),
        "pooled_projections": torch.randn(batch, preset.pooled_dim, generator=g).to(device, dtype),
    }
    return model, cond


def rollout_inputs(
    preset: SD3Preset, T: int, batch: int, device: torch.device, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latents (T, B, C, H, W), timesteps (T,) from 1 down, upstream gradients like latents.

    The latents follow a straight noise-to-data path (a flow-matching rollout's shape); the
    timing does not depend on their values.
    """
    dtype = getattr(torch, preset.dtype)
    g = torch.Generator().manual_seed(seed + 2)
    shape = (batch, preset.channels, preset.latent, preset.latent)
    x1 = torch.randn(shape, generator=g)
    x0 = torch.randn(shape, generator=g) * 0.5
    sig = torch.linspace(1.0, 0.0, T + 1, dtype=torch.float64)[:T]
    lat = torch.stack([s * x1 + (1 - s) * x0 for s in sig.tolist()])
    grads = torch.randn((T, *shape), generator=g) * 1e-2
    return lat.to(device, dtype), sig.to(device, dtype), grads.to(device, dtype)
