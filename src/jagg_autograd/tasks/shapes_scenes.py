"""Scenes, prompts and the tokenizer of the compositional shapes task (GenEval on a CPU).

A **scene** is a 32x32 RGB picture on a black background holding 1-4 non-overlapping flat
objects; each object has a shape (:data:`SHAPES`), one of :data:`COLORS` and a size (the
half-extent ``h`` in :data:`SIZES`: the object fits a ``(2h+1) x (2h+1)`` box).  Rendering
is exact rasterisation in numpy (no anti-aliasing), so every pixel is either background or
exactly one palette colour; the reward's segmentation relies on that for clean renders.

**Prompts** follow GenEval's six categories and its "a photo of ..." templates:

=================  =====================================================  =========
category           template                                               prompts
=================  =====================================================  =========
``single_object``  a photo of a {shape}                                   3
``two_object``     a photo of a {shape} and a {shape'}                    6
``counting``       a photo of {one|two|three|four} {shape}s               12
``colors``         a photo of a {color} {shape}                           18
``position``       a photo of a {shape} {left of|right of|above|below}    24
                   a {shape'}
``color_attr``     a photo of a {color} {shape} and a {color'} {shape'}   180
=================  =====================================================  =========

(``shape != shape'`` and ``color != color'``.)  :func:`prompt_split` divides them into a
training split and a **held-out** split (every category except ``single_object``, whose
three prompts cannot be split without hiding a shape, keeps about a quarter of its prompts
out); the held-out prompts are for evaluation and must never be GRPO training prompts.

Image conventions (as the digits DiT): pictures are float ``(3, 32, 32)`` in ``[-1, 1]``
(``pixel / 127.5 - 1``), the latent *is* the picture (no VAE).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

__all__ = [
    "CATEGORIES",
    "COLORS",
    "IMAGE_SIZE",
    "LARGEST_SIDE",
    "MAX_OBJECTS",
    "NUMBERS",
    "RELATIONS",
    "SHAPES",
    "SIZES",
    "ObjectGroup",
    "PromptSpec",
    "SceneObject",
    "ShapesTokenizer",
    "all_prompts",
    "eval_prompt_set",
    "meaning",
    "parse_prompt",
    "prompt_split",
    "relation_holds",
    "render_batch",
    "render_objects",
    "render_prompt",
]

IMAGE_SIZE = 32
MAX_OBJECTS = 4
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
PLURALS: dict[str, str] = {"circle": "circles", "square": "squares", "triangle": "triangles"}
#: The six secondary/primary corners of the RGB cube: pairwise distances >= 1, so nearest-
#: colour quantisation has a wide margin even for a generator's imprecise colours.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 255, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
    "magenta": (255, 0, 255),
    "cyan": (0, 255, 255),
}
#: Object half-extents in pixels (box sides 9, 11, 13).
SIZES: tuple[int, ...] = (4, 5, 6)
#: The box side of the largest rendered object, in pixels.
LARGEST_SIDE = 2 * max(SIZES) + 1
NUMBERS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
CATEGORIES: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)

# Placement: gap in pixels between object boxes (keeps same-coloured objects separate
# components even under 8-connectivity), and the margin by which a rendered relation holds
# beyond the checker's threshold (so clean renders are never borderline).
_GAP = 2
RELATION_MIN_OFFSET = 3.0
_RELATION_RENDER_MARGIN = 2.0
# The held-out split's seed is part of the task's contract (shipped evaluation figures).
SPLIT_SEED = 1234
HELDOUT_FRACTION = 0.25


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectGroup:
    """``count`` objects of ``shape``, all of ``color`` (None: any colour)."""

    shape: str
    color: str | None
    count: int


@dataclass(frozen=True)
class PromptSpec:
    """What a prompt asks for: object groups and, for ``position``, ``groups[0] relation
    groups[1]`` (e.g. "a circle left of a square")."""

    category: str
    groups: tuple[ObjectGroup, ...]
    relation: str | None = None

    @property
    def num_objects(self) -> int:
        return sum(g.count for g in self.groups)


def _noun(shape: str, color: str | None) -> str:
    return shape if color is None else f"{color} {shape}"


def _text(spec: PromptSpec) -> str:
    g = spec.groups
    if spec.category == "counting":
        word = NUMBERS[g[0].count]
        return f"a photo of {word} {g[0].shape if g[0].count == 1 else PLURALS[g[0].shape]}"
    if spec.category == "position":
        return f"a photo of a {g[0].shape} {spec.relation} a {g[1].shape}"
    return "a photo of " + " and ".join(f"a {_noun(x.shape, x.color)}" for x in g)


@lru_cache(maxsize=1)
def _all_specs() -> dict[str, PromptSpec]:
    specs: list[PromptSpec] = []
    for s in SHAPES:
        specs.append(PromptSpec("single_object", (ObjectGroup(s, None, 1),)))
    for a, b in itertools.permutations(SHAPES, 2):
        specs.append(PromptSpec("two_object", (ObjectGroup(a, None, 1), ObjectGroup(b, None, 1))))
    for s in SHAPES:
        for n in NUMBERS:
            specs.append(PromptSpec("counting", (ObjectGroup(s, None, n),)))
    for c in COLORS:
        for s in SHAPES:
            specs.append(PromptSpec("colors", (ObjectGroup(s, c, 1),)))
    for a, b in itertools.permutations(SHAPES, 2):
        for r in RELATIONS:
            specs.append(
                PromptSpec("position", (ObjectGroup(a, None, 1), ObjectGroup(b, None, 1)), r)
            )
    for a, b in itertools.permutations(SHAPES, 2):
        for ca, cb in itertools.permutations(COLORS, 2):
            specs.append(PromptSpec("color_attr", (ObjectGroup(a, ca, 1), ObjectGroup(b, cb, 1))))
    out = {_text(sp): sp for sp in specs}
    assert len(out) == len(specs), "prompt texts must be unique"
    return out


def all_prompts(category: str | None = None) -> list[str]:
    """Every prompt (of ``category``, or of all six), in a fixed order."""
    if category is not None and category not in CATEGORIES:
        raise ValueError(f"category must be one of {CATEGORIES} or None, got {category!r}")
    return [t for t, s in _all_specs().items() if category is None or s.category == category]


def parse_prompt(text: str) -> PromptSpec:
    """The :class:`PromptSpec` of one of :func:`all_prompts` (ValueError for anything else)."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    spec = _all_specs().get(" ".join(text.lower().split()))
    if spec is None:
        raise ValueError(f"text is not a prompt of the shapes task: {text!r}")
    return spec


