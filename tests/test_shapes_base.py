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
    assert a["shape_sides"] == pytest.approx({"in_order": 1 / 3, "swapped": 1 / 3, "other": 1 / 3})
    assert a["color_sides"] == pytest.approx({"in_order": 2 / 3, "swapped": 1 / 3, "other": 0.0})


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
    pa = m["pair_anatomy"]
    assert 0 <= pa["two_detected"] <= 1 and 0 <= pa["asked_shapes"] <= 1
    if pa["two_detected"]:
        assert sum(pa["drawn"].values()) == pytest.approx(1.0)
        assert sum(pa["shape_sides"].values()) == pytest.approx(1.0)
    md = (out / "SHAPES_BASE.md").read_text()
    assert "| shipped |" in md and "| shipped | color_attr |" in md
    assert "asked shapes" in md


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
