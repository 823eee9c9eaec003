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
    md = (out / "SHAPES_BASE.md").read_text()
    assert "| shipped |" in md
