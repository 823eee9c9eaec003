"""DiffusionNFT's loss with a JAGG gradient over each sample's timesteps (issue 20).

With one noise per sample ("shared"), a sample's inputs ``x_t = (1 - t) x_0 + t eps`` lie
on one segment, so for a model affine in ``(z, t)`` the JAGG gradient of the K-timestep
NFT loss through one ``jagg_trajectory`` call equals DiffusionNFT's per-timestep loop's,
for any anchors; with fresh noise per timestep it does not (the counter-property shows
the exactness test can fail).  Then the trainer's ``--nft-noise`` / ``--nft-gradient``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from jagg_autograd import jagg_trajectory
from jagg_autograd.estimators import Minibatch
from jagg_autograd.grpo import group_advantages
from jagg_autograd.nft import draw_timesteps, nft_loss, nft_noised, nft_timesteps_loss
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer, train

F64 = torch.float64
EXAMPLES = 10 if os.environ.get("CI") else 40
BETA, M, KL_BETA = 0.7, 5.0, 0.3


class Affine(nn.Module):
    """``v = A z + t b + c + E[y]``: affine in ``(z, t)`` (JAGG's exactness family (a))."""

    def __init__(self, d: int, gen: torch.Generator) -> None:
        super().__init__()
        self.A = nn.Parameter(0.3 * torch.randn(d, d, generator=gen, dtype=F64))
        self.b = nn.Parameter(torch.randn(d, generator=gen, dtype=F64))
        self.c = nn.Parameter(torch.randn(d, generator=gen, dtype=F64))
        self.E = nn.Parameter(torch.randn(10, d, generator=gen, dtype=F64))

    def forward(self, z: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = z.flatten(1) @ self.A.T + t[:, None] * self.b + self.c + self.E[y]
        return v.view_as(z)


def _problem(seed: int, K: int, B: int, shared: bool):
    g = torch.Generator().manual_seed(seed)
    model = Affine(6, g)
    x0 = torch.randn(B, 2, 3, generator=g, dtype=F64)
    y = torch.randint(0, 10, (B,), generator=g)
    sigmas = torch.linspace(1.0, 0.0, 11, dtype=F64)
    ts = draw_timesteps(sigmas, B, K, g).sort(dim=0, descending=True).values  # (K, B)
    shape = (B, 2, 3) if shared else (K, B, 2, 3)
    eps = torch.randn(*shape, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64) * 2
    return model, x0, y, ts, nft_noised(x0, ts, eps), adv


def _ref_model(model: Affine) -> Affine:
    ref = Affine(6, torch.Generator().manual_seed(99))
    with torch.no_grad():
        for p, q in zip(ref.parameters(), model.parameters()):
            p.copy_(q + 0.1 * p)
    return ref.requires_grad_(False)


def loop_grad(model, x0, y, ts, xt, adv, ref=None):
    """DiffusionNFT's loop: per timestep an old (no-grad) forward, a forward + backward of
    the trained model, the reference without grad, the loss divided by K."""
    model.zero_grad(set_to_none=True)
    K = xt.shape[0]
    for j in range(K):
        with torch.no_grad():
            v_old = model(xt[j], ts[j], y)
        v = model(xt[j], ts[j], y)
        loss = nft_loss(v, v_old, xt[j], x0, ts[j], adv, beta=BETA, adv_clip_max=M)
        if ref is not None:
            with torch.no_grad():
                v_ref = ref(xt[j], ts[j], y)
            loss = loss + KL_BETA * ((v - v_ref) ** 2).flatten(1).mean(1).mean()
        (loss / K).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def jagg_grad(model, x0, y, ts, xt, adv, ref=None, **kw):
    """One ``jagg_trajectory`` call over the K sorted timesteps, on-policy values."""
    model.zero_grad(set_to_none=True)
    K = xt.shape[0]
    with torch.no_grad():
        v_old = torch.stack([model(xt[j], ts[j], y) for j in range(K)])
        v_ref = None if ref is None else torch.stack([ref(xt[j], ts[j], y) for j in range(K)])
    v = jagg_trajectory(model, xt, ts, cond={"y": y}, values=v_old, deferred=True, **kw)
    loss, _ = nft_timesteps_loss(v, v_old, xt, x0, ts, adv, beta=BETA, adv_clip_max=M,
                                 v_ref=v_ref, kl_beta=KL_BETA)  # fmt: skip
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


# uniform windows (shared or disjoint anchors), or adaptive at budget 2 + b (K - 2)
anchors = st.one_of(
    st.builds(lambda w, s: {"window": w, "shared_anchors": s}, st.integers(2, 9), st.booleans()),
    st.builds(
        lambda w, b: {"window": w, "placement": "adaptive", "budget": b},
        st.integers(2, 9),
        st.floats(0.0, 1.0),
    ),
)


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(2, 9), B=st.integers(1, 4), kw=anchors,
       kl=st.booleans())  # fmt: skip
def test_shared_noise_jagg_equals_the_timestep_loop(seed, K, B, kw, kl):
    model, x0, y, ts, xt, adv = _problem(seed, K, B, shared=True)
    ref = _ref_model(model) if kl else None
    want = loop_grad(model, x0, y, ts, xt, adv, ref)
    kw = dict(kw, window=min(kw["window"], K))
    if "budget" in kw:
        kw["budget"] = 2 + kw["budget"] * (K - 2)
    got = jagg_grad(model, x0, y, ts, xt, adv, ref, **kw)
    assert float((got - want).abs().max()) <= 1e-10 * (1 + float(want.abs().max()))


@settings(max_examples=EXAMPLES, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(3, 9), B=st.integers(1, 4))
def test_fresh_noise_jagg_is_not_exact(seed, K, B):
    """The counter-property: fresh noise per timestep puts the inputs off one segment, and
    the same call (2 anchors for K >= 3 timesteps) misses the loop's gradient."""
    model, x0, y, ts, xt, adv = _problem(seed, K, B, shared=False)
    want = loop_grad(model, x0, y, ts, xt, adv)
    got = jagg_grad(model, x0, y, ts, xt, adv, window=K)
    rel = float((got - want).norm() / want.norm())
    assert rel > 1e-4, rel
    # ... and mode="exact" on the same inputs is the loop (the comparison itself is sound).
    ex = jagg_grad(model, x0, y, ts, xt, adv, window=K, mode="exact")
    assert float((ex - want).abs().max()) <= 1e-10 * (1 + float(want.abs().max()))


def test_adaptive_placement_is_group_fair():
    """Adaptive anchors over the sample's timesteps: every sample gets the same count, the
    remainder one more each (the planner's group-fair rule)."""
    model, x0, y, ts, xt, adv = _problem(3, 9, 8, shared=True)
    K = xt.shape[0]
    with torch.no_grad():
        v_old = torch.stack([model(xt[j], ts[j], y) for j in range(K)])
    v, stats = jagg_trajectory(model, xt, ts, cond={"y": y}, values=v_old, deferred=True,
                               window=4, placement="adaptive", budget=3.5,
                               return_stats=True)  # fmt: skip
    loss, _ = nft_timesteps_loss(v, v_old, xt, x0, ts, adv, beta=BETA, adv_clip_max=M)
    loss.backward()
    counts = stats.anchor_mask.sum(0)
    assert int(counts.sum()) == round(3.5 * 8)
    assert int(counts.max() - counts.min()) <= 1


# ------------------------------------------------------------------------ the trainer

DIGITS = dict(prompts_per_step=4, group_size=4, num_steps=10, window=4, eval_per_digit=0,
              progress=False)  # fmt: skip


def test_config_options_and_checks():
    assert GRPOConfig(mode="nft").num_train_steps == 9  # DiffusionNFT's int(0.99 * 10)
    assert GRPOConfig(mode="nft", num_steps=20).num_train_steps == 19
    assert GRPOConfig(mode="nft", nft_timesteps=4).num_train_steps == 4
    GRPOConfig(mode="nft", nft_noise="shared", nft_gradient="jagg").validate()
    with pytest.raises(ValueError, match="nft_noise='shared'"):
        GRPOConfig(mode="nft", nft_gradient="jagg").validate()
    with pytest.raises(ValueError, match="nft_noise"):
        GRPOConfig(nft_noise="same").validate()
    with pytest.raises(ValueError, match="nft_gradient"):
        GRPOConfig(nft_gradient="approx").validate()
    d = GRPOConfig(mode="nft").resolved()
    assert d["nft_timesteps"] == 9 and d["num_train_steps"] == 9


def test_cli_trains_two_steps_with_jagg(tmp_path):
    import json

    from jagg_autograd.demo import main

    argv = ["--mode", "nft", "--nft-noise", "shared", "--nft-gradient", "jagg", "--steps", "2",
            "--prompts-per-step", "2", "--group-size", "2", "--eval-per-digit", "0",
            "--grid-samples", "0", "--no-progress", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["config"]["nft_timesteps"] == 9 and log["config"]["nft_gradient"] == "jagg"
    for r in log["steps"]:
        assert r["paths"] == ["nft+values+deferred"]
        # 9 timesteps, window 4: anchors 0, 3, 6, 8 of each sample, with grad.
        assert r["grad_samples"] == 4 * 4 and r["grad_forward_calls"] == 4
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    assert "shared noise, jagg gradient (window 4)" in log["summary"]


def _minibatch_grad(tr: GRPOTrainer, mb: Minibatch, seed: int) -> torch.Tensor:
    tr.optimizer.zero_grad(set_to_none=True)
    tr.estimator.loss(tr, mb, generator=torch.Generator().manual_seed(seed), on_policy=True,
                      inline_backward=True)  # fmt: skip
    return torch.cat([p.grad.flatten() for p in tr.params if p.grad is not None])


def nft_grad_cosines(n_batches: int, seed: int = 0, **kw) -> list[float]:
    """Per batch: the cosine of the trainer's NFT + JAGG gradient to its exact one with the
    same timesteps and shared noise, on the digits DiT."""
    ex = GRPOTrainer(GRPOConfig(**DIGITS, mode="nft", nft_noise="shared", seed=seed, **kw))
    jg = GRPOTrainer(GRPOConfig(**DIGITS, mode="nft", nft_noise="shared", nft_gradient="jagg",
                                seed=seed, **kw))  # fmt: skip
    jg.policy.load_state_dict(ex.policy.state_dict())
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        prompts, groups = ex._group(ex.task.sample_prompts(ex.config.prompts_per_step, g))
        traj = ex._sample(prompts, g)
        adv = group_advantages(ex.task.reward(traj.latents[-1], prompts), groups)
        mb = Minibatch(traj, adv, None)
        a, b = _minibatch_grad(ex, mb, 100 + i), _minibatch_grad(jg, mb, 100 + i)
        out.append(float(torch.nn.functional.cosine_similarity(a, b, dim=0)))
    return out


def test_trainer_jagg_gradient_cosine_to_exact():
    """Measured 0.99x per batch on the digits DiT (benchmarks/nft_jagg.py); a loose bound."""
    cos = nft_grad_cosines(3)
    assert min(cos) >= 0.95, cos


def test_trainer_jagg_loss_value_equals_exact_and_off_policy_runs():
    """Same timesteps and noise: the JAGG path's loss value is the loop's (forward values
    are exact); after an optimizer step (off-policy) it recomputes instead of reusing
    values, and the KL reference (beta > 0) is in the loss."""
    kw = dict(DIGITS, mode="nft", nft_noise="shared", beta=0.01)
    ex = GRPOTrainer(GRPOConfig(**kw))
    jg = GRPOTrainer(GRPOConfig(**kw, nft_gradient="jagg"))
    jg.policy.load_state_dict(ex.policy.state_dict())
    g = torch.Generator().manual_seed(0)
    prompts, groups = ex._group(ex.task.sample_prompts(4, g))
    traj = ex._sample(prompts, g)
    mb = Minibatch(traj, group_advantages(ex.task.reward(traj.latents[-1], prompts), groups), None)
    res = {}
    for name, tr in (("exact", ex), ("jagg", jg)):
        res[name] = tr.estimator.loss(tr, mb, generator=torch.Generator().manual_seed(1),
                                      on_policy=True, inline_backward=True)  # fmt: skip
    assert float(res["jagg"].loss) == pytest.approx(float(res["exact"].loss), rel=1e-5)
    assert "kl" in res["jagg"].infos[0]
    assert res["jagg"].grad_cost() == (4 * 16, 4)  # anchors 0, 3, 6, 8 of 9, B = 16
    assert res["exact"].grad_cost() == (9 * 16, 9)
    log = train(GRPOConfig(**dict(kw, steps=1, prompts_per_step=2), nft_gradient="jagg",
                           optimizer_steps_per_rollout=2))  # fmt: skip
    assert log["steps"][0]["paths"] == ["nft+values+deferred", "nft+deferred"]
    with pytest.raises(ValueError, match="nft_timesteps >= 2"):
        GRPOConfig(mode="nft", nft_noise="shared", nft_gradient="jagg", nft_timesteps=1).validate()
