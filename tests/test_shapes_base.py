"""benchmarks/shapes_base.py: the failure flags on known pictures, and --quick end to end."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from jagg_autograd.tasks.shapes_scenes import CATEGORIES, SceneObject, render_objects


def _picture(objects: list[SceneObject]) -> torch.Tensor:
    img = render_objects(objects)
    return torch.from_numpy(img).permute(2, 0, 1).float() / 127.5 - 1.0


def test_failure_flags_on_known_pictures() -> None:
    from benchmarks.shapes_base import MERGED_AREA, failure_flags

    blank = -torch.ones(3, 32, 32)
    assert failure_flags(blank) == (True, False)
    # The largest rendered objects, apart: neither blank nor merged.
    two = _picture(
        [SceneObject("square", "red", 7, 7, 6), SceneObject("circle", "blue", 23, 23, 6)]
    )
    assert failure_flags(two) == (False, False)
    # Two largest squares side by side with no gap form one component of 2 * 13 * 13 px.
    touching = _picture(
        [SceneObject("square", "red", 8, 12, 6), SceneObject("square", "red", 21, 12, 6)]
    )
    assert 2 * 13 * 13 > MERGED_AREA
    assert failure_flags(touching) == (False, True)
    # A dim object (brightest channel below half-way) is not detected: blank.
    dim = (two + 1.0) * 0.2 - 1.0
    assert failure_flags(dim) == (True, False)


def test_pair_anatomy_on_known_pictures() -> None:
    """Clean renders: every asked shape drawn; the sides follow the placement."""
    from benchmarks.shapes_base import pair_anatomy
    from jagg_autograd.tasks.shapes_reward import detect_objects

    red_circle = SceneObject("circle", "red", 7, 7, 5)
    blue_square = SceneObject("square", "blue", 24, 20, 5)
    red_left = detect_objects(_picture([red_circle, blue_square]))
    # The same boxes with the objects exchanged: the square is now on the left.
    swapped_pic = [
        SceneObject("square", "blue", 7, 7, 5), SceneObject("circle", "red", 24, 20, 5)
    ]
    blue_left = detect_objects(_picture(swapped_pic))
    two_circles = detect_objects(
        _picture([red_circle, SceneObject("circle", "blue", 24, 20, 5)])
    )
    ca = "a photo of a red circle and a blue square"
    a = pair_anatomy(
        [red_left, blue_left, two_circles, red_left[:1], red_left],
        [ca, ca, ca, "a photo of a circle and a square", "a photo of a red circle"],
    )
    # The single-object prompt is not counted; the one-detection picture is not a pair.
    assert a["pictures"] == 4 and a["two_detected"] == pytest.approx(3 / 4)
    # 2 + 2 + 1 asked shapes of 6 detections; two circles are one asked shape of two.
    assert a["asked_shapes"] == pytest.approx(5 / 6)
    assert a["drawn"] == pytest.approx(
        {"circle": 4 / 6, "square": 2 / 6, "triangle": 0.0, "unknown": 0.0}
    )
    # Each pair's prompt asks for a circle and a square: half each, no triangle.
    assert a["asked"] == pytest.approx({"circle": 0.5, "square": 0.5, "triangle": 0.0})
    assert a["shape_sides"] == pytest.approx({"in_order": 1 / 3, "swapped": 1 / 3, "other": 1 / 3})
    assert a["color_sides"] == pytest.approx({"in_order": 2 / 3, "swapped": 1 / 3, "other": 0.0})


def test_binding_chain_on_known_pictures() -> None:
    """Each link of the chain fails on the picture built to fail it, and the product of the
    links is the strict accuracy that the reward's own strict_correct gives."""
    from benchmarks.shapes_base import binding_chain
    from jagg_autograd.tasks.shapes_reward import detect_objects, strict_correct

    def dets(*objects: SceneObject) -> list:
        return detect_objects(_picture(list(objects)))

    red_circle_left = SceneObject("circle", "red", 7, 12, 5)
    blue_square_right = SceneObject("square", "blue", 24, 12, 5)
    good = dets(red_circle_left, blue_square_right)
    extra_triangle = dets(
        red_circle_left, blue_square_right, SceneObject("triangle", "green", 16, 26, 4)
    )
    two_circles = dets(red_circle_left, SceneObject("circle", "blue", 24, 12, 5))
    one = dets(red_circle_left)
    pos = "a photo of a circle left of a square"
    pos_wrong = "a photo of a circle right of a square"
    ca = "a photo of a red circle and a blue square"
    ca_wrong = "a photo of a blue circle and a red square"
    two = "a photo of a circle and a square"
    pictures = [good, good, two_circles, one, good, good, extra_triangle, two_circles, good]
    prompts = [pos, pos_wrong, pos, pos, ca, ca_wrong, two, two, "a photo of a red circle"]
    ch = binding_chain(pictures, prompts)
    assert set(ch) == {"two_object", "position", "color_attr"}
    missed = {cat: c.pop("missed") for cat, c in ch.items()}
    # position: 4 pictures, 3 with two named-shape detections, 2 of them the asked shapes,
    # 1 of those in the asked relation.
    assert ch["position"] == pytest.approx(
        {"pictures": 4, "found": 3 / 4, "shapes": 2 / 3, "bound": 1 / 2, "strict": 1 / 4}
    )
    assert ch["color_attr"] == pytest.approx(
        {"pictures": 2, "found": 1.0, "shapes": 1.0, "bound": 1 / 2, "strict": 1 / 2}
    )
    # An object of a shape the prompt does not name costs nothing, as in the reward.
    assert ch["two_object"] == pytest.approx(
        {"pictures": 2, "found": 1.0, "shapes": 1 / 2, "bound": 1.0, "strict": 1 / 2}
    )
    for cat, c in ch.items():
        idx = [i for i, p in enumerate(prompts) if _category(p) == cat]
        strict = sum(strict_correct(prompts[i], pictures[i]) for i in idx) / len(idx)
        assert c["found"] * c["shapes"] * c["bound"] == pytest.approx(strict)
        assert c["strict"] == pytest.approx(strict)
        assert c["found"] + sum(missed[cat].values()) == pytest.approx(1.0)
    assert missed["position"] == pytest.approx(
        {"more": 0.0, "merged": 0.0, "unknown": 0.0, "other_shape": 0.0, "missing": 1 / 4}
    )


