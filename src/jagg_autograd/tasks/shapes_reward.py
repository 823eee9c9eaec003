"""The programmatic GenEval-style reward of the shapes task.

**Detection** (:func:`detect_objects`), on a picture ``(3, 32, 32)`` in ``[-1, 1]``, object
first and then its attributes, as GenEval detects objects and then classifies their colour:

1. a pixel is foreground when its brightest channel is at least half-way up
   (``max_c p_c >= 0.5`` on ``[0, 1]``);
2. the foreground's 4-connected components (``scipy.ndimage.label``) of at least
   :data:`MIN_AREA` pixels are the objects (smaller ones are specks);
3. an object's colour is the palette colour
   (:data:`~jagg_autograd.tasks.shapes_scenes.COLORS`, nearest in RGB) of the majority of its
   pixels, ``"unknown"`` without a majority;
4. its shape is the template (circle = inscribed ellipse, square = its box, triangle =
   apex-up inscribed triangle) drawn in the object's bounding box with the largest IoU with
   the object (geometric template matching: exact on clean renders, where a small CNN would
   only approximate it); ``"unknown"`` below :data:`MIN_IOU` or for a box larger than any
   object (pure noise forms one such component);
5. its position is the centre of its bounding box (GenEval positions detector boxes too; a
   triangle's centroid would sit below its box centre).

**Score** (:func:`clause_scores`, :func:`score_detections`): Flow-GRPO's partial credit,
ported from ``evaluate_reward`` in the reward server Flow-GRPO trains GenEval with
(github.com/yifan123/reward-server, ``reward_server/gen_eval.py``; Flow-GRPO's
``flow_grpo/rewards.py::geneval_score`` uses its ``scores`` as the reward as they are).
A prompt is a list of object groups ``(shape, colour, n)`` (GenEval's ``include`` entries);
the objects *found* for a group are the detections of its shape.  Per group:

* *count*: ``1 - |n - n_found| / n`` (not clamped: it is negative when more than ``2n``
  objects of the shape are found, as in the reward server);
* *colour* (if the prompt names one): ``1 - |n - n_colour| / n``, ``n_colour`` the found
  objects of that colour, and ``0`` when the count is wrong;
* *position* (``position`` prompts, one clause): ``1`` when every found object of the first
  shape stands in the relation (:func:`~jagg_autograd.tasks.shapes_scenes.relation_holds`)
  to every found object of the second, else ``0``; also ``0`` when either group's count
  (or colour) is wrong.

The **reward** is the mean of the clause scores (at most 1); an image is **strictly
correct** (GenEval's accuracy, :func:`strict_correct`) when every clause scores 1.  As in
the reward server, objects of shapes the prompt does not name, and ``"unknown"`` objects
(what GenEval's detector would not report), cost nothing; extra objects of a named shape
lower its count clause.

Mapping to the reward server: its per-class detector boxes (kept above a confidence
threshold) are our detections of one shape (a template IoU of at least :data:`MIN_IOU`);
its CLIP colour of each found object's masked crop is our majority palette colour
(``"unknown"`` matches no colour, as a wrong CLIP colour would not); its
``relative_position`` of two boxes is :func:`relation_holds` on box centres.  One
deviation: when a relation fails, the server's loop appends ``0.0`` and then, after its
``break``, also ``1.0`` (a failed relation with right counts scores 0.75 there instead of
2/3); we score the position clause 1 or 0, as that code evidently intends.  Its cap of
16 detections per class is moot on 32x32 pictures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from jagg_autograd.tasks.shapes_scenes import (
    COLORS,
    IMAGE_SIZE,
    LARGEST_SIDE,
    PromptSpec,
    parse_prompt,
    relation_holds,
)

__all__ = [
    "MIN_AREA",
    "MIN_IOU",
    "UNKNOWN",
    "Detection",
    "clause_results",
    "clause_scores",
    "detect_objects",
    "score_detections",
    "shapes_reward",
    "shapes_scores",
    "strict_correct",
]

MIN_AREA = 12
#: A component whose best shape template overlaps it less than this is no known shape.
MIN_IOU = 0.5
#: Label of an object whose shape or colour the checker cannot name.
UNKNOWN = "unknown"
# Largest object box (13 px) plus slack for a generator's blurry edges.
_MAX_SIDE = LARGEST_SIDE + 4
_FG_THRESHOLD = 0.5
_COLOR_NAMES = tuple(COLORS)
_PALETTE = np.array([COLORS[c] for c in _COLOR_NAMES], dtype=np.float64) / 255.0  # (6, 3)
_FOUR_CONNECTED = np.array([[0, 1, 0], [1, 1, 1], [0, 1, 0]], dtype=bool)


@dataclass(frozen=True)
class Detection:
    """One detected object: shape, colour, bounding-box centre ``(cx, cy)`` in pixels, area,
    and the IoU of the best shape template (a confidence)."""

    shape: str
    color: str
    cx: float
    cy: float
    area: int
    iou: float


def _templates(hb: int, wb: int) -> dict[str, np.ndarray]:
    """Boolean ``(hb, wb)`` masks of each shape inscribed in an ``hb x wb`` box."""
    y = np.arange(hb, dtype=np.float64)[:, None] + 0.5
    x = np.arange(wb, dtype=np.float64)[None, :] + 0.5
    ex = (x - wb / 2) / (wb / 2)
    ey = (y - hb / 2) / (hb / 2)
    return {
        "circle": ex**2 + ey**2 <= 1.0,
        "square": np.ones((hb, wb), dtype=bool),
        # Half-width grows linearly from the apex row (top) to wb/2 at the base (bottom).
        "triangle": np.abs(x - wb / 2) <= y / hb * (wb / 2),
    }


def _as_hwc01(image: object) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        arr = image.detach().to("cpu", torch.float64).numpy()
    elif isinstance(image, np.ndarray):
        arr = image.astype(np.float64)
    else:
        raise TypeError(f"image must be a torch.Tensor or numpy array, got {type(image).__name__}")
    if arr.shape != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(
            f"image must have shape (3, {IMAGE_SIZE}, {IMAGE_SIZE}) in [-1, 1], got {arr.shape}"
        )
    arr = np.nan_to_num(arr, nan=-1.0)
    return np.clip((arr.transpose(1, 2, 0) + 1.0) / 2.0, 0.0, 1.0)


def _classify_shape(comp: np.ndarray) -> tuple[str, float]:
    """Best template and its IoU for a component mask cropped to its bounding box."""
    best, best_iou = UNKNOWN, -1.0
    for shape, tmpl in _templates(*comp.shape).items():
        inter = np.logical_and(comp, tmpl).sum()
        union = np.logical_or(comp, tmpl).sum()
        iou = float(inter / union) if union else 0.0
        if iou > best_iou:
            best, best_iou = shape, iou
    return best, best_iou


def detect_objects(image: torch.Tensor | np.ndarray) -> list[Detection]:
    """The objects in one picture ``(3, 32, 32)`` in ``[-1, 1]`` (NaN counts as background).

    Object first, then its attributes (as GenEval detects, then classifies colour): the
    foreground's 4-connected components of at least :data:`MIN_AREA` pixels are the objects;
    each takes the palette colour most of its pixels are nearest to (``"unknown"`` when no
    colour has half of them) and the best-matching shape template (``"unknown"`` when the
    best IoU is below :data:`MIN_IOU` or the box is larger than any object can be, e.g. the
    one big component that pure noise forms).  Unknown objects match no clause but count
    towards the total.  Returns the detections in scan order of their components.
    """
    from scipy import ndimage

    p = _as_hwc01(image)
    fg = p.max(axis=-1) >= _FG_THRESHOLD
    dist = ((p[:, :, None, :] - _PALETTE[None, None]) ** 2).sum(-1)  # (H, W, 6)
    color_idx = dist.argmin(-1)
    labels, n = ndimage.label(fg, structure=_FOUR_CONNECTED)
    out: list[Detection] = []
    if n == 0:
        return out
    for k, sl in enumerate(ndimage.find_objects(labels), start=1):
        comp = labels[sl] == k
        area = int(comp.sum())
        if area < MIN_AREA:
            continue
        votes = np.bincount(color_idx[sl][comp], minlength=len(_COLOR_NAMES))
        color = _COLOR_NAMES[int(votes.argmax())] if 2 * votes.max() >= area else UNKNOWN
        shape, iou = _classify_shape(comp)
        if iou < MIN_IOU or max(comp.shape) > _MAX_SIDE:
            shape = UNKNOWN
        out.append(
            Detection(
                shape=shape,
                color=color,
                cx=(sl[1].start + sl[1].stop - 1) / 2.0,
                cy=(sl[0].start + sl[0].stop - 1) / 2.0,
                area=area,
                iou=iou,
            )
        )
    return out


def _as_spec(spec: PromptSpec | str) -> PromptSpec:
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if not isinstance(spec, PromptSpec):
        raise TypeError(f"spec must be a PromptSpec or a prompt str, got {type(spec).__name__}")
    return spec


def clause_scores(spec: PromptSpec | str, detections: Sequence[Detection]) -> dict[str, float]:
    """Each clause of the prompt and its partial-credit score (see the module doc).

    Keys, in order: ``count[i]`` and, if group ``i`` names a colour, ``color[i]`` for each
    object group ``i``; then ``position`` for ``position`` prompts.
    """
    spec = _as_spec(spec)
    res: dict[str, float] = {}
    matched = []  # per group: count (and colour) exactly right, as the server's `matched`
    found = [[d for d in detections if d.shape == g.shape] for g in spec.groups]
    for i, g in enumerate(spec.groups):
        n_found = len(found[i])
        res[f"count[{i}]"] = 1.0 - abs(g.count - n_found) / g.count
        ok = n_found == g.count
        if g.color is not None:
            if ok:
                n_color = sum(d.color == g.color for d in found[i])
                res[f"color[{i}]"] = 1.0 - abs(g.count - n_color) / g.count
                ok = n_color == g.count
            else:
                res[f"color[{i}]"] = 0.0
        matched.append(ok)
    if spec.relation is not None:
        holds = all(matched) and all(
            relation_holds(spec.relation, (a.cx, a.cy), (b.cx, b.cy))
            for a in found[0]
            for b in found[1]
        )
        res["position"] = 1.0 if holds else 0.0
    return res


def clause_results(spec: PromptSpec | str, detections: Sequence[Detection]) -> dict[str, bool]:
    """Whether each clause of :func:`clause_scores` holds fully (scores 1)."""
    return {k: v == 1.0 for k, v in clause_scores(spec, detections).items()}


def score_detections(spec: PromptSpec | str, detections: Sequence[Detection]) -> float:
    """The reward: the mean of the clause scores (1 exactly when every clause holds; below
    0 only when far more objects of a named shape are found than asked for)."""
    res = clause_scores(spec, detections)
    return sum(res.values()) / len(res)


def strict_correct(spec: PromptSpec | str, detections: Sequence[Detection]) -> bool:
    """GenEval's strict accuracy of one picture: every clause holds."""
    return all(clause_results(spec, detections).values())


