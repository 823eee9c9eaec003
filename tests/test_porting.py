"""docs/porting.md, run: Flow-GRPO's per-timestep training loop vs its port onto the library.

A tiny random ``SD3Transformer2DModel`` with peft LoRA (random A and B, so the KL term and
every LoRA gradient are non-zero), CFG with Flow-GRPO's semantics, the KL term, T' = 4 of
T = 5 steps, 4 minibatches of 2 with gradient accumulation 2 (two optimizer steps per
epoch).  The reference loop is written the way ``train_sd3.py``'s is: one transformer call
and one backward per timestep inside an accumulation of ``GA * T'`` backward calls, the
KL reference recomputed at every step with the adapters disabled.  The ported loop is the
code of docs/porting.md, executed from the page itself.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("peft")

from jagg_autograd import jagg_trajectory  # noqa: E402
from jagg_autograd.grpo import flow_match_sigmas, scheduler_sigmas, sde_step_with_logprob  # noqa: E402
from jagg_autograd.integrations.diffusers import SD3Velocity, adapters_disabled, add_lora  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "porting.md"
T, B, MB, GA, W_CFG = 5, 8, 2, 2, 4.5


def doc_blocks(*names: str) -> dict:
    """Execute the python blocks marked ``<!-- porting-test: NAME -->`` in docs/porting.md,
    in order, in one namespace (as a reader pasting them into one file would)."""
    text = DOC.read_text(encoding="utf-8")
    ns: dict = {}
    for name in names:
        m = re.search(rf"<!-- porting-test: {name} -->\s*```python\n(.*?)```", text, re.S)
        assert m, f"block {name} not found in {DOC}"
        exec(compile(m.group(1), f"{DOC}:{name}", "exec"), ns)
    return ns


def make_transformer(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    tr = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8,
    )  # fmt: skip
    add_lora(tr, rank=4, init_lora_weights=False)  # random A and B: B != 0
    return tr.to(dtype)


def make_config(dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1)
    return SimpleNamespace(
        sample=SimpleNamespace(num_steps=T, noise_level=0.7, guidance_scale=W_CFG),
        train=SimpleNamespace(
            timestep_fraction=0.8, clip_range=1e-4, adv_clip_max=5.0, beta=0.04,
            gradient_accumulation_steps=GA, max_grad_norm=1.0, learning_rate=1e-3,
        ),
        train_neg_prompt_embeds=torch.randn(1, 6, 16, generator=g).to(dtype),
        train_neg_pooled_prompt_embeds=torch.randn(1, 8, generator=g).to(dtype),
    )  # fmt: skip


@torch.no_grad()
def flowgrpo_rollout(transformer, config, dtype):
    """Flow-GRPO's pipeline_with_logprob + sample collection, in their (B, T, ...) layout,
    with the one added line that keeps the CFG velocity."""
    sch = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    sigmas = scheduler_sigmas(sch, T)  # also sets sch.timesteps = 1000 * sigma
    s = sigmas.tolist()
    g = torch.Generator().manual_seed(2)
    samples = []
    for _ in range(B // MB):
        ehs = torch.randn(MB, 6, 16, generator=g).to(dtype)
        pooled = torch.randn(MB, 8, generator=g).to(dtype)
        neg = config.train_neg_prompt_embeds.expand(MB, -1, -1)
        neg_p = config.train_neg_pooled_prompt_embeds.expand(MB, -1)
        z = torch.randn(MB, 4, 8, 8, generator=g).to(dtype)
        all_latents, all_log_probs, all_velocities = [z], [], []
        for i, t in enumerate(sch.timesteps):
            noise_pred = transformer(
                hidden_states=torch.cat([z] * 2), timestep=t.expand(2 * MB).to(dtype),
                encoder_hidden_states=torch.cat([neg, ehs]),
                pooled_projections=torch.cat([neg_p, pooled]), return_dict=False,
            )[0]  # fmt: skip
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + W_CFG * (noise_pred_text - noise_pred_uncond)
            all_velocities.append(noise_pred)  # <- the one line
            z, log_prob, _, _ = sde_step_with_logprob(
                noise_pred, z, s[i], s[i + 1], noise_level=0.7, sigma_max=s[1], generator=g
            )
            all_latents.append(z)
            all_log_probs.append(log_prob)
        latents = torch.stack(all_latents, dim=1)  # (MB, T + 1, 4, 8, 8)
        adv = torch.randn(MB, generator=g).to(dtype)
        samples.append({
            "prompt_embeds": ehs, "pooled_prompt_embeds": pooled,
            "timesteps": sch.timesteps.repeat(MB, 1).to(dtype),  # (MB, T), 1000 * sigma
            "latents": latents[:, :-1], "next_latents": latents[:, 1:],
            "log_probs": torch.stack(all_log_probs, dim=1),
            "velocities": torch.stack(all_velocities, dim=1),
            "advantages": adv[:, None].repeat(1, T),
        })  # fmt: skip
    return samples, sigmas


def _flat_grads(params):
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in params])


def _flat(params):
    return torch.cat([p.detach().reshape(-1).clone() for p in params])


def compute_log_prob(transformer, sample, embeds, pooled, s, config, dtype, j):
    """Flow-GRPO's compute_log_prob: one CFG transformer call at step j, then the SDE step."""
    noise_pred = transformer(
        hidden_states=torch.cat([sample["latents"][:, j]] * 2),
        timestep=torch.cat([sample["timesteps"][:, j]] * 2),
        encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False,
    )[0]  # fmt: skip
    noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
    noise_pred_uncond = noise_pred_uncond.detach()
    noise_pred = noise_pred_uncond + W_CFG * (noise_pred_text - noise_pred_uncond)
    return sde_step_with_logprob(
        noise_pred.to(dtype), sample["latents"][:, j].to(dtype), s[j], s[j + 1],
        noise_level=config.sample.noise_level, sigma_max=s[1],
        prev_sample=sample["next_latents"][:, j].to(dtype),
    )  # fmt: skip


