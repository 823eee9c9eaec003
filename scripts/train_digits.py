#!/usr/bin/env python
"""Reproduce the shipped digits artefacts: the DiT, the reward classifier and their meta file.

    python scripts/train_digits.py                 # writes src/jagg_autograd/assets/digits_*
    python scripts/train_digits.py --out-dir /tmp/digits --dit-steps 50   # a quick check

Everything is seeded and runs single-threaded by default, so two runs on the same machine and
torch build write byte-identical safetensors (BLAS kernels can differ across CPUs/builds, so
across machines expect agreement to round-off, not bits). It uses only scikit-learn's bundled
8x8 digits; nothing is downloaded.
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

import torch
import torch.nn.functional as F

from jagg_autograd.models.digits import (
    ASSETS_DIR,
    NULL_LABEL,
    NUM_CLASSES,
    DigitsClassifier,
    DigitsClassifierConfig,
    DigitsDiT,
    DigitsDiTConfig,
    digit_reward,
    digits_split,
    sample_digits,
)

# Training settings of the shipped artefacts (recorded in digits_meta.json).
DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "classifier_epochs": 40,
    "classifier_batch": 64,
    "classifier_lr": 2e-3,
    "classifier_weight_decay": 1e-4,
    "dit_steps": 300,
    "dit_batch": 128,
    "dit_lr": 1e-3,
    "dit_warmup": 50,
    "dit_weight_decay": 0.0,
    "dit_label_dropout": 0.1,
    "dit_ema": 0.99,
    "eval_samples_per_label": 100,
    "eval_steps": 10,
    "eval_noise_level": 0.7,
}


def _shift(images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random +-1 pixel translations (background -1 fills in): the classifier must judge
    generated digits, which are less well centred than the scanned ones."""
    n = images.shape[0]
    padded = F.pad(images, (1, 1, 1, 1), value=-1.0)
    dx = torch.randint(0, 3, (n,), generator=gen)
    dy = torch.randint(0, 3, (n,), generator=gen)
    out = torch.empty_like(images)
    for i in range(n):
        out[i] = padded[i, :, dy[i] : dy[i] + 8, dx[i] : dx[i] + 8]
    return out


