"""Shapes task: the GenEval-style checker against the renderer's ground truth, and Flow-GRPO's
partial-credit scoring (reward-server ``evaluate_reward``) on scenes of known content."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jagg_autograd.tasks.shapes_reward import (
    clause_results,
    clause_scores,
    detect_objects,
    score_detections,
    shapes_reward,
    shapes_scores,
    strict_correct,
)
from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    COLORS,
    NUMBERS,
    PLURALS,
    SHAPES,
    SIZES,
    ObjectGroup,
    PromptSpec,
    SceneObject,
    all_prompts,
    meaning,
    render_objects,
    render_prompt,
)

SCENES_PER_CATEGORY = 300


def _to_tensor(img: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(img).permute(2, 0, 1).float() / 127.5 - 1.0


@pytest.mark.parametrize("category", CATEGORIES)
def test_checker_validation_on_renders(category):
    """Clean renders of a prompt are detected object by object and score 1 (strictly
    correct) in >= 99 % (100 % measured); scored against a prompt of the same category with
    a different meaning, they are never strictly correct and score below 1."""
    rng = np.random.default_rng(100 + CATEGORIES.index(category))
    ps = all_prompts(category)
    right = wrong_strict = 0
    for _ in range(SCENES_PER_CATEGORY):
        p = ps[int(rng.integers(len(ps)))]
        img, objs = render_prompt(p, rng)
        det = detect_objects(_to_tensor(img))
        # detection agrees with the ground truth object by object
        assert sorted((d.shape, d.color) for d in det) == sorted((o.shape, o.color) for o in objs)
        right += score_detections(p, det) == 1.0 and strict_correct(p, det)
        others = [q for q in ps if meaning(q) != meaning(p)]
        q = others[int(rng.integers(len(others)))]
        assert (score_detections(q, det) == 1.0) == strict_correct(q, det)
        wrong_strict += strict_correct(q, det)
    assert right / SCENES_PER_CATEGORY >= 0.99
    assert wrong_strict / SCENES_PER_CATEGORY <= 0.01


def test_every_shape_colour_size_detected():
    for s in SHAPES:
        for c in COLORS:
            for h in SIZES:
                det = detect_objects(_to_tensor(render_objects([SceneObject(s, c, 15, 16, h)])))
                assert len(det) == 1
                d = det[0]
                assert (d.shape, d.color) == (s, c)
                assert (d.cx, d.cy) == (15.0, 16.0) and d.iou > 0.99


def test_noise_scores_low():
    """Gaussian noise forms one big unknown component (or specks): no shape is found, so
    every count clause and the clauses that depend on it score 0 (measured: mean 0.0 over
    240 pictures, none strictly correct); a blank picture likewise."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(240, 3, 32, 32, generator=g)
    prompts = [all_prompts()[i % len(all_prompts())] for i in range(240)]
    r = shapes_reward(noise, prompts)
    assert r.shape == (240,) and r.dtype == torch.float32
    assert float(r.mean()) < 0.02 and float(r.max()) < 0.5
    r2, strict = shapes_scores(noise, prompts)
    assert torch.equal(r, r2) and strict.dtype == torch.bool and not strict.any()
    blank = shapes_reward(torch.full((2, 3, 32, 32), -1.0), prompts[:2])
    assert blank.tolist() == [0.0, 0.0]


def _scene(*groups: tuple[str, str | None, int], seed: int = 0) -> list:
    """Detections of a clean render with the given ``(shape, colour, count)`` groups."""
    spec = PromptSpec("counting", tuple(ObjectGroup(*g) for g in groups))
    img, objs = render_prompt(spec, np.random.default_rng(seed))
    det = detect_objects(_to_tensor(img))
    assert sorted((d.shape, d.color) for d in det) == sorted((o.shape, o.color) for o in objs)
    return det


