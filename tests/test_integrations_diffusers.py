"""Tests for jagg_autograd.integrations.diffusers on tiny random SD3 and FLUX transformers.

Everything runs in float64 on CPU unless a test is about dtypes, so that "equal" can mean
1e-10 relative: the comparisons are against direct diffusers calls and hand-written
gradients, never against the adapter itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
from torch import nn

import jagg_autograd
from jagg_autograd.integrations.diffusers import (
    FluxVelocity,
    SD3Velocity,
    adapters_disabled,
    add_lora,
    batched_cond_keys,
    flux_image_ids,
    flux_pack_latents,
    flux_unpack_latents,
    lora_parameters,
    reference_velocity,
    velocity_adapter,
)

F64 = torch.float64
B = 3
TOKENS = 5


def make_sd3(seed: int = 0, dtype: torch.dtype = F64) -> SD3Transformer2DModel:
    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
        pos_embed_max_size=8,
    ).to(dtype)


def make_flux(seed: int = 0, dtype: torch.dtype = F64, guidance: bool = True):
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        guidance_embeds=guidance,
        axes_dims_rope=(4, 6, 6),
    ).to(dtype)


def sd3_inputs(n: int = B, dtype: torch.dtype = F64, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": torch.randn(n, 4, 8, 8, generator=g, dtype=dtype),
        "t": torch.rand(n, generator=g, dtype=dtype) * 0.9 + 0.05,
        "encoder_hidden_states": torch.randn(n, TOKENS, 16, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(n, 8, generator=g, dtype=dtype),
        "negative_encoder_hidden_states": torch.randn(n, TOKENS, 16, generator=g, dtype=dtype),
        "negative_pooled_projections": torch.randn(n, 8, generator=g, dtype=dtype),
    }


def flux_inputs(n: int = B, dtype: torch.dtype = F64, seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "z": flux_pack_latents(torch.randn(n, 4, 8, 8, generator=g, dtype=dtype)),
        "t": torch.rand(n, generator=g, dtype=dtype) * 0.9 + 0.05,
        "encoder_hidden_states": torch.randn(n, TOKENS, 32, generator=g, dtype=dtype),
        "pooled_projections": torch.randn(n, 16, generator=g, dtype=dtype),
        "negative_encoder_hidden_states": torch.randn(n, TOKENS, 32, generator=g, dtype=dtype),
        "negative_pooled_projections": torch.randn(n, 16, generator=g, dtype=dtype),
        "img_ids": flux_image_ids(8, 8, dtype=dtype),
        "txt_ids": torch.zeros(TOKENS, 3, dtype=dtype),
    }


def split(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    d = dict(inputs)
    return d.pop("z"), d.pop("t"), d


def positive(cond: dict) -> dict:
    return {k: v for k, v in cond.items() if not k.startswith("negative_")}


def sd3_direct(tr, z, t, ehs, pooled) -> torch.Tensor:
    return tr(
        hidden_states=z,
        encoder_hidden_states=ehs,
        pooled_projections=pooled,
        timestep=t * 1000.0,
        return_dict=False,
    )[0]


def flux_direct(tr, z, t, ehs, pooled, img, txt, guidance=3.5) -> torch.Tensor:
    g = None if guidance is None else torch.full((z.shape[0],), guidance, dtype=z.dtype)
    return tr(
        hidden_states=z,
        encoder_hidden_states=ehs,
        pooled_projections=pooled,
        timestep=t,
        guidance=g,
        img_ids=img,
        txt_ids=txt,
        return_dict=False,
    )[0]


def grads(out: torch.Tensor, params: list[nn.Parameter], g: torch.Tensor) -> list[torch.Tensor]:
    # retain_graph: some tests differentiate two expressions sharing one forward.
    return list(torch.autograd.grad((out * g).sum(), params, retain_graph=True))


def assert_grads_close(a: list[torch.Tensor], b: list[torch.Tensor], rtol: float) -> None:
    num = math.sqrt(sum(float((x - y).pow(2).sum()) for x, y in zip(a, b, strict=True)))
    den = math.sqrt(sum(float(y.pow(2).sum()) for y in b))
    assert den > 0
    assert num <= rtol * den, f"relative gradient error {num / den:.3e} > {rtol}"


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------
# values and timestep scales
# --------------------------------------------------------------------------------------------


def test_sd3_values_equal_direct_call_with_timestep_times_1000() -> None:
    tr = make_sd3()
    z, t, cond = split(sd3_inputs())
    v = SD3Velocity(tr)(z, t, **positive(cond))
    ref = sd3_direct(tr, z, t, cond["encoder_hidden_states"], cond["pooled_projections"])
    assert v.shape == z.shape and v.dtype == F64
    assert torch.equal(v, ref)
    # The scale matters: sigma fed raw is a different network input.
    wrong = tr(
        hidden_states=z,
        encoder_hidden_states=cond["encoder_hidden_states"],
        pooled_projections=cond["pooled_projections"],
        timestep=t,
        return_dict=False,
    )[0]
    assert not torch.allclose(v, wrong)


@pytest.mark.parametrize("guidance_embeds", [True, False])
def test_flux_values_equal_direct_call_with_raw_sigma(guidance_embeds: bool) -> None:
    tr = make_flux(guidance=guidance_embeds)
    z, t, cond = split(flux_inputs())
    g = 3.5 if guidance_embeds else None
    v = FluxVelocity(tr, guidance=g)(z, t, **positive(cond))
    ref = flux_direct(
        tr,
        z,
        t,
        cond["encoder_hidden_states"],
        cond["pooled_projections"],
        cond["img_ids"],
        cond["txt_ids"],
        guidance=g,
    )
    assert v.shape == z.shape
    assert torch.equal(v, ref)


def test_flux_guidance_per_call_overrides_default_and_accepts_tensor() -> None:
    tr = make_flux()
    z, t, cond = split(flux_inputs())
    ad = FluxVelocity(tr, guidance=3.5)
    pos = positive(cond)
    a = ad(z, t, guidance=5.0, **pos)
    b = ad(z, t, guidance=torch.full((B,), 5.0, dtype=F64), **pos)
    ref = flux_direct(
        tr,
        z,
        t,
        pos["encoder_hidden_states"],
        pos["pooled_projections"],
        pos["img_ids"],
        pos["txt_ids"],
        guidance=5.0,
    )
    assert torch.equal(a, ref) and torch.equal(b, ref)
    assert not torch.allclose(a, ad(z, t, **pos))


def test_scalar_t_and_shared_conditioning_broadcast() -> None:
    tr = make_sd3()
    z, t, cond = split(sd3_inputs())
    ad = SD3Velocity(tr)
    ehs1, pooled1 = cond["encoder_hidden_states"][:1], cond["pooled_projections"][:1]
    v = ad(z, t[0], encoder_hidden_states=ehs1, pooled_projections=pooled1)
    ref = sd3_direct(tr, z, t[0].expand(B), ehs1.expand(B, -1, -1), pooled1.expand(B, -1))
    torch.testing.assert_close(v, ref, rtol=1e-12, atol=1e-12)


def test_flux_ids_accepted_2d_or_3d_and_pack_roundtrip() -> None:
    tr = make_flux()
    z, t, cond = split(flux_inputs())
    ad = FluxVelocity(tr, guidance=3.5)
    pos = positive(cond)
    a = ad(z, t, **pos)
    pos3 = dict(
        pos, img_ids=pos["img_ids"].expand(B, -1, -1), txt_ids=pos["txt_ids"].expand(B, -1, -1)
    )
    assert torch.equal(ad(z, t, **pos3), a)
    x = torch.randn(2, 4, 6, 10, dtype=F64)
    assert torch.equal(flux_unpack_latents(flux_pack_latents(x), 6, 10), x)
    from diffusers import FluxPipeline

    expected = FluxPipeline._prepare_latent_image_ids(1, 3, 5, "cpu", F64)
    assert torch.equal(flux_image_ids(6, 10, dtype=F64), expected)


# --------------------------------------------------------------------------------------------
# classifier-free guidance
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w", [4.5, 0.5])
def test_sd3_cfg_value_and_gradient_through_conditional_half_only(w: float) -> None:
    tr = make_sd3()
    z, t, cond = split(sd3_inputs())
    ad = SD3Velocity(tr, guidance_scale=w)
    params = trainable(tr)
    gout = torch.randn(z.shape, generator=torch.Generator().manual_seed(9), dtype=F64)

    v = ad(z, t, **cond)
    v_c = sd3_direct(tr, z, t, cond["encoder_hidden_states"], cond["pooled_projections"])
    v_u = sd3_direct(
        tr, z, t, cond["negative_encoder_hidden_states"], cond["negative_pooled_projections"]
    )
    torch.testing.assert_close(v, v_u + w * (v_c - v_u), rtol=1e-10, atol=1e-12)

    g_ad = grads(v, params, gout)
    g_cond = [w * x for x in grads(v_c, params, gout)]
    assert_grads_close(g_ad, g_cond, 1e-10)
    # The full CFG gradient (through v_u too) is different: the test can tell them apart.
    g_full = grads(v_u + w * (v_c - v_u), params, gout)
    err = math.sqrt(sum(float((a - b).pow(2).sum()) for a, b in zip(g_ad, g_full, strict=True)))
    assert err > 1e-3


def test_flux_cfg_value_and_gradient_through_conditional_half_only() -> None:
    # diffusers' apply_rotary_emb rounds q/k to float32 even for float64 inputs, so J^T (w g)
    # and w J^T g only agree to ~1e-8 for a general w; a power of two makes the scaling
    # exact in floating point and keeps the comparison at 1e-10.
    w = 4.0
    tr = make_flux()
    z, t, cond = split(flux_inputs())
    ad = FluxVelocity(tr, guidance_scale=w, guidance=3.5)
    params = trainable(tr)
    gout = torch.randn(z.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
    img, txt = cond["img_ids"], cond["txt_ids"]
    v = ad(z, t, **cond)
    v_c = flux_direct(tr, z, t, cond["encoder_hidden_states"], cond["pooled_projections"], img, txt)
    v_u = flux_direct(
        tr,
        z,
        t,
        cond["negative_encoder_hidden_states"],
        cond["negative_pooled_projections"],
        img,
        txt,
    )
    torch.testing.assert_close(v, v_u + w * (v_c - v_u), rtol=1e-10, atol=1e-12)
    assert_grads_close(grads(v, params, gout), [w * x for x in grads(v_c, params, gout)], 1e-10)


def test_guidance_scale_one_is_plain_call() -> None:
    tr = make_sd3()
    z, t, cond = split(sd3_inputs())
    assert not SD3Velocity(tr, guidance_scale=1.0).uses_cfg
    assert torch.equal(
        SD3Velocity(tr, guidance_scale=1.0)(z, t, **cond), SD3Velocity(tr)(z, t, **cond)
    )


# --------------------------------------------------------------------------------------------
# LoRA and the reference policy
# --------------------------------------------------------------------------------------------


def _perturb_lora(module: nn.Module, seed: int = 5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(module):
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_lora_only_adapter_weights_get_gradients(kind: str) -> None:
    if kind == "sd3":
        tr, inputs, ad_cls, kw = make_sd3(), sd3_inputs(), SD3Velocity, {}
    else:
        tr, inputs, ad_cls, kw = make_flux(), flux_inputs(), FluxVelocity, {"guidance": 3.5}
    z, t, cond = split(inputs)
    base_v = ad_cls(tr, **kw)(z, t, **positive(cond)).detach()
    params = add_lora(tr, rank=2)
    assert params and all(p.requires_grad for p in params)
    ids = {id(p) for p in params}
    assert all(not p.requires_grad for p in tr.parameters() if id(p) not in ids)
    assert {id(p) for p in trainable(tr)} == ids
    ad = ad_cls(tr, **kw)
    # peft initialises B = 0: the adapted model starts as the base model (to round-off:
    # peft's layer evaluates the base linear through a different kernel path).
    torch.testing.assert_close(ad(z, t, **positive(cond)), base_v, rtol=1e-12, atol=1e-12)
    _perturb_lora(tr)
    ad(z, t, **positive(cond)).pow(2).sum().backward()
    for p in tr.parameters():
        if id(p) in ids:
            assert p.grad is not None and torch.isfinite(p.grad).all()
        else:
            assert p.grad is None
    assert sum(float(p.grad.abs().sum()) for p in params) > 0


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_reference_velocity_disables_adapters_under_no_grad(kind: str) -> None:
    if kind == "sd3":
        tr, inputs, ad_cls, kw = make_sd3(), sd3_inputs(), SD3Velocity, {}
    else:
        tr, inputs, ad_cls, kw = make_flux(), flux_inputs(), FluxVelocity, {"guidance": 3.5}
    z, t, cond = split(inputs)
    pos = positive(cond)
    base_v = ad_cls(tr, **kw)(z, t, **pos).detach()
    params = add_lora(tr, rank=2)
    _perturb_lora(tr)
    ad = ad_cls(tr, **kw)
    policy = ad(z, t, **pos)
    assert (policy - base_v).abs().max() > 1e-4
    ref = reference_velocity(ad, z, t, **pos)
    assert not ref.requires_grad
    torch.testing.assert_close(ref, base_v, rtol=1e-12, atol=1e-12)
    # State restored: adapters on, the same parameters trainable as before.
    assert {id(p) for p in trainable(tr)} == {id(p) for p in params}
    torch.testing.assert_close(ad(z, t, **pos), policy, rtol=0, atol=0)
    with pytest.raises(RuntimeError), adapters_disabled(ad):
        raise RuntimeError("boom")
    torch.testing.assert_close(ad(z, t, **pos), policy, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no peft adapter"):
        reference_velocity(SD3Velocity(make_sd3()), z, t, **pos)


def test_add_lora_bad_arguments() -> None:
    tr = make_sd3()
    with pytest.raises(ValueError, match="rank"):
        add_lora(tr, rank=0)
    with pytest.raises(ValueError, match="target_modules"):
        add_lora(tr, target_modules=["no_such_layer"])
    with pytest.raises(ValueError, match="dropout"):
        add_lora(tr, dropout=1.5)
    with pytest.raises(TypeError, match="transformer"):
        add_lora("not a module")  # type: ignore[arg-type]
    # Nothing was frozen by the failed calls (validation happens before any change).
    assert all(p.requires_grad for p in tr.parameters())


# --------------------------------------------------------------------------------------------
# gradient checkpointing and autocast
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize("lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradient(kind: str, lora: bool) -> None:
    if kind == "sd3":
        tr, inputs, ad_cls, kw = make_sd3(), sd3_inputs(), SD3Velocity, {"guidance_scale": 2.0}
    else:
        tr, inputs = make_flux(), flux_inputs()
        ad_cls, kw = FluxVelocity, {"guidance_scale": 2.0, "guidance": 3.5}
    if lora:
        add_lora(tr, rank=2)
        _perturb_lora(tr)
    z, t, cond = split(inputs)
    params = trainable(tr)
    gout = torch.randn(z.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    ad = ad_cls(tr, **kw)
    v_off = ad(z, t, **cond)
    g_off = grads(v_off, params, gout)
    tr.enable_gradient_checkpointing()
    assert tr.gradient_checkpointing
    v_on = ad(z, t, **cond)
    g_on = grads(v_on, params, gout)
    torch.testing.assert_close(v_on, v_off, rtol=1e-12, atol=1e-12)
    assert_grads_close(g_on, g_off, 1e-10)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_returns_fp32_close_to_fp32_and_backprops(dtype: torch.dtype) -> None:
    tr = make_sd3(dtype=torch.float32)
    add_lora(tr, rank=2)
    _perturb_lora(tr)
    z, t, cond = split(sd3_inputs(dtype=torch.float32))
    ref = SD3Velocity(tr, guidance_scale=2.0)(z, t, **cond)
    ad = SD3Velocity(tr, guidance_scale=2.0, autocast_dtype=dtype)
    try:
        v = ad(z, t, **cond)
    except RuntimeError as e:  # pragma: no cover - depends on the CPU build
        pytest.skip(f"CPU autocast {dtype} unsupported here: {e}")
    assert v.dtype == torch.float32
    rel = float((v - ref).detach().norm() / ref.detach().norm())
    assert rel < 0.05, rel
    v.pow(2).sum().backward()
    lp = lora_parameters(tr)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in lp)
    assert all(torch.isfinite(p.grad).all() for p in lp)


def test_low_precision_weights_are_fed_matching_inputs() -> None:
    tr = make_sd3(dtype=torch.bfloat16)
    z, t, cond = split(sd3_inputs(dtype=torch.float32))
    v = SD3Velocity(tr)(z, t, **positive(cond))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    v16 = SD3Velocity(tr, output_dtype=torch.bfloat16)(z, t, **positive(cond))
    assert v16.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------------------------


def test_unknown_model_class_is_type_error_naming_transformer() -> None:
    with pytest.raises(TypeError, match="transformer"):
        velocity_adapter(nn.Linear(3, 3))
    with pytest.raises(TypeError, match="transformer.*SD3Transformer2DModel"):
        SD3Velocity(make_flux())
    with pytest.raises(TypeError, match="transformer.*FluxTransformer2DModel"):
        FluxVelocity(make_sd3())
    assert isinstance(velocity_adapter(make_sd3()), SD3Velocity)
    assert isinstance(velocity_adapter(make_flux(), guidance=3.5), FluxVelocity)


def test_bad_arguments_are_clear_errors() -> None:
    sd3, flux = make_sd3(), make_flux()
    z, t, cond = split(sd3_inputs())
    pos = positive(cond)
    with pytest.raises(ValueError, match="guidance_scale"):
        SD3Velocity(sd3, guidance_scale=float("nan"))
    with pytest.raises(ValueError, match="autocast_dtype"):
        SD3Velocity(sd3, autocast_dtype=torch.float64)
    with pytest.raises(ValueError, match="timestep_scale"):
        SD3Velocity(sd3, timestep_scale=0.0)
    with pytest.raises(ValueError, match="t must have shape"):
        SD3Velocity(sd3)(z, t[:2], **pos)
    with pytest.raises(ValueError, match="z must have shape"):
        SD3Velocity(sd3)(z[:, :2], t, **pos)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        SD3Velocity(sd3)(
            z,
            t,
            encoder_hidden_states=pos["encoder_hidden_states"][:2],
            pooled_projections=pos["pooled_projections"],
        )
    with pytest.raises(ValueError, match="negative_encoder_hidden_states"):
        SD3Velocity(sd3, guidance_scale=3.0)(z, t, **pos)
    with pytest.raises(ValueError, match="guidance_embeds=False"):
        FluxVelocity(make_flux(guidance=False), guidance=3.5)

    fz, ft, fcond = split(flux_inputs())
    fpos = positive(fcond)
    with pytest.raises(ValueError, match="guidance is required"):
        FluxVelocity(flux)(fz, ft, **fpos)
    tiled = dict(fpos, img_ids=fpos["img_ids"].repeat(2, 1))
    with pytest.raises(ValueError, match="batched_cond"):
        FluxVelocity(flux, guidance=3.5)(fz, ft, **tiled)
    bad3 = fpos["img_ids"].expand(B, -1, -1).clone()
    bad3[1] += 1
    with pytest.raises(ValueError, match="img_ids"):
        FluxVelocity(flux, guidance=3.5)(fz, ft, **dict(fpos, img_ids=bad3))
    with pytest.raises(ValueError, match="packed latents"):
        FluxVelocity(flux, guidance=3.5)(z, ft, **fpos)


def test_batched_cond_keys_skips_position_ids() -> None:
    _, _, cond = split(flux_inputs(n=TOKENS))  # batch size == text length: the trap case
    keys = batched_cond_keys(cond, TOKENS)
    assert "txt_ids" not in keys and "img_ids" not in keys
    assert {"encoder_hidden_states", "pooled_projections"} <= keys
    with pytest.raises(ValueError, match="batch_size"):
        batched_cond_keys(cond, 0)


# --------------------------------------------------------------------------------------------
# through the core: jagg_window
# --------------------------------------------------------------------------------------------

_HAS_CORE = hasattr(jagg_autograd, "jagg_window") and hasattr(jagg_autograd, "CosineRouter")
needs_core = pytest.mark.skipif(not _HAS_CORE, reason="jagg_autograd.jagg_window not available")


def _window_setup(kind: str, W: int, lora: bool, cfg: bool):
    if kind == "sd3":
        tr, inputs = make_sd3(), sd3_inputs()
        ad = SD3Velocity(tr, guidance_scale=2.5 if cfg else None)
    else:
        tr, inputs = make_flux(), flux_inputs()
        ad = FluxVelocity(tr, guidance_scale=2.5 if cfg else None, guidance=3.5)
    if lora:
        add_lora(tr, rank=2)
        _perturb_lora(tr)
    z0, _, cond = split(inputs)
    if not cfg:
        cond = positive(cond)
    g = torch.Generator().manual_seed(11)
    latents = torch.stack(
        [z0 + 0.3 * k * torch.randn(z0.shape, generator=g, dtype=F64) for k in range(W)]
    )
    timesteps = torch.linspace(0.9, 0.2, W, dtype=F64)
    upstream = torch.randn(latents.shape, generator=g, dtype=F64)
    return tr, ad, latents, timesteps, cond, upstream


def _window_grads(tr, ad, latents, timesteps, cond, upstream, **kw):
    params = trainable(tr)
    out = jagg_autograd.jagg_window(
        ad,
        latents,
        timesteps,
        cond=cond,
        batched_cond=batched_cond_keys(cond, latents.shape[1]),
        **kw,
    )
    v, stats = out if kw.get("return_stats") else (out, None)
    return v, list(torch.autograd.grad((v * upstream).sum(), params)), stats


@needs_core
@pytest.mark.parametrize("kind", ["sd3", "flux"])
@pytest.mark.parametrize("lora,cfg", [(False, False), (True, True)])
def test_jagg_equals_exact_at_w2(kind: str, lora: bool, cfg: bool) -> None:
    tr, ad, latents, timesteps, cond, up = _window_setup(kind, 2, lora, cfg)
    v_e, g_e, _ = _window_grads(tr, ad, latents, timesteps, cond, up, mode="exact")
    v_j, g_j, _ = _window_grads(tr, ad, latents, timesteps, cond, up, mode="jagg")
    torch.testing.assert_close(v_j, v_e, rtol=1e-12, atol=1e-12)
    assert_grads_close(g_j, g_e, 1e-10)
    # Values are the step-by-step adapter calls.
    for k in range(2):
        torch.testing.assert_close(
            v_e[k], ad(latents[k], timesteps[k].expand(B), **cond), rtol=1e-12, atol=1e-12
        )


@needs_core
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_w4_runs_and_routes_through_adapters(kind: str) -> None:
    W = 4
    tr, ad, latents, timesteps, cond, up = _window_setup(kind, W, lora=True, cfg=True)
    CosineRouter = jagg_autograd.CosineRouter
    _, g_exact, _ = _window_grads(tr, ad, latents, timesteps, cond, up, mode="exact")
    _, g_jagg, st_j = _window_grads(
        tr, ad, latents, timesteps, cond, up, mode="jagg", return_stats=True
    )
    assert st_j.scores.shape == (B,) and st_j.exact.shape == (B,)
    assert not bool(st_j.exact.any())
    assert st_j.grad_samples == 2 * B
    assert all(torch.isfinite(x).all() for x in g_jagg)
    # Routing everything to exact (threshold above 1) reproduces the exact gradient.
    _, g_forced, st_f = _window_grads(
        tr,
        ad,
        latents,
        timesteps,
        cond,
        up,
        mode="jagg",
        router=CosineRouter(threshold=1.5),
        return_stats=True,
    )
    assert bool(st_f.exact.all())
    assert st_f.grad_samples == 2 * B + (W - 2) * B
    assert_grads_close(g_forced, g_exact, 1e-10)
    # A mixed batch: jagg_frac keeps ceil(0.3 B) = 1 sample on JAGG, routes the others.
    _, g_mix, st_m = _window_grads(
        tr,
        ad,
        latents,
        timesteps,
        cond,
        up,
        mode="jagg",
        router=CosineRouter(threshold=-2.0, jagg_frac=0.3),
        return_stats=True,
    )
    assert int(st_m.exact.sum()) == B - 1
    assert st_m.grad_samples == 2 * B + (W - 2) * (B - 1)
    assert all(torch.isfinite(x).all() for x in g_mix)
    # Scores are cosines of the adapters' own velocities: within [-1, 1].
    assert bool(((st_j.scores >= -1 - 1e-9) & (st_j.scores <= 1 + 1e-9)).all())


@needs_core
def test_flux_position_ids_tiled_by_the_core_are_caught() -> None:
    # Batch size == text length: without batched_cond the core tiles txt_ids like a
    # per-sample tensor; the adapter must refuse it rather than mis-read positions.
    n = TOKENS
    tr = make_flux()
    ad = FluxVelocity(tr, guidance=3.5)
    z0, _, cond = split(flux_inputs(n=n))
    cond = positive(cond)
    latents = torch.stack([z0, 0.5 * z0])
    timesteps = torch.tensor([0.8, 0.4], dtype=F64)
    with pytest.raises(ValueError, match="batched_cond"):
        jagg_autograd.jagg_window(ad, latents, timesteps, cond=cond)
    v = jagg_autograd.jagg_window(
        ad, latents, timesteps, cond=cond, batched_cond=batched_cond_keys(cond, n)
    )
    torch.testing.assert_close(v[1], ad(latents[1], timesteps[1].expand(n), **cond))