_INVERSE = {"right of": "left of", "below": "above"}


def meaning(prompt: str | PromptSpec) -> tuple:
    """A key equal for prompts that ask for the same scene: "a circle and a square" and "a
    square and a circle", or "a circle left of a square" and "a square right of a circle"."""
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    groups = spec.groups
    rel = spec.relation
    if rel in _INVERSE:
        groups, rel = groups[::-1], _INVERSE[rel]
    if rel is None:
        groups = tuple(sorted(groups, key=lambda g: (g.shape, g.color or "", g.count)))
    return (spec.category, groups, rel)


@lru_cache(maxsize=1)
def _split() -> tuple[tuple[str, ...], tuple[str, ...]]:
    rng = np.random.default_rng(SPLIT_SEED)
    train: list[str] = []
    held: list[str] = []
    for cat in CATEGORIES:
        ps = all_prompts(cat)
        if cat == "single_object":
            # Three prompts: hiding one would hide a shape, so they are in both splits.
            train += ps
            held += ps
            continue
        # Split by meaning, so that no held-out prompt has a reworded twin in training.
        keys = list(dict.fromkeys(meaning(p) for p in ps))
        perm = rng.permutation(len(keys))
        k = max(1, round(HELDOUT_FRACTION * len(keys)))
        held_keys = {keys[i] for i in perm[:k].tolist()}
        held += [p for p in ps if meaning(p) in held_keys]
        train += [p for p in ps if meaning(p) not in held_keys]
    return tuple(train), tuple(held)


