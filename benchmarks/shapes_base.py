"""The shapes base model at the trainer's sampler: GenEval figures per category with their
standard errors, and the two failure modes behind the weak categories.

    python -m benchmarks.shapes_base                       # the shipped model, ~1 min
    python -m benchmarks.shapes_base --models stage2=src/jagg_autograd/assets \\
        s3=/tmp/shapes_stage3                              # compare candidate models
    python -m benchmarks.shapes_base --split train         # GRPO's training prompts
    python -m benchmarks.shapes_base --quick               # the test configuration

Issue 21 asks for a base model whose strict accuracy per GenEval category lies between ~0.2
and 0.8 at the trainer's SDE sampler.  ``scripts/train_shapes.py`` records 32 prompts per
category with one noise draw in the meta file: a category's strict accuracy near 0.15 then
has a standard error of ~0.065, so two candidate models (or the same one under other noise)
can swap places.  This evaluates each model on the held-out evaluation set
(:func:`~jagg_autograd.tasks.shapes_scenes.eval_prompt_set`, ``--per-category`` prompts per
category) under each ``--noise-seeds`` draw, all models on the same noise, and reports per
category: the strict accuracy (GenEval's, via :meth:`ShapesTask.eval_breakdown`) with its
binomial standard error over all samples, the mean partial-credit reward, and two failure
fractions from the detector (:func:`~jagg_autograd.tasks.shapes_reward.detect_objects`):

* **blank**: no object detected at all (the picture stays background);
* **merged**: a detected component of more pixels than the largest rendered object (a 13 x 13
  square) with a one-pixel rim, ``> 15 * 15``: objects drawn into one another, which the
  detector cannot count or place.

Probes of the categories that name two objects follow (``pair_anatomy``, ``binding_chain``,
``relation_anatomy``: where position pictures put the first named object, per relation).

Outputs (``--out``, default ``benchmarks/results/shapes_base``): ``shapes_base.json`` and
``SHAPES_BASE.md``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/shapes_base.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info, write_report
from jagg_autograd.models.shapes import ASSETS_DIR, ShapesModel, load_shapes_model, sample_shapes
from jagg_autograd.tasks.shapes import ShapesTask
from jagg_autograd.tasks.shapes_reward import (
    UNKNOWN,
    Detection,
    clause_results,
    detect_objects,
)
from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    COLORS,
    LARGEST_SIDE,
    RELATIONS,
    SHAPES,
    PromptSpec,
    all_prompts,
    eval_prompt_set,
    parse_prompt,
)

#: A rendered object's box is at most LARGEST_SIDE px on a side; a generated one may carry a
#: blurry one-pixel rim, so a component of more than MERGED_AREA pixels is not one object.
MERGED_AREA = (LARGEST_SIDE + 2) ** 2
_REVERSED = {"left": "right", "right": "left", "above": "below", "below": "above"}
#: The categories whose prompts bind words to one of two objects.
BINDING_CATEGORIES = ("color_attr", "position")
#: Why a two-object picture lacks its two named-shape detections (:func:`binding_chain`).
MISS_REASONS = ("more", "merged", "unknown", "other_shape", "missing")
#: Where a position picture puts its first named object (:func:`relation_anatomy`).
PLACEMENTS = ("left", "right", "above", "below")
#: The text's two paths into the MMDiT (:func:`pooled_probe`).
TEXT_PATHS = ("tokens", "pooled", "other")
CONFIGS = {
    "quick": {"per_category": 2, "noise_seeds": [12345], "probe_per_prompt": 1},
    "full": {"per_category": 64, "noise_seeds": [12345, 777], "probe_per_prompt": 8},
}


def failure_flags(image: torch.Tensor) -> tuple[bool, bool]:
    """``(blank, merged)`` of one picture ``(3, 32, 32)``: no detection at all; a detection
    of more pixels than the largest rendered object with a blurry rim (:data:`MERGED_AREA`)."""
    return _flags(detect_objects(image))


def _flags(dets: list[Detection]) -> tuple[bool, bool]:
    if not dets:
        return True, False
    return False, any(d.area > MERGED_AREA for d in dets)


def _sides(first: str, second: str, left: str, right: str) -> str:
    if (left, right) == (first, second):
        return "in_order"
    return "swapped" if (left, right) == (second, first) else "other"


def pair_anatomy(detections: list[list[Detection]], prompts: list[str]) -> dict[str, Any]:
    """How a model draws the prompts that name two different objects without a relation
    (``two_object``, ``color_attr``): which shapes it draws, and which side each goes to.

    Over the pictures with exactly two detections (``two_detected`` of all such pictures):
    ``asked_shapes``, the fraction of the detections whose shapes are the ones asked for
    (as a multiset: two circles for "a circle and a square" is one of two); ``drawn``, the
    share of each shape among the detections, against ``asked``, its share among the asked
    shapes of the same pictures (not a third each: the held-out split holds one meaning of
    ``two_object``, "a circle and a square", so triangles are asked only by ``color_attr``);
    ``shape_sides`` / ``color_sides`` (the latter on ``color_attr``), the fraction whose
    left and right detection carry the first and second named shape / colour
    (``in_order``), the reverse (``swapped``), or neither (``other``).  A model that binds
    a colour to its noun but not to a side gets ``in_order`` ~ ``swapped``; one that draws
    the named objects left to right (``--reading-order`` pre-training) gets ``in_order``
    >> ``swapped`` whether or not it draws the right shapes.
    """
    total = 0
    pairs: list[tuple[PromptSpec, Detection, Detection]] = []
    for dets, prompt in zip(detections, prompts, strict=True):
        spec = parse_prompt(prompt)
        if spec.category not in ("two_object", "color_attr"):
            continue
        total += 1
        if len(dets) == 2:
            left, right = sorted(dets, key=lambda d: (d.cx, d.cy))
            pairs.append((spec, left, right))
    drawn = Counter(d.shape for _, left, right in pairs for d in (left, right))
    asked_all = Counter(g.shape for spec, _, _ in pairs for g in spec.groups)
    hits = 0
    for spec, left, right in pairs:
        asked = Counter(g.shape for g in spec.groups)
        hits += sum((asked & Counter((left.shape, right.shape))).values())
    shape_sides = Counter(
        _sides(s.groups[0].shape, s.groups[1].shape, a.shape, b.shape) for s, a, b in pairs
    )
    color_pairs = [(s, a, b) for s, a, b in pairs if s.category == "color_attr"]
    color_sides = Counter(
        _sides(str(s.groups[0].color), str(s.groups[1].color), a.color, b.color)
        for s, a, b in color_pairs
    )
    n = max(len(pairs), 1)
    return {
        "pictures": total,
        "two_detected": len(pairs) / max(total, 1),
        "asked_shapes": hits / (2 * n),
        "drawn": {k: drawn[k] / (2 * n) for k in (*SHAPES, UNKNOWN)},
        "asked": {k: asked_all[k] / (2 * n) for k in SHAPES},
        "shape_sides": {k: shape_sides[k] / n for k in ("in_order", "swapped", "other")},
        "color_sides": {
            k: color_sides[k] / max(len(color_pairs), 1) for k in ("in_order", "swapped", "other")
        },
    }


def binding_chain(detections: list[list[Detection]], prompts: list[str]) -> dict[str, Any]:
    """Strict accuracy of the prompts that name two objects (``two_object``, ``position``,
    ``color_attr``), factored into the three things such a picture must get right:

    * ``found``: exactly two detections of the named shapes (objects of other shapes and
      unknown ones cost nothing, as in the reward);
    * ``shapes`` (given ``found``): they are the asked shapes, one of each -- every count
      clause holds;
    * ``bound`` (given ``shapes``): the rest holds -- the colours (``color_attr``) or the
      relation (``position``); 1 for ``two_object``, which asks nothing more.

    ``found * shapes * bound`` is the category's strict accuracy (``strict``) exactly, since
    the count clauses holding implies ``found``.  Per category, with ``pictures``, and why
    the rest is not ``found`` (``missed``, fractions of ``pictures`` that sum with ``found``
    to 1; the first reason that applies): ``more`` than two named-shape detections; fewer,
    with a ``merged`` component (objects drawn into one another, :data:`MERGED_AREA`); fewer,
    with an ``unknown`` shape; fewer, with a detection of a shape the prompt does not name
    (``other_shape``); fewer and nothing else drawn (``missing``).
    """
    tallies: dict[str, Counter] = {c: Counter() for c in ("two_object", "position", "color_attr")}
    for dets, prompt in zip(detections, prompts, strict=True):
        spec = parse_prompt(prompt)
        if spec.category not in tallies:
            continue
        t = tallies[spec.category]
        t["pictures"] += 1
        named = {g.shape for g in spec.groups}
        n_named = sum(d.shape in named for d in dets)
        if n_named != 2:
            t[_miss_reason(dets, named, n_named)] += 1
            continue
        t["found"] += 1
        clauses = clause_results(spec, dets)
        if not _counts_hold(clauses):
            continue
        t["shapes"] += 1
        t["bound"] += all(clauses.values())
    out: dict[str, Any] = {}
    for cat, t in tallies.items():
        out[cat] = {
            "pictures": t["pictures"],
            "found": t["found"] / max(t["pictures"], 1),
            "shapes": t["shapes"] / max(t["found"], 1),
            "bound": t["bound"] / max(t["shapes"], 1),
            "strict": t["bound"] / max(t["pictures"], 1),
            "missed": {r: t[r] / max(t["pictures"], 1) for r in MISS_REASONS},
        }
    return out


def relation_anatomy(detections: list[list[Detection]], prompts: list[str]) -> dict[str, Any]:
    """Where ``position`` pictures put the first named object, per asked relation.

    Over the pictures in which the asked pair is drawn (every count clause holds: one
    detection of each named shape, the ``bound`` link of :func:`binding_chain`), per relation
    of :data:`RELATIONS`: ``pictures``; ``holds``, the share whose position clause holds (the
    reward's rule, with its margin); and ``placed``, the share in which the first named
    object lies ``left`` / ``right`` / ``above`` / ``below`` the second along the axis of the
    larger centre offset (image y grows downwards; no margin, so the four sum to 1).  A model
    that reads the relation word has ``placed`` concentrated on the asked side; one that
    ignores it spreads ``placed`` whatever the relation.  ``horizontal`` / ``vertical`` pool
    left of + right of / above + below.
    """
    tallies: dict[str, Counter] = {r: Counter() for r in RELATIONS}
    for dets, prompt in zip(detections, prompts, strict=True):
        spec = parse_prompt(prompt)
        if spec.category != "position":
            continue
        clauses = clause_results(spec, dets)
        if not _counts_hold(clauses):
            continue
        (a,) = (d for d in dets if d.shape == spec.groups[0].shape)
        (b,) = (d for d in dets if d.shape == spec.groups[1].shape)
        dx, dy = a.cx - b.cx, a.cy - b.cy
        if abs(dx) >= abs(dy):
            where = "left" if dx < 0 else "right"
        else:
            where = "above" if dy < 0 else "below"
        t = tallies[str(spec.relation)]
        t["pictures"] += 1
        t["holds"] += bool(clauses["position"])
        t[where] += 1
    pooled = {
        "horizontal": tallies["left of"] + tallies["right of"],
        "vertical": tallies["above"] + tallies["below"],
    }
    out: dict[str, Any] = {}
    for key, t in {**tallies, **pooled}.items():
        n = max(t["pictures"], 1)
        out[key] = {
            "pictures": t["pictures"],
            "holds": t["holds"] / n,
            "placed": {w: t[w] / n for w in PLACEMENTS},
        }
    return out


def _counts_hold(clauses: dict[str, bool]) -> bool:
    """Whether every count clause of :func:`clause_results` holds: the asked objects, one
    group each, are drawn (the chain's ``shapes`` link)."""
    return all(v for k, v in clauses.items() if k.startswith("count"))


def _miss_reason(dets: list[Detection], named: set[str], n_named: int) -> str:
    if n_named > 2:
        return "more"
    if _flags(dets)[1]:
        return "merged"
    if any(d.shape == UNKNOWN for d in dets):
        return "unknown"
    return "other_shape" if any(d.shape not in named for d in dets) else "missing"


def swapped(prompt: str) -> str:
    """The same words bound the other way: a colour-attribution prompt with its two colours
    exchanged, a position prompt with its relation reversed (nouns stay in place)."""
    words = prompt.split()
    category = parse_prompt(prompt).category
    if category == "color_attr":
        i, j = (k for k, w in enumerate(words) if w in COLORS)
        words[i], words[j] = words[j], words[i]
    elif category == "position":
        words = [_REVERSED.get(w, w) for w in words]
    else:
        raise ValueError(f"prompt must be a color_attr or position prompt, got {prompt!r}")
    return " ".join(words)


@torch.no_grad()
def binding_probe(model: ShapesModel) -> dict[str, dict[str, float]]:
    """Does the text encoder put a noun's colour (or relation) into the noun's embedding?

    For every prompt of the binding categories and its :func:`swapped` twin, the relative
    change ``||e_swapped - e|| / ||e||`` of the text encoder's output at each noun (first
    and second object; the nouns' own words and positions are the same in both prompts, so
    only context can change them), and at the words that were exchanged (the scale of a
    change of meaning).  A per-token encoder gives 0 at the nouns: the MMDiT would then have
    to pair each colour with its noun from the token positions alone.
    """
    out: dict[str, dict[str, float]] = {}
    for cat in BINDING_CATEGORIES:
        prompts = all_prompts(cat)
        twins = [swapped(p) for p in prompts]
        tok, _ = model.text_encoder(model.tokenizer(prompts))
        tok_sw, _ = model.text_encoder(model.tokenizer(twins))
        rel = (tok - tok_sw).norm(dim=-1) / tok.norm(dim=-1).clamp_min(1e-12)  # (N, L)
        nouns: list[list[float]] = [[], []]
        changed: list[float] = []
        for k, (p, q) in enumerate(zip(prompts, twins, strict=True)):
            # Position 0 is <cls>: word i sits at i + 1.
            words = list(zip(p.split(), q.split(), strict=True))
            at = [i + 1 for i, (w, _) in enumerate(words) if w in SHAPES]
            for n, i in enumerate(at):
                nouns[n].append(float(rel[k, i]))
            changed += [float(rel[k, i + 1]) for i, (w, v) in enumerate(words) if w != v]
        out[cat] = {
            "first_noun": sum(nouns[0]) / len(nouns[0]),
            "second_noun": sum(nouns[1]) / len(nouns[1]),
            "swapped_words": sum(changed) / len(changed),
            "prompts": len(prompts),
        }
    return out


def _probe_twin(prompt: str, attr: str) -> str:
    """The single-object colour prompt with its shape (``attr="shape"``) or its colour
    (``"color"``) replaced by the next one of :data:`SHAPES` / :data:`COLORS`."""
    *head, color, shape = prompt.split()
    if attr == "shape":
        shape = SHAPES[(SHAPES.index(shape) + 1) % len(SHAPES)]
    else:
        names = list(COLORS)
        color = names[(names.index(color) + 1) % len(names)]
    return " ".join([*head, color, shape])


@torch.no_grad()
def pooled_probe(
    task: ShapesTask, per_prompt: int, noise_seed: int, noise_level: float, steps: int
) -> dict[str, dict[str, float]]:
    """Which of the text's two paths into the MMDiT sets an object's shape and its colour?

    SD3's MMDiT reads a prompt twice: its tokens through joint attention (each image token
    attends to the words it needs) and a pooled vector through adaLN (one modulation for
    every image token alike).  For every "colors" prompt (one coloured object), the
    sampler runs with the prompt's tokens but the pooled vector of its twin with the other
    shape (or colour; :func:`_probe_twin`), ``per_prompt`` pictures each on fixed noise.
    Among the pictures with exactly one detection: the share whose shape (colour) is the
    tokens' / the pooled vector's / neither (``other``: unknown shape), and ``pictures``,
    how many there were.  What the pooled vector sets, it sets for every object of a
    picture at once: two objects cannot get two different shapes from it.
    """
    prompts = [p for p in all_prompts("colors") for _ in range(per_prompt)]
    gen = torch.Generator().manual_seed(noise_seed)
    noise = torch.randn((len(prompts), *task.latent_shape), generator=gen)
    own = task.cond(prompts)
    out: dict[str, dict[str, float]] = {}
    for attr in ("shape", "color"):
        twins = [_probe_twin(p, attr) for p in prompts]
        cond = {**own, "pooled_projections": task.cond(twins)["pooled_projections"]}
        x = sample_shapes(
            task.velocity_model(),
            cond,
            steps=steps,
            noise_level=noise_level,
            generator=torch.Generator().manual_seed(noise_seed + 1),
            noise=noise,
        )
        counts = Counter()
        for im, p, q in zip(x, prompts, twins, strict=True):
            dets = detect_objects(im)
            if len(dets) != 1:
                continue
            got = getattr(dets[0], attr)
            want_tok, want_pool = (getattr(parse_prompt(r).groups[0], attr) for r in (p, q))
            counts["tokens" if got == want_tok else "pooled" if got == want_pool else "other"] += 1
        n = sum(counts.values())
        out[attr] = {k: counts[k] / n if n else 0.0 for k in TEXT_PATHS} | {"pictures": n}
    return out


def evaluate_model(
    weights_dir: Path,
    prompts: list[str],
    noise_seeds: list[int],
    guidance_scale: float,
    noise_level: float,
    steps: int,
    probe_per_prompt: int,
) -> dict[str, Any]:
    """Per-category figures of one model over every noise draw (samples pooled), and the
    probes of how its text reaches the picture."""
    model = load_shapes_model(
        weights=weights_dir / "shapes_model.safetensors", meta=weights_dir / "shapes_meta.json"
    )
    task = ShapesTask(model=model, guidance_scale=guidance_scale)
    cats = [parse_prompt(p).category for p in prompts]
    pics = []
    for seed in noise_seeds:
        gen = torch.Generator().manual_seed(seed)
        noise = torch.randn((len(prompts), *task.latent_shape), generator=gen)
        pics.append(
            sample_shapes(
                task.velocity_model(),
                task.cond(prompts),
                steps=steps,
                noise_level=noise_level,
                generator=gen,
                noise=noise,
            )
        )
    x = torch.cat(pics)
    # Named apart from the imported all_prompts(): the set once per noise draw.
    drawn_prompts = prompts * len(noise_seeds)
    all_cats = cats * len(noise_seeds)
    figures = task.eval_breakdown(x, drawn_prompts)
    dets = [detect_objects(im) for im in x]
    flags = [_flags(d) for d in dets]
    per_cat: dict[str, dict[str, float]] = {}
    for c in CATEGORIES:
        idx = [i for i, k in enumerate(all_cats) if k == c]
        p = figures[f"{c}_strict_accuracy"]
        per_cat[c] = {
            "strict_accuracy": p,
            "strict_se": math.sqrt(p * (1 - p) / len(idx)),
            "mean_reward": figures[c],
            "blank": sum(flags[i][0] for i in idx) / len(idx),
            "merged": sum(flags[i][1] for i in idx) / len(idx),
            "samples": len(idx),
        }
    strict = figures["strict_accuracy"]
    return {
        "weights_dir": str(weights_dir),
        "binding_probe": binding_probe(model),
        "pooled_probe": pooled_probe(task, probe_per_prompt, noise_seeds[0], noise_level, steps),
        "pair_anatomy": pair_anatomy(dets, drawn_prompts),
        "binding_chain": binding_chain(dets, drawn_prompts),
        "relation_anatomy": relation_anatomy(dets, drawn_prompts),
        "samples": len(drawn_prompts),
        "strict_accuracy": strict,
        "strict_se": math.sqrt(strict * (1 - strict) / len(drawn_prompts)),
        "mean_reward": sum(per_cat[c]["mean_reward"] for c in CATEGORIES) / len(CATEGORIES),
        "blank": sum(f[0] for f in flags) / len(flags),
        "per_category": per_cat,
    }


def _parse_models(specs: list[str]) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--models entries must be NAME=DIR, got {s!r}")
        d = Path(path)
        for f in ("shapes_model.safetensors", "shapes_meta.json"):
            if not (d / f).is_file():
                raise ValueError(f"--models {name}: {d / f} not found")
        out[name] = d
    return out


def _category_rows(
    res: dict[str, Any], key: str, *fields: tuple[str, str | Callable[[Any], str]]
) -> list[str]:
    """One markdown row per model and category of the per-category figures ``key``, each
    ``(field, format spec or formatter)`` a cell."""

    def cell(v: Any, fmt: str | Callable[[Any], str]) -> str:
        return fmt(v) if callable(fmt) else format(v, fmt)

    return [
        f"| {name} | {cat} | " + " | ".join(cell(v[f], fmt) for f, fmt in fields) + " |"
        for name, m in res["models"].items()
        for cat, v in m[key].items()
    ]


def report(res: dict[str, Any]) -> str:
    cfg = res["config"]
    lines = [
        "# The shapes base model at the trainer's sampler",
        "",
        f"`{res['command']}` — {res['date']}, {res['seconds']:.0f} s.",
        "",
        f"{'Training' if cfg.get('split') == 'train' else 'Held-out'} evaluation set, "
        f"{cfg['per_category']} prompts per category x "
        f"{len(cfg['noise_seeds'])} noise draws (seeds {cfg['noise_seeds']}, the same for "
        f"every model), CFG {cfg['guidance_scale']:g}, {cfg['steps']} steps, SDE noise level "
        f"{cfg['noise_level']:g}.  Strict accuracy ± its binomial standard error; the "
        "issue's aim is 0.2-0.8 in every category.",
        "",
        "| model | strict accuracy | mean reward | blank | " + " | ".join(CATEGORIES) + " |",
        "|---|---|---|---|" + "---|" * len(CATEGORIES),
    ]
    for name, m in res["models"].items():
        pc = m["per_category"]
        cells = [f"{pc[c]['strict_accuracy']:.3f} ± {pc[c]['strict_se']:.3f}" for c in CATEGORIES]
        lines.append(
            f"| {name} | {m['strict_accuracy']:.3f} ± {m['strict_se']:.3f} | "
            f"{m['mean_reward']:.3f} | {m['blank']:.3f} | " + " | ".join(cells) + " |"
        )
    lines += [
        "",
        "Failure fractions per category: blank (no object detected) / merged (a component "
        f"of more than {MERGED_AREA} px, the largest rendered object with a one-pixel rim):",
        "",
        "| model | " + " | ".join(CATEGORIES) + " |",
        "|---|" + "---|" * len(CATEGORIES),
    ]
    for name, m in res["models"].items():
        cells = [
            f"{m['per_category'][c]['blank']:.2f} / {m['per_category'][c]['merged']:.2f}"
            for c in CATEGORIES
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Text-encoder binding probe (`binding_probe`): relative change of the text encoder's "
        "output at each object noun when the prompt's colours are exchanged (color_attr) or "
        "its relation reversed (position), against the change at the exchanged words:",
        "",
        "| model | category | first noun | second noun | exchanged words |",
        "|---|---|---|---|---|",
    ]
    lines += _category_rows(
        res, "binding_probe", ("first_noun", ".3f"), ("second_noun", ".3f"),
        ("swapped_words", ".3f"),
    )  # fmt: skip
    lines += [
        "",
        "Which path of the text sets a single object's shape and colour (`pooled_probe`): "
        "sampled with a \"colors\" prompt's tokens but the pooled vector (adaLN, shared "
        "by every image token) of its twin with the other shape / colour; among pictures "
        "with one detection, the share that follows the tokens / the pooled vector / "
        "neither:",
        "",
        "| model | attribute | tokens | pooled | other | pictures |",
        "|---|---|---|---|---|---|",
    ]
    lines += _category_rows(
        res, "pooled_probe", ("tokens", ".2f"), ("pooled", ".2f"), ("other", ".2f"),
        ("pictures", "d"),
    )  # fmt: skip
    lines += [
        "",
        "Two named objects without a relation (two_object, color_attr; `pair_anatomy`): "
        "pictures with exactly two detections, the fraction of their detections of an asked "
        "shape, the share of each drawn shape against its share among the asked ones, and "
        "which side the first named shape / colour goes to (left-right in the prompt's order "
        "/ swapped / neither):",
        "",
        "| model | two detected | asked shapes | drawn " + " / ".join((*SHAPES, UNKNOWN))
        + " | asked " + " / ".join(SHAPES)
        + " | shapes in order / swapped / other | colours in order / swapped / other |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in res["models"].items():
        a = m["pair_anatomy"]
        sides = [
            " / ".join(f"{a[key][k]:.2f}" for k in ("in_order", "swapped", "other"))
            for key in ("shape_sides", "color_sides")
        ]
        lines.append(
            f"| {name} | {a['two_detected']:.2f} | {a['asked_shapes']:.2f} | "
            + " / ".join(f"{a['drawn'][k]:.2f}" for k in (*SHAPES, UNKNOWN))
            + " | " + " / ".join(f"{a['asked'][k]:.2f}" for k in SHAPES)
            + f" | {sides[0]} | {sides[1]} |"
        )
    lines += [
        "",
        "The two-object categories' strict accuracy factored (`binding_chain`): found (exactly "
        "two detections of the named shapes) x shapes (they are the asked ones, given found) "
        "x bound (colours / relation right, given the shapes) = strict; and why the other "
        "pictures are not found (fractions of all pictures: more than two named-shape "
        "detections / fewer with a merged component / with an unknown shape / with a shape "
        "not named / nothing else drawn):",
        "",
        "| model | category | found | shapes | bound | strict | missed: more / merged / "
        "unknown / other shape / missing |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += _category_rows(
        res, "binding_chain", ("found", ".2f"), ("shapes", ".2f"), ("bound", ".2f"),
        ("strict", ".3f"), ("missed", lambda d: " / ".join(f"{v:.2f}" for v in d.values())),
    )  # fmt: skip
    lines += [
        "",
        "Where position pictures with the asked pair put the first named object "
        "(`relation_anatomy`): per asked relation, the pictures, the share whose relation "
        "holds (the reward's rule), and the side of the second object the first lies on "
        "(the axis of the larger offset, no margin):",
        "",
        "| model | asked relation | pictures | holds | placed " + " / ".join(PLACEMENTS) + " |",
        "|---|---|---|---|---|",
    ]
    lines += _category_rows(
        res, "relation_anatomy", ("pictures", "d"), ("holds", ".2f"),
        ("placed", lambda d: " / ".join(f"{d[w]:.2f}" for w in PLACEMENTS)),
    )  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI: 2 prompts per category, 1 draw")
    p.add_argument("--models", nargs="+", default=[f"shipped={ASSETS_DIR}"],
                   help="NAME=DIR entries, DIR holding shapes_model.safetensors and "
                   "shapes_meta.json (default: the shipped model)")  # fmt: skip
    p.add_argument("--per-category", type=int, default=None, help="prompts per category")
    p.add_argument("--noise-seeds", type=int, nargs="+", default=None)
    p.add_argument("--guidance-scale", type=float, default=2.0, help="the trainer's CFG 2")
    p.add_argument("--noise-level", type=float, default=0.7, help="the trainer's SDE eta")
    p.add_argument("--steps", type=int, default=10, help="the trainer's sampler steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--split", choices=("heldout", "train"), default="heldout",
                   help="prompt split to sample (train: GRPO's training prompts; pre-training "
                   "draws from both)")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/shapes_base"))
    p.add_argument("--no-progress", action="store_true", help="accepted; prints nothing else")
    args = p.parse_args(argv)
    cfg = dict(CONFIGS["quick" if args.quick else "full"])
    if args.per_category is not None:
        if args.per_category < 1:
            p.error("--per-category must be >= 1")
        cfg["per_category"] = args.per_category
    if args.noise_seeds is not None:
        cfg["noise_seeds"] = list(args.noise_seeds)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    try:
        models = _parse_models(args.models)
    except ValueError as e:
        p.error(str(e))
    torch.set_num_threads(args.threads)
    cfg.update(guidance_scale=args.guidance_scale, noise_level=args.noise_level, steps=args.steps,
               split=args.split)  # fmt: skip
    prompts = eval_prompt_set(cfg["per_category"], args.split)
    t0 = time.time()
    res: dict[str, Any] = {
        "command": "python -m benchmarks.shapes_base "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": cfg,
        "machine": machine_info(torch.device("cpu")),
        "models": {
            name: evaluate_model(
                d, prompts, cfg["noise_seeds"], cfg["guidance_scale"], cfg["noise_level"],
                cfg["steps"], cfg["probe_per_prompt"],
            )
            for name, d in models.items()
        },
    }  # fmt: skip
    res["seconds"] = time.time() - t0
    write_report(args.out, "shapes_base", res, report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