def flowgrpo_train(transformer, samples, sigmas, config, dtype):
    """Flow-GRPO's training phase (train_sd3.py), accelerate's accumulation emulated:
    every per-step loss divided by GA * T', optimizer step and zero_grad on sync only."""
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.train.learning_rate)
    Tp = int(config.sample.num_steps * config.train.timestep_fraction)
    n_acc = config.train.gradient_accumulation_steps * Tp  # their Accelerator's count
    s = sigmas.tolist()
    count, first_sync = 0, None
    for sample in samples:
        mb = sample["latents"].shape[0]
        embeds = torch.cat([config.train_neg_prompt_embeds.expand(mb, -1, -1),
                            sample["prompt_embeds"]])  # fmt: skip
        pooled = torch.cat([config.train_neg_pooled_prompt_embeds.expand(mb, -1),
                            sample["pooled_prompt_embeds"]])  # fmt: skip

        args = (transformer, sample, embeds, pooled, s, config, dtype)
        for j in range(Tp):
            _, log_prob, mean, std_dev_t = compute_log_prob(*args, j)
            with adapters_disabled(transformer):
                mean_ref = compute_log_prob(*args, j)[2]
            advantages = torch.clamp(sample["advantages"][:, j], -5.0, 5.0)
            ratio = torch.exp(log_prob - sample["log_probs"][:, j])
            unclipped = -advantages * ratio
            clipped = -advantages * torch.clamp(ratio, 1.0 - 1e-4, 1.0 + 1e-4)
            policy_loss = torch.mean(torch.maximum(unclipped, clipped))
            kl_loss = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (
                2 * std_dev_t**2
            )
            loss = policy_loss + config.train.beta * torch.mean(kl_loss)
            (loss / n_acc).backward()
            count += 1
            if count % n_acc == 0:  # accelerator.sync_gradients
                if first_sync is None:
                    first_sync = _flat_grads(params)
                torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
                opt.step()
                opt.zero_grad()
    return first_sync, params


def ported_train(transformer, samples, sigmas, config, *, mode, use_values):
    """The loop of docs/porting.md section 3 (accelerate's accumulation emulated)."""
    ns = doc_blocks("train_minibatch", "reference_means")
    velocity = SD3Velocity(transformer, guidance_scale=W_CFG)
    params = [p for p in transformer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.train.learning_rate)
    ref = [ns["reference_means"](velocity, s, sigmas, config) for s in samples]
    first_sync, ratios, steps = None, [], 0
    for i, sample in enumerate(samples):
        on_policy = steps == 0
        loss, ratio = ns["train_minibatch"](
            velocity, sample, sigmas, config, ref_means=ref[i],
            values=sample["velocities"].transpose(0, 1) if (use_values and on_policy) else None,
            params=params, mode=mode,
        )  # fmt: skip
        ratios.append((on_policy, ratio))
        (loss / GA).backward()
        if (i + 1) % GA == 0:
            if first_sync is None:
                first_sync = _flat_grads(params)
            torch.nn.utils.clip_grad_norm_(params, config.train.max_grad_norm)
            opt.step()
            opt.zero_grad()
            steps += 1
    return first_sync, params, ratios


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _run(dtype, mode, use_values=False):
    config = make_config(dtype)
    ref_tr = make_transformer(dtype)
    samples, sigmas = flowgrpo_rollout(ref_tr, config, dtype)
    p0 = _flat([p for p in ref_tr.parameters() if p.requires_grad])
    g_ref, p_ref = flowgrpo_train(ref_tr, samples, sigmas, config, dtype)
    port_tr = make_transformer(dtype)
    g_port, p_port, ratios = ported_train(
        port_tr, samples, sigmas, config, mode=mode, use_values=use_values
    )
    upd_ref, upd_port = _flat(p_ref) - p0, _flat(p_port) - p0
    return g_ref, g_port, upd_ref, upd_port, ratios