def _check_batch(images: torch.Tensor, prompts: Sequence[str]) -> list[PromptSpec]:
    if not isinstance(images, torch.Tensor) or not images.dtype.is_floating_point:
        raise TypeError("images must be a floating-point torch.Tensor of shape (N, 3, 32, 32)")
    if images.ndim != 4 or tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must have shape (N, 3, 32, 32), got {tuple(images.shape)}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(
            f"prompts must be a sequence of {images.shape[0]} prompt strings (one per image)"
        )
    return [parse_prompt(p) for p in prompts]


def shapes_scores(
    images: torch.Tensor, prompts: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reward and strict correctness of pictures ``images`` ``(N, 3, 32, 32)`` (``[-1, 1]``;
    clamped) for their prompts, from one detection pass.

    Returns ``(reward, strict)``: ``(N,)`` float32 (at most 1) and ``(N,)`` bool, on
    ``images``' device; no gradient.
    """
    specs = _check_batch(images, prompts)
    x = images.detach().to("cpu", torch.float32)
    per = [clause_scores(s, detect_objects(x[i])) for i, s in enumerate(specs)]
    reward = torch.tensor([sum(c.values()) / len(c) for c in per], dtype=torch.float32)
    strict = torch.tensor([all(v == 1.0 for v in c.values()) for c in per], dtype=torch.bool)
    return reward.to(images.device), strict.to(images.device)


def shapes_reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """The training reward (:func:`score_detections`) of pictures ``images``
    ``(N, 3, 32, 32)`` (``[-1, 1]``; clamped): ``(N,)`` float32, at most 1, on ``images``'
    device; no gradient."""
    return shapes_scores(images, prompts)[0]
