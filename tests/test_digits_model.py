"""Tests for the embedded digits DiT, its reward classifier and the shipped artefacts."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path

import pytest
import torch

import jagg_autograd
from jagg_autograd.models import (
    NULL_LABEL,
    DigitsClassifier,
    DigitsDiT,
    DigitsDiTConfig,
    build_digits_classifier,
    build_digits_dit,
    digit_reward,
    digits_dataset,
    digits_split,
    load_digits_classifier,
    load_digits_dit,
    load_digits_meta,
    sample_digits,
)
from jagg_autograd.models.digits import (
    CLASSIFIER_WEIGHTS,
    DIT_WEIGHTS,
    META_FILE,
)

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64


@pytest.fixture(scope="module")
def meta() -> dict:
    return load_digits_meta()


@pytest.fixture(scope="module")
def dit() -> DigitsDiT:
    return load_digits_dit()


@pytest.fixture(scope="module")
def classifier() -> DigitsClassifier:
    return load_digits_classifier()


def _train_script():
    spec = importlib.util.spec_from_file_location("train_digits", ROOT / "scripts/train_digits.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------------------------
# artefacts and loading
# --------------------------------------------------------------------------------------------


def test_artefacts_ship_and_are_small() -> None:
    for p in (DIT_WEIGHTS, CLASSIFIER_WEIGHTS, META_FILE):
        assert p.is_file(), p
    assert DIT_WEIGHTS.stat().st_size + CLASSIFIER_WEIGHTS.stat().st_size < 10 * 2**20


def test_loading_works_offline(monkeypatch: pytest.MonkeyPatch, meta: dict) -> None:
    # Any attempt to reach the network would fail loudly under these settings.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    import socket

    def no_network(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    model = load_digits_dit()
    clf = load_digits_classifier()
    assert not model.training and not clf.training
    assert sum(p.numel() for p in model.parameters()) == meta["dit"]["num_parameters"]
    assert sum(p.numel() for p in clf.parameters()) == meta["classifier"]["num_parameters"]
    assert all(p.requires_grad for p in model.parameters())
    assert not any(p.requires_grad for p in clf.parameters())


def test_fresh_build_matches_shipped_architecture(dit: DigitsDiT, meta: dict) -> None:
    fresh = build_digits_dit(meta["dit"]["config"])
    assert fresh.config == dit.config == DigitsDiTConfig.from_dict(meta["dit"]["config"])
    shipped = dit.state_dict()
    for k, v in fresh.state_dict().items():
        assert shipped[k].shape == v.shape, k
    assert set(shipped) == set(fresh.state_dict())
    clf = build_digits_classifier(meta["classifier"]["config"])
    assert set(clf.state_dict()) == set(load_digits_classifier().state_dict())


def test_data_split_is_fixed_and_scaled() -> None:
    x, y = digits_dataset()
    assert x.shape == (1797, 1, 8, 8) and y.shape == (1797,)
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0
    x_tr, y_tr, x_te, y_te = digits_split()
    assert x_tr.shape[0] + x_te.shape[0] == 1797 and x_te.shape[0] == 450
    assert torch.equal(digits_split()[3], y_te)
    # Stratified: every digit appears in both parts.
    assert set(y_te.tolist()) == set(range(10)) == set(y_tr.tolist())


# --------------------------------------------------------------------------------------------
# the classifier and the reward
# --------------------------------------------------------------------------------------------


def test_heldout_accuracy_is_what_meta_says(classifier: DigitsClassifier, meta: dict) -> None:
    _, _, x_te, y_te = digits_split()
    with torch.no_grad():
        acc = (classifier(x_te).argmax(-1) == y_te).double().mean().item()
    # Identical on this build; another BLAS may flip at most a borderline sample.
    assert abs(acc - meta["classifier"]["heldout_accuracy"]) <= 1.0 / y_te.numel() + 1e-12
    assert acc > 0.95


def test_reward_is_probability_of_prompted_digit(classifier: DigitsClassifier) -> None:
    _, _, x_te, y_te = digits_split()
    r = digit_reward(x_te, y_te)
    assert r.shape == y_te.shape and r.dtype == torch.float32
    assert bool(((r >= 0) & (r <= 1)).all())
    assert r.mean() > 0.85
    with torch.no_grad():
        p = torch.softmax(classifier(x_te), -1)
    torch.testing.assert_close(r, p[torch.arange(y_te.numel()), y_te])
    wrong = (y_te + 1) % 10
    assert digit_reward(x_te, wrong).mean() < 0.1
    # Out-of-range pixels are clamped to the data range first.
    big = 5 * x_te
    assert (big.abs() > 1).any()
    torch.testing.assert_close(digit_reward(big, y_te), digit_reward(big.clamp(-1, 1), y_te))


def test_reward_bad_input() -> None:
    x = torch.zeros(4, 1, 8, 8)
    with pytest.raises(ValueError, match="labels"):
        digit_reward(x, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(TypeError, match="labels"):
        digit_reward(x, torch.zeros(4))
    with pytest.raises(ValueError, match="labels must have shape"):
        digit_reward(x, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="images"):
        digit_reward(torch.zeros(4, 8, 8), torch.zeros(4, dtype=torch.long))


# --------------------------------------------------------------------------------------------
# the velocity callable
# --------------------------------------------------------------------------------------------


def test_velocity_contract_shapes_and_timestep_scale(dit: DigitsDiT) -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 1, 8, 8, generator=g)
    t = torch.rand(6, generator=g)
    y = torch.tensor([0, 1, 2, 3, NULL_LABEL, 9])
    with torch.no_grad():
        v = dit(z, t, labels=y)
        ehs, pooled = dit.encode_labels(y)
        direct = dit.transformer(
            hidden_states=z,
            encoder_hidden_states=ehs,
            pooled_projections=pooled,
            timestep=1000 * t,
            return_dict=False,
        )[0]
    assert v.shape == z.shape and v.dtype == z.dtype
    assert torch.equal(v, direct)
    assert ehs.shape == (6, dit.config.label_tokens, dit.config.inner_dim)


def test_stacked_call_with_repeated_labels_equals_per_step_calls(dit: DigitsDiT) -> None:
    # The core stacks n steps of B samples step-major and repeats cond the same way.
    model = load_digits_dit(dtype=F64)
    n, b = 3, 4
    g = torch.Generator().manual_seed(1)
    z = torch.randn(n, b, 1, 8, 8, generator=g, dtype=F64)
    t = torch.linspace(0.9, 0.1, n, dtype=F64)
    y = torch.tensor([3, 1, 4, 1])
    with torch.no_grad():
        stacked = model(z.reshape(n * b, 1, 8, 8), t.repeat_interleave(b), labels=y.repeat(n))
        per = torch.stack([model(z[k], t[k].expand(b), labels=y) for k in range(n)])
    torch.testing.assert_close(stacked.view(n, b, 1, 8, 8), per, rtol=1e-12, atol=1e-12)


def test_velocity_bad_input(dit: DigitsDiT) -> None:
    z = torch.zeros(2, 1, 8, 8)
    y = torch.tensor([1, 2])
    with pytest.raises(ValueError, match="t must have shape"):
        dit(z, torch.zeros(2, 1), labels=y)
    with pytest.raises(ValueError, match="t must have shape"):
        dit(z, torch.zeros(()), labels=y)
    with pytest.raises(ValueError, match="z must have shape"):
        dit(torch.zeros(2, 8, 8), torch.zeros(2), labels=y)
    with pytest.raises(ValueError, match="labels"):
        dit(z, torch.zeros(2), labels=torch.tensor([1, 11]))
    with pytest.raises(ValueError, match="labels"):
        dit(z, torch.zeros(2), labels=torch.tensor([-1, 1]))
    with pytest.raises(TypeError, match="labels"):
        dit(z, torch.zeros(2), labels=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="num_layers"):
        DigitsDiTConfig(num_layers=0)
    with pytest.raises(ValueError, match="unknown keys"):
        DigitsDiTConfig.from_dict({"depth": 3})


def test_determinism(dit: DigitsDiT) -> None:
    y = torch.arange(10)
    a = sample_digits(dit, y, steps=4, noise_level=0.7, generator=torch.Generator().manual_seed(5))
    b = sample_digits(
        load_digits_dit(), y, steps=4, noise_level=0.7, generator=torch.Generator().manual_seed(5)
    )
    assert torch.equal(a, b)
    c = sample_digits(dit, y, steps=4, noise_level=0.7, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(a, c)


def test_training_is_seeded() -> None:
    mod = _train_script()
    settings = {**mod.DEFAULTS, "dit_steps": 2, "dit_batch": 8, "dit_warmup": 1}
    m1, i1 = mod.train_dit(settings, log=False)
    m2, i2 = mod.train_dit(settings, log=False)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert i1["final_loss"] == i2["final_loss"]
    c1, _ = mod.train_classifier({**mod.DEFAULTS, "classifier_epochs": 1}, log=False)
    c2, _ = mod.train_classifier({**mod.DEFAULTS, "classifier_epochs": 1}, log=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(c1.state_dict().values(), c2.state_dict().values(), strict=True)
    )


# --------------------------------------------------------------------------------------------
# sample quality, the SDE step, and the core
# --------------------------------------------------------------------------------------------


def test_ten_step_samples_score_as_meta_says(
    dit: DigitsDiT, classifier: DigitsClassifier, meta: dict
) -> None:
    ev = meta["dit"]["eval"]["ode"]
    per_label = 30 if os.environ.get("CI") else ev["samples_per_label"]
    labels = torch.arange(10).repeat_interleave(per_label)
    x = sample_digits(
        dit,
        labels,
        steps=ev["steps"],
        generator=torch.Generator().manual_seed(meta["settings"]["seed"] + 3),
    )
    r = digit_reward(x, labels, classifier=classifier)
    # Clearly above chance (0.1) and with room left for GRPO.
    assert 0.3 < float(r.mean()) < 0.95
    if per_label == ev["samples_per_label"]:
        assert abs(float(r.mean()) - ev["mean_reward"]) < 0.02
    assert min(meta["dit"]["eval"]["sde"]["mean_reward_per_label"]) > 0.15


def test_sde_sampler_matches_grpo_step(dit: DigitsDiT) -> None:
    grpo = pytest.importorskip("jagg_autograd.grpo")
    y = torch.tensor([0, 5, 7])
    steps, eta = 3, 0.7
    x = sample_digits(
        dit, y, steps=steps, noise_level=eta, generator=torch.Generator().manual_seed(2)
    )
    # Replay the same noise draws through grpo.sde_step_with_logprob's mean and std.
    g = torch.Generator().manual_seed(2)
    cur = torch.randn(3, 1, 8, 8, generator=g)
    sig = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).tolist()
    with torch.no_grad():
        for i in range(steps):
            v = dit(cur, torch.full((3,), sig[i]), labels=y)
            _, _, mean, std = grpo.sde_step_with_logprob(
                v, cur, sig[i], sig[i + 1], noise_level=eta, sigma_max=sig[1]
            )
            noise = torch.randn(cur.shape, generator=g)
            cur = mean + std * math.sqrt(sig[i] - sig[i + 1]) * noise
    torch.testing.assert_close(x, cur.float(), rtol=1e-5, atol=1e-5)


_HAS_CORE = hasattr(jagg_autograd, "jagg_window")


@pytest.mark.skipif(not _HAS_CORE, reason="jagg_autograd.jagg_window not available")
def test_through_jagg_window_w2_exact(dit: DigitsDiT) -> None:
    model = load_digits_dit(dtype=F64)
    b = 4
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, b, 1, 8, 8, generator=g, dtype=F64)
    timesteps = torch.tensor([0.7, 0.6], dtype=F64)
    cond = {"labels": torch.tensor([2, 7, NULL_LABEL, 0])}
    up = torch.randn(latents.shape, generator=g, dtype=F64)
    params = [p for p in model.parameters() if p.requires_grad]
    out = {}
    for mode in ("exact", "jagg"):
        v = jagg_autograd.jagg_window(model, latents, timesteps, cond=cond, mode=mode)
        out[mode] = (v, torch.autograd.grad((v * up).sum(), params))
    torch.testing.assert_close(out["jagg"][0], out["exact"][0], rtol=1e-12, atol=1e-12)
    num = sum(
        float((a - b_).pow(2).sum()) for a, b_ in zip(out["jagg"][1], out["exact"][1], strict=True)
    )
    den = sum(float(b_.pow(2).sum()) for b_ in out["exact"][1])
    assert math.sqrt(num / den) < 1e-10
    with torch.no_grad():
        per = model(latents[1], timesteps[1].expand(b), labels=cond["labels"])
    torch.testing.assert_close(out["exact"][0][1], per, rtol=1e-12, atol=1e-12)


def test_lora_on_the_digits_dit_and_reference_policy() -> None:
    from jagg_autograd.integrations.diffusers import add_lora, reference_velocity

    model = load_digits_dit()
    g = torch.Generator().manual_seed(4)
    z, t, y = torch.randn(4, 1, 8, 8, generator=g), torch.rand(4, generator=g), torch.arange(4)
    base = model(z, t, labels=y).detach()
    # A plain nn.Module (not a diffusers ModelMixin): the peft injection path; the label
    # tables are frozen too.
    params = add_lora(model, rank=2)
    assert {id(p) for p in model.parameters() if p.requires_grad} == {id(p) for p in params}
    with torch.no_grad():
        for p in params:
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    assert (model(z, t, labels=y) - base).abs().max() > 1e-3
    torch.testing.assert_close(reference_velocity(model, z, t, labels=y), base)