def test_binding_chain_miss_reasons() -> None:
    """A picture without its two named-shape detections is put down to the first reason that
    applies: more than two, a merged component, an unknown shape, a shape not named, none."""
    from benchmarks.shapes_base import MERGED_AREA, binding_chain
    from jagg_autograd.tasks.shapes_reward import UNKNOWN, Detection

    def det(shape: str, area: int = 81) -> Detection:
        return Detection(shape, "red", 10.0, 10.0, area, 0.9)

    big = MERGED_AREA + 1
    pictures = [
        [det("circle"), det("square"), det("square")],  # more (a merged one does not matter)
        [det("circle", big), det(UNKNOWN)],  # merged, before unknown
        [det("circle"), det(UNKNOWN), det("triangle")],  # unknown, before other shape
        [det("square"), det("triangle")],  # other shape
        [det("circle")],  # missing
        [],  # missing
        [det("circle"), det("square", big)],  # found: two named, merged or not
    ]
    ch = binding_chain(pictures, ["a photo of a circle and a square"] * len(pictures))
    n = len(pictures)
    assert ch["two_object"]["found"] == pytest.approx(1 / n)
    assert ch["two_object"]["missed"] == pytest.approx(
        {"more": 1 / n, "merged": 1 / n, "unknown": 1 / n, "other_shape": 1 / n, "missing": 2 / n}
    )


