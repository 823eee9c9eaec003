"""Baselines of the trainer: Flow-GRPO's per-step exact loop (its gradient is the batched
one's), DiffusionNFT's forward-process loss (against hand-written float64 formulas) and
the peak saved-activation memory in the log."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_autograd.estimators import Minibatch
from jagg_autograd.grpo import group_advantages
from jagg_autograd.nft import draw_timesteps, nft_loss, optimality_probability
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer, train

TINY = dict(
    prompts_per_step=2, group_size=2, num_steps=5, window=3, eval_per_digit=0, progress=False
)
F64 = torch.float64


def _grads_per_optimizer_step(cfg: GRPOConfig) -> tuple[list[torch.Tensor], dict]:
    """Run one GRPO step; the flat (clipped) gradient seen by every optimizer step."""
    tr = GRPOTrainer(cfg)
    seen: list[torch.Tensor] = []
    step = tr.optimizer.step

    def recording_step(*a, **kw):
        seen.append(torch.cat([p.grad.detach().flatten() for p in tr.params]).clone())
        return step(*a, **kw)

    tr.optimizer.step = recording_step  # type: ignore[method-assign]
    row = tr.step()
    return seen, row


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------ exact loop


@pytest.mark.parametrize("fraction", [1.0, 0.6])
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_exact_loop_gradient_is_the_batched_gradient(fraction, beta):
    base = dict(
        TINY, steps=1, mode="exact", timestep_fraction=fraction, beta=beta,
        optimizer_steps_per_rollout=2, clip_range=0.2, lr=1e-3,
    )  # fmt: skip
    loop, row = _grads_per_optimizer_step(GRPOConfig(**base, exact_loop=True))
    batched, row_b = _grads_per_optimizer_step(GRPOConfig(**base, exact_loop=False))
    assert len(loop) == len(batched) == 2  # the second minibatch is off-policy
    for g_loop, g_batched in zip(loop, batched):
        assert _rel(g_loop, g_batched) < 1e-5
    n = max(1, int(5 * fraction))
    assert row["grad_samples"] == row_b["grad_samples"] == n * 4
    assert row["grad_forward_calls"] == 2 * n  # one with-grad call per trained step
    assert row["paths"] == ["exact", "exact"] and row["routed_frac"] == 1.0
    assert row["backward_passes"] == 2 * n and row_b["backward_passes"] == 2
    assert row["loss"] == pytest.approx(row_b["loss"], rel=1e-5, abs=1e-7)
    for k in ("clipfrac", "approx_kl", "ratio_min", "ratio_max"):
        assert row[k] == pytest.approx(row_b[k], rel=1e-5, abs=1e-7)
    assert row["forward_seconds"] > 0 and row["backward_seconds"] > 0
    if beta:
        assert row["kl"] == pytest.approx(row_b["kl"], rel=1e-5, abs=1e-9)


def test_exact_loop_random_steps_and_probe():
    base = dict(TINY, steps=1, mode="exact", timestep_fraction=0.6,
                timestep_selection="random")  # fmt: skip
    loop, _ = _grads_per_optimizer_step(GRPOConfig(**base))
    batched, _ = _grads_per_optimizer_step(GRPOConfig(**base, exact_loop=False))
    assert _rel(loop[0], batched[0]) < 1e-5
    pr = GRPOTrainer(GRPOConfig(**dict(TINY, mode="exact"), probe_every=1)).probe()
    assert pr["probe_cosine"] == pytest.approx(1.0, abs=1e-12)


# ------------------------------------------------------------------------ DiffusionNFT loss


def _hand_nft(v, v_old, xt, x0, t, adv, beta, M):
    """train_nft_sd3.py's policy loss, written out per sample in float64."""
    out = []
    for b in range(v.shape[0]):
        a = min(max(float(adv[b]), -M), M)
        r = min(max(a / M / 2 + 0.5, 0.0), 1.0)
        vp = beta * v[b] + (1 - beta) * v_old[b]
        vm = (1 + beta) * v_old[b] - beta * v[b]
        ep = xt[b] - t[b] * vp - x0[b]
        em = xt[b] - t[b] * vm - x0[b]
        lp = (ep**2).mean() / max(float(ep.detach().abs().mean()), 1e-5)
        lm = (em**2).mean() / max(float(em.detach().abs().mean()), 1e-5)
        out.append(M * (r * lp + (1 - r) * lm) / beta)
    return torch.stack(out).mean()


