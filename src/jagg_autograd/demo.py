"""The main job: online Flow-GRPO on a task (default: the digits DiT), gradients through JAGG.

Run ``python -m jagg_autograd.demo`` (or ``jagg-demo``) with no arguments for the default
run (a few minutes on a 2-core CPU); ``--help`` lists the options. The run writes
``log.json``, ``reward.png`` and ``grid.png`` (held-out samples before and after training)
to ``--out`` and prints a one-paragraph summary. The training loop itself is
:func:`jagg_autograd.trainer.train`; this module is only its CLI.

The CLI is generated from :class:`~jagg_autograd.config.GRPOConfig`'s fields (flag
``--a-b`` for field ``a_b``, help, group and choices from the field's metadata), so a new
field, estimator or task needs no edit here.  ``--config FILE`` (YAML or JSON) sets any
field; precedence, lowest first: the field's default, the task's ``demo_defaults``, the
file, the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import sys
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jagg_autograd.config import GROUPS, GRPOConfig
from jagg_autograd.tasks import task_factory
from jagg_autograd.trainer import TrainingDivergedError, train

__all__ = ["build_parser", "config_from_args", "load_config_file", "main", "parse_config"]

_FIELDS = {f.name: f for f in dataclasses.fields(GRPOConfig)}
_HINTS = typing.get_type_hints(GRPOConfig)


def _cli_fields() -> list[dataclasses.Field]:
    return [f for f in _FIELDS.values() if f.metadata.get("cli", True)]


def _scalar_type(name: str) -> tuple[type, bool]:
    """``(type, optional)`` of field ``name`` (``int | None`` -> ``(int, True)``)."""
    hint = _HINTS[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if args and len(args) < len(typing.get_args(hint)):
        return args[0], True
    return hint, False


def _converter(name: str) -> Callable[[str], Any]:
    """The string converter of field ``name`` ("none" is None for an optional field)."""
    typ, optional = _scalar_type(name)

    def convert(text: str) -> Any:
        if optional and text.strip().lower() == "none":
            return None
        return typ(text)

    convert.__name__ = typ.__name__  # argparse names the type in its error messages
    return convert


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser, generated from :class:`GRPOConfig`'s fields (defaults
    are the config's, shown by ``--help``)."""
    p = argparse.ArgumentParser(
        prog="jagg-demo",
        description=(
            "Online Flow-GRPO on a task (default: the embedded 8x8-digits DiT, reward = the "
            "classifier's probability of the prompted digit); gradients through "
            "jagg_trajectory. Writes log.json (after every step) and reward.png to --out."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help="YAML or JSON file of GRPOConfig fields (any field, e.g. task_options); "
        "flags given on the command line override it",
    )
    groups = {g: p if g == "task" else p.add_argument_group(g) for g in GROUPS}
    for f in _cli_fields():
        meta = f.metadata
        kw: dict[str, Any] = {"dest": f.name, "help": meta["help"]}
        kw["default"] = meta.get("cli_default", f.default)
        if _HINTS[f.name] is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = _converter(f.name)
            choices = meta.get("choices")
            if choices is not None:
                kw["choices"] = tuple(choices() if callable(choices) else choices)
        flags = [f"--{f.name.replace('_', '-')}", *meta.get("flags", ())]
        groups[meta["group"]].add_argument(*flags, **kw)
    return p


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The fields set by a YAML or JSON file (``ValueError`` naming unknown keys).

    Strings given for numeric fields are converted as on the command line (YAML reads
    ``1e-4`` as a string)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--config {str(path)!r}: cannot read it ({exc})") from exc
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:
        raise ValueError(f"--config {str(path)!r}: not valid YAML/JSON ({exc})") from exc
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"--config {str(path)!r}: expected a mapping of field: value")
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise ValueError(
            f"--config {str(path)!r}: unknown GRPOConfig field(s) {unknown} "
            f"(the fields: {sorted(_FIELDS)})"
        )
    out = {}
    for name, value in data.items():
        typ, _ = _scalar_type(name)
        if isinstance(value, str) and typ in (int, float):
            value = _converter(name)(value)
        out[name] = value
    return out


def _task_demo_defaults(name: str) -> dict[str, Any]:
    """``demo_defaults`` of the registered task ``name`` (its class attribute, read without
    building the task), restricted to the demo's flags."""
    factory = task_factory(name)
    defaults = dict(getattr(factory, "demo_defaults", {}) or {})
    unknown = sorted(set(defaults) - {f.name for f in _cli_fields()})
    if unknown:
        raise ValueError(f"task {name!r}: demo_defaults has no demo flag(s) {unknown}")
    return defaults


def config_from_args(args: argparse.Namespace) -> GRPOConfig:
    """A validated :class:`GRPOConfig` from parsed arguments (``ValueError`` if bad)."""
    values = {name: getattr(args, name) for name in _FIELDS if hasattr(args, name)}
    for name in ("max_grad_norm", "guard_ratio"):  # <= 0 on the command line: off
        v = values.get(name)
        if v is not None and math.isfinite(v) and v <= 0:
            values[name] = None
    cfg = GRPOConfig(**values)
    cfg.validate()
    if cfg.tuning == "lora" and importlib.util.find_spec("peft") is None:
        raise ValueError("tuning='lora' needs peft: pip install peft (or use --tuning full)")
    return cfg


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv`` over the task's demo defaults and the ``--config`` file."""
    args = parser.parse_args(argv)
    from_file = load_config_file(args.config) if args.config else {}
    if from_file:  # the file may name the task whose demo defaults apply
        parser.set_defaults(**from_file)
        args = parser.parse_args(argv)
    # The task's own demo defaults (e.g. the shapes task's lr and steps) replace the
    # GRPOConfig defaults, never a value from the file or a flag: parse again with them.
    task_defaults = _task_demo_defaults(args.task)
    if task_defaults:
        parser.set_defaults(**{**task_defaults, **from_file})
        args = parser.parse_args(argv)
    return args


def parse_config(argv: Sequence[str] | None = None) -> GRPOConfig:
    """The validated :class:`GRPOConfig` of a command line (``ValueError`` if bad)."""
    return config_from_args(_parse(build_parser(), argv))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status.

    0: finished; 2: bad arguments (argparse's convention); 1: the run stopped on an error
    (e.g. a non-finite loss); 130: Ctrl-C.  Every stopped run keeps a valid partial
    ``log.json`` with its finished steps in ``--out``.
    """
    parser = build_parser()
    try:
        cfg = config_from_args(_parse(parser, argv))
    except ValueError as exc:
        # argparse's error(): usage + message on stderr, exit status 2, like a type error.
        parser.error(str(exc))
    done: list[int] = []
    try:
        log = train(cfg, on_step=lambda row: done.append(row["step"]))
    except KeyboardInterrupt:
        print(
            f"\njagg-demo: interrupted after {len(done)} of {cfg.steps} steps; the partial log "
            f"(status 'interrupted', every finished step) is in {cfg.out}/log.json"
            + (f"; continue with --resume-from latest --out {cfg.out}" if cfg.save_every else ""),
            file=sys.stderr,
        )
        return 130
    except (TrainingDivergedError, ValueError, ImportError) as exc:
        print(
            f"jagg-demo: {exc}\n(stopped after {len(done)} finished steps; log in "
            f"{cfg.out}/log.json)",
            file=sys.stderr,
        )
        return 1
    if os.environ.get("RANK", "0") == "0":  # several processes: rank 0 reports
        print(log["summary"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