def test_relation_anatomy_on_known_pictures() -> None:
    """Each picture lands on the side its placement puts the first named object, per asked
    relation; pictures without the asked pair and other categories are not counted; holds
    is the reward's position clause (with its margin), placed is the dominant axis."""
    from benchmarks.shapes_base import PLACEMENTS, binding_chain, relation_anatomy
    from jagg_autograd.tasks.shapes_reward import detect_objects

    def dets(*objects: SceneObject) -> list:
        return detect_objects(_picture(list(objects)))

    circle_left = dets(
        SceneObject("circle", "red", 7, 12, 5), SceneObject("square", "blue", 24, 12, 5)
    )
    circle_top = dets(
        SceneObject("circle", "red", 12, 6, 5), SceneObject("square", "blue", 14, 24, 5)
    )
    # Diagonal, the vertical offset larger: placed "above", and "left of" does not hold.
    diagonal = dets(
        SceneObject("circle", "red", 8, 7, 4), SceneObject("square", "blue", 20, 21, 4)
    )
    two_circles = dets(
        SceneObject("circle", "red", 7, 12, 5), SceneObject("circle", "blue", 24, 12, 5)
    )
    pos = "a photo of a circle {} a square"
    pictures = [circle_left, circle_left, circle_top, circle_top, circle_left, two_circles,
                circle_left, diagonal]
    prompts = [pos.format("left of"), pos.format("right of"), pos.format("above"),
               pos.format("below"), pos.format("below"), pos.format("above"),
               "a photo of a circle and a square", pos.format("left of")]  # fmt: skip
    ra = relation_anatomy(pictures, prompts)
    assert set(ra) == {"left of", "right of", "above", "below", "horizontal", "vertical"}

    def check(key: str, pictures: int, holds: float, **placed: float) -> None:
        row = ra[key]
        assert row["pictures"] == pictures and row["holds"] == pytest.approx(holds)
        assert row["placed"] == pytest.approx({w: placed.get(w, 0.0) for w in PLACEMENTS})

    check("left of", 2, 0.5, left=0.5, above=0.5)
    check("right of", 1, 0.0, left=1.0)
    check("above", 1, 1.0, above=1.0)  # two_circles lacks the asked pair: not counted
    check("below", 2, 0.0, above=0.5, left=0.5)
    check("horizontal", 3, 1 / 3, left=2 / 3, above=1 / 3)
    check("vertical", 3, 1 / 3, above=2 / 3, left=1 / 3)
    # The relations' pictures are binding_chain's "shapes" pictures, and their holds its
    # "bound" link.
    ch = binding_chain(pictures, prompts)["position"]
    n_shapes = ch["found"] * ch["shapes"] * ch["pictures"]
    assert ra["horizontal"]["pictures"] + ra["vertical"]["pictures"] == pytest.approx(n_shapes)
    held = sum(ra[k]["holds"] * ra[k]["pictures"] for k in ("horizontal", "vertical"))
    assert held / n_shapes == pytest.approx(ch["bound"])


def _category(prompt: str) -> str:
    from jagg_autograd.tasks.shapes_scenes import parse_prompt

    return parse_prompt(prompt).category


def test_parse_models_names_the_bad_entry(tmp_path) -> None:
    from benchmarks.shapes_base import _parse_models

    with pytest.raises(ValueError, match="NAME=DIR"):
        _parse_models(["no_equals_sign"])
    with pytest.raises(ValueError, match="shapes_model.safetensors"):
        _parse_models([f"empty={tmp_path}"])


def test_shapes_base_quick(run_benchmark) -> None:
    out = run_benchmark("benchmarks.shapes_base", "--quick", "--threads", "1")
    res = json.loads((out / "shapes_base.json").read_text())
    cfg = res["config"]
    assert (cfg["guidance_scale"], cfg["noise_level"], cfg["steps"]) == (2.0, 0.7, 10)
    m = res["models"]["shipped"]
    n = cfg["per_category"] * len(cfg["noise_seeds"])
    assert m["samples"] == n * len(CATEGORIES)
    for c in CATEGORIES:
        pc = m["per_category"][c]
        assert pc["samples"] == n
        p = pc["strict_accuracy"]
        # Strict accuracy and the failure fractions are counts over n samples.
        for k in ("strict_accuracy", "blank", "merged"):
            assert np.isclose(pc[k] * n, round(pc[k] * n))
        assert pc["strict_se"] == pytest.approx(math.sqrt(p * (1 - p) / n))
        # A blank picture is never strictly correct: at most the non-blank share is.
        assert p <= 1 - pc["blank"] + 1e-12
    probe = m["binding_probe"]
    assert set(probe) == {"color_attr", "position"}
    assert all(0 <= v["first_noun"] < v["swapped_words"] for v in probe.values())
    paths = m["pooled_probe"]
    assert set(paths) == {"shape", "color"}
    for v in paths.values():
        assert 0 <= v["pictures"] <= 18  # one picture per "colors" prompt in the quick run
        if v["pictures"]:
            assert sum(v[k] for k in ("tokens", "pooled", "other")) == pytest.approx(1.0)
    pa = m["pair_anatomy"]
    assert 0 <= pa["two_detected"] <= 1 and 0 <= pa["asked_shapes"] <= 1
    if pa["two_detected"]:
        assert sum(pa["drawn"].values()) == pytest.approx(1.0)
        assert sum(pa["shape_sides"].values()) == pytest.approx(1.0)
    md = (out / "SHAPES_BASE.md").read_text()
    assert "| shipped |" in md and "| shipped | color_attr |" in md
    assert "asked shapes" in md and "| shipped | shape |" in md
    chain = m["binding_chain"]
    for cat in ("two_object", "position", "color_attr"):
        c = chain[cat]
        assert c["found"] * c["shapes"] * c["bound"] == pytest.approx(
            m["per_category"][cat]["strict_accuracy"]
        )
    assert "| shipped | position |" in md
    ra = m["relation_anatomy"]
    assert set(ra) == {"left of", "right of", "above", "below", "horizontal", "vertical"}
    # The relations' pictures are the chain's "shapes" pictures, their holds its "bound".
    pos = chain["position"]
    n_pair = ra["horizontal"]["pictures"] + ra["vertical"]["pictures"]
    assert n_pair == round(pos["found"] * pos["shapes"] * pos["pictures"])
    for v in ra.values():
        if v["pictures"]:
            assert sum(v["placed"].values()) == pytest.approx(1.0)
    assert "| shipped | vertical |" in md