# (dtype, gradient tolerance, update tolerance).  The float64 row proves the math (1e-10
# for both).  In float32 the gradient agrees to ~6e-8; the parameter update after a whole
# epoch of AdamW steps amplifies round-off (Adam divides each gradient by its own running
# RMS, so parameters with tiny gradients carry relative round-off into the update): we
# measured 8.2e-7 and 1.007e-6 on two CI runs of the same code (2 threads, summation
# order), so its tolerance is 5e-6 rather than the gradient's 1e-6.
@pytest.mark.parametrize(
    "dtype, tol, tol_upd", [(torch.float32, 1e-6, 5e-6), (torch.float64, 1e-10, 1e-10)]
)
def test_exact_port_equals_flowgrpo_loop(dtype, tol, tol_upd):
    g_ref, g_port, upd_ref, upd_port, _ = _run(dtype, "exact")
    assert float(g_ref.abs().min()) >= 0 and float(g_ref.norm()) > 0
    e_grad, e_upd = _rel(g_port, g_ref), _rel(upd_port, upd_ref)
    print(f"\n[porting] {dtype}: first-sync gradient rel err {e_grad:.2e}, "
          f"parameter update after the epoch rel err {e_upd:.2e}")  # fmt: skip
    assert e_grad <= tol and e_upd <= tol_upd


def test_jagg_port_cosine_and_on_policy_ratios():
    """JAGG (T' = 4: one window, anchors 0 and 3) with values= on the on-policy minibatches:
    every on-policy ratio exactly 1; the cosine to the per-step loop is reported."""
    if "values" not in __import__("inspect").signature(jagg_trajectory).parameters:
        pytest.skip("jagg_trajectory has no values= in this build")
    g_ref, g_port, upd_ref, upd_port, ratios = _run(torch.float32, "jagg", use_values=True)
    cos = float(torch.nn.functional.cosine_similarity(g_port, g_ref, dim=0))
    print(f"\n[porting] JAGG W=4 first-sync gradient cosine {cos:.4f}, rel err "
          f"{_rel(g_port, g_ref):.3f}; update cosine "
          f"{float(torch.nn.functional.cosine_similarity(upd_port, upd_ref, dim=0)):.4f}")  # fmt: skip
    on = [r for p, r in ratios if p]
    assert len(on) == GA and all(torch.equal(r, torch.ones_like(r)) for r in on)
    off = [r for p, r in ratios if not p]
    assert any(not torch.equal(r, torch.ones_like(r)) for r in off)  # not vacuous
    assert cos > 0.5


# ---------------------------------------------------------------- the traps, fixed


def test_adapter_refuses_1000_sigma_and_keeps_its_inputs():
    tr = make_transformer(torch.float32)
    v = SD3Velocity(tr, guidance_scale=W_CFG)
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4, 8, 8, generator=g)
    cond = {
        "encoder_hidden_states": torch.randn(2, 6, 16, generator=g),
        "pooled_projections": torch.randn(2, 8, generator=g),
        "negative_encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
        "negative_pooled_projections": torch.randn(1, 8, generator=g),
    }
    sigmas = flow_match_sigmas(4, 3.0, dtype=torch.float32)
    with pytest.raises(ValueError, match="timestep_scale"):
        v(z, (1000 * sigmas[1]).expand(2), **cond)
    # The check reads t only: the call is bit-identical to Flow-GRPO's transformer call.
    t = sigmas[1].expand(2)
    with torch.no_grad():
        out = v(z, t, **cond)
        raw = tr(
            hidden_states=torch.cat([z] * 2), timestep=torch.cat([t * 1000] * 2),
            encoder_hidden_states=torch.cat([cond["negative_encoder_hidden_states"].expand(2, -1, -1),
                                             cond["encoder_hidden_states"]]),
            pooled_projections=torch.cat([cond["negative_pooled_projections"].expand(2, -1),
                                          cond["pooled_projections"]]),
            return_dict=False,
        )[0]  # fmt: skip
    u, c = raw.chunk(2)
    assert torch.equal(out, u + W_CFG * (c - u))
    # a custom scale is the caller's convention: nothing is checked
    v1 = SD3Velocity(tr, guidance_scale=W_CFG, timestep_scale=1.0)
    with torch.no_grad():
        v1(z, (1000 * t), **cond)