@torch.no_grad()
def accuracy(model: DigitsClassifier, x: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on ``(x, y)``."""
    was_training = model.training
    model.eval()
    acc = (model(x).argmax(-1) == y).double().mean().item()
    model.train(was_training)
    return acc


def train_classifier(settings: dict[str, Any], log: bool = True) -> tuple[DigitsClassifier, dict]:
    """Train :class:`DigitsClassifier` on the fixed train split; report held-out accuracy."""
    torch.manual_seed(settings["seed"])
    gen = torch.Generator().manual_seed(settings["seed"] + 1)
    x_tr, y_tr, x_te, y_te = digits_split()
    model = DigitsClassifier(DigitsClassifierConfig())
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=settings["classifier_lr"],
        weight_decay=settings["classifier_weight_decay"],
    )
    epochs, bs = settings["classifier_epochs"], settings["classifier_batch"]
    total = epochs * math.ceil(x_tr.shape[0] / bs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, total) / total))
    )
    loss = torch.zeros(())
    for epoch in range(epochs):
        perm = torch.randperm(x_tr.shape[0], generator=gen)
        for j in range(0, perm.numel(), bs):
            idx = perm[j : j + bs]
            xb = _shift(x_tr[idx], gen)
            loss = F.cross_entropy(model(xb), y_tr[idx], label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        if log and (epoch + 1) % 10 == 0:
            print(
                f"[classifier] epoch {epoch + 1}/{epochs} loss {loss.item():.4f} "
                f"held-out acc {accuracy(model, x_te, y_te):.4f}",
                flush=True,
            )
    model.eval()
    info = {
        "config": model.config.to_dict(),
        "train_accuracy": accuracy(model, x_tr, y_tr),
        "heldout_accuracy": accuracy(model, x_te, y_te),
        "heldout_size": int(y_te.numel()),
        "train_size": int(y_tr.numel()),
        "final_loss": float(loss.item()),
        "num_parameters": sum(p.numel() for p in model.parameters()),
    }
    return model, info


def train_dit(
    settings: dict[str, Any],
    log: bool = True,
    eval_hook: Any = None,
) -> tuple[DigitsDiT, dict]:
    """Rectified-flow training of :class:`DigitsDiT` on the train split.

    Loss ``|| f(x_s, s, y) - (eps - x0) ||^2`` with ``x_s = (1 - s) x0 + s eps``, ``s`` drawn
    logit-normal (SD3's choice: it spends the capacity on mid-range noise levels) and ``y``
    replaced by :data:`NULL_LABEL` with probability ``dit_label_dropout`` (CFG dropout).
    Returns the EMA weights.
    """
    torch.manual_seed(settings["seed"])
    gen = torch.Generator().manual_seed(settings["seed"] + 2)
    x_tr, y_tr, _, _ = digits_split()
    model = DigitsDiT(DigitsDiTConfig())
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.AdamW(
        model.parameters(), lr=settings["dit_lr"], weight_decay=settings["dit_weight_decay"]
    )
    steps, warm = settings["dit_steps"], settings["dit_warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / warm)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
        ),
    )
    bs, decay = settings["dit_batch"], settings["dit_ema"]
    running, loss = None, torch.zeros(())
    t0 = time.time()
    for step in range(steps):
        idx = torch.randint(0, x_tr.shape[0], (bs,), generator=gen)
        x0, y = x_tr[idx], y_tr[idx].clone()
        y[torch.rand(bs, generator=gen) < settings["dit_label_dropout"]] = NULL_LABEL
        eps = torch.randn(x0.shape, generator=gen)
        s = torch.sigmoid(torch.randn(bs, generator=gen))
        xs = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
        loss = (model(xs, s, labels=y) - (eps - x0)).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        # Warm-started EMA (min with the step-based rate) so early checkpoints are usable.
        d = min(decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), model.parameters(), strict=True):
                pe.lerp_(pm, 1 - d)
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if log and (step + 1) % 50 == 0:
            print(
                f"[dit] step {step + 1}/{steps} loss {running:.4f} ({time.time() - t0:.0f}s)",
                flush=True,
            )
        if eval_hook is not None:
            eval_hook(step + 1, ema)
    ema.eval()
    info = {
        "config": ema.config.to_dict(),
        "final_loss_ema_running": float(running) if running is not None else None,
        "final_loss": float(loss.item()),
        "num_parameters": sum(p.numel() for p in ema.parameters()),
        "train_seconds": time.time() - t0,
    }
    return ema, info


@torch.no_grad()
def evaluate_rewards(
    dit: DigitsDiT,
    classifier: DigitsClassifier,
    settings: dict[str, Any],
    noise_level: float,
    guidance_scale: float | None = None,
) -> dict[str, Any]:
    """Mean reward (classifier probability of the prompted digit) of ``eval_steps``-step
    samples, per label and overall."""
    gen = torch.Generator().manual_seed(settings["seed"] + 3)
    n = settings["eval_samples_per_label"]
    labels = torch.arange(NUM_CLASSES).repeat_interleave(n)
    x = sample_digits(
        dit,
        labels,
        steps=settings["eval_steps"],
        noise_level=noise_level,
        guidance_scale=guidance_scale,
        generator=gen,
    )
    r = digit_reward(x, labels, classifier=classifier)
    acc = (classifier(x.clamp(-1, 1)).argmax(-1) == labels).double()
    per = r.view(NUM_CLASSES, n).mean(1)
    return {
        "steps": settings["eval_steps"],
        "sigmas": "uniform: sigma_i = 1 - i / steps, i = 0..steps (models.digits.sample_digits)",
        "noise_level": noise_level,
        "guidance_scale": guidance_scale,
        "samples_per_label": n,
        "mean_reward": float(r.mean()),
        "mean_reward_per_label": [round(float(v), 4) for v in per],
        "accuracy": float(acc.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=ASSETS_DIR)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 = bit-reproducible)")
    for k, v in DEFAULTS.items():
        p.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    p.add_argument(
        "--eval-every", type=int, default=0, help="also evaluate the EMA every N DiT steps"
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    settings = {k: getattr(args, k) for k in DEFAULTS}
    t_start = time.time()

    classifier, cls_info = train_classifier(settings)
    print(f"[classifier] held-out accuracy {cls_info['heldout_accuracy']:.4f}", flush=True)

    def hook(step: int, ema: DigitsDiT) -> None:
        if args.eval_every and step % args.eval_every == 0:
            for eta in (0.0, settings["eval_noise_level"]):
                ev = evaluate_rewards(ema, classifier, settings, eta)
                print(
                    f"[eval] step {step} eta {eta}: mean reward {ev['mean_reward']:.3f} "
                    f"acc {ev['accuracy']:.3f} per label {ev['mean_reward_per_label']}",
                    flush=True,
                )

    dit, dit_info = train_dit(settings, eval_hook=hook)
    evals = {
        "ode": evaluate_rewards(dit, classifier, settings, 0.0),
        "sde": evaluate_rewards(dit, classifier, settings, settings["eval_noise_level"]),
        "ode_cfg2": evaluate_rewards(dit, classifier, settings, 0.0, guidance_scale=2.0),
    }
    for name, ev in evals.items():
        print(
            f"[eval] {name}: mean reward {ev['mean_reward']:.3f} acc {ev['accuracy']:.3f} "
            f"per label {ev['mean_reward_per_label']}",
            flush=True,
        )

    from safetensors.torch import save_file

    out: Path = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.contiguous() for k, v in dit.state_dict().items()},
        str(out / "digits_dit.safetensors"),
    )
    save_file(
        {k: v.contiguous() for k, v in classifier.state_dict().items()},
        str(out / "digits_classifier.safetensors"),
    )
    meta = {
        "format": 1,
        "description": (
            "Class-conditional SD3Transformer2DModel on scikit-learn's 8x8 digits (rectified "
            "flow: x_s = (1-s) x0 + s eps, v = eps - x0, timestep = 1000 s, labels 0..9, "
            f"null label {NULL_LABEL}) and the reward classifier; made by "
            "scripts/train_digits.py"
        ),
        "data": {
            "source": "sklearn.datasets.load_digits",
            "scaling": "pixel / 8 - 1 (values 0..16 -> [-1, 1])",
            "split": "train_test_split(test_size=0.25, stratify=labels, random_state=0)",
        },
        "settings": settings,
        "dit": {**dit_info, "eval": evals},
        "classifier": cls_info,
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "threads": args.threads,
            "wall_seconds": round(time.time() - t_start, 1),
        },
    }
    with open(out / "digits_meta.json", "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
        fh.write("\n")
    print(f"wrote {out} in {time.time() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
