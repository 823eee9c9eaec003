"""The trainer's baselines (DanceGRPO subsampling, MixGRPO window), its periodic evaluation
and gradient probe: each checked against an independent computation."""

from __future__ import annotations

import math

import pytest
import torch
from fields import params_grad, rel_err

from jagg_autograd.grpo import ode_step
from jagg_autograd.models.digits import load_digits_dit
from jagg_autograd.trainer import (
    GRPOConfig,
    GRPOTrainer,
    _estimator_loss,
    evaluate,
    mix_window_start,
    rollout,
    sigma_schedule,
    subsample_log_probs,
    train,
    trajectory_log_probs,
)

TINY = dict(
    prompts_per_step=2, group_size=2, num_steps=5, window=3, eval_per_digit=1, progress=False
)


def _six_step_rollout(labels: list[int], seed: int, sde_steps: list[int] | None = None):
    torch.manual_seed(0)
    model = load_digits_dit()
    sigmas = sigma_schedule(GRPOConfig(num_steps=6))
    g = torch.Generator().manual_seed(seed)
    ro = rollout(
        model, torch.tensor(labels), sigmas, noise_level=0.7, generator=g, sde_steps=sde_steps
    )
    return model, sigmas, ro


@pytest.fixture(scope="module")
def setup():
    return _six_step_rollout([1, 4, 4, 9], seed=5)


def test_subsample_draws_distinct_steps_per_sample(setup):
    model, sigmas, ro = setup
    g = torch.Generator().manual_seed(0)
    lp, old, ks = subsample_log_probs(model, ro, sigmas, noise_level=0.7, num=3, generator=g)
    assert lp.shape == old.shape == ks.shape == (3, 4)
    for b in range(4):
        assert len(set(ks[:, b].tolist())) == 3  # without replacement, per sample
    assert len({tuple(sorted(ks[:, b].tolist())) for b in range(4)}) > 1  # not one shared set
    # Old log-probs are the rollout's at the drawn steps; on-policy ratio is 1.
    for j in range(3):
        for b in range(4):
            assert old[j, b] == ro.log_probs[ks[j, b], b]
    torch.testing.assert_close(lp.detach(), old, rtol=0, atol=2e-5)


@pytest.mark.parametrize("batching", ["stacked", "per_step"])
def test_subsample_of_all_steps_is_the_exact_gradient(setup, batching):
    """num = T draws a permutation of every step: the loss, hence the gradient, is exact's."""
    model, sigmas, ro = setup
    adv = torch.tensor([1.0, -0.5, 0.5, -1.0])
    cfg = GRPOConfig(num_steps=6, mode="subsample", subsample_steps=6, batching=batching)
    g = torch.Generator().manual_seed(1)
    loss, _, cost = _estimator_loss(model, ro, adv, sigmas, cfg, None, step=0, generator=g)
    ref, _, _ = _estimator_loss(
        model, ro, adv, sigmas, cfg, None, step=0, generator=g, mode="exact"
    )
    assert cost["grad_samples"] == 6 * 4
    assert cost["backward_calls"] == (1 if batching == "stacked" else 6)
    assert rel_err(params_grad(loss, model), params_grad(ref, model)) < 1e-5


def test_subsample_is_unbiased_over_draws(setup):
    """The mean of the subsampled gradient over many draws approaches the exact gradient."""
    model, sigmas, ro = setup
    adv = torch.tensor([1.0, -0.5, 0.5, -1.0])
    cfg = GRPOConfig(num_steps=6, mode="subsample", subsample_steps=2)
    g = torch.Generator().manual_seed(2)
    ref = params_grad(
        _estimator_loss(model, ro, adv, sigmas, cfg, None, step=0, generator=g, mode="exact")[0],
        model,
    )
    draws = [
        params_grad(
            _estimator_loss(model, ro, adv, sigmas, cfg, None, step=0, generator=g)[0], model
        )
        for _ in range(60)
    ]
    assert rel_err(torch.stack(draws).mean(0), ref) < 0.5 * rel_err(draws[0], ref)
    # averaging draws removes most of one draw's error


def test_mixed_sampler_and_window_schedule():
    model, sigmas, ro = _six_step_rollout([0, 0, 3, 3], seed=3, sde_steps=[2, 3])
    labels = ro.labels
    s = sigmas.tolist()
    for k in range(6):
        if k in (2, 3):
            assert torch.isfinite(ro.log_probs[k]).all()
        else:
            assert torch.isnan(ro.log_probs[k]).all()
            with torch.no_grad():
                v = model(ro.latents[k], torch.full((4,), s[k]), labels=labels)
            torch.testing.assert_close(
                ro.latents[k + 1], ode_step(v, ro.latents[k], s[k], s[k + 1])
            )
    cfg = GRPOConfig(steps=20, num_steps=6, window=3, mode="mixgrpo")
    starts = [mix_window_start(cfg, i) for i in range(20)]
    assert starts[0] == 0 and starts[-1] == 3 and sorted(starts) == starts
    assert set(starts) == {0, 1, 2, 3}  # sweeps the trajectory once: 20 // 4 = 5 per place
    assert mix_window_start(GRPOConfig(num_steps=6, window=3, mix_shift_interval=2), 5) == 2