@pytest.mark.parametrize("shape", SHAPES)
def test_wrong_count_scores_by_the_formula(shape):
    """Count clause: 1 - |n_req - n_found| / n_req, unclamped (reward-server's
    ``evaluate_reward``): e.g. 3 found for "one" scores -1; objects of other shapes cost
    nothing."""
    other = next(s for s in SHAPES if s != shape)
    for k in range(5):
        det = _scene((shape, None, k), seed=k) if k else []
        det_extra = _scene((shape, None, k), (other, None, 1), seed=10 + k) if k < 4 else None
        for n in range(1, 5):
            p = f"a photo of {NUMBERS[n]} {shape if n == 1 else PLURALS[shape]}"
            want = 1.0 - abs(n - k) / n
            assert score_detections(p, det) == pytest.approx(want, abs=1e-12), (n, k)
            assert clause_scores(p, det) == {"count[0]": pytest.approx(want, abs=1e-12)}
            assert strict_correct(p, det) == (n == k)
            if det_extra is not None:
                assert score_detections(p, det_extra) == pytest.approx(want, abs=1e-12)
                assert strict_correct(p, det_extra) == (n == k)
    # two-object prompts: one count clause per shape, each by the formula
    det = _scene((shape, None, 2), (other, None, 1))
    assert clause_scores(f"a photo of a {shape} and a {other}", det) == {
        "count[0]": 0.0,
        "count[1]": 1.0,
    }
    assert score_detections(f"a photo of a {other} and a {shape}", det) == 0.5
    det = _scene((shape, None, 3), (other, None, 1))
    assert score_detections(f"a photo of a {shape} and a {other}", det) == (-1.0 + 1.0) / 2


def test_colour_clause_formula_and_zero_when_count_wrong():
    # n_req = 2, count right, one of the two in the colour: 1 - |2 - 1| / 2
    two_red = PromptSpec("colors", (ObjectGroup("circle", "red", 2),))
    det = _scene(("circle", "red", 1), ("circle", "green", 1))
    assert clause_scores(two_red, det) == {"count[0]": 1.0, "color[0]": 0.5}
    assert score_detections(two_red, det) == 0.75 and not strict_correct(two_red, det)
    det = _scene(("circle", "red", 2))
    assert score_detections(two_red, det) == 1.0 and strict_correct(two_red, det)
    # count wrong: the colour clause is 0 even though every circle found is red
    det = _scene(("circle", "red", 2), ("square", "red", 1))
    assert clause_scores("a photo of a red circle", det) == {"count[0]": 0.0, "color[0]": 0.0}
    assert clause_scores("a photo of a red square", det) == {"count[0]": 1.0, "color[0]": 1.0}
    det = _scene(("circle", "red", 3))
    three = PromptSpec("colors", (ObjectGroup("circle", "red", 2),))
    assert clause_scores(three, det) == {"count[0]": 0.5, "color[0]": 0.0}
    det = _scene(("circle", "red", 1), ("square", "green", 1))
    assert clause_scores("a photo of a red circle", det) == {"count[0]": 1.0, "color[0]": 1.0}
    assert score_detections("a photo of a blue circle", det) == 0.5
    # colour attribution: the second object's colour clause
    assert score_detections("a photo of a red circle and a blue square", det) == 0.75
    assert score_detections("a photo of a green circle and a red square", det) == 0.5
    assert score_detections("a photo of a red circle and a green triangle", det) == 0.5
    det = _scene(("circle", "red", 1), ("square", "green", 2))
    assert clause_scores("a photo of a red circle and a green square", det) == {
        "count[0]": 1.0,
        "color[0]": 1.0,
        "count[1]": 0.0,
        "color[1]": 0.0,
    }


def test_position_clause_zero_when_a_count_is_wrong():
    objs = [SceneObject("circle", "red", 8, 16, 4), SceneObject("square", "green", 24, 16, 4)]
    det = detect_objects(_to_tensor(render_objects(objs)))
    left = "a photo of a circle left of a square"
    assert clause_scores(left, det) == {"count[0]": 1.0, "count[1]": 1.0, "position": 1.0}
    assert strict_correct(left, det) and score_detections(left, det) == 1.0
    # relation false, counts right: 2/3 (the reward server's loop would give 0.75)
    right = "a photo of a circle right of a square"
    assert clause_scores(right, det) == {"count[0]": 1.0, "count[1]": 1.0, "position": 0.0}
    assert score_detections(right, det) == pytest.approx(2 / 3) and not strict_correct(right, det)
    # an extra circle (also left of the square): the circles' count and the relation fail
    extra = [*objs, SceneObject("circle", "blue", 8, 4, 3)]
    det = detect_objects(_to_tensor(render_objects(extra)))
    assert clause_scores(left, det) == {"count[0]": 0.0, "count[1]": 1.0, "position": 0.0}
    assert score_detections(left, det) == pytest.approx(1 / 3)
    # the target's count wrong (no square): the relation fails too
    det = detect_objects(_to_tensor(render_objects(objs[:1])))
    assert clause_scores(left, det) == {"count[0]": 1.0, "count[1]": 0.0, "position": 0.0}
    # an object of another shape costs nothing (GenEval does not penalise unnamed classes)
    other = [*objs, SceneObject("triangle", "blue", 16, 4, 3)]
    det = detect_objects(_to_tensor(render_objects(other)))
    assert score_detections(left, det) == 1.0 and strict_correct(left, det)