@pytest.fixture
def nft_data():
    g = torch.Generator().manual_seed(0)
    B, S = 5, (1, 4, 4)
    x0 = torch.randn(B, *S, generator=g, dtype=F64)
    eps = torch.randn(B, *S, generator=g, dtype=F64)
    t = torch.rand(B, generator=g, dtype=F64) * 0.9 + 0.05
    xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * eps
    v_old = (eps - x0) + 0.3 * torch.randn(B, *S, generator=g, dtype=F64)
    v = (v_old + 0.2 * torch.randn(B, *S, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([2.0, -1.0, 0.0, 7.0, -6.0], dtype=F64)
    return v, v_old, xt, x0, t, eps, adv


@pytest.mark.parametrize("beta", [1.0, 0.3])
def test_nft_loss_matches_the_formula(nft_data, beta):
    v, v_old, xt, x0, t, _, adv = nft_data
    got = nft_loss(v, v_old, xt, x0, t, adv, beta=beta, adv_clip_max=5.0)
    ref = _hand_nft(v, v_old, xt, x0, t, adv, beta, 5.0)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    g_got = torch.autograd.grad(got, v)[0]
    # The adaptive weights are constants of the gradient (detached in theirs).
    vv = v.detach().clone().requires_grad_(True)
    w = {}
    for name, sgn in (("p", 1), ("m", -1)):
        vx = v_old + sgn * beta * (v.detach() - v_old)
        w[name] = (xt - t.view(-1, 1, 1, 1) * vx - x0).abs().flatten(1).mean(1).clip(min=1e-5)
    r = ((adv.clamp(-5, 5) / 5) / 2 + 0.5).clamp(0, 1)
    te = t.view(-1, 1, 1, 1)
    ep = (xt - te * (beta * vv + (1 - beta) * v_old) - x0) ** 2
    em = (xt - te * ((1 + beta) * v_old - beta * vv) - x0) ** 2
    hand = (5 * (r * ep.flatten(1).mean(1) / w["p"]
                 + (1 - r) * em.flatten(1).mean(1) / w["m"]) / beta).mean()  # fmt: skip
    torch.testing.assert_close(g_got, torch.autograd.grad(hand, vv)[0], rtol=1e-10, atol=1e-14)
    # A wrong sign of v_minus or a wrong beta would not match.
    bad = _hand_nft(v, -v_old, xt, x0, t, adv, beta, 5.0)
    assert not torch.allclose(got, bad)
    assert not torch.allclose(got, _hand_nft(v, v_old, xt, x0, t, adv, beta / 2, 5.0))


def test_nft_positive_only_is_flow_matching_of_the_positive_policy(nft_data):
    v, v_old, xt, x0, t, eps, _ = nft_data
    adv = torch.full((v.shape[0],), 5.0, dtype=F64)  # r = 1: only the positive policy
    for beta in (1.0, 0.4):
        got = nft_loss(v, v_old, xt, x0, t, adv, beta=beta, adv_clip_max=5.0)
        vp = beta * v + (1 - beta) * v_old
        err = t.view(-1, 1, 1, 1) * (vp - (eps - x0))  # x0_pred - x0 = t (v+ - (eps - x0))
        w = err.detach().abs().flatten(1).mean(1)
        ref = (5.0 * (err**2).flatten(1).mean(1) / w / beta).mean()
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    # r = 0 is the negative policy's flow matching; r = 1/2 (advantage 0) the average.
    zero = torch.zeros_like(adv)
    pos = nft_loss(v, v_old, xt, x0, t, adv, beta=0.4, adv_clip_max=5.0)
    neg = nft_loss(v, v_old, xt, x0, t, -adv, beta=0.4, adv_clip_max=5.0)
    mid = nft_loss(v, v_old, xt, x0, t, zero, beta=0.4, adv_clip_max=5.0)
    torch.testing.assert_close(mid, (pos + neg) / 2)
    # At v = v_old both policies are v_old: the gradient pushes v toward the target for
    # r = 1 and away from it for r = 0.
    target = eps - x0
    vo = v_old.clone().requires_grad_(True)
    for a, sign in ((adv, 1.0), (-adv, -1.0)):
        g = torch.autograd.grad(nft_loss(vo, v_old, xt, x0, t, a, beta=0.4,
                                         adv_clip_max=5.0), vo)[0]  # fmt: skip
        assert sign * float((g * (v_old - target)).sum()) > 0


def test_optimality_probability_and_timesteps():
    r = optimality_probability(torch.tensor([-9.0, -5.0, 0.0, 2.5, 5.0, 9.0]), 5.0)
    torch.testing.assert_close(r, torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))
    sig = torch.linspace(1, 0, 11, dtype=F64)
    ts = draw_timesteps(sig, 6, 4, torch.Generator().manual_seed(0))
    assert ts.shape == (4, 6)
    for b in range(6):
        assert len(set(ts[:, b].tolist())) == 4
    assert bool((ts > 0).all()) and set(ts.flatten().tolist()) <= set(sig[:-1].tolist())


# ------------------------------------------------------------------------ nft in the trainer


def test_nft_minibatch_loss_decreases():
    cfg = GRPOConfig(**TINY, steps=1, mode="nft", lr=1e-4, nft_beta=0.5)
    tr = GRPOTrainer(cfg)
    g = torch.Generator().manual_seed(3)
    prompts, groups = tr._group(tr.task.sample_prompts(2, g))
    traj = tr._sample(prompts, g)
    adv = group_advantages(tr.task.reward(traj.latents[-1], prompts), groups)
    mb = Minibatch(traj, adv, None)
    before = [p.detach().clone() for p in tr.params]
    losses = []
    for i in range(6):
        tr.optimizer.zero_grad(set_to_none=True)
        res = tr.estimator.loss(
            tr, mb, generator=torch.Generator().manual_seed(7), on_policy=i == 0,
        )  # fmt: skip
        assert res.backward_done and res.path == "nft"
        assert res.grad_samples == 4 * 4 and res.grad_forward_calls == 4
        losses.append(float(res.loss))
        tr.optimizer.step()
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]
    assert any(not torch.equal(p, q) for p, q in zip(tr.params, before))
    # v_old stayed the rollout's parameters (the snapshot), not the current ones.
    snap = tr.estimator.snapshot[1]
    assert all(torch.equal(s, q) for s, q in zip(snap.values, before))


