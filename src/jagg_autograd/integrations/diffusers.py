"""Velocity callables for diffusers DiTs (SD3 / SD3.5 MMDiT and FLUX), with CFG, LoRA, autocast.

:func:`jagg_autograd.jagg_window` needs ``model(z, t, **cond) -> v`` with ``z`` ``(N, *S)``,
``t`` ``(N,)`` the rectified-flow noise level ``sigma in [0, 1]`` and ``v`` shaped like ``z``.
The adapters here wrap a diffusers transformer into exactly that:

* :class:`SD3Velocity` for :class:`diffusers.SD3Transformer2DModel`: ``z`` ``(N, C, H, W)``,
  the transformer gets ``timestep = 1000 * sigma`` (what ``StableDiffusion3Pipeline`` passes:
  the scheduler's timesteps are ``1000 * sigma``).
* :class:`FluxVelocity` for :class:`diffusers.FluxTransformer2DModel`: packed latents ``z``
  ``(N, L, C)`` (:func:`flux_pack_latents`), the transformer gets ``timestep = sigma`` because
  in diffusers 0.42 ``FluxTransformer2DModel.forward`` itself multiplies ``timestep`` and
  ``guidance`` by 1000 (``FluxPipeline`` passes ``timestep / 1000`` and the raw guidance
  scale). ``img_ids`` ``(L, 3)`` and ``txt_ids`` ``(T, 3)`` are not batched; pass them either
  2-D with ``batched_cond=batched_cond_keys(cond, B)`` (so the core does not tile them) or
  3-D ``(B, L, 3)`` (tiled like any per-sample tensor; the adapter uses row 0 after checking
  the rows agree).

**Classifier-free guidance** (Flow-GRPO's semantics). With ``guidance_scale = w`` (not None
and not 1) the adapter makes ONE transformer call on the batch ``[uncond; cond]`` (2N
samples) and returns ``v = sg(v_u) + w (v_c - sg(v_u))``, ``sg`` = stop-gradient: the value
is the usual CFG velocity, and the parameter gradient is ``w J_c^T g``, through the
conditional half only (as in Flow-GRPO, which trains the conditional branch). The
unconditional conditioning comes in ``negative_*`` keyword arguments of the same shape as
the positive ones (or dim 0 of size 1, broadcast).

**Dtypes.** Without autocast, floating inputs are cast to the transformer's parameter dtype
(so a bf16 transformer just works). With ``autocast_dtype=torch.bfloat16`` (or float16) the
call runs under :func:`torch.autocast` on the input's device. Either way the returned
velocity is in ``output_dtype`` (default: ``z``'s dtype, so fp32 latents give fp32
velocities and fp32 log-probs downstream); the CFG combination is done in that dtype.

**Gradient checkpointing** enabled on the transformer (``enable_gradient_checkpointing()``)
works unchanged: diffusers uses non-reentrant checkpointing, which also propagates to LoRA
weights when no input requires grad.

**LoRA** (through peft): :func:`add_lora` injects an adapter and freezes everything else;
:func:`adapters_disabled` / :func:`reference_velocity` give the reference policy (adapters
off, under ``no_grad``) for the KL term.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn

from jagg_autograd.integrations._common import (
    _as_tensor,
    _batch,
    _cast,
    _cfg_combine,
    _check_dtype,
    _check_scale,
    _checked_config,
    _float_latents,
    _param_dtype,
    _timesteps,
    _unwrap,
)
from jagg_autograd.integrations.lora import (
    DEFAULT_LORA_TARGETS,
    adapters_disabled,
    add_lora,
    lora_parameters,
    reference_velocity,
)

__all__ = [
    "DEFAULT_LORA_TARGETS",
    "UNBATCHED_COND",
    "FluxVelocity",
    "SD3Velocity",
    "adapters_disabled",
    "add_lora",
    "batched_cond_keys",
    "flux_image_ids",
    "flux_pack_latents",
    "flux_unpack_latents",
    "lora_parameters",
    "reference_velocity",
    "velocity_adapter",
]

class _VelocityBase(nn.Module):
    """Shared plumbing: CFG switch, autocast, dtype policy."""

    _DEFAULT_TIMESTEP_SCALE = 1.0

    def __init__(
        self,
        transformer: nn.Module,
        guidance_scale: float | None,
        timestep_scale: float,
        autocast_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.transformer = transformer
        self.guidance_scale = _check_scale(guidance_scale, "guidance_scale")
        ts = _check_scale(timestep_scale, "timestep_scale", allow_none=False)
        if ts is None or ts <= 0:
            raise ValueError(f"timestep_scale must be > 0, got {timestep_scale}")
        self.timestep_scale = ts
        # With the default scale t must be sigma in [0, 1]; a custom scale means the caller
        # chose the convention, so nothing is checked.
        self.check_sigma_range = ts == self._DEFAULT_TIMESTEP_SCALE
        _check_dtype(autocast_dtype, "autocast_dtype", (torch.bfloat16, torch.float16))
        _check_dtype(output_dtype, "output_dtype")
        self.autocast_dtype = autocast_dtype
        self.output_dtype = output_dtype

    def _sigmas(self, t: object, n: int) -> torch.Tensor:
        """``t`` as ``(n,)`` sigmas, unchanged; refused outside [0, 1] with the default scale.

        Flow-GRPO's loops pass ``scheduler.timesteps`` (``1000 * sigma``) to the transformer;
        fed to an adapter that multiplies by ``timestep_scale`` again they would run
        silently 1000x off.  The check reads ``t`` (one host sync) and never modifies it.
        """
        t = _timesteps(t, n)
        if self.check_sigma_range and t.numel():
            lo, hi = (float(x) for x in torch.aminmax(t.detach().float()))
            if not (lo >= 0.0 and hi <= 1.0):
                raise ValueError(
                    f"t must be the noise level sigma in [0, 1], got values in [{lo:g}, {hi:g}]: "
                    f"{type(self).__name__} multiplies t by timestep_scale="
                    f"{self.timestep_scale:g} itself. Pass sigmas (scheduler.sigmas, or "
                    "scheduler.timesteps / 1000), or set timestep_scale=1 if t is already the "
                    "transformer's timestep"
                )
        return t

    @property
    def uses_cfg(self) -> bool:
        """True when the call runs the ``[uncond; cond]`` batch (``guidance_scale`` not None/1)."""
        return self.guidance_scale is not None and self.guidance_scale != 1.0

    def _context(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def _input_dtype(self) -> torch.dtype | None:
        # Under autocast the parameters stay in their dtype and autocast picks per-op dtypes,
        # so inputs are left alone; otherwise they must match the weights.
        return None if self.autocast_dtype is not None else _param_dtype(self.transformer)

    def _run(self, z: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out_dtype = self.output_dtype or z.dtype
        with self._context(z.device):
            out = self.transformer(**kwargs, return_dict=False)[0]
        return out.to(out_dtype)

    @staticmethod
    def _prompt_pair(
        encoder_hidden_states: object, pooled_projections: object, n: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt conditioning as tensors with dim 0 of size ``n``."""
        ehs = _batch(
            _as_tensor(encoder_hidden_states, "encoder_hidden_states"), n, "encoder_hidden_states"
        )
        pooled = _batch(
            _as_tensor(pooled_projections, "pooled_projections"), n, "pooled_projections"
        )
        return ehs, pooled

    def _negative_pair(
        self,
        negative_encoder_hidden_states: object | None,
        negative_pooled_projections: object | None,
        ehs: torch.Tensor,
        pooled: torch.Tensor,
        ehs_hint: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The CFG negatives, checked against the positives ``ehs`` / ``pooled`` (``(n, ...)``).

        ``ehs_hint`` is the parenthesised advice in the token-shape mismatch message.
        """
        if negative_encoder_hidden_states is None or negative_pooled_projections is None:
            raise ValueError(
                "negative_encoder_hidden_states and negative_pooled_projections are required "
                f"when guidance_scale={self.guidance_scale} (classifier-free guidance)"
            )
        n = ehs.shape[0]
        neg_ehs = _batch(
            _as_tensor(negative_encoder_hidden_states, "negative_encoder_hidden_states"),
            n,
            "negative_encoder_hidden_states",
        )
        neg_pooled = _batch(
            _as_tensor(negative_pooled_projections, "negative_pooled_projections"),
            n,
            "negative_pooled_projections",
        )
        if neg_ehs.shape[1:] != ehs.shape[1:]:
            raise ValueError(
                "negative_encoder_hidden_states must match encoder_hidden_states' shape "
                f"{tuple(ehs.shape[1:])} after the batch dim ({ehs_hint}), got "
                f"{tuple(neg_ehs.shape[1:])}"
            )
        if neg_pooled.shape[1:] != pooled.shape[1:]:
            raise ValueError(
                "negative_pooled_projections must match pooled_projections' shape "
                f"{tuple(pooled.shape[1:])} after the batch dim, got "
                f"{tuple(neg_pooled.shape[1:])}"
            )
        return neg_ehs, neg_pooled

    def _velocity(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        ehs: torch.Tensor,
        pooled: torch.Tensor,
        negative_encoder_hidden_states: object | None,
        negative_pooled_projections: object | None,
        *,
        dt: torch.dtype | None,
        ehs_hint: str,
        per_sample: Mapping[str, torch.Tensor | None],
        **kw: Any,
    ) -> torch.Tensor:
        """One transformer call: on ``z``, or with CFG on ``[uncond; cond]`` combined.

        ``per_sample`` are extra transformer inputs with one row per sample (doubled for CFG;
        None stays None); ``kw`` go to the transformer as they are.
        """
        if not self.uses_cfg:
            return self._run(
                z,
                hidden_states=_cast(z, dt),
                encoder_hidden_states=_cast(ehs, dt),
                pooled_projections=_cast(pooled, dt),
                timestep=t * self.timestep_scale,
                **per_sample,
                **kw,
            )
        neg_ehs, neg_pooled = self._negative_pair(
            negative_encoder_hidden_states, negative_pooled_projections, ehs, pooled, ehs_hint
        )
        both = self._run(
            z,
            hidden_states=_cast(torch.cat([z, z]), dt),
            encoder_hidden_states=_cast(torch.cat([neg_ehs, ehs]), dt),
            pooled_projections=_cast(torch.cat([neg_pooled, pooled]), dt),
            timestep=torch.cat([t, t]) * self.timestep_scale,
            **{k: None if x is None else torch.cat([x, x]) for k, x in per_sample.items()},
            **kw,
        )
        v_u, v_c = both.chunk(2)
        return _cfg_combine(v_u, v_c, self.guidance_scale)  # type: ignore[arg-type]

    def extra_repr(self) -> str:
        return (
            f"guidance_scale={self.guidance_scale}, timestep_scale={self.timestep_scale}, "
            f"autocast_dtype={self.autocast_dtype}, output_dtype={self.output_dtype}"
        )


# --------------------------------------------------------------------------------------------
# SD3
# --------------------------------------------------------------------------------------------


class SD3Velocity(_VelocityBase):
    """``model(z, t, encoder_hidden_states=..., pooled_projections=...) -> v`` for an SD3 MMDiT.

    ``v = transformer(z, timestep = timestep_scale * t, ...)`` with ``timestep_scale = 1000``
    (SD3's convention: the network was trained on ``1000 * sigma``); with CFG,
    ``v = sg(v_u) + w (v_c - sg(v_u))`` from one call on ``[uncond; cond]``.

    Args:
        transformer: a :class:`diffusers.SD3Transformer2DModel` (possibly LoRA-injected,
            compiled, or wrapped by peft).
        guidance_scale: CFG weight ``w``; None (or 1) disables CFG.
        timestep_scale: multiplier from ``sigma`` to the transformer's ``timestep``. With
            the default 1000, ``t`` outside [0, 1] (e.g. a scheduler's ``timesteps``,
            already 1000 * sigma) is a ``ValueError`` naming ``timestep_scale``; ``t`` is
            read, never changed, so the call stays bit-identical to the raw transformer's.
        autocast_dtype: None, ``torch.bfloat16`` or ``torch.float16``.
        output_dtype: dtype of the returned velocity (default: ``z``'s dtype).
    """

    _DEFAULT_TIMESTEP_SCALE = 1000.0

    def __init__(
        self,
        transformer: nn.Module,
        *,
        guidance_scale: float | None = None,
        timestep_scale: float = 1000.0,
        autocast_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        from diffusers import SD3Transformer2DModel

        cfg = _checked_config(transformer, SD3Transformer2DModel)
        super().__init__(transformer, guidance_scale, timestep_scale, autocast_dtype, output_dtype)
        self.in_channels = int(cfg.in_channels)
        self.patch_size = int(cfg.patch_size)

    def forward(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        negative_encoder_hidden_states: torch.Tensor | None = None,
        negative_pooled_projections: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Velocity for latents ``z`` ``(N, C, H, W)`` at noise levels ``t`` ``(N,)``.

        Args:
            encoder_hidden_states: ``(N or 1, T, joint_attention_dim)`` prompt tokens.
            pooled_projections: ``(N or 1, pooled_projection_dim)``.
            negative_encoder_hidden_states / negative_pooled_projections: the unconditional
                counterparts (same shapes), required when CFG is on.

        Returns:
            ``(N, C, H, W)`` velocity in ``output_dtype`` (default ``z.dtype``).
        """
        z = _float_latents(z)
        if z.ndim != 4 or z.shape[1] != self.in_channels:
            raise ValueError(
                f"z must have shape (N, {self.in_channels}, H, W), got {tuple(z.shape)}"
            )
        if z.shape[2] % self.patch_size or z.shape[3] % self.patch_size:
            raise ValueError(
                f"z's spatial size {tuple(z.shape[2:])} must be divisible by the patch size "
                f"{self.patch_size}"
            )
        n = z.shape[0]
        t = self._sigmas(t, n)
        ehs, pooled = self._prompt_pair(encoder_hidden_states, pooled_projections, n)
        return self._velocity(
            z,
            t,
            ehs,
            pooled,
            negative_encoder_hidden_states,
            negative_pooled_projections,
            dt=self._input_dtype(),
            ehs_hint="pad the prompts to one length",
            per_sample={},
            joint_attention_kwargs=joint_attention_kwargs,
        )


# --------------------------------------------------------------------------------------------
# FLUX
# --------------------------------------------------------------------------------------------


def flux_pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``(B, C, H, W) -> (B, (H/2)(W/2), 4C)``: FLUX's 2x2 patch packing (as ``FluxPipeline``)."""
    latents = _as_tensor(latents, "latents")
    if latents.ndim != 4 or latents.shape[2] % 2 or latents.shape[3] % 2:
        raise ValueError(f"latents must be (B, C, H, W) with even H, W, got {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def flux_unpack_latents(packed: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`flux_pack_latents`: ``(B, (H/2)(W/2), 4C) -> (B, C, H, W)``."""
    packed = _as_tensor(packed, "packed")
    if height % 2 or width % 2 or height < 2 or width < 2:
        raise ValueError(f"height and width must be positive and even, got {height}, {width}")
    if packed.ndim != 3 or packed.shape[1] != (height // 2) * (width // 2) or packed.shape[2] % 4:
        raise ValueError(
            f"packed must be (B, {(height // 2) * (width // 2)}, 4C), got {tuple(packed.shape)}"
        )
    b, _, c4 = packed.shape
    x = packed.view(b, height // 2, width // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, height, width)


def flux_image_ids(
    height: int,
    width: int,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``img_ids`` ``((H/2)(W/2), 3)`` for latents of size ``H x W``: rows ``(0, i, j)``."""
    if height % 2 or width % 2 or height < 2 or width < 2:
        raise ValueError(f"height and width must be positive and even, got {height}, {width}")
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3, dtype=dtype, device=device)
    ids[..., 1] = torch.arange(h, dtype=dtype, device=device)[:, None]
    ids[..., 2] = torch.arange(w, dtype=dtype, device=device)[None, :]
    return ids.reshape(h * w, 3)


def _ids(x: object, rows: int, name: str) -> torch.Tensor:
    x = _as_tensor(x, name)
    if x.ndim == 3:
        # Tiled by the core as a per-sample tensor: every row must be the same position table.
        if x.shape[0] > 1 and not bool((x == x[:1]).all()):
            raise ValueError(f"{name} given 3-D must hold the same (L, 3) table for every sample")
        x = x[0]
    if x.ndim != 2 or x.shape[1] != 3:
        raise ValueError(
            f"{name} must have shape ({rows}, 3) (or (B, {rows}, 3)), got {tuple(x.shape)}"
        )
    if x.shape[0] != rows:
        raise ValueError(
            f"{name} has {x.shape[0]} rows but the sequence has {rows}; if the core tiled it "
            "along dim 0, pass batched_cond=batched_cond_keys(cond, B) to jagg_window"
        )
    return x


class FluxVelocity(_VelocityBase):
    """``model(z, t, encoder_hidden_states=..., pooled_projections=..., img_ids=..., txt_ids=...)``
    for a FLUX transformer on packed latents.

    ``v = transformer(z, timestep = timestep_scale * t, guidance = g, ...)`` with
    ``timestep_scale = 1`` (diffusers' FLUX multiplies by 1000 inside ``forward``); ``g`` is
    the distilled-guidance value (FLUX.1-dev's ``guidance_scale``, e.g. 3.5), required iff the
    transformer has ``guidance_embeds``. ``guidance_scale`` here is *true* CFG (two branches,
    Flow-GRPO semantics), independent of ``g``.

    Args:
        transformer: a :class:`diffusers.FluxTransformer2DModel`.
        guidance_scale: true-CFG weight ``w``; None (or 1) disables it.
        guidance: default distilled guidance ``g`` (a per-call ``guidance=`` overrides it).
        timestep_scale, autocast_dtype, output_dtype: as in :class:`SD3Velocity`.
    """

    def __init__(
        self,
        transformer: nn.Module,
        *,
        guidance_scale: float | None = None,
        guidance: float | None = None,
        timestep_scale: float = 1.0,
        autocast_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        from diffusers import FluxTransformer2DModel

        cfg = _checked_config(transformer, FluxTransformer2DModel)
        super().__init__(transformer, guidance_scale, timestep_scale, autocast_dtype, output_dtype)
        self.in_channels = int(cfg.in_channels)
        self.guidance_embeds = bool(cfg.guidance_embeds)
        self.guidance = _check_scale(guidance, "guidance")
        if self.guidance is not None and not self.guidance_embeds:
            raise ValueError("guidance was given but the transformer has guidance_embeds=False")

    def _guidance(self, guidance: object, n: int, like: torch.Tensor) -> torch.Tensor | None:
        if guidance is None:
            guidance = self.guidance
        if not self.guidance_embeds:
            if guidance is not None:
                raise ValueError("guidance was given but the transformer has guidance_embeds=False")
            return None
        if guidance is None:
            raise ValueError(
                "guidance is required: the transformer has guidance_embeds=True (pass "
                "guidance= to FluxVelocity or per call)"
            )
        if isinstance(guidance, torch.Tensor):
            g = guidance.to(device=like.device, dtype=like.dtype)
            return g.expand(n) if g.ndim == 0 else _batch(g, n, "guidance")
        g_val = _check_scale(guidance, "guidance", allow_none=False)
        return torch.full((n,), g_val, device=like.device, dtype=like.dtype)  # type: ignore[arg-type]

    def forward(
        self,
        z: torch.Tensor,
        t: torch.Tensor,
        *,
        encoder_hidden_states: torch.Tensor,
        pooled_projections: torch.Tensor,
        img_ids: torch.Tensor,
        txt_ids: torch.Tensor,
        guidance: torch.Tensor | float | None = None,
        negative_encoder_hidden_states: torch.Tensor | None = None,
        negative_pooled_projections: torch.Tensor | None = None,
        joint_attention_kwargs: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Velocity for packed latents ``z`` ``(N, L, C)`` at noise levels ``t`` ``(N,)``.

        Args:
            encoder_hidden_states: ``(N or 1, T, joint_attention_dim)``.
            pooled_projections: ``(N or 1, pooled_projection_dim)``.
            img_ids: ``(L, 3)`` (or ``(N, L, 3)`` with identical rows).
            txt_ids: ``(T, 3)`` (or ``(N, T, 3)``); shared by both CFG branches.
            guidance: distilled guidance, float or ``(N,)``; defaults to the constructor's.
            negative_*: unconditional conditioning (same shapes), required when CFG is on.

        Returns:
            ``(N, L, C)`` velocity in ``output_dtype`` (default ``z.dtype``).
        """
        z = _float_latents(z)
        if z.ndim != 3 or z.shape[2] != self.in_channels:
            raise ValueError(
                f"z must be packed latents of shape (N, L, {self.in_channels}), got "
                f"{tuple(z.shape)}"
            )
        n = z.shape[0]
        t = self._sigmas(t, n)
        ehs, pooled = self._prompt_pair(encoder_hidden_states, pooled_projections, n)
        if ehs.ndim != 3:
            raise ValueError(f"encoder_hidden_states must be (N, T, D), got {tuple(ehs.shape)}")
        img = _ids(img_ids, z.shape[1], "img_ids")
        txt = _ids(txt_ids, ehs.shape[1], "txt_ids")
        g = self._guidance(guidance, n, t)
        dt = self._input_dtype()
        return self._velocity(
            z,
            t,
            ehs,
            pooled,
            negative_encoder_hidden_states,
            negative_pooled_projections,
            dt=dt,
            ehs_hint="one txt_ids table serves both branches",
            per_sample={"guidance": g},
            img_ids=_cast(img, dt),
            txt_ids=_cast(txt, dt),
            joint_attention_kwargs=joint_attention_kwargs,
        )


UNBATCHED_COND: frozenset[str] = frozenset({"img_ids", "txt_ids", "joint_attention_kwargs"})


def batched_cond_keys(
    cond: Mapping[str, Any],
    batch_size: int,
    *,
    unbatched: Collection[str] = UNBATCHED_COND,
) -> frozenset[str]:
    """The keys of ``cond`` for ``jagg_window(..., batched_cond=...)``.

    They are the per-sample tensors (dim 0 equal to ``batch_size``), except the names in
    ``unbatched`` (FLUX's ``img_ids`` / ``txt_ids`` position tables, which have one row per
    token and would be tiled wrongly when their length happens to equal the batch size).
    """
    if not isinstance(cond, Mapping):
        raise TypeError(f"cond must be a mapping of keyword arguments, got {type(cond).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(unbatched, str) or not isinstance(unbatched, Collection):
        raise TypeError("unbatched must be a collection of key names")
    skip = frozenset(unbatched)
    return frozenset(
        k
        for k, v in cond.items()
        if k not in skip and isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == batch_size
    )


def velocity_adapter(transformer: nn.Module, **kwargs: Any) -> SD3Velocity | FluxVelocity:
    """The adapter for ``transformer``'s class: :class:`SD3Velocity` or :class:`FluxVelocity`.

    ``kwargs`` go to the adapter's constructor. Any other class is a TypeError.
    """
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    base = _unwrap(transformer)
    if isinstance(base, SD3Transformer2DModel):
        return SD3Velocity(transformer, **kwargs)
    if isinstance(base, FluxTransformer2DModel):
        return FluxVelocity(transformer, **kwargs)
    raise TypeError(
        "transformer must be a diffusers SD3Transformer2DModel or FluxTransformer2DModel, "
        f"got {type(base).__name__}"
    )