def test_strict_accuracy_only_when_all_clauses_hold():
    objs = [SceneObject("circle", "red", 8, 16, 4), SceneObject("square", "green", 24, 16, 4)]
    x = _to_tensor(render_objects(objs))
    det = detect_objects(x)
    cases = {
        "a photo of a red circle and a green square": (1.0, True),
        "a photo of a square and a circle": (1.0, True),
        "a photo of a circle": (1.0, True),  # the square is not named: no penalty
        "a photo of a red circle": (1.0, True),
        "a photo of a circle above a square": (2 / 3, False),
        "a photo of a red circle and a blue square": (0.75, False),
        "a photo of a circle and a triangle": (0.5, False),
        "a photo of two circles": (0.5, False),
        "a photo of four squares": (0.25, False),
        "a photo of a blue triangle": (0.0, False),
    }
    for p, (score, strict) in cases.items():
        res = clause_results(p, det)
        assert strict_correct(p, det) == strict == all(res.values()), p
        assert score_detections(p, det) == pytest.approx(score), p
        assert (score_detections(p, det) == 1.0) == strict, p
    prompts = list(cases)
    r, s = shapes_scores(torch.stack([x] * len(prompts)), prompts)
    assert r.dtype == torch.float32 and s.dtype == torch.bool
    assert r.tolist() == pytest.approx([c[0] for c in cases.values()])
    assert s.tolist() == [c[1] for c in cases.values()]
    assert torch.equal(shapes_reward(torch.stack([x] * len(prompts)), prompts), r)


def test_reward_errors():
    x = torch.zeros(2, 3, 32, 32)
    with pytest.raises(ValueError, match="prompts"):
        shapes_reward(x, ["a photo of a circle"])
    with pytest.raises(ValueError, match="shape"):
        shapes_reward(torch.zeros(2, 1, 32, 32), ["a photo of a circle"] * 2)
    with pytest.raises(ValueError, match="not a prompt"):
        shapes_reward(x, ["a photo of a circle", "a cat"])
    with pytest.raises(TypeError):
        detect_objects([[0.0]])


def test_object_first_colour_vote_and_unknowns():
    from jagg_autograd.tasks.shapes_reward import UNKNOWN

    img = render_objects([SceneObject("circle", "red", 10, 10, 5)]).copy()
    img[8:11, 9:12] = COLORS["magenta"]  # 9 off-colour pixels inside the circle
    det = detect_objects(_to_tensor(img))
    assert [(d.shape, d.color) for d in det] == [("circle", "red")]
    # a half-red, half-green blob has no colour a clause can match
    img = render_objects([SceneObject("square", "red", 10, 10, 5)]).copy()
    img[5:16, 10:16] = COLORS["green"]
    (d,) = detect_objects(_to_tensor(img))
    assert d.shape == "square" and d.color in ("green", UNKNOWN)
    img[5:16, 11:16] = COLORS["green"]
    img[5:16, 5:10] = COLORS["red"]
    img[5:16, 10] = COLORS["blue"]
    (d,) = detect_objects(_to_tensor(img))
    assert d.color == UNKNOWN
    # pure noise forms one big component: an unknown object, matching no shape clause
    noise = torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(1))
    big = [d for d in detect_objects(noise) if d.area > 200]
    assert big and all(d.shape == UNKNOWN for d in big)
    assert score_detections("a photo of a square", detect_objects(noise)) == 0.0