def prompt_split(split: str) -> list[str]:
    """The fixed ``"train"`` or ``"heldout"`` prompts (disjoint except ``single_object``)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    tr, ho = _split()
    return list(tr if split == "train" else ho)


def eval_prompt_set(per_category: int = 32, split: str = "heldout") -> list[str]:
    """The fixed evaluation prompts: ``per_category`` per category, cycling through that
    category's prompts of ``split`` in order (so every category weighs the same in the mean,
    whatever its number of prompts)."""
    if isinstance(per_category, bool) or not isinstance(per_category, int) or per_category < 1:
        raise ValueError(f"per_category must be an int >= 1, got {per_category!r}")
    ps = prompt_split(split)
    out: list[str] = []
    for cat in CATEGORIES:
        mine = [p for p in ps if parse_prompt(p).category == cat]
        out += [mine[i % len(mine)] for i in range(per_category)]
    return out


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SceneObject:
    """One rendered object: shape, colour, centre pixel ``(cx, cy)`` and half-extent."""

    shape: str
    color: str
    cx: int
    cy: int
    size: int


def _shape_mask(shape: str, h: int) -> np.ndarray:
    """Boolean ``(2h+1, 2h+1)`` mask of a shape centred in its box (triangle: apex up)."""
    yy, xx = np.mgrid[-h : h + 1, -h : h + 1].astype(np.float64)
    if shape == "circle":
        return xx**2 + yy**2 <= (h + 0.5) ** 2
    if shape == "square":
        return np.ones_like(xx, dtype=bool)
    if shape == "triangle":
        # Rows from the apex (yy = -h) widen by half a pixel per row each side.
        return np.abs(xx) <= (yy + h) / 2.0 + 0.25
    raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")


_MASKS = {(s, h): _shape_mask(s, h) for s in SHAPES for h in SIZES}


def render_objects(objects: Sequence[SceneObject]) -> np.ndarray:
    """Rasterise ``objects`` on black: ``(32, 32, 3)`` uint8."""
    img = np.zeros((IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    for o in objects:
        if o.color not in COLORS:
            raise ValueError(f"color must be one of {tuple(COLORS)}, got {o.color!r}")
        m = _MASKS.get((o.shape, o.size))
        if m is None:
            m = _shape_mask(o.shape, o.size)
        h = o.size
        y0, x0 = o.cy - h, o.cx - h
        if y0 < 0 or x0 < 0 or o.cy + h >= IMAGE_SIZE or o.cx + h >= IMAGE_SIZE:
            raise ValueError(f"object {o} does not fit the {IMAGE_SIZE}x{IMAGE_SIZE} picture")
        region = img[y0 : y0 + 2 * h + 1, x0 : x0 + 2 * h + 1]
        region[m] = COLORS[o.color]
    return img


def relation_holds(relation: str, a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether centre ``a = (x, y)`` is ``relation`` centre ``b`` (image y grows downwards).

    "left of": ``b.x - a.x >= RELATION_MIN_OFFSET`` and the horizontal offset dominates the
    vertical one (``|dx| > |dy|``), and likewise for the others, so the four relations are
    mutually exclusive: a picture of "a circle left of a square" never also shows "a circle
    above a square".
    """
    dx, dy = b[0] - a[0], b[1] - a[1]
    if relation == "left of":
        return dx >= RELATION_MIN_OFFSET and abs(dx) > abs(dy)
    if relation == "right of":
        return -dx >= RELATION_MIN_OFFSET and abs(dx) > abs(dy)
    if relation == "above":
        return dy >= RELATION_MIN_OFFSET and abs(dy) > abs(dx)
    if relation == "below":
        return -dy >= RELATION_MIN_OFFSET and abs(dy) > abs(dx)
    raise ValueError(f"relation must be one of {RELATIONS}, got {relation!r}")


def _relation_clear(relation: str, a: SceneObject, b: SceneObject) -> bool:
    # The checker's rule with a margin on both conditions.
    dx, dy = b.cx - a.cx, b.cy - a.cy
    along, across = {
        "left of": (dx, dy),
        "right of": (-dx, dy),
        "above": (dy, dx),
        "below": (-dy, dx),
    }[relation]
    m = _RELATION_RENDER_MARGIN
    return along >= RELATION_MIN_OFFSET + m and along >= abs(across) + m


