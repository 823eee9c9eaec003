"""The embedded default model: a tiny class-conditional DiT on scikit-learn's 8x8 digits.

Everything here works offline: the data are scikit-learn's bundled ``load_digits()`` images and
the pretrained weights ship with the package under ``jagg_autograd/assets/`` (reproduced by
``scripts/train_digits.py``).

Conventions (rectified flow, as in SD3 / Flow-GRPO):

* images ``x0`` are ``(N, 1, 8, 8)`` in ``[-1, 1]`` (pixel values ``0..16`` mapped by
  ``x / 8 - 1``);
* ``x_sigma = (1 - sigma) * x0 + sigma * eps`` with ``eps ~ N(0, I)`` and ``sigma in [0, 1]``;
* the network predicts the velocity ``v = eps - x0``; sampling integrates from ``sigma = 1``
  (noise) down to ``sigma = 0`` (data), an Euler step being ``x' = x + (sigma' - sigma) * v``;
* the velocity callable takes ``t = sigma`` and feeds the transformer ``timestep = 1000 * sigma``
  (the SD3 scale).

Labels are the digits ``0..9``; :data:`NULL_LABEL` ``= 10`` is the "no prompt" label the DiT
was trained with (classifier-free-guidance dropout), so ``v_uncond = model(z, t,
labels=torch.full_like(labels, NULL_LABEL))``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "ASSETS_DIR",
    "CLASSIFIER_WEIGHTS",
    "DIT_WEIGHTS",
    "META_FILE",
    "NULL_LABEL",
    "NUM_CLASSES",
    "DigitsClassifier",
    "DigitsClassifierConfig",
    "DigitsDiT",
    "DigitsDiTConfig",
    "build_digits_classifier",
    "build_digits_dit",
    "digit_reward",
    "digits_dataset",
    "digits_split",
    "load_digits_classifier",
    "load_digits_dit",
    "load_digits_meta",
    "sample_digits",
]

NUM_CLASSES = 10
NULL_LABEL = 10
IMAGE_SIZE = 8

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DIT_WEIGHTS = ASSETS_DIR / "digits_dit.safetensors"
CLASSIFIER_WEIGHTS = ASSETS_DIR / "digits_classifier.safetensors"
META_FILE = ASSETS_DIR / "digits_meta.json"

# The split is part of the shipped artefacts' contract: meta's held-out accuracy is measured on
# exactly this split, and the tests recompute it.
SPLIT_SEED = 0
TEST_FRACTION = 0.25


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------


def digits_dataset(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 bundled scikit-learn digits as tensors.

    Returns:
        ``(images, labels)``: images ``(1797, 1, 8, 8)`` in ``[-1, 1]`` (``pixel / 8 - 1``) of
        ``dtype``, labels ``(1797,)`` int64 in ``0..9``.
    """
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.as_tensor(np.asarray(data.images), dtype=torch.float64) / 8.0 - 1.0
    labels = torch.as_tensor(np.asarray(data.target), dtype=torch.int64)
    return images.unsqueeze(1).to(dtype), labels


