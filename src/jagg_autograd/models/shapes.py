"""The shapes task's text-to-image model: a word-level text encoder and an SD3 MMDiT on pixels.

* :class:`ShapesTextEncoder`: token + position embeddings and a few pre-LN transformer
  blocks over the tokenizer's ids (:class:`~jagg_autograd.tasks.shapes_scenes.ShapesTokenizer`);
  it returns per-token embeddings ``(N, L, text_dim)`` (pads zeroed) and a pooled embedding
  ``(N, pooled_projection_dim)`` read from the ``<cls>`` token, like CLIP's.
* a diffusers :class:`~diffusers.SD3Transformer2DModel` (joint attention over image patches
  and text tokens) consumes them as ``encoder_hidden_states`` / ``pooled_projections``.

The latent is the picture itself, ``(3, 32, 32)`` in ``[-1, 1]`` (no VAE); rectified flow as
in :mod:`jagg_autograd.models.digits`: ``x_s = (1 - s) x0 + s eps``, ``v = eps - x0``, the
transformer sees ``timestep = 1000 s``.  Both parts were trained jointly by
``scripts/train_shapes.py`` with caption dropout (the empty prompt ``""`` is the CFG
negative), and ship as one safetensors file (keys ``text_encoder.*`` and ``transformer.*``).

For GRPO the text encoder is frozen (as SD3's are) and the velocity callable is the
library's :class:`~jagg_autograd.integrations.diffusers.SD3Velocity` around
``model.transformer``, with the conditioning of :meth:`ShapesModel.cond`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from jagg_autograd.tasks.shapes_scenes import IMAGE_SIZE, ShapesTokenizer

__all__ = [
    "META_FILE",
    "WEIGHTS_FILE",
    "ShapesModel",
    "ShapesModelConfig",
    "ShapesTextEncoder",
    "load_shapes_meta",
    "load_shapes_model",
    "sample_shapes",
]

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
WEIGHTS_FILE = ASSETS_DIR / "shapes_model.safetensors"
META_FILE = ASSETS_DIR / "shapes_meta.json"


@dataclass(frozen=True)
class ShapesModelConfig:
    """Architecture of :class:`ShapesModel` (text encoder + SD3 MMDiT).

    ``inner_dim = num_attention_heads * attention_head_dim`` is the MMDiT's token width;
    ``text_dim`` is the text encoder's width (= the MMDiT's ``joint_attention_dim``).

    ``pooled_text``: whether the pooled projection carries the prompt (SD3's CLIP-pooled
    vector). It modulates every image token alike (adaLN), so what it carries cannot
    differ between two objects of one picture: on the model shipped until 2026-12-06 it
    decided the shape (``benchmarks.shapes_base``'s pooled probe) and two named shapes came
    out at chance.  ``False`` (the shipped model's) feeds zeros, so the prompt reaches the
    picture only through joint attention.
    """

    in_channels: int = 3
    sample_size: int = IMAGE_SIZE
    patch_size: int = 4
    num_layers: int = 4
    attention_head_dim: int = 16
    num_attention_heads: int = 4
    pooled_projection_dim: int = 64
    text_dim: int = 64
    text_layers: int = 2
    text_heads: int = 4
    vocab_size: int = 26
    max_length: int = 11
    pooled_text: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "pooled_text":
                if not isinstance(value, bool):
                    raise TypeError(f"ShapesModelConfig.pooled_text must be a bool, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"ShapesModelConfig.{f.name} must be a positive int, got {value!r}"
                )
        if self.sample_size % self.patch_size:
            raise ValueError(
                f"ShapesModelConfig.sample_size ({self.sample_size}) must be divisible by "
                f"patch_size ({self.patch_size})"
            )
        if self.text_dim % self.text_heads:
            raise ValueError(
                f"ShapesModelConfig.text_dim ({self.text_dim}) must be divisible by "
                f"text_heads ({self.text_heads})"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def to_dict(self) -> dict[str, int | bool]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ShapesModelConfig:
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"ShapesModelConfig.from_dict: unknown keys {sorted(unknown)}")
        return cls(**d)


class _Block(nn.Module):
    """Pre-LN transformer block with a key-padding mask (plain SDPA: the same maths in train
    and eval mode, unlike ``nn.TransformerEncoder``'s nested-tensor fast path)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        n, L, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(n, L, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep[:, None, None]
        )
        x = x + self.proj(attn.transpose(1, 2).reshape(n, L, d))
        return x + self.mlp(self.norm2(x))


class ShapesTextEncoder(nn.Module):
    """Token ids ``(N, L)`` -> ``(tokens (N, L, text_dim), pooled (N, pooled_dim))``.

    Pads (id 0) are masked out as keys and their output rows are zero, so a prompt's
    embedding does not depend on how much padding follows it.
    """

    def __init__(self, config: ShapesModelConfig) -> None:
        super().__init__()
        self.config = config
        d = config.text_dim
        self.token_embed = nn.Embedding(config.vocab_size, d)
        self.pos_embed = nn.Parameter(torch.zeros(config.max_length, d))
        nn.init.normal_(self.token_embed.weight, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)
        self.blocks = nn.ModuleList(_Block(d, config.text_heads) for _ in range(config.text_layers))
        self.norm = nn.LayerNorm(d)
        self.pooled = nn.Linear(d, config.pooled_projection_dim)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            raise TypeError("ids must be an int64 torch.Tensor of shape (N, max_length)")
        if ids.ndim != 2 or ids.shape[1] != c.max_length:
            raise ValueError(f"ids must have shape (N, {c.max_length}), got {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size):
            raise ValueError(f"ids must lie in [0, {c.vocab_size}), got out-of-range values")
        keep = ids != 0
        x = self.token_embed(ids) + self.pos_embed
        for blk in self.blocks:
            x = blk(x, keep)
        x = self.norm(x)
        tokens = x * keep[..., None].to(x.dtype)
        if not c.pooled_text:
            # The layer stays (checkpoints load either way); its output is not used.
            return tokens, x.new_zeros(x.shape[0], c.pooled_projection_dim)
        return tokens, self.pooled(x[:, 0])


class ShapesModel(nn.Module):
    """Text encoder + SD3 MMDiT: ``model(z, t, ids) -> v`` (no CFG; training and tests).

    Attributes ``text_encoder`` (:class:`ShapesTextEncoder`), ``transformer`` (the diffusers
    :class:`~diffusers.SD3Transformer2DModel`) and ``tokenizer``
    (:class:`~jagg_autograd.tasks.shapes_scenes.ShapesTokenizer`).
    """

    def __init__(self, config: ShapesModelConfig | None = None) -> None:
        super().__init__()
        from diffusers import SD3Transformer2DModel

        if config is None:
            config = ShapesModelConfig()
        if not isinstance(config, ShapesModelConfig):
            raise TypeError(f"config must be a ShapesModelConfig, got {type(config).__name__}")
        self.config = config
        self.tokenizer = ShapesTokenizer(config.max_length)
        if self.tokenizer.vocab_size != config.vocab_size:
            raise ValueError(
                f"config.vocab_size ({config.vocab_size}) must equal the tokenizer's "
                f"({self.tokenizer.vocab_size})"
            )
        self.text_encoder = ShapesTextEncoder(config)
        self.transformer = SD3Transformer2DModel(
            sample_size=config.sample_size,
            patch_size=config.patch_size,
            in_channels=config.in_channels,
            num_layers=config.num_layers,
            attention_head_dim=config.attention_head_dim,
            num_attention_heads=config.num_attention_heads,
            joint_attention_dim=config.text_dim,
            caption_projection_dim=config.inner_dim,
            pooled_projection_dim=config.pooled_projection_dim,
            out_channels=config.in_channels,
            pos_embed_max_size=config.sample_size // config.patch_size,
        )

    def encode(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(encoder_hidden_states (N, L, text_dim), pooled_projections (N, pooled_dim))``
        of ``texts`` (``""`` is the unconditional prompt)."""
        dev = self.text_encoder.pos_embed.device
        return self.text_encoder(self.tokenizer(texts).to(dev))

    @torch.no_grad()
    def cond(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Keyword arguments of :class:`SD3Velocity` for ``texts``, negatives included.

        Every tensor has dim 0 ``len(texts)`` (the negative, the empty prompt's embedding,
        is repeated), as the GRPO trainer's batched conditioning requires.  No gradient: the
        text encoder is frozen during GRPO.
        """
        ehs, pooled = self.encode(list(texts))
        neg_ehs, neg_pooled = self.encode([""])
        n = len(texts)
        return {
            "encoder_hidden_states": ehs,
            "pooled_projections": pooled,
            "negative_encoder_hidden_states": neg_ehs.expand(n, -1, -1).contiguous(),
            "negative_pooled_projections": neg_pooled.expand(n, -1).contiguous(),
        }

    def forward(self, z: torch.Tensor, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Velocity ``(N, 3, 32, 32)`` of ``z`` ``(N, 3, 32, 32)`` at ``t`` ``(N,)`` for token
        ids ``(N, L)``, without guidance (what pre-training fits)."""
        c = self.config
        shape = (c.in_channels, c.sample_size, c.sample_size)
        if not isinstance(z, torch.Tensor) or not z.dtype.is_floating_point:
            raise TypeError("z must be a floating-point torch.Tensor")
        if z.ndim != 4 or tuple(z.shape[1:]) != shape:
            raise ValueError(f"z must have shape (N, {', '.join(map(str, shape))}), got {z.shape}")
        if not isinstance(t, torch.Tensor) or t.shape != (z.shape[0],):
            raise ValueError(f"t must be a tensor of shape ({z.shape[0]},)")
        ehs, pooled = self.text_encoder(ids)
        out = self.transformer(
            hidden_states=z,
            encoder_hidden_states=ehs,
            pooled_projections=pooled,
            timestep=t * 1000.0,
            return_dict=False,
        )[0]
        return out.to(z.dtype)

    def velocity(self, guidance_scale: float | None = None) -> nn.Module:
        """The library's :class:`SD3Velocity` around ``self.transformer`` (CFG weight
        ``guidance_scale``; call it with :meth:`cond`'s keyword arguments)."""
        from jagg_autograd.integrations.diffusers import SD3Velocity

        return SD3Velocity(self.transformer, guidance_scale=guidance_scale)


def load_shapes_meta(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped ``shapes_meta.json`` (config, training settings, measured figures)."""
    p = Path(path) if path is not None else META_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"shapes meta file not found at {p}; run `python scripts/train_shapes.py`"
        )
    with open(p, encoding="utf-8") as fh:
        return json.load(fh)


def load_shapes_model(
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights: str | Path | None = None,
    meta: str | Path | None = None,
) -> ShapesModel:
    """The pretrained text encoder + MMDiT (eval mode; ``requires_grad`` left on)."""
    from safetensors.torch import load_file

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cfg = ShapesModelConfig.from_dict(load_shapes_meta(meta)["model"]["config"])
    model = ShapesModel(cfg)
    path = Path(weights) if weights is not None else WEIGHTS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"shapes model weights not found at {path}; run `python scripts/train_shapes.py`"
        )
    model.load_state_dict(load_file(str(path)), strict=True)
    dev = torch.device("cpu") if device is None else torch.device(device)
    return model.to(device=dev, dtype=dtype).eval()


@torch.no_grad()
def sample_shapes(
    velocity: nn.Module,
    cond: dict[str, torch.Tensor],
    *,
    steps: int = 10,
    noise_level: float = 0.0,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample pictures from ``sigma = 1`` to ``0`` on the grid ``sigma_i = 1 - i / steps``.

    ``noise_level = 0``: Euler ODE steps; ``> 0``: Flow-GRPO's SDE step
    (:func:`jagg_autograd.grpo.sde_step_with_logprob`, ``sigma_max = sigmas[1]``), as the
    GRPO trainer samples.

    Args:
        velocity: ``velocity(z, t, **cond) -> v`` (e.g. :meth:`ShapesModel.velocity`).
        cond: its keyword arguments, dim 0 = the number of samples N.
        noise: optional initial latents ``(N, 3, 32, 32)`` (else drawn from ``generator``).

    Returns:
        ``(N, 3, 32, 32)`` float32 samples (not clamped).
    """
    from jagg_autograd.grpo import ode_step, sde_step_with_logprob

    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps must be an int >= 2, got {steps!r}")
    if not (isinstance(noise_level, (int, float)) and math.isfinite(noise_level)) or (
        noise_level < 0
    ):
        raise ValueError(f"noise_level must be a finite float >= 0, got {noise_level!r}")
    n = next(iter(cond.values())).shape[0]
    if noise is None:
        x = torch.randn((n, 3, IMAGE_SIZE, IMAGE_SIZE), generator=generator)
    else:
        if noise.shape != (n, 3, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"noise must have shape ({n}, 3, 32, 32), got {tuple(noise.shape)}")
        x = noise.float().clone()
    s = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    for k in range(steps):
        v = velocity(x, torch.full((n,), s[k]), **cond)
        if noise_level == 0:
            x = ode_step(v, x, s[k], s[k + 1])
        else:
            x = sde_step_with_logprob(
                v, x, s[k], s[k + 1], noise_level=noise_level, sigma_max=s[1], generator=generator
            )[0]
    return x
