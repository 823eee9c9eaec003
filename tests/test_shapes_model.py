"""Shapes task: the shipped text encoder + MMDiT, the GRPOTask implementation, the grid."""

from __future__ import annotations

import pytest
import torch

from jagg_autograd.integrations.diffusers import SD3Velocity
from jagg_autograd.models.shapes import (
    WEIGHTS_FILE,
    ShapesModel,
    ShapesModelConfig,
    load_shapes_meta,
    load_shapes_model,
    sample_shapes,
)
from jagg_autograd.tasks.base import GRPOTask
from jagg_autograd.tasks.shapes import ShapesTask, grid_caption, save_grid
from jagg_autograd.tasks.shapes_reward import shapes_reward
from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    eval_prompt_set,
    prompt_split,
    render_batch,
)


@pytest.fixture(scope="module")
def model() -> ShapesModel:
    torch.set_num_threads(1)
    return load_shapes_model()


@pytest.fixture(scope="module")
def task(model) -> ShapesTask:
    return ShapesTask(model=model)


def test_shipped_files_small_and_meta_consistent(model):
    size = WEIGHTS_FILE.stat().st_size
    assert size <= 20 * 2**20
    meta = load_shapes_meta()
    assert meta["model"]["weights_bytes"] == size
    assert meta["model"]["num_parameters"] == sum(p.numel() for p in model.parameters())
    assert not model.training


def test_generates_in_distribution(model):
    """Fixed-noise samples of held-out prompts score well above their pure-noise latents, and
    some are exactly right (pure noise never is)."""
    prompts = eval_prompt_set(8)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(len(prompts), 3, 32, 32, generator=g)
    x = sample_shapes(model.velocity(2.0), model.cond(prompts), steps=10, noise=noise)
    assert x.shape == noise.shape and torch.isfinite(x).all()
    r = shapes_reward(x, prompts)
    r_noise = shapes_reward(noise, prompts)
    assert float(r.mean()) > 1.5 * float(r_noise.mean()) + 0.03
    assert int((r == 1).sum()) >= 3 and int((r_noise == 1).sum()) == 0
    # the pictures are mostly black background, like the renders
    bg = (x.clamp(-1, 1).amax(1) < 0).double().mean()
    assert 0.5 < float(bg) < 0.97


def test_text_encoder_padding_and_empty_prompt(model):
    ehs, pooled = model.encode(["a photo of a circle", ""])
    assert ehs.shape == (2, model.config.max_length, model.config.text_dim)
    assert pooled.shape == (2, model.config.pooled_projection_dim)
    n_words = 5 + 1  # <cls> + words
    assert (ehs[0, n_words:] == 0).all() and (ehs[0, :n_words].abs().sum(-1) > 0).all()
    assert (ehs[1, 1:] == 0).all()
    with pytest.raises(ValueError, match="shapes vocabulary"):
        model.encode(["a photo of a dog"])
    with pytest.raises(TypeError, match="ids"):
        model.text_encoder(torch.zeros(1, model.config.max_length))


def test_forward_matches_sd3velocity_without_cfg(model):
    prompts = ["a photo of two squares", "a photo of a red circle and a blue square"]
    z = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([0.9, 0.3])
    with torch.no_grad():
        v1 = model(z, t, model.tokenizer(prompts))
        v2 = model.velocity(None)(z, t, **model.cond(prompts))
    torch.testing.assert_close(v1, v2, rtol=1e-5, atol=1e-5)


def test_task_interface(task, model):
    assert isinstance(task, GRPOTask) and task.name == "shapes"
    assert task.latent_shape == (3, 32, 32)
    vel = task.velocity_model()
    assert isinstance(vel, SD3Velocity) and vel.uses_cfg
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    p1 = task.sample_prompts(64, g1)
    assert p1 == task.sample_prompts(64, g2)
    train = set(prompt_split("train"))
    assert set(p1) <= train
    held_only = set(prompt_split("heldout")) - train
    assert not held_only & set(p1)
    ev = task.eval_prompts()
    assert len(ev) == task.eval_per_category * len(CATEGORIES)
    cond = task.cond(p1[:3])
    assert all(v.shape[0] == 3 for v in cond.values())
    z = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        v = vel(z, torch.full((3,), 0.5), **cond)
    assert v.shape == z.shape
    pics = task.decode(z)
    assert pics.shape == (3, 32, 32, 3) and 0 <= float(pics.min()) and float(pics.max()) <= 1
    br = task.eval_breakdown(torch.cat([z, z]), ev[:3] + ev[-3:])
    assert set(br) == {
        "strict_accuracy",
        "single_object",
        "single_object_strict_accuracy",
        "color_attr",
        "color_attr_strict_accuracy",
    }
    assert all(v <= 1.0 for v in br.values())
    assert all(0.0 <= br[k] <= 1.0 for k in br if k.endswith("strict_accuracy"))
    pics = render_batch(ev[:3] + ev[-3:], 0)  # clean renders of their prompts
    assert all(v == 1.0 for v in task.eval_breakdown(pics, ev[:3] + ev[-3:]).values())
    with pytest.raises(ValueError, match="tuning"):
        task.trainable_parameters("partial", 4)


