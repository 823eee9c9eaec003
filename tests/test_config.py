"""GRPOConfig as data: help in the field metadata, the CLI generated from the fields, and
``--config FILE`` (YAML or JSON) under the command line's flags."""

from __future__ import annotations

import dataclasses
import json

import pytest

from jagg_autograd.config import GROUPS, GRPOConfig
from jagg_autograd.demo import build_parser, load_config_file, main, parse_config


def test_every_field_has_help_and_a_group_and_a_flag():
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    for f in dataclasses.fields(GRPOConfig):
        assert f.metadata["help"] and f.metadata["group"] in GROUPS, f.name
        if f.metadata.get("cli", True):
            assert f.name in dests, f.name
    # choices come from the field, defaults from the config
    actions = {a.dest: a for a in parser._actions}
    assert actions["placement"].choices == ("uniform", "adaptive", "stochastic")
    assert actions["lr"].default == GRPOConfig().lr and actions["out"].default == "jagg_demo_out"
    assert "--minibatches" in actions["optimizer_steps_per_rollout"].option_strings


def test_yaml_file_and_an_overriding_flag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "mode: exact\nexact_loop: false\nsteps: 7\nlr: 1e-3\nmax_grad_norm: null\n"
        "timestep_fraction: 0.5\ntask_options: {eval_per_digit: 2}\n",
        encoding="utf-8",
    )
    cfg = parse_config(["--config", str(path), "--steps", "3", "--no-exact-loop"])
    expected = GRPOConfig(mode="exact", exact_loop=False, steps=3, lr=1e-3, max_grad_norm=None,
                          timestep_fraction=0.5, task_options={"eval_per_digit": 2},
                          out="jagg_demo_out")  # fmt: skip
    assert cfg == expected
    assert parse_config(["--config", str(path), "--mode", "jagg"]).mode == "jagg"
    assert parse_config(["--config", str(path)]).steps == 7


def test_json_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"group_size": 2, "placement": "adaptive", "budget": 3.0}))
    cfg = parse_config(["--config", str(path), "--budget", "none"])
    assert cfg.group_size == 2 and cfg.placement == "adaptive" and cfg.budget is None


def test_unknown_keys_in_the_file_are_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("steps: 2\nlearning_rate: 0.1\nwindw: 3\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown GRPOConfig field\(s\) \['learning_rate', 'windw'\]"):
        load_config_file(path)
    with pytest.raises(SystemExit) as exc:
        main(["--config", str(path)])
    assert exc.value.code == 2
    assert "learning_rate" in capsys.readouterr().err
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n", encoding="utf-8")
    with pytest.raises(ValueError, match="mapping"):
        load_config_file(tmp_path / "list.yaml")
    with pytest.raises(ValueError, match="cannot read"):
        load_config_file(tmp_path / "missing.yaml")


def test_bad_values_in_the_file_name_the_field(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("window: 1\n", encoding="utf-8")
    with pytest.raises(ValueError, match="window must be"):
        parse_config(["--config", str(path)])


def test_the_file_beats_the_task_demo_defaults_and_flags_beat_the_file(tmp_path):
    from jagg_autograd.tasks.shapes import ShapesTask

    path = tmp_path / "run.yaml"
    path.write_text("task: shapes\nlr: 0.002\n", encoding="utf-8")
    cfg = parse_config(["--config", str(path)])
    assert cfg.task == "shapes" and cfg.lr == 0.002  # the file over shapes' lr
    assert cfg.steps == ShapesTask.demo_defaults["steps"]  # shapes' demo default
    cfg = parse_config(["--config", str(path), "--steps", "4", "--task", "digits"])
    assert cfg.task == "digits" and cfg.steps == 4 and cfg.lr == 0.002
