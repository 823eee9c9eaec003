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

**Score** (:func:`score_detections`): a prompt is a conjunction of clauses, each true or false:

* per object group ``(shape, colour, n)``: *count* — exactly ``n`` detected objects of that
  shape; and if a colour is named, *binding* — exactly ``n`` detected objects of that shape
  **in that colour**;
* ``position`` prompts: *relation* — some object of the first shape stands in the relation
  (:func:`~jagg_autograd.tasks.shapes_scenes.relation_holds`) to some object of the second;
* always: *total* — no objects beyond the prompt's (the detected total equals the prompt's).

The score is ``1`` when every clause holds (GenEval's binary "correct") and otherwise
``0.5 * passed / clauses`` — partial credit that gives GRPO a graded signal but always stays
below ``0.5``, so an image that gets any clause wrong can never look half right.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from jagg_autograd.tasks.shapes_scenes import (
    COLORS,
    IMAGE_SIZE,
    SIZES,
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
    "detect_objects",
    "score_detections",
    "shapes_reward",
]

MIN_AREA = 12
#: A component whose best shape template overlaps it less than this is no known shape.
MIN_IOU = 0.5
#: Label of an object whose shape or colour the checker cannot name.
UNKNOWN = "unknown"
# Largest object box (13 px) plus slack for a generator's blurry edges.
_MAX_SIDE = 2 * max(SIZES) + 1 + 4
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


def clause_results(spec: PromptSpec | str, detections: Sequence[Detection]) -> dict[str, bool]:
    """Each clause of the prompt (see the module doc) and whether ``detections`` satisfy it."""
    if isinstance(spec, str):
        spec = parse_prompt(spec)
    if not isinstance(spec, PromptSpec):
        raise TypeError(f"spec must be a PromptSpec or a prompt str, got {type(spec).__name__}")
    res: dict[str, bool] = {}
    for i, g in enumerate(spec.groups):
        of_shape = [d for d in detections if d.shape == g.shape]
        res[f"count[{i}]"] = len(of_shape) == g.count
        if g.color is not None:
            res[f"binding[{i}]"] = sum(d.color == g.color for d in of_shape) == g.count
    if spec.relation is not None:
        a = [d for d in detections if d.shape == spec.groups[0].shape]
        b = [d for d in detections if d.shape == spec.groups[1].shape]
        res["relation"] = any(
            relation_holds(spec.relation, (da.cx, da.cy), (db.cx, db.cy)) for da in a for db in b
        )
    res["total"] = len(detections) == spec.num_objects
    return res


def score_detections(spec: PromptSpec | str, detections: Sequence[Detection]) -> float:
    """``1`` if every clause holds, else ``0.5 * passed / clauses`` (always ``< 0.5``)."""
    res = clause_results(spec, detections)
    passed = sum(res.values())
    if passed == len(res):
        return 1.0
    return 0.5 * passed / len(res)


def shapes_reward(images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
    """GenEval-style scores of pictures ``images`` ``(N, 3, 32, 32)`` (``[-1, 1]``; clamped).

    Returns ``(N,)`` float32 in ``[0, 1]`` on ``images``' device; no gradient.
    """
    if not isinstance(images, torch.Tensor) or not images.dtype.is_floating_point:
        raise TypeError("images must be a floating-point torch.Tensor of shape (N, 3, 32, 32)")
    if images.ndim != 4 or tuple(images.shape[1:]) != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must have shape (N, 3, 32, 32), got {tuple(images.shape)}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        raise ValueError(
            f"prompts must be a sequence of {images.shape[0]} prompt strings (one per image)"
        )
    specs = [parse_prompt(p) for p in prompts]
    x = images.detach().to("cpu", torch.float32)
    scores = [score_detections(s, detect_objects(x[i])) for i, s in enumerate(specs)]
    return torch.tensor(scores, dtype=torch.float32, device=images.device)