def _place(
    shapes_colors: Sequence[tuple[str, str]], rng: np.random.Generator, relation: str | None
) -> list[SceneObject]:
    """Random non-overlapping placement (rejection sampling; sizes shrink for 4 objects)."""
    sizes = SIZES if len(shapes_colors) < MAX_OBJECTS else SIZES[:2]
    for _ in range(1000):
        placed: list[SceneObject] = []
        for shape, color in shapes_colors:
            h = int(rng.choice(sizes))
            for _ in range(100):
                cx = int(rng.integers(h, IMAGE_SIZE - h))
                cy = int(rng.integers(h, IMAGE_SIZE - h))
                if all(max(abs(cx - o.cx), abs(cy - o.cy)) > h + o.size + _GAP for o in placed):
                    placed.append(SceneObject(shape, color, cx, cy, h))
                    break
            else:
                break
        if len(placed) == len(shapes_colors) and (
            relation is None or _relation_clear(relation, placed[0], placed[1])
        ):
            return placed
    raise RuntimeError("could not place the objects (this should not happen)")  # pragma: no cover


READING_ORDERS = ("horizontal", "2d")


def _reading_order_mode(reading_order: bool | str | None) -> str | None:
    # True is the horizontal rule: the meta files of models trained before "2d" existed
    # record ``"reading_order": true``.
    if reading_order is None or reading_order is False:
        return None
    if reading_order is True:
        return "horizontal"
    if isinstance(reading_order, str) and reading_order in READING_ORDERS:
        return reading_order
    raise ValueError(
        f"reading_order must be a bool, None or one of {READING_ORDERS}, got {reading_order!r}"
    )


def _reading_order_boxes(placed: list[SceneObject], mode: str) -> list[SceneObject]:
    # The order in which a caption names the objects of a picture.  "horizontal": left to
    # right.  "2d": a pair that is stacked (farther apart vertically than horizontally) is
    # read top to bottom, any other pair left to right -- the vertical half of what the
    # horizontal rule teaches (benchmarks.shapes_base's relation anatomy: a model trained
    # with the horizontal rule stacks "above" pairs in either order).
    if mode == "2d" and len(placed) == 2:
        a, b = placed
        if abs(b.cy - a.cy) > abs(b.cx - a.cx):
            return sorted(placed, key=lambda o: (o.cy, o.cx))
    return sorted(placed, key=lambda o: (o.cx, o.cy))


def _scene_objects(
    spec: PromptSpec, rng: np.random.Generator, mode: str | None
) -> list[SceneObject]:
    # ``mode``: the reading order, already checked (:func:`_reading_order_mode`).
    colors = list(COLORS)
    items: list[tuple[str, str]] = []
    for g in spec.groups:
        for _ in range(g.count):
            items.append((g.shape, g.color if g.color is not None else str(rng.choice(colors))))
    placed = _place(items, rng, spec.relation)
    if mode is not None and spec.relation is None and len(spec.groups) > 1:
        # The placed boxes (centre and size) stay where they are; the objects move into them
        # in the caption's order, so the layout stays non-overlapping.
        boxes = _reading_order_boxes(placed, mode)
        placed = [SceneObject(o.shape, o.color, b.cx, b.cy, b.size) for o, b in zip(placed, boxes)]
    return placed