def digits_split(
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fixed stratified train / held-out split used for every shipped artefact.

    75 % / 25 % of :func:`digits_dataset`, stratified by label, ``random_state=0``.

    Returns:
        ``(x_train, y_train, x_test, y_test)`` with images ``(N, 1, 8, 8)`` and labels ``(N,)``.
    """
    from sklearn.model_selection import train_test_split

    images, labels = digits_dataset(dtype)
    idx = np.arange(labels.shape[0])
    train_idx, test_idx = train_test_split(
        idx, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=labels.numpy()
    )
    tr = torch.as_tensor(np.sort(train_idx))
    te = torch.as_tensor(np.sort(test_idx))
    return images[tr], labels[tr], images[te], labels[te]


# --------------------------------------------------------------------------------------------
# the DiT
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitsDiTConfig:
    """Architecture of :class:`DigitsDiT` (an SD3 MMDiT plus a label embedding).

    ``inner_dim = num_attention_heads * attention_head_dim`` is the token width of both the
    image stream and the label stream (SD3's joint attention needs them equal), and
    ``label_tokens`` label tokens form ``encoder_hidden_states``.
    """

    in_channels: int = 1
    sample_size: int = IMAGE_SIZE
    patch_size: int = 2
    num_layers: int = 4
    attention_head_dim: int = 16
    num_attention_heads: int = 4
    label_tokens: int = 2
    pooled_projection_dim: int = 64
    num_labels: int = NUM_CLASSES + 1

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"DigitsDiTConfig.{f.name} must be a positive int, got {value!r}")
        if self.sample_size % self.patch_size:
            raise ValueError(
                f"DigitsDiTConfig.sample_size ({self.sample_size}) must be divisible by "
                f"patch_size ({self.patch_size})"
            )
        if self.num_labels < NUM_CLASSES + 1:
            raise ValueError(
                f"DigitsDiTConfig.num_labels must be >= {NUM_CLASSES + 1} (10 digits and the "
                f"null label), got {self.num_labels}"
            )

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DigitsDiTConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"DigitsDiTConfig.from_dict: unknown keys {sorted(unknown)}")
        return cls(**d)


def _check_labels(labels: object, n: int, name: str = "labels", high: int = NULL_LABEL) -> None:
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of ints, got {type(labels).__name__}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(labels.shape)}")
    if n and (int(labels.min()) < 0 or int(labels.max()) > high):
        raise ValueError(
            f"{name} must lie in [0, {high}], got values in "
            f"[{int(labels.min())}, {int(labels.max())}]"
        )


class DigitsDiT(nn.Module):
    """Class-conditional SD3 DiT on 8x8 digits: the velocity callable ``model(z, t, labels=y)``.

    A label ``y`` (``0..9``, or :data:`NULL_LABEL` for "unconditional") is embedded twice by
    learned tables: ``label_tokens`` tokens of width ``inner_dim`` for
    ``encoder_hidden_states`` and one ``pooled_projection_dim`` vector for
    ``pooled_projections``; the diffusers :class:`~diffusers.SD3Transformer2DModel` is
    available as ``self.transformer`` (e.g. for LoRA or the generic SD3 adapter, with
    :meth:`encode_labels` producing its conditioning).
    """

    def __init__(self, config: DigitsDiTConfig | None = None) -> None:
        super().__init__()
        from diffusers import SD3Transformer2DModel

        if config is None:
            config = DigitsDiTConfig()
        if not isinstance(config, DigitsDiTConfig):
            raise TypeError(f"config must be a DigitsDiTConfig, got {type(config).__name__}")
        self.config = config
        d = config.inner_dim
        self.transformer = SD3Transformer2DModel(
            sample_size=config.sample_size,
            patch_size=config.patch_size,
            in_channels=config.in_channels,
            num_layers=config.num_layers,
            attention_head_dim=config.attention_head_dim,
            num_attention_heads=config.num_attention_heads,
            joint_attention_dim=d,
            caption_projection_dim=d,
            pooled_projection_dim=config.pooled_projection_dim,
            out_channels=config.in_channels,
            pos_embed_max_size=config.sample_size // config.patch_size,
        )
        self.label_embed = nn.Embedding(config.num_labels, config.label_tokens * d)
        self.pooled_embed = nn.Embedding(config.num_labels, config.pooled_projection_dim)
        # Unit-scale tables make every label's conditioning comparable in norm at init.
        nn.init.normal_(self.label_embed.weight, std=1.0)
        nn.init.normal_(self.pooled_embed.weight, std=1.0)

    def encode_labels(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Label conditioning for the transformer.

        Args:
            labels: ``(N,)`` integer tensor in ``[0, NULL_LABEL]``.

        Returns:
            ``(encoder_hidden_states, pooled_projections)`` of shapes
            ``(N, label_tokens, inner_dim)`` and ``(N, pooled_projection_dim)``.
        """
        n = labels.shape[0] if isinstance(labels, torch.Tensor) and labels.ndim else -1
        _check_labels(labels, max(n, 0), high=self.config.num_labels - 1)
        return self._encode(labels)

    def _encode(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        tokens = self.label_embed(labels).view(labels.shape[0], c.label_tokens, c.inner_dim)
        return tokens, self.pooled_embed(labels)

    def forward(self, z: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Velocity ``v = f(z, sigma, y)`` (rectified flow, ``v ~ eps - x0``).

        Args:
            z: ``(N, C, 8, 8)`` noisy images ``x_sigma``.
            t: ``(N,)`` noise levels ``sigma in [0, 1]`` (the transformer sees ``1000 * t``).
            labels: ``(N,)`` integer labels in ``[0, NULL_LABEL]``.

        Returns:
            ``(N, C, 8, 8)`` velocity in ``z``'s dtype.
        """
        c = self.config
        if not isinstance(z, torch.Tensor) or not z.dtype.is_floating_point:
            raise TypeError("z must be a floating-point torch.Tensor")
        if z.ndim != 4 or tuple(z.shape[1:]) != (c.in_channels, c.sample_size, c.sample_size):
            raise ValueError(
                f"z must have shape (N, {c.in_channels}, {c.sample_size}, {c.sample_size}), "
                f"got {tuple(z.shape)}"
            )
        n = z.shape[0]
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            raise TypeError("t must be a floating-point torch.Tensor of shape (N,)")
        if t.shape != (n,):
            raise ValueError(
                f"t must have shape ({n},) (one sigma per sample), got {tuple(t.shape)}"
            )
        _check_labels(labels, n, high=c.num_labels - 1)
        ehs, pooled = self._encode(labels)
        out = self.transformer(
            hidden_states=z,
            encoder_hidden_states=ehs,
            pooled_projections=pooled,
            timestep=t * 1000.0,
            return_dict=False,
        )[0]
        return out.to(z.dtype)


def build_digits_dit(config: DigitsDiTConfig | dict[str, Any] | None = None) -> DigitsDiT:
    """A freshly initialised :class:`DigitsDiT` (train mode) from a config or its dict."""
    if isinstance(config, dict):
        config = DigitsDiTConfig.from_dict(config)
    return DigitsDiT(config)


# --------------------------------------------------------------------------------------------
# the classifier and the reward
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DigitsClassifierConfig:
    """Architecture of :class:`DigitsClassifier`: two 3x3 convs, a 2x2 max-pool, an MLP head."""

    channels1: int = 16
    channels2: int = 32
    hidden: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"DigitsClassifierConfig.{f.name} must be a positive int, got {value!r}"
                )

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DigitsClassifierConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"DigitsClassifierConfig.from_dict: unknown keys {sorted(unknown)}")
        return cls(**d)


class DigitsClassifier(nn.Module):
    """Small CNN on ``(N, 1, 8, 8)`` images in ``[-1, 1]``; returns ``(N, 10)`` logits."""

    def __init__(self, config: DigitsClassifierConfig | None = None) -> None:
        super().__init__()
        if config is None:
            config = DigitsClassifierConfig()
        if not isinstance(config, DigitsClassifierConfig):
            raise TypeError(f"config must be a DigitsClassifierConfig, got {type(config).__name__}")
        self.config = config
        c1, c2, h = config.channels1, config.channels2, config.hidden
        self.net = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(c1, c2, 3, padding=1),
            nn.GELU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * 16, h),
            nn.GELU(),
            nn.Dropout(0.2),
            nn.Linear(h, NUM_CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if not isinstance(images, torch.Tensor) or not images.dtype.is_floating_point:
            raise TypeError("images must be a floating-point torch.Tensor")
        if images.ndim != 4 or tuple(images.shape[1:]) != (1, IMAGE_SIZE, IMAGE_SIZE):
            raise ValueError(f"images must have shape (N, 1, 8, 8), got {tuple(images.shape)}")
        return self.net(images)


def build_digits_classifier(
    config: DigitsClassifierConfig | dict[str, Any] | None = None,
) -> DigitsClassifier:
    """A freshly initialised :class:`DigitsClassifier` (train mode) from a config or its dict."""
    if isinstance(config, dict):
        config = DigitsClassifierConfig.from_dict(config)
    return DigitsClassifier(config)


# --------------------------------------------------------------------------------------------
# loading the shipped artefacts
# --------------------------------------------------------------------------------------------


def load_digits_meta(path: str | Path | None = None) -> dict[str, Any]:
    """The shipped ``digits_meta.json`` (configs, training settings, measured figures)."""
    p = Path(path) if path is not None else META_FILE
    if not p.is_file():
        raise FileNotFoundError(
            f"digits meta file not found at {p}; run `python scripts/train_digits.py`"
        )
    with open(p, encoding="utf-8") as fh:
        return json.load(fh)


def _load_state(module: nn.Module, path: Path, what: str) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(
            f"{what} weights not found at {path}; run `python scripts/train_digits.py`"
        )
    module.load_state_dict(load_file(str(path)), strict=True)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    return torch.device("cpu") if device is None else torch.device(device)


def load_digits_dit(
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights: str | Path | None = None,
    meta: str | Path | None = None,
) -> DigitsDiT:
    """The pretrained digits DiT (eval mode, ``requires_grad`` left on for fine-tuning).

    Its call ``model(z, t, labels=y) -> v`` with ``z (N, 1, 8, 8)``, ``t (N,) = sigma`` and
    ``y (N,)`` is directly the ``model(z, t, **cond)`` callable of :func:`jagg_window` (pass
    ``cond={"labels": y}`` with ``y`` of shape ``(B,)``; the core repeats it step-major).
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cfg = DigitsDiTConfig.from_dict(load_digits_meta(meta)["dit"]["config"])
    model = DigitsDiT(cfg)
    _load_state(model, Path(weights) if weights is not None else DIT_WEIGHTS, "digits DiT")
    return model.to(device=_resolve_device(device), dtype=dtype).eval()


def load_digits_classifier(
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    weights: str | Path | None = None,
    meta: str | Path | None = None,
) -> DigitsClassifier:
    """The pretrained digit classifier (eval mode, parameters frozen: it is the reward)."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    cfg = DigitsClassifierConfig.from_dict(load_digits_meta(meta)["classifier"]["config"])
    model = DigitsClassifier(cfg)
    _load_state(
        model, Path(weights) if weights is not None else CLASSIFIER_WEIGHTS, "digits classifier"
    )
    model.requires_grad_(False)
    return model.to(device=_resolve_device(device), dtype=dtype).eval()


_CLASSIFIER_CACHE: dict[tuple[str, torch.dtype], DigitsClassifier] = {}


@torch.no_grad()
def digit_reward(
    images: torch.Tensor,
    labels: torch.Tensor,
    *,
    classifier: DigitsClassifier | None = None,
) -> torch.Tensor:
    """Reward ``r_i = p_classifier(y_i | clamp(x_i, -1, 1))``: the prompted digit's probability.

    Args:
        images: ``(N, 1, 8, 8)`` generated images in the data range ``[-1, 1]`` (clamped first,
            as a decoder would).
        labels: ``(N,)`` integer prompted digits in ``0..9``.
        classifier: defaults to the shipped :func:`load_digits_classifier` (cached per
            device/dtype).

    Returns:
        ``(N,)`` float32 rewards in ``[0, 1]`` on ``images``' device; no gradient.
    """
    if not isinstance(images, torch.Tensor) or not images.dtype.is_floating_point:
        raise TypeError("images must be a floating-point torch.Tensor of shape (N, 1, 8, 8)")
    if images.ndim != 4 or tuple(images.shape[1:]) != (1, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must have shape (N, 1, 8, 8), got {tuple(images.shape)}")
    _check_labels(labels, images.shape[0], high=NUM_CLASSES - 1)
    if classifier is None:
        key = (str(images.device), torch.float32)
        if key not in _CLASSIFIER_CACHE:
            _CLASSIFIER_CACHE[key] = load_digits_classifier(device=images.device)
        classifier = _CLASSIFIER_CACHE[key]
    elif not isinstance(classifier, nn.Module):
        raise TypeError(f"classifier must be an nn.Module, got {type(classifier).__name__}")
    p = next(iter(classifier.parameters()))
    x = images.detach().to(device=p.device, dtype=p.dtype).clamp(-1.0, 1.0)
    probs = torch.softmax(classifier(x).float(), dim=-1)
    r = probs.gather(1, labels.to(probs.device).long().view(-1, 1)).squeeze(1)
    return r.to(images.device)


# --------------------------------------------------------------------------------------------
# a reference sampler
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def sample_digits(
    model: nn.Module,
    labels: torch.Tensor,
    *,
    steps: int = 10,
    noise_level: float = 0.0,
    guidance_scale: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample images from ``sigma = 1`` to ``0`` on the uniform grid ``sigma_i = 1 - i / steps``.

    ``noise_level = 0`` is the Euler ODE ``x' = x + (sigma' - sigma) v``; ``noise_level = eta >
    0`` is Flow-GRPO's SDE step (``eps_t = eta sqrt(sigma / (1 - sigma~))``, ``sigma~`` =
    ``sigma_1`` at ``sigma = 1``; mean ``x (1 + eps_t^2 dt / (2 sigma)) + v (1 + eps_t^2 (1 -
    sigma) / (2 sigma)) dt``, std ``eps_t sqrt(-dt)``). With ``guidance_scale = w``, ``v =
    v_u + w (v_c - v_u)`` with ``v_u`` the :data:`NULL_LABEL` velocity.

    Args:
        model: a :class:`DigitsDiT` (or any ``model(z, t, labels=y)`` callable on 8x8 images).
        labels: ``(N,)`` integer digits.

    Returns:
        ``(N, 1, 8, 8)`` float32 samples (not clamped).
    """
    if not callable(model):
        raise TypeError("model must be callable as model(z, t, labels=...)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not (isinstance(noise_level, (int, float)) and math.isfinite(noise_level)) or (
        noise_level < 0
    ):
        raise ValueError(f"noise_level must be a finite float >= 0, got {noise_level!r}")
    if guidance_scale is not None and not (
        isinstance(guidance_scale, (int, float)) and math.isfinite(guidance_scale)
    ):
        raise ValueError(f"guidance_scale must be None or a finite float, got {guidance_scale!r}")
    if not isinstance(labels, torch.Tensor) or labels.ndim != 1:
        raise ValueError("labels must be a 1-D integer tensor")
    _check_labels(labels, labels.shape[0], high=NULL_LABEL)
    params = list(model.parameters()) if isinstance(model, nn.Module) else []
    device = params[0].device if params else labels.device
    dtype = params[0].dtype if params else torch.float32
    n = labels.shape[0]
    labels = labels.to(device)
    x = torch.randn((n, 1, IMAGE_SIZE, IMAGE_SIZE), generator=generator, dtype=torch.float32)
    x = x.to(device)
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    for i in range(steps):
        s, s_next = sigmas[i], sigmas[i + 1]
        t = torch.full((n,), s, device=device, dtype=dtype)
        if guidance_scale is None:
            v = model(x.to(dtype), t, labels=labels).float()
        else:
            both = model(
                torch.cat([x, x]).to(dtype),
                torch.cat([t, t]),
                labels=torch.cat([torch.full_like(labels, NULL_LABEL), labels]),
            ).float()
            v_u, v_c = both.chunk(2)
            v = v_u + guidance_scale * (v_c - v_u)
        dt = s_next - s
        if noise_level == 0:
            x = x + dt * v
            continue
        s_tilde = sigmas[1] if s == 1.0 else s
        # At s~ = 1 (a one-step grid) the Flow-GRPO std is undefined; fall back to the ODE.
        if s_tilde >= 1.0:
            x = x + dt * v
            continue
        eps_t = noise_level * math.sqrt(s / (1.0 - s_tilde))
        mean = x * (1 + eps_t**2 / (2 * s) * dt) + v * (1 + eps_t**2 * (1 - s) / (2 * s)) * dt
        noise = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(device)
        x = mean + eps_t * math.sqrt(-dt) * noise
    return x
