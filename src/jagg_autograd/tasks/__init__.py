"""Tasks of the GRPO trainer, by name: ``get_task("digits")``.

A task (:class:`GRPOTask`) bundles the velocity model, the prompts, the reward and the
held-out evaluation; the trainer knows nothing else about it.  Tasks are registered by
name with an import path, so that a task's code (and its weights) is imported only when
that task is asked for::

    register_task("shapes", "jagg_autograd.tasks.shapes:ShapesTask")

``get_task(name, **options)`` imports the factory (a class or a function) and calls it
with ``options``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

from jagg_autograd.tasks.base import GRPOTask

__all__ = ["GRPOTask", "get_task", "register_task", "task_factory", "task_names"]

_REGISTRY: dict[str, str | Callable[..., GRPOTask]] = {}


def register_task(name: str, factory: str | Callable[..., GRPOTask]) -> None:
    """Register ``factory`` (a callable, or ``"module.path:Attribute"`` imported lazily).

    Re-registering a name replaces the earlier entry (so a user can override a built-in).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if isinstance(factory, str):
        if ":" not in factory:
            raise ValueError(f"factory must be 'module.path:Attribute', got {factory!r}")
    elif not callable(factory):
        raise TypeError(f"factory must be callable or an import path, got {type(factory).__name__}")
    _REGISTRY[name] = factory


def task_names() -> list[str]:
    """The registered task names, sorted."""
    return sorted(_REGISTRY)


def task_factory(name: str) -> Callable[..., GRPOTask]:
    """The factory registered as ``name`` (imported on first use)."""
    if name not in _REGISTRY:
        raise ValueError(f"task must be one of {task_names()}, got {name!r}")
    factory = _REGISTRY[name]
    if isinstance(factory, str):
        module, attr = factory.split(":", 1)
        factory = getattr(importlib.import_module(module), attr)
        _REGISTRY[name] = factory
    return factory


def get_task(name: str, **options: Any) -> GRPOTask:
    """A new task ``name`` built with ``options`` (``ValueError`` naming ``task`` if unknown)."""
    factory = task_factory(name)
    if options:
        params = inspect.signature(factory).parameters
        accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [k for k in options if k not in params and not accepts_any]
        if unknown:
            raise ValueError(f"task {name!r} takes no option(s) {unknown}; it takes {list(params)}")
    task = factory(**options)
    if not isinstance(task, GRPOTask):
        raise TypeError(f"task {name!r} built a {type(task).__name__}, not a GRPOTask")
    return task


register_task("digits", "jagg_autograd.tasks.digits:DigitsTask")
register_task("shapes", "jagg_autograd.tasks.shapes:ShapesTask")