def test_transposed_layout_is_named_before_any_model_call():
    calls = []

    def model(z, t):
        calls.append(1)
        return z

    lat = torch.randn(4, 6, 3)  # Flow-GRPO's (B=4, T=6, ...)
    sig = flow_match_sigmas(6, 3.0)[:-1]
    for ts in (sig.expand(4, 6), sig):
        with pytest.raises(ValueError, match=re.escape("(T, B, ...)")) as exc:
            jagg_trajectory(model, lat, ts, window=2)
        assert "transpose" in str(exc.value)
    assert not calls
    jagg_trajectory(model, lat.transpose(0, 1), sig, window=2)  # the fix: a view
    assert calls


def test_bf16_gradient_round_off():
    """Stacked batching under bf16 autocast changes the exact-mode GRADIENT against a
    per-step loop by ~1e-3 relative (batch-size-dependent round-off); per_step: 0."""
    config = make_config(torch.float32)
    tr = make_transformer(torch.float32)
    samples, sigmas = flowgrpo_rollout(tr, config, torch.float32)
    s = samples[0]
    lat = s["latents"].transpose(0, 1)
    n, T_ = lat.shape[1], lat.shape[0]
    cond = {
        "encoder_hidden_states": s["prompt_embeds"],
        "pooled_projections": s["pooled_prompt_embeds"],
        "negative_encoder_hidden_states": config.train_neg_prompt_embeds,
        "negative_pooled_projections": config.train_neg_pooled_prompt_embeds,
    }
    params = [p for p in tr.parameters() if p.requires_grad]
    g = torch.randn(lat.shape, generator=torch.Generator().manual_seed(3))

    def grad_of(loss):
        return torch.cat([x.reshape(-1) for x in torch.autograd.grad(loss, params)]).double()

    errs = {}
    for prec, ac in (("fp32", None), ("bf16", torch.bfloat16)):
        vel = SD3Velocity(tr, guidance_scale=W_CFG, autocast_dtype=ac)
        loop = sum(
            (vel(lat[k], torch.full((n,), float(sigmas[k])), **cond) * g[k]).sum()
            for k in range(T_)
        )
        ref = grad_of(loop)
        for batching in ("stacked", "per_step"):
            v = jagg_trajectory(vel, lat, sigmas[:-1], window=T_, cond=cond, mode="exact",
                                batching=batching)  # fmt: skip
            errs[prec, batching] = _rel(grad_of((v * g).sum()), ref)
    print(f"\n[porting] gradient vs the per-step loop: {errs}")
    assert errs["fp32", "per_step"] <= 1e-6 and errs["bf16", "per_step"] <= 1e-6
    assert errs["fp32", "stacked"] <= 1e-5
    assert 1e-5 < errs["bf16", "stacked"] < 5e-2


# ------------------------------------------------------------------------ DiffusionNFT


def nft_their_loop(velocity, x0, sigmas, adv, config, cond, reference, generator):
    """train_nft_sd3.py's timestep loop written out, with ONE noise per sample (shared):
    old forward, trained forward, reference forward, the adaptive-weighted x0 losses, the
    KL, a backward per timestep divided by K (GA = 1)."""
    K = sigmas.shape[1]
    noise = torch.randn(x0.shape, generator=generator, dtype=x0.dtype)  # shared
    for j in range(K):
        t = sigmas[:, j]
        t_expanded = t.view(-1, *([1] * (len(x0.shape) - 1)))
        xt = (1 - t_expanded) * x0 + t_expanded * noise
        with torch.no_grad():
            old_prediction = velocity(xt, t, **cond).detach()
        forward_prediction = velocity(xt, t, **cond)
        with torch.no_grad():
            ref_forward_prediction = reference(xt, t, **cond)
        r = torch.clamp(
            (torch.clamp(adv, -config.train.adv_clip_max, config.train.adv_clip_max)
             / config.train.adv_clip_max) / 2.0 + 0.5, 0, 1,
        )  # fmt: skip
        positive_prediction = config.beta * forward_prediction + (1 - config.beta) * old_prediction
        implicit_negative_prediction = (1.0 + config.beta) * old_prediction - (
            config.beta * forward_prediction
        )
        dims = tuple(range(1, x0.ndim))
        x0_prediction = xt - t_expanded * positive_prediction
        with torch.no_grad():
            wf = torch.abs(x0_prediction.double() - x0.double()).mean(dim=dims, keepdim=True)
            wf = wf.clip(min=0.00001)
        positive_loss = ((x0_prediction - x0) ** 2 / wf).mean(dim=dims)
        negative_x0_prediction = xt - t_expanded * implicit_negative_prediction
        with torch.no_grad():
            nwf = torch.abs(negative_x0_prediction.double() - x0.double()).mean(dim=dims,
                                                                               keepdim=True)
            nwf = nwf.clip(min=0.00001)
        negative_loss = ((negative_x0_prediction - x0) ** 2 / nwf).mean(dim=dims)
        ori_policy_loss = r * positive_loss / config.beta + (1.0 - r) * negative_loss / config.beta
        policy_loss = (ori_policy_loss * config.train.adv_clip_max).mean()
        kl_div_loss = ((forward_prediction - ref_forward_prediction) ** 2).mean(dim=dims)
        loss = policy_loss + config.train.beta * torch.mean(kl_div_loss)
        (loss / K).backward()