def test_trainable_parameters_full_freezes_text_encoder():
    cfg = ShapesModelConfig(num_layers=1, text_layers=1)
    torch.manual_seed(0)
    task = ShapesTask(model=ShapesModel(cfg))
    params = task.trainable_parameters("full", 4)
    assert {id(p) for p in params} == {id(p) for p in task.model.transformer.parameters()}
    assert not any(p.requires_grad for p in task.model.text_encoder.parameters())
    prompts = ["a photo of a circle", "a photo of a blue square"]
    v = task.velocity_model()(
        torch.randn(2, 3, 32, 32), torch.full((2,), 0.5), **task.cond(prompts)
    )
    v.square().mean().backward()
    assert all(p.grad is not None for p in params)
    assert all(p.grad is None for p in task.model.text_encoder.parameters())
    t2 = ShapesTask(model=ShapesModel(cfg))
    lora = t2.trainable_parameters("lora", 2)
    names = {id(p): n for n, p in t2.model.named_parameters()}
    assert lora and all("lora_" in names[id(p)] for p in lora)
    assert not any(p.requires_grad for n, p in t2.model.named_parameters() if "lora_" not in n)


def test_save_grid(tmp_path, task):
    ps = eval_prompt_set(1)
    pics = task.decode(torch.rand(len(ps), 3, 32, 32) * 2 - 1)
    out = save_grid(
        tmp_path / "sub" / "shapes_grid.png", pics, [grid_caption(p, 0.5) for p in ps], ncols=3
    )
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert grid_caption("a photo of two circles", 1.0) == "two circles\nscore 1.00"
    with pytest.raises(ValueError, match="captions"):
        save_grid(tmp_path / "g.png", pics, ["x"])
    with pytest.raises(ValueError, match="images"):
        save_grid(tmp_path / "g.png", torch.rand(2, 3, 8, 8), ["a", "b"])


def test_grpo_smoke_run_through_the_trainer(tmp_path):
    """Two GRPO steps of the registered task under the model-agnostic trainer (JAGG)."""
    from jagg_autograd.trainer import GRPOConfig, train

    config = GRPOConfig(
        task="shapes",
        task_options={"eval_per_category": 1},
        steps=2,
        prompts_per_step=2,
        group_size=2,
        num_steps=4,
        window=2,
        progress=False,
        out=str(tmp_path),
    )
    log = train(config)
    assert log["task"] == "shapes" and log["status"] == "finished"
    assert len(log["steps"]) == 2
    first, last = log["evals"][0], log["evals"][-1]
    assert first["samples"] == len(CATEGORIES) and first["mean_reward"] <= 1.0
    assert 0.0 <= first["strict_accuracy"] <= 1.0
    assert set(CATEGORIES) <= set(last)
    assert {f"{c}_strict_accuracy" for c in CATEGORIES} <= set(last)
    assert (tmp_path / "log.json").is_file()



def _train_script():
    """scripts/train_shapes.py as a module (it is not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "train_shapes.py"
    spec = importlib.util.spec_from_file_location("train_shapes", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_training_script_is_deterministic():
    """Two short runs of scripts/train_shapes.py's training loop give identical weights."""
    mod = _train_script()
    settings = {**mod.DEFAULTS, "steps": 3, "batch": 4, "warmup": 2, "num_layers": 1}
    torch.set_num_threads(1)
    a, info = mod.train(settings, log_every=10**9)
    b, _ = mod.train(settings, log_every=10**9)
    assert info["config"]["num_layers"] == 1
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    torch.manual_seed(settings["seed"])  # the script's initialisation
    init = ShapesModel(ShapesModelConfig(num_layers=1)).state_dict()
    assert any(not torch.equal(sa[k], init[k]) for k in sa)  # it did train


def test_training_script_continues_from_init_weights(tmp_path):
    """--init-weights: at lr 0 the run returns those weights; a step from them moves off them and
    differs from a step from the seed's initialisation."""
    from safetensors.torch import save_file

    mod = _train_script()
    settings = {**mod.DEFAULTS, "steps": 2, "batch": 4, "warmup": 1, "num_layers": 1}
    torch.set_num_threads(1)
    torch.manual_seed(123)  # weights unlike the seed's initialisation
    cfg = ShapesModelConfig(
        num_layers=1,
        attention_head_dim=settings["attention_head_dim"],
        num_attention_heads=settings["num_attention_heads"],
        patch_size=settings["patch_size"],
        text_layers=settings["text_layers"],
    )
    start = ShapesModel(cfg).state_dict()
    w = tmp_path / "start.safetensors"
    save_file({k: v.contiguous() for k, v in start.items()}, str(w))
    same, _ = mod.train({**settings, "lr": 0.0}, log_every=10**9, init_weights=w)
    assert all(torch.equal(v, start[k]) for k, v in same.state_dict().items())
    cont, _ = mod.train(settings, log_every=10**9, init_weights=w)
    fresh, _ = mod.train(settings, log_every=10**9)
    sc, sf = cont.state_dict(), fresh.state_dict()
    assert any(not torch.equal(sc[k], start[k]) for k in sc)
    assert any(not torch.equal(sc[k], sf[k]) for k in sc)