def test_swapped_prompts_bind_the_other_way() -> None:
    from benchmarks.shapes_base import swapped

    assert swapped("a photo of a red circle and a blue square") == (
        "a photo of a blue circle and a red square"
    )
    assert swapped("a photo of a triangle above a circle") == "a photo of a triangle below a circle"
    assert (
        swapped("a photo of a square left of a circle") == "a photo of a square right of a circle"
    )
    with pytest.raises(ValueError, match="color_attr or position"):
        swapped("a photo of a red circle")


def test_binding_probe_is_zero_for_a_per_token_encoder() -> None:
    """With the attention's output projection zeroed the encoder maps each (word, position)
    on its own: a noun's output cannot depend on its colour or relation, so the probe must
    give exactly 0 at the nouns (and not at the exchanged words); with attention it is > 0."""
    from benchmarks.shapes_base import BINDING_CATEGORIES, binding_probe
    from jagg_autograd.models.shapes import ShapesModel, ShapesModelConfig

    torch.manual_seed(0)
    model = ShapesModel(ShapesModelConfig(num_layers=1, attention_head_dim=8)).eval()
    mixed = binding_probe(model)
    for blk in model.text_encoder.blocks:
        torch.nn.init.zeros_(blk.proj.weight)
        torch.nn.init.zeros_(blk.proj.bias)
    alone = binding_probe(model)
    assert set(alone) == set(BINDING_CATEGORIES)
    for cat in BINDING_CATEGORIES:
        assert alone[cat]["first_noun"] == 0.0 and alone[cat]["second_noun"] == 0.0
        assert alone[cat]["swapped_words"] > 0.1
        assert mixed[cat]["first_noun"] > 1e-4 and mixed[cat]["second_noun"] > 1e-4


class _TwoPathTask:
    """A stand-in task whose sampler draws, at the picture's centre, the shape its pooled
    vector names in the colour its tokens name (the ODE's velocity ``(z - x0) / t`` lands
    on that render): :func:`pooled_probe` must find shape <- pooled, colour <- tokens."""

    latent_shape = (3, 32, 32)

    def cond(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        from jagg_autograd.tasks.shapes_scenes import COLORS, SHAPES, parse_prompt

        g = [parse_prompt(p).groups[0] for p in prompts]
        key = torch.tensor([[SHAPES.index(x.shape), list(COLORS).index(x.color)] for x in g])
        return {"encoder_hidden_states": key.float(), "pooled_projections": key.float()}

    def velocity_model(self):
        from jagg_autograd.tasks.shapes_scenes import COLORS, SHAPES

        def velocity(z, t, encoder_hidden_states, pooled_projections):
            objs = [
                [SceneObject(SHAPES[int(p[0])], list(COLORS)[int(e[1])], 16, 16, 6)]
                for e, p in zip(encoder_hidden_states, pooled_projections, strict=True)
            ]
            x0 = torch.stack([_picture(o) for o in objs])
            return (z - x0) / t.view(-1, 1, 1, 1)

        return velocity


def test_pooled_probe_follows_each_path() -> None:
    from benchmarks.shapes_base import _probe_twin, pooled_probe

    assert _probe_twin("a photo of a red triangle", "shape") == "a photo of a red circle"
    assert _probe_twin("a photo of a cyan square", "color") == "a photo of a red square"
    probe = pooled_probe(_TwoPathTask(), 1, 0, noise_level=0.0, steps=2)
    assert probe["shape"] == {"tokens": 0.0, "pooled": 1.0, "other": 0.0, "pictures": 18}
    assert probe["color"] == {"tokens": 1.0, "pooled": 0.0, "other": 0.0, "pictures": 18}