def _nft_config():
    return SimpleNamespace(beta=0.7, train=SimpleNamespace(adv_clip_max=5.0, beta=0.05))


def _nft_sigmas(B: int, K: int, g: torch.Generator, dtype) -> torch.Tensor:
    grid = torch.linspace(1.0, 0.1, 10, dtype=dtype)
    return torch.stack([grid[torch.randperm(10, generator=g)[:K]] for _ in range(B)])  # (B, K)


def _run_both(velocity, params, x0, sigmas, adv, cond, reference, **kw):
    cfg = _nft_config()
    for p in params:
        p.grad = None
    nft_their_loop(velocity, x0, sigmas, adv, cfg, cond, reference, torch.Generator().manual_seed(5))
    want = _flat_grads(params)
    for p in params:
        p.grad = None
    ns = doc_blocks("nft_minibatch")
    loss = ns["nft_minibatch"](velocity, x0, sigmas, adv, cfg, cond=cond, reference=reference,
                               generator=torch.Generator().manual_seed(5), **kw)  # fmt: skip
    loss.backward()
    return _flat_grads(params), want


def test_nft_port_exact_equals_their_loop_on_sd3_lora():
    """The ported call in mode="exact" on a tiny SD3 transformer with LoRA (shared noise)."""
    dtype = torch.float64
    tr = make_transformer(dtype)
    velocity = SD3Velocity(tr)
    params = [p for p in tr.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(3)
    B, K = 3, 4
    x0 = torch.randn(B, 4, 8, 8, generator=g, dtype=dtype)
    cond = {"encoder_hidden_states": torch.randn(B, 6, 16, generator=g, dtype=dtype),
            "pooled_projections": torch.randn(B, 8, generator=g, dtype=dtype)}  # fmt: skip
    adv = torch.randn(B, generator=g, dtype=dtype) * 2

    def reference(x, t, **c):
        with adapters_disabled(tr):
            return velocity(x, t, **c)

    got, want = _run_both(velocity, params, x0, _nft_sigmas(B, K, g, dtype), adv, cond,
                          reference, mode="exact")  # fmt: skip
    assert float(want.norm()) > 0
    assert float((got - want).norm() / want.norm()) < 1e-10


def test_nft_port_jagg_equals_their_loop_on_an_affine_model():
    """mode="jagg" (values, deferred, 2-4 anchors of K = 9): exact for a model affine in
    (z, t) with shared noise."""
    dtype = torch.float64
    g = torch.Generator().manual_seed(4)

    class Affine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(12, 12, dtype=dtype)
            self.b = torch.nn.Parameter(torch.randn(12, generator=g, dtype=dtype))

        def forward(self, x, t, y):
            return (self.lin(x.flatten(1)) + t[:, None] * self.b + y).view_as(x)

    model, ref = Affine(), Affine().requires_grad_(False)
    params = list(model.parameters())
    B, K = 4, 9
    x0 = torch.randn(B, 3, 4, generator=g, dtype=dtype)
    cond = {"y": torch.randn(B, 12, generator=g, dtype=dtype)}
    adv = torch.randn(B, generator=g, dtype=dtype) * 2
    sig = _nft_sigmas(B, K, g, dtype)
    for window in (3, 4, 5, 9):
        got, want = _run_both(model, params, x0, sig, adv, cond, ref, mode="jagg", window=window)
        assert float((got - want).abs().max()) <= 1e-10 * (1 + float(want.abs().max())), window