def render_prompt(
    prompt: str | PromptSpec,
    rng: np.random.Generator,
    *,
    reading_order: bool | str | None = False,
) -> tuple[np.ndarray, list[SceneObject]]:
    """A random clean picture of ``prompt``: ``((32, 32, 3) uint8, objects)``.

    Unspecified colours are uniform over :data:`COLORS`, sizes uniform over :data:`SIZES`
    (the two smaller ones for 4 objects), positions uniform among non-overlapping
    placements; a ``position`` prompt's relation holds with a margin.

    ``reading_order``: a prompt naming different objects without a relation (``two_object``,
    ``color_attr``) puts them in the order it names them, as captions that describe a
    picture in reading order do (the same placements, relabelled; nothing else changes):
    ``True`` / ``"horizontal"`` left to right; ``"2d"`` top to bottom when the two objects
    are stacked (vertical offset larger than the horizontal one), else left to right.
    ``False`` / ``None``: no rule.  The reward never asks for it: it only makes the
    pre-training data tie each named object to a side of the picture.
    """
    spec = parse_prompt(prompt) if isinstance(prompt, str) else prompt
    if not isinstance(spec, PromptSpec):
        raise TypeError(f"prompt must be a str or PromptSpec, got {type(prompt).__name__}")
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy Generator, got {type(rng).__name__}")
    mode = _reading_order_mode(reading_order)  # a bad value fails before any drawing
    objects = _scene_objects(spec, rng, mode)
    return render_objects(objects), objects


def render_batch(
    prompts: Sequence[str],
    seed: int | np.random.Generator,
    *,
    reading_order: bool | str | None = False,
) -> torch.Tensor:
    """Clean pictures of ``prompts`` as float32 ``(N, 3, 32, 32)`` in ``[-1, 1]``.

    Deterministic in ``seed`` (one numpy generator, drawn in prompt order; a Generator is
    used as it is and advanced).  ``reading_order``: as in :func:`render_prompt`.
    """
    _reading_order_mode(reading_order)  # fails for an empty batch too
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    imgs = (
        np.stack([render_prompt(p, rng, reading_order=reading_order)[0] for p in prompts])
        if len(prompts)
        else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    )
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float()
    return x / 127.5 - 1.0


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------


class ShapesTokenizer:
    """Word-level tokenizer over the task's closed vocabulary.

    ``encode`` lower-cases, splits on whitespace and maps each word to its id; a word outside
    the vocabulary is a ``ValueError`` naming it (no silent UNK).  Every sequence starts with
    ``<cls>`` (the text encoder's pooled token) and is right-padded with ``<pad>`` (id 0) to
    :attr:`max_length`; the empty prompt ``""`` (the CFG negative) is ``<cls>`` + pads.
    """

    PAD = "<pad>"
    CLS = "<cls>"

    def __init__(self, max_length: int | None = None) -> None:
        words = sorted({w for p in all_prompts() for w in p.split()})
        self.vocab: list[str] = [self.PAD, self.CLS, *words]
        self.ids: dict[str, int] = {w: i for i, w in enumerate(self.vocab)}
        longest = max(len(p.split()) for p in all_prompts()) + 1
        if max_length is None:
            max_length = longest
        if (
            isinstance(max_length, bool)
            or not isinstance(max_length, int)
            or (max_length < longest)
        ):
            raise ValueError(f"max_length must be an int >= {longest}, got {max_length!r}")
        self.max_length = max_length

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return self.ids[self.PAD]

    def encode(self, text: str) -> list[int]:
        """``max_length`` ids of ``text`` (``<cls>`` first, pads last)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        words = text.lower().split()
        out = [self.ids[self.CLS]]
        for w in words:
            if w not in self.ids or w in (self.PAD, self.CLS):
                raise ValueError(
                    f"text contains the word {w!r}, which is not in the shapes vocabulary "
                    f"({', '.join(self.vocab[2:])})"
                )
            out.append(self.ids[w])
        if len(out) > self.max_length:
            raise ValueError(
                f"text has {len(words)} words, more than max_length - 1 = {self.max_length - 1}"
            )
        return out + [self.pad_id] * (self.max_length - len(out))

    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        """``(N, max_length)`` int64 ids of ``texts``."""
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of str (wrap a single prompt in a list)")
        return torch.tensor([self.encode(t) for t in texts], dtype=torch.int64).view(
            -1, self.max_length
        )

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """The text of one id sequence (``<cls>`` and pads dropped)."""
        seq = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        out = []
        for i in seq:
            if not isinstance(i, int) or not 0 <= i < self.vocab_size:
                raise ValueError(f"ids must be ints in [0, {self.vocab_size}), got {i!r}")
            if i not in (self.pad_id, self.ids[self.CLS]):
                out.append(self.vocab[i])
        return " ".join(out)