def test_training_script_options_change_the_run_and_default_reproduces():
    """--uniform-t-frac and --category-weights change the training draws; their defaults
    (absent from the settings) take the shipped model's code path."""
    import numpy as np

    mod = _train_script()
    settings = {**mod.DEFAULTS, "steps": 2, "batch": 4, "warmup": 1, "num_layers": 1}
    torch.set_num_threads(1)
    base, _ = mod.train(settings, log_every=10**9)
    same, _ = mod.train({**settings, "uniform_t_frac": 0.0}, log_every=10**9)
    unif, _ = mod.train({**settings, "uniform_t_frac": 1.0}, log_every=10**9)
    sb, ss, su = base.state_dict(), same.state_dict(), unif.state_dict()
    assert all(torch.equal(sb[k], ss[k]) for k in sb)
    assert any(not torch.equal(sb[k], su[k]) for k in sb)
    # --text-lr-mult: 1 is the default path; otherwise the text encoder moves further
    # from its initialisation while the MMDiT's first step (Adam: ~lr per weight) does not.
    one, _ = mod.train({**settings, "text_lr_mult": 1.0}, log_every=10**9)
    fast, _ = mod.train({**settings, "text_lr_mult": 10.0}, log_every=10**9)
    torch.manual_seed(settings["seed"])  # train()'s initialisation
    init = mod.ShapesModel(base.config).state_dict()
    so, sf = one.state_dict(), fast.state_dict()
    assert all(torch.equal(sb[k], so[k]) for k in sb)

    def moved(sd, prefix):
        return sum((sd[k] - init[k]).abs().sum().item() for k in sd if k.startswith(prefix))

    assert moved(sf, "text_encoder.") > 3 * moved(sb, "text_encoder.")
    # category weights: all mass on one category draws only its prompts
    caps = mod.sample_captions(50, np.random.default_rng(0), [0, 0, 0, 0, 1, 0])
    from jagg_autograd.tasks.shapes_scenes import parse_prompt

    assert {parse_prompt(c).category for c in caps} == {"position"}


def test_pooled_text_off_feeds_zeros_and_loads_the_same_checkpoints():
    """``pooled_text=False``: the pooled projection is zero for every prompt (so the velocity
    cannot depend on the pooled layer's weights), the token embeddings are unchanged, and
    the two configurations share one state-dict layout (a pooled model's weights load)."""
    torch.manual_seed(0)
    on = ShapesModel(ShapesModelConfig(num_layers=1, text_layers=1)).eval()
    off = ShapesModel(ShapesModelConfig(num_layers=1, text_layers=1, pooled_text=False)).eval()
    off.load_state_dict(on.state_dict(), strict=True)
    prompts = ["a photo of a red circle", "a photo of a blue square", ""]
    ehs_on, pooled_on = on.encode(prompts)
    ehs_off, pooled_off = off.encode(prompts)
    torch.testing.assert_close(ehs_off, ehs_on, rtol=0, atol=0)
    assert pooled_off.shape == pooled_on.shape and (pooled_off == 0).all()
    assert (pooled_on[0] != pooled_on[1]).any()
    z = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    t = torch.full((3,), 0.6)
    ids = off.tokenizer(prompts)
    with torch.no_grad():
        v = off(z, t, ids)
        torch.nn.init.normal_(off.text_encoder.pooled.weight)
        assert torch.equal(off(z, t, ids), v)
        assert not torch.equal(on(z, t, ids), v)  # with pooled text the output differs
    assert ShapesModelConfig.from_dict(off.config.to_dict()) == off.config
    # Meta files written before the option existed load as pooled models.
    legacy = {k: v for k, v in on.config.to_dict().items() if k != "pooled_text"}
    assert ShapesModelConfig.from_dict(legacy).pooled_text is True
    with pytest.raises(TypeError, match="pooled_text must be a bool"):
        ShapesModelConfig(pooled_text=1)


def test_training_script_no_pooled_text():
    """--no-pooled-text trains a model whose config says so (and whose pooled layer, unused,
    keeps its initial weights)."""
    mod = _train_script()
    settings = {**mod.DEFAULTS, "steps": 2, "batch": 4, "warmup": 1, "num_layers": 1}
    torch.set_num_threads(1)
    model, info = mod.train({**settings, "pooled_text": False}, log_every=10**9)
    assert info["config"]["pooled_text"] is False and not model.config.pooled_text
    torch.manual_seed(settings["seed"])  # the script's initialisation
    init = ShapesModel(ShapesModelConfig(num_layers=1, pooled_text=False)).state_dict()
    sd = model.state_dict()
    assert torch.equal(sd["text_encoder.pooled.weight"], init["text_encoder.pooled.weight"])
    assert not torch.equal(
        sd["text_encoder.token_embed.weight"], init["text_encoder.token_embed.weight"]
    )