def test_nft_run_logs():
    log = train(GRPOConfig(**dict(TINY, eval_per_digit=1), steps=2, mode="nft", beta=0.01,
                           optimizer_steps_per_rollout=2, nft_timesteps=3))  # fmt: skip
    for r in log["steps"]:
        assert r["paths"] == ["nft", "nft"]
        assert r["grad_samples"] == 3 * 4 and r["grad_forward_calls"] == 2 * 3
        assert r["anchor_frac"] == pytest.approx(3 / 5) and r["routed_frac"] == 0.0
        assert r["clipfrac"] == 0.0 and r["ratio_min"] == r["ratio_max"] == 1.0
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and "kl" in r
        assert r["backward_seconds"] > 0 and r["backward_passes"] == 2 * 3
    assert "nft (DiffusionNFT" in log["summary"]


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"nft_beta": 0.0}, "nft_beta"),
        ({"nft_beta": float("nan")}, "nft_beta"),
        ({"nft_timesteps": 0}, "nft_timesteps"),
        ({"mode": "nft", "nft_timesteps": 11}, "nft_timesteps"),
        ({"nft_timesteps": 2.0}, "nft_timesteps"),
        ({"mode": "nft", "probe_every": 2}, "probe_every"),
        ({"mode": "nft", "timestep_fraction": 0.5}, "timestep_fraction"),
        ({"exact_loop": 1}, "exact_loop"),
        ({"track_memory": "yes"}, "track_memory"),
    ],
)
def test_bad_baseline_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**kw).validate()


# ------------------------------------------------------------------------ memory


def _peak(**kw) -> int:
    log = train(GRPOConfig(**TINY, steps=1, track_memory=True, **kw))
    peak = log["steps"][0]["peak_saved_bytes"]
    assert isinstance(peak, int) and peak > 0
    return peak


def test_peak_saved_bytes_exact_loop_vs_batched():
    loop = _peak(mode="exact")
    batched = _peak(mode="exact", exact_loop=False)
    assert loop < batched / 2  # T' = 5: about batched / 5
    assert "peak_saved_bytes" not in train(GRPOConfig(**TINY, steps=1))["steps"][0]


def test_peak_saved_bytes_deferred_vs_eager():
    eager = _peak(mode="jagg", reuse_values=False, deferred=False)  # the eager path
    deferred = _peak(mode="jagg", reuse_values=True, deferred=True)
    adaptive = _peak(mode="jagg", reuse_values=False, deferred=False, placement="adaptive")
    # T = 5, W = 3: eager holds its 3 anchors' activations, deferred one anchor chunk.
    assert deferred < eager / 2 and adaptive < eager / 2
    assert _peak(mode="nft") < eager / 2  # one timestep's activations at a time
