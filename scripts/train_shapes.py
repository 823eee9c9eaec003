#!/usr/bin/env python
"""Reproduce the shipped shapes text-to-image model (text encoder + SD3 MMDiT) and its meta file.

The shipped model (since 2026-12-06: 6 MMDiT layers, a 3-layer text encoder, no pooled
text vector, 3.6 M parameters, 14.6 MB) is made in two stages, 88 min on 2 cores in all:

    python scripts/train_shapes.py --threads 2 --num-layers 6 --text-layers 3 \
        --steps 9000 --category-weights 1 1.5 1 1 2 2 --uniform-t-frac 0.3 \
        --reading-order --no-pooled-text --out-dir /tmp/shapes_stage1
    python scripts/train_shapes.py --threads 2 --num-layers 6 --text-layers 3 \
        --uniform-t-frac 0.3 --reading-order --no-pooled-text \
        --init-weights /tmp/shapes_stage1/shapes_model.safetensors \
        --steps 1400 --lr 3e-4 --warmup 100 --category-weights 1 1.5 1 1 3 2 --eval-every 0
        # --out-dir defaults to src/jagg_autograd/assets: writes shapes_* there

    python scripts/train_shapes.py --out-dir /tmp/shapes --steps 300   # a quick check

Stage 1 (4491 s with its evaluations) trains from scratch with two objects, position and
colour attribution drawn 1.5x / 2x / 2x as often, 30 % of each batch's noise levels
uniform, two-object scenes laid out left to right in the caption's order, and a zero
pooled vector; stage 2 (770 s) continues it at a fifth of the learning rate with position
drawn 3x.  At the trainer's sampler (``python -m benchmarks.shapes_base``: CFG 2, SDE eta
0.7, 768 held-out samples) stage 2 moved the strict accuracy 0.292 -> 0.366 (single object
0.34 -> 0.41, two objects 0.25 -> 0.33, counting 0.25 -> 0.32, colours 0.61 -> 0.71,
position 0.09 -> 0.08, colour attribution 0.22 -> 0.34); the model it replaced (4 layers
with the pooled vector, below) is at 0.275 (position 0.06, colour attribution 0.08).  The
meta file keeps stage 1's settings under ``init``.

Why no pooled vector (``benchmarks.shapes_base``'s pooled probe,
benchmarks/results/shapes/SHAPES.md): SD3's MMDiT also reads a pooled text vector through
adaLN, which modulates every image token alike; a model trained with it takes an object's
shape from that vector (75 % of probe pictures, 8 % from the tokens), so two objects
cannot get two shapes.  With ``--no-pooled-text`` the prompt reaches the picture through
joint attention only (shape from the tokens 0.63).

The earlier model (the defaults below plus a stage 2 of 6000 steps at lr 5e-4 with the
category weights 1 1.5 1 1 2 2: strict 0.275 at the trainer's sampler) and the variants of
it that were not kept: a third stage with position and colour attribution drawn 3x / 4x
(strict position 0.16 -> 0.03 on 192 prompts), 30 % / 70 % uniform noise levels
(``--uniform-t-frac``: strict +0.031 / +0.017), the text encoder at 5x / 20x the learning
rate (``--text-lr-mult``: colour attribution 0.07 / 0.06), ``--reading-order`` with
the pooled vector (colours to their sides, shapes not: colour attribution 0.09-0.13), and
the shipped stage 2 with ``--reading-order 2d`` (stacked pairs read top to bottom: the
vertical relations' order stayed at chance, position 0.120 -> 0.099 over six noise draws),
and both stages with ``--reading-order 2d`` from scratch (the vertical order still at
chance and the horizontal one lost: position 0.073, strict 0.323 against 0.363).
The meta file's evaluations use 32 prompts per category (about +-0.065 per category);
compare models with ``python -m benchmarks.shapes_base`` (768 samples, standard errors,
blank / merged pictures).
The paragraph below is about stage 1.

Rectified-flow pre-training of :class:`jagg_autograd.models.shapes.ShapesModel` on clean
renders of the task's prompts (:mod:`jagg_autograd.tasks.shapes_scenes`), drawn on the fly:
each sample picks a category uniformly, then one of its prompts uniformly (all prompts: the
held-out split is held out from GRPO, as GenEval's prompts are from Flow-GRPO's training,
while pre-training stands for the broad data a real T2I model has seen), then a random
scene of it.  The caption is replaced by ``""`` with probability ``caption_dropout`` (CFG).

Everything is seeded and runs on ``--threads`` torch threads (default 1: bit-reproducible
on one machine and torch build, and polite on a shared CPU); nothing is downloaded.  The
shipped weights were made with ``--threads 2`` on an otherwise idle 2-core CPU (0.49 s per
step for the 6-layer model); the earlier model's default-size stage 1 took 8000 steps in
1897 s of training, 1947 s with the evaluations (0.2 s per step alone; while another
job shared the cores for its first 800 steps two threads slowed to 1-2 s per step, so
give it the machine).  The defaults (4 layers of width 128, 2.4 M parameters, 9.6 MB)
replaced a width-64 model trained 5000 steps, whose pictures were shapeless blobs
(held-out ODE score 0.214 at CFG 2 vs 0.383 for them, both under the task's earlier
all-or-below-half reward) and on which no GRPO setting we tried raised the reward.  At
the end the EMA model is evaluated on the held-out evaluation set with fixed noise
(:func:`jagg_autograd.tasks.shapes_scenes.eval_prompt_set`), per GenEval category (mean
reward and strict accuracy), and the figures go into ``shapes_meta.json``.
``--eval-only`` re-runs just these evaluations (about 3 min on one thread; that is how
the figures were recomputed when the reward became Flow-GRPO's partial credit).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from jagg_autograd.models.shapes import (
    ASSETS_DIR,
    ShapesModel,
    ShapesModelConfig,
    sample_shapes,
)
from jagg_autograd.tasks.shapes_reward import shapes_scores
from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    READING_ORDERS,
    all_prompts,
    eval_prompt_set,
    parse_prompt,
    render_batch,
)

DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "steps": 8000,
    "batch": 64,
    "lr": 1.5e-3,
    "warmup": 300,
    "weight_decay": 0.0,
    "caption_dropout": 0.1,
    "ema": 0.999,
    "num_layers": 4,
    "attention_head_dim": 32,
    "num_attention_heads": 4,
    "patch_size": 4,
    "text_layers": 2,
    "eval_per_category": 32,
    "eval_steps": 10,
    "eval_seed": 12345,
}
GUIDANCE_SCALES = (1.0, 2.0, 3.0, 4.5)
EVAL_NOISE_LEVEL = 0.7


def sample_captions(
    n: int, rng: np.random.Generator, weights: list[float] | None = None
) -> list[str]:
    """``n`` training captions: a category (uniform, or in proportion to ``weights``, one
    per entry of ``CATEGORIES``), then a prompt of it uniform."""
    by_cat = {c: all_prompts(c) for c in CATEGORIES}
    p = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)
    out = []
    for _ in range(n):
        k = int(rng.integers(len(CATEGORIES))) if p is None else int(rng.choice(len(p), p=p))
        ps = by_cat[CATEGORIES[k]]
        out.append(ps[int(rng.integers(len(ps)))])
    return out


@torch.no_grad()
def evaluate(
    model: ShapesModel,
    settings: dict[str, Any],
    guidance_scale: float,
    noise_level: float,
    split: str = "heldout",
) -> dict[str, Any]:
    """Mean reward (Flow-GRPO's partial credit) and GenEval's strict accuracy of fixed-noise
    samples of the evaluation set, overall and per category."""
    prompts = eval_prompt_set(settings["eval_per_category"], split)
    gen = torch.Generator().manual_seed(settings["eval_seed"])
    noise = torch.randn((len(prompts), 3, 32, 32), generator=gen)
    vel = model.velocity(guidance_scale if guidance_scale != 1.0 else None)
    x = sample_shapes(
        vel,
        model.cond(prompts),
        steps=settings["eval_steps"],
        noise_level=noise_level,
        generator=gen,
        noise=noise,
    )
    r, strict = shapes_scores(x, prompts)
    cats = [parse_prompt(p).category for p in prompts]
    idx = {c: [i for i, k in enumerate(cats) if k == c] for c in CATEGORIES}
    per = {c: float(r[idx[c]].mean()) for c in CATEGORIES}
    strict_per = {c: float(strict[idx[c]].double().mean()) for c in CATEGORIES}
    return {
        "split": split,
        "guidance_scale": guidance_scale,
        "noise_level": noise_level,
        "steps": settings["eval_steps"],
        "samples": len(prompts),
        "mean_reward": float(r.mean()),
        "strict_accuracy": float(strict.double().mean()),
        "per_category": {c: round(v, 4) for c, v in per.items()},
        "strict_accuracy_per_category": {c: round(v, 4) for c, v in strict_per.items()},
    }


def train(
    settings: dict[str, Any],
    log_every: int = 100,
    eval_every: int = 0,
    init_weights: Path | None = None,
    progress: tuple[int, float, float] = (8, 3.0, 0.0),
) -> tuple[ShapesModel, dict[str, Any]]:
    """Joint rectified-flow training of the text encoder and the MMDiT; returns the EMA.

    ``eval_every > 0``: also print a held-out evaluation of the EMA every that many steps
    (progress only; not in the meta file): ``progress`` = (samples per category, CFG
    scale, SDE noise level; 0 = ODE).  ``init_weights``: start the model and its EMA from
    these weights (a safetensors file of the same architecture) instead of the seed's
    initialisation -- continued training, e.g. to measure what more steps buy.
    """
    torch.manual_seed(settings["seed"])
    rng = np.random.default_rng(settings["seed"] + 1)
    gen = torch.Generator().manual_seed(settings["seed"] + 2)
    cfg = ShapesModelConfig(
        num_layers=settings["num_layers"],
        attention_head_dim=settings["attention_head_dim"],
        num_attention_heads=settings["num_attention_heads"],
        patch_size=settings["patch_size"],
        text_layers=settings["text_layers"],
        pooled_text=settings.get("pooled_text", True),
    )
    model = ShapesModel(cfg)
    if init_weights is not None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(init_weights)))
    ema = copy.deepcopy(model).requires_grad_(False)
    # The text encoder may learn faster than the MMDiT (``text_lr_mult``): it barely binds a
    # colour or a relation to its noun (benchmarks.shapes_base's binding probe).
    text_mult = settings.get("text_lr_mult", 1.0)
    params: Any = model.parameters()  # one group: the shipped model's optimizer
    if text_mult != 1.0:
        params = [
            {"params": model.text_encoder.parameters(), "lr": settings["lr"] * text_mult},
            {"params": model.transformer.parameters()},
        ]
    opt = torch.optim.AdamW(params, lr=settings["lr"], weight_decay=settings["weight_decay"])
    steps, warm, bs = settings["steps"], settings["warmup"], settings["batch"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / warm)
            * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
        ),
    )
    reading_order = settings.get("reading_order", False)
    running, loss = None, torch.zeros(())
    t0 = time.time()
    for step in range(steps):
        captions = sample_captions(bs, rng, settings.get("category_weights"))
        x0 = render_batch(captions, rng, reading_order=reading_order)
        drop = rng.random(bs) < settings["caption_dropout"]
        ids = model.tokenizer(["" if d else c for c, d in zip(captions, drop, strict=True)])
        eps = torch.randn(x0.shape, generator=gen)
        s = torch.sigmoid(torch.randn(bs, generator=gen))
        frac = settings.get("uniform_t_frac", 0.0)
        if frac > 0.0:
            # Part of the batch at s ~ U(0, 1): the logit-normal puts 1.4 % of its mass
            # above s = 0.9, where the 10-step sampler makes its first, layout-setting step.
            u = torch.rand(bs, generator=gen)
            s = torch.where(torch.rand(bs, generator=gen) < frac, u, s)
        xs = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
        loss = (model(xs, s, ids) - (eps - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        # Warm-started EMA so that short runs (and early checkpoints) are usable.
        d = min(settings["ema"], (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - d)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if (step + 1) % log_every == 0:
            print(
                f"[train] step {step + 1}/{steps} loss {running:.4f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
        if eval_every and (step + 1) % eval_every == 0:
            ema.eval()
            n_cat, w, eta = progress
            ev = evaluate(ema, {**settings, "eval_per_category": n_cat}, w, eta)
            print(
                f"[eval] step {step + 1} cfg {w} eta {eta}: mean {ev['mean_reward']:.3f} "
                f"strict {ev['strict_accuracy']:.3f} {ev['strict_accuracy_per_category']}",
                flush=True,
            )
    ema.eval()
    info = {
        "config": cfg.to_dict(),
        "final_loss_running": float(running) if running is not None else None,
        "num_parameters": sum(p.numel() for p in ema.parameters()),
        "num_parameters_text_encoder": sum(p.numel() for p in ema.text_encoder.parameters()),
        "train_seconds": round(time.time() - t0, 1),
    }
    return ema, info


def run_evals(model: ShapesModel, settings: dict[str, Any]) -> dict[str, Any]:
    """The meta file's evaluations: held-out at every CFG scale with the ODE and the SDE
    sampler, the training split with the SDE, and the pure-noise reference."""
    # Reference: the same evaluation set scored on its pure-noise initial latents.
    ev_prompts = eval_prompt_set(settings["eval_per_category"], "heldout")
    noise = torch.randn(
        (len(ev_prompts), 3, 32, 32), generator=torch.Generator().manual_seed(settings["eval_seed"])
    )
    r_noise, strict_noise = shapes_scores(noise, ev_prompts)
    noise_eval = {
        "mean_reward": float(r_noise.mean()),
        "strict_accuracy": float(strict_noise.double().mean()),
        "samples": len(ev_prompts),
    }
    print(f"[eval] pure noise: mean {noise_eval['mean_reward']:.4f}", flush=True)
    evals, evals_train = [], []
    for w in GUIDANCE_SCALES:
        for eta in (0.0, EVAL_NOISE_LEVEL):
            ev = evaluate(model, settings, w, eta)
            evals.append(ev)
            print(
                f"[eval] held-out cfg {w} eta {eta}: mean {ev['mean_reward']:.3f} strict "
                f"{ev['strict_accuracy']:.3f} per category {ev['per_category']} strict "
                f"{ev['strict_accuracy_per_category']}",
                flush=True,
            )
        ev = evaluate(model, settings, w, EVAL_NOISE_LEVEL, split="train")
        evals_train.append(ev)
        print(
            f"[eval] train cfg {w} eta {EVAL_NOISE_LEVEL}: mean {ev['mean_reward']:.3f} strict "
            f"{ev['strict_accuracy']:.3f} per category {ev['per_category']}",
            flush=True,
        )
    return {
        "eval_heldout": evals,
        "eval_train": evals_train,
        "eval_heldout_pure_noise": noise_eval,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=ASSETS_DIR)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = bit-reproducible)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    p.add_argument("--eval-every", type=int, default=0, help="progress evaluations (0: off)")
    p.add_argument("--progress-eval", type=float, nargs=3, default=(8, 3.0, 0.0),
                   metavar=("PER_CATEGORY", "CFG", "ETA"),
                   help="the progress evaluation: samples per category, CFG, SDE noise level")
    p.add_argument("--category-weights", type=float, nargs=len(CATEGORIES), default=None,
                   metavar="W", help="sampling weight of each category, in the order "
                   f"{', '.join(CATEGORIES)} (default: uniform)")
    p.add_argument("--uniform-t-frac", type=float, default=0.0,
                   help="fraction of each batch with the noise level s ~ U(0, 1) instead of "
                   "the logit-normal sigmoid(N(0, 1)) (default 0: the shipped model's)")
    p.add_argument("--text-lr-mult", type=float, default=1.0,
                   help="the text encoder's learning rate as a multiple of --lr (default 1: "
                   "the shipped model's)")
    p.add_argument("--reading-order", nargs="?", const="horizontal", default=None,
                   choices=READING_ORDERS,
                   help="two_object / color_attr scenes put the named objects in the "
                   "caption's order: 'horizontal' (the flag alone) left to right; '2d' top "
                   "to bottom when the pair is stacked, else left to right (default: none)")
    p.add_argument("--no-pooled-text", action="store_true",
                   help="feed the MMDiT a zero pooled projection, so that the prompt reaches "
                   "the picture only through joint attention (default off: the shipped "
                   "model's pooled text, which sets one shape for every object)")
    p.add_argument("--init-weights", type=Path, default=None,
                   help="continue from these weights (same architecture; recorded in the meta)")
    p.add_argument(
        "--eval-only",
        action="store_true",
        help="no training: re-run the evaluations of the model in --out-dir, update its meta",
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out: Path = args.out_dir
    t_start = time.time()

    if args.eval_only:
        from jagg_autograd.models.shapes import load_shapes_model

        meta_path = out / "shapes_meta.json"
        with open(meta_path, encoding="utf-8") as fh:
            meta = json.load(fh)
        model = load_shapes_model(weights=out / "shapes_model.safetensors", meta=meta_path)
        meta.update(run_evals(model, meta["settings"]))
        with open(meta_path, "w", encoding="utf-8") as fh:
            json.dump(meta, fh, indent=2)
            fh.write("\n")
        print(f"updated {meta_path} in {time.time() - t_start:.0f}s", flush=True)
        return 0

    settings = {k: getattr(args, k) for k in DEFAULTS}
    if args.category_weights is not None:
        if any(w < 0 for w in args.category_weights) or sum(args.category_weights) <= 0:
            p.error("--category-weights must be >= 0 with a positive sum")
        settings["category_weights"] = list(args.category_weights)
    if not 0.0 <= args.uniform_t_frac <= 1.0:
        p.error("--uniform-t-frac must be in [0, 1]")
    if args.uniform_t_frac > 0.0:
        settings["uniform_t_frac"] = args.uniform_t_frac
    if not (math.isfinite(args.text_lr_mult) and args.text_lr_mult > 0.0):
        p.error("--text-lr-mult must be a finite number > 0")
    if args.text_lr_mult != 1.0:
        settings["text_lr_mult"] = args.text_lr_mult
    if args.reading_order is not None:
        # "horizontal" is recorded as True, as the meta files written before "2d" have it.
        settings["reading_order"] = True if args.reading_order == "horizontal" else "2d"
    if args.no_pooled_text:
        settings["pooled_text"] = False
    n_cat, w, eta = args.progress_eval
    model, info = train(
        settings,
        eval_every=args.eval_every,
        init_weights=args.init_weights,
        progress=(int(n_cat), w, eta),
    )
    init_meta = None
    if args.init_weights is not None:
        info["init_weights"] = str(args.init_weights)
        # Provenance: the stage this run continues (its settings reproduce it).
        prev = args.init_weights.parent / "shapes_meta.json"
        if prev.is_file():
            with open(prev, encoding="utf-8") as fh:
                pm = json.load(fh)
            init_meta = {k: pm[k] for k in ("settings", "model", "init") if k in pm}
    evals = run_evals(model, settings)

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    weights = out / "shapes_model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(weights))
    meta = {
        "format": 1,
        "description": (
            "Text encoder + SD3Transformer2DModel on 32x32 RGB shape scenes (rectified flow: "
            "x_s = (1-s) x0 + s eps, v = eps - x0, timestep = 1000 s; latent = picture in "
            "[-1, 1]; CFG negative = the empty prompt); made by scripts/train_shapes.py"
        ),
        "settings": settings,
        "model": {**info, "weights_bytes": weights.stat().st_size},
        **({"init": init_meta} if init_meta is not None else {}),
        **evals,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": args.threads,
            "wall_seconds": round(time.time() - t_start, 1),
        },
    }
    with open(out / "shapes_meta.json", "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    print(f"wrote {out} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
