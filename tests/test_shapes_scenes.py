"""Shapes task: prompts, held-out split, renderer and tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jagg_autograd.tasks.shapes_scenes import (
    CATEGORIES,
    COLORS,
    IMAGE_SIZE,
    SHAPES,
    SceneObject,
    ShapesTokenizer,
    all_prompts,
    eval_prompt_set,
    meaning,
    parse_prompt,
    prompt_split,
    relation_holds,
    render_batch,
    render_objects,
    render_prompt,
)


def test_prompt_counts_and_parse():
    sizes = {c: len(all_prompts(c)) for c in CATEGORIES}
    assert sizes == {
        "single_object": 3,
        "two_object": 6,
        "counting": 12,
        "colors": 18,
        "position": 24,
        "color_attr": 180,
    }
    assert len(set(all_prompts())) == sum(sizes.values())
    spec = parse_prompt("a photo of a red circle and a blue square")
    assert spec.category == "color_attr"
    assert [(g.shape, g.color, g.count) for g in spec.groups] == [
        ("circle", "red", 1),
        ("square", "blue", 1),
    ]
    spec = parse_prompt("a photo of three triangles")
    assert spec.category == "counting" and spec.groups[0].count == 3
    spec = parse_prompt("a photo of a square below a circle")
    assert spec.relation == "below" and spec.groups[0].shape == "square"
    with pytest.raises(ValueError, match="not a prompt"):
        parse_prompt("a photo of a dog")
    with pytest.raises(ValueError, match="category"):
        all_prompts("shapes")


def test_heldout_split_never_in_training():
    train, held = prompt_split("train"), prompt_split("heldout")
    assert sorted(train + [p for p in held if p not in train]) == sorted(all_prompts())
    for p in held:
        cat = parse_prompt(p).category
        if cat == "single_object":
            continue  # three prompts: in both splits by design
        assert p not in train
        # no reworded twin ("a square and a circle") in training either
        assert all(meaning(q) != meaning(p) for q in train)
    for cat in CATEGORIES:
        assert any(parse_prompt(p).category == cat for p in held)
    ev = eval_prompt_set(5)
    assert len(ev) == 5 * len(CATEGORIES) and set(ev) <= set(held)
    with pytest.raises(ValueError, match="split"):
        prompt_split("test")


def test_meaning_identifies_rewordings():
    assert meaning("a photo of a circle left of a square") == meaning(
        "a photo of a square right of a circle"
    )
    assert meaning("a photo of a circle and a square") == meaning(
        "a photo of a square and a circle"
    )
    assert meaning("a photo of a circle left of a square") != meaning(
        "a photo of a circle above a square"
    )


def test_render_deterministic_and_seed_dependent():
    prompts = all_prompts()[::7]
    a = render_batch(prompts, seed=3)
    b = render_batch(prompts, seed=3)
    c = render_batch(prompts, seed=4)
    assert a.shape == (len(prompts), 3, IMAGE_SIZE, IMAGE_SIZE) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.min() == -1.0 and a.max() == 1.0


def test_render_matches_objects():
    rng = np.random.default_rng(0)
    palette = {tuple(v) for v in COLORS.values()}
    for p in all_prompts()[::3]:
        img, objs = render_prompt(p, rng)
        spec = parse_prompt(p)
        assert len(objs) == spec.num_objects
        for g in spec.groups:
            mine = [o for o in objs if o.shape == g.shape]
            assert len(mine) == g.count
            if g.color is not None:
                assert all(o.color == g.color for o in mine)
        # boxes (half-extent + gap) never overlap
        for i, o in enumerate(objs):
            for q in objs[i + 1 :]:
                assert max(abs(o.cx - q.cx), abs(o.cy - q.cy)) > o.size + q.size
        # every pixel is background or exactly a palette colour
        px = {tuple(v) for v in img.reshape(-1, 3).tolist()}
        assert px <= palette | {(0, 0, 0)}
        if spec.relation is not None:
            a, b = objs[0], objs[1]
            assert relation_holds(spec.relation, (a.cx, a.cy), (b.cx, b.cy))


@pytest.mark.parametrize("mode", [True, "horizontal", "2d"])
def test_render_reading_order(mode):
    """``reading_order`` relabels the same placements so that a relation-free prompt's
    objects run in caption order -- left to right, or for "2d" top to bottom when the pair
    is stacked -- and other prompts draw exactly as without it."""
    prompts = all_prompts("two_object") + all_prompts("color_attr")[::9]
    stacked = 0
    for seed in range(4):
        for p in prompts:
            plain_img, plain = render_prompt(p, np.random.default_rng(seed))
            img, objs = render_prompt(p, np.random.default_rng(seed), reading_order=mode)
            spec = parse_prompt(p)
            assert [o.shape for o in objs] == [g.shape for g in spec.groups]
            assert all(g.color in (None, o.color) for o, g in zip(objs, spec.groups, strict=True))
            a, b = objs
            if mode == "2d" and abs(b.cy - a.cy) > abs(b.cx - a.cx):
                stacked += 1
                assert a.cy < b.cy  # first named on top
            else:
                assert a.cx <= b.cx  # first named on the left
            # the boxes are the plain placement's, so non-overlap and bounds carry over
            assert sorted((o.cx, o.cy, o.size) for o in objs) == sorted(
                (o.cx, o.cy, o.size) for o in plain
            )
            assert sorted(o.color for o in objs) == sorted(o.color for o in plain)
            assert np.array_equal(img, render_objects(objs))
    # the left-to-right rule changes some pictures (it is not a no-op) ...
    changed = [
        not np.array_equal(
            render_prompt(p, np.random.default_rng(i))[0],
            render_prompt(p, np.random.default_rng(i), reading_order=mode)[0],
        )
        for i, p in enumerate(prompts)
    ]
    assert 0 < sum(changed) < len(changed)
    # the vertical branch of "2d" is exercised (52 % of these placements are stacked)
    assert (stacked > 0) == (mode == "2d")
    # ... and leaves prompts with a relation or a single group alone
    others = all_prompts("position") + all_prompts("counting") + all_prompts("colors")
    a = render_batch(others, seed=5)
    assert torch.equal(a, render_batch(others, seed=5, reading_order=mode))


def test_render_reading_order_modes_differ_and_bad_values():
    # True is "horizontal"; "2d" is another rule (where, test_render_reading_order checks).
    prompts = all_prompts("two_object")
    h = render_batch(prompts * 4, seed=3, reading_order="horizontal")
    assert torch.equal(h, render_batch(prompts * 4, seed=3, reading_order=True))
    assert not torch.equal(h, render_batch(prompts * 4, seed=3, reading_order="2d"))
    for bad in ("vertical", 1, "2D"):
        with pytest.raises(ValueError, match="reading_order"):
            render_prompt(prompts[0], np.random.default_rng(0), reading_order=bad)
        with pytest.raises(ValueError, match="reading_order"):
            render_batch(prompts, seed=0, reading_order=bad)


def test_render_objects_shapes_and_errors():
    img = render_objects([SceneObject("square", "red", 10, 10, 4)])
    assert (img[6:15, 6:15] == (255, 0, 0)).all() and img.sum() == 81 * 255
    circle = render_objects([SceneObject("circle", "green", 10, 10, 4)])
    tri = render_objects([SceneObject("triangle", "blue", 10, 10, 4)])
    n_c, n_t = int((circle.sum(-1) > 0).sum()), int((tri.sum(-1) > 0).sum())
    assert 81 > n_c > n_t > 30  # a square fills its box, a circle ~pi/4 of it, a triangle ~1/2
    # the triangle's apex is up: its top row is narrower than its bottom row
    assert (tri[6].sum(-1) > 0).sum() < (tri[14].sum(-1) > 0).sum()
    with pytest.raises(ValueError, match="fit"):
        render_objects([SceneObject("square", "red", 2, 10, 4)])
    with pytest.raises(ValueError, match="color"):
        render_objects([SceneObject("square", "black", 10, 10, 4)])
    with pytest.raises(ValueError, match="shape"):
        render_objects([SceneObject("hexagon", "red", 10, 10, 3)])
    with pytest.raises(ValueError, match="relation"):
        relation_holds("near", (0, 0), (5, 5))
    assert set(SHAPES) == {"circle", "square", "triangle"} and len(COLORS) >= 6


def test_tokenizer_round_trip_and_errors():
    tok = ShapesTokenizer()
    ids = tok(all_prompts())
    assert ids.shape == (len(all_prompts()), tok.max_length) and ids.dtype == torch.int64
    for p, row in zip(all_prompts(), ids):
        assert row[0] == tok.ids[tok.CLS]
        assert tok.decode(row) == p
    # distinct prompts get distinct ids
    assert len({tuple(r) for r in ids.tolist()}) == len(all_prompts())
    empty = tok([""])[0]
    assert empty[0] == tok.ids[tok.CLS] and (empty[1:] == tok.pad_id).all()
    assert tok.encode("A Photo of  a CIRCLE") == tok.encode("a photo of a circle")
    with pytest.raises(ValueError, match="'dog'"):
        tok.encode("a photo of a dog")
    with pytest.raises(ValueError, match="'circle,'"):
        tok.encode("a circle, please")
    with pytest.raises(ValueError, match="<pad>"):
        tok.encode("a <pad>")
    with pytest.raises(ValueError, match="max_length"):
        tok.encode(" ".join(["a"] * tok.max_length))
    with pytest.raises(TypeError):
        tok("a photo of a circle")
    with pytest.raises(ValueError, match="max_length"):
        ShapesTokenizer(max_length=3)