def test_mixgrpo_trains_only_its_window(setup):
    model, sigmas, ro = setup
    adv = torch.tensor([1.0, -0.5, 0.5, -1.0])
    cfg = GRPOConfig(steps=8, num_steps=6, window=3, mode="mixgrpo")  # start = step // 2
    g = torch.Generator()
    loss, _, cost = _estimator_loss(model, ro, adv, sigmas, cfg, None, step=4, generator=g)
    assert cost["grad_samples"] == 3 * 4
    lp, _ = trajectory_log_probs(model, ro, sigmas, noise_level=0.7, mode="exact")
    from jagg_autograd.estimators import grpo_loss_mean

    ref, _ = grpo_loss_mean(lp[2:5], ro.log_probs[2:5], adv, cfg)
    torch.testing.assert_close(params_grad(loss, model), params_grad(ref, model))


def test_probe_exact_is_one_and_does_not_change_the_run():
    base = dict(TINY, steps=2, mode="jagg")
    a = GRPOTrainer(GRPOConfig(**base, probe_every=1))
    before = [p.detach().clone() for p in a.params]
    pr = a.probe()
    assert all(torch.equal(p, q) for p, q in zip(a.params, before))
    assert all(p.grad is None for p in a.params)
    assert 0.0 < pr["probe_cosine"] <= 1.0 and pr["probe_rel_error"] > 0
    ex = GRPOTrainer(GRPOConfig(**dict(base, mode="exact"), probe_every=1)).probe()
    assert ex["probe_cosine"] == pytest.approx(1.0, abs=1e-12) and ex["probe_rel_error"] == 0.0
    # A prefix of the steps (Flow-GRPO's timestep_fraction): the oracle is exact over the
    # same prefix, so exact scores 1 there too (against all T it would not), and JAGG over
    # the prefix is compared with it.
    pre = dict(base, num_steps=8, timestep_fraction=0.5, window=4)
    ex = GRPOTrainer(GRPOConfig(**dict(pre, mode="exact"), probe_every=1)).probe()
    assert ex["probe_cosine"] == pytest.approx(1.0, abs=1e-12) and ex["probe_rel_error"] == 0.0
    jp = GRPOTrainer(GRPOConfig(**pre, probe_every=1)).probe()
    assert 0.5 < jp["probe_cosine"] < 1.0
    with_probe = train(GRPOConfig(**base, probe_every=1))
    without = train(GRPOConfig(**base))
    key = lambda log: [(r["reward_mean"], r["loss"]) for r in log["steps"]]  # noqa: E731
    assert key(with_probe) == key(without)
    assert all("probe_cosine" in r for r in with_probe["steps"])


@pytest.mark.parametrize("mode", ["subsample", "mixgrpo", "router"])
def test_modes_run_and_log(mode):
    log = train(
        GRPOConfig(
            **TINY,
            steps=3,
            mode=mode,
            eval_every=2,
            eval_sampler="ode",
            probe_every=2,
            jagg_frac=0.5,
        )
    )
    assert [e["step"] for e in log["evals"]] == [0, 2, 3]
    assert log["eval"]["final"] is log["evals"][-1]
    assert all(math.isfinite(r["loss"]) for r in log["steps"])
    walls = [e["wall_seconds"] for e in log["evals"]]
    assert walls[0] == 0 and walls == sorted(walls)
    B = 4
    budget = {"subsample": 3 * B, "mixgrpo": 3 * B}  # anchors of T=5, W=3: 0, 2, 4
    if mode in budget:
        assert all(r["grad_samples"] == budget[mode] for r in log["steps"])
    assert "probe" in log["summary"]


def test_ode_evaluation_is_deterministic_and_differs_from_sde():
    model = load_digits_dit()
    from jagg_autograd.models.digits import load_digits_classifier

    clf = load_digits_classifier()
    sig = sigma_schedule(GRPOConfig(num_steps=4))
    kw = dict(per_digit=2, noise_level=0.7, seed=9)
    a = evaluate(model, clf, sig, sampler="ode", **kw)
    b = evaluate(model, clf, sig, sampler="ode", **kw)
    c = evaluate(model, clf, sig, sampler="sde", **kw)
    assert a == b and a["mean_reward"] != c["mean_reward"]
    with pytest.raises(ValueError, match="sampler"):
        evaluate(model, clf, sig, sampler="euler", **kw)


@pytest.mark.parametrize(
    "field, value",
    [
        ("eval_every", -1),
        ("probe_every", 1.5),
        ("eval_sampler", "euler"),
        ("eval_seed", "x"),
        ("subsample_steps", 0),
        ("subsample_steps", 11),
        ("mix_shift_interval", 0),
        ("jagg_frac", 1.5),
        ("jagg_frac", float("nan")),
        ("mode", "dance"),
    ],
)
def test_bad_new_fields(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value}).validate()
