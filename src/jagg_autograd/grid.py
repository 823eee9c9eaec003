"""Picture grids of a run: samples with their prompt and score, before and after training.

Model-agnostic: pictures come from :meth:`jagg_autograd.tasks.GRPOTask.decode` as
``(n, H, W, C)`` in ``[0, 1]`` and prompts are turned into captions with ``str``.  The
trainer writes ``grid.png`` with these (the first evaluation's samples on the top rows, the
last one's below, same prompts and noise).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["grid_caption", "save_grid"]


def grid_caption(prompt: Any, score: float | None = None) -> str:
    """A short grid caption: the prompt (``str``, without "a photo of") and, if given, its
    score."""
    text = str(prompt)
    text = text[len("a photo of ") :] if text.startswith("a photo of ") else text
    return text if score is None else f"{text}\nscore {score:.2f}"


def save_grid(
    path: str | Path,
    images: torch.Tensor,
    captions: Sequence[str],
    *,
    ncols: int | None = None,
    title: str | None = None,
) -> Path:
    """Save pictures with captions as one PNG.

    Args:
        path: the PNG to write (parent folders are created).
        images: ``(n, H, W, C)`` in ``[0, 1]`` (what :meth:`GRPOTask.decode` returns), C = 1
            or 3; values outside are clipped.
        captions: ``n`` strings (e.g. :func:`grid_caption` of prompt and score), drawn under
            each picture (long ones wrapped).
        ncols: pictures per row (default ``min(n, 8)``); e.g. put the "before" samples on
            the first rows and the same prompts' "after" samples on the next.
        title: optional figure title.

    Returns:
        The path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not isinstance(images, torch.Tensor) or images.ndim != 4 or images.shape[-1] not in (1, 3):
        raise ValueError("images must be a tensor of shape (n, H, W, C) with C in (1, 3)")
    n = images.shape[0]
    if isinstance(captions, str) or len(captions) != n:
        raise ValueError(f"captions must be a sequence of {n} strings (one per image)")
    if n == 0:
        raise ValueError("images must hold at least one picture")
    if ncols is None:
        ncols = min(n, 8)
    if isinstance(ncols, bool) or not isinstance(ncols, int) or ncols < 1:
        raise ValueError(f"ncols must be an int >= 1, got {ncols!r}")
    nrows = math.ceil(n / ncols)
    pics = images.detach().float().clamp(0, 1).cpu().numpy()
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(1.9 * ncols, 2.25 * nrows + (0.4 if title else 0)), squeeze=False
    )
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= n:
            continue
        pic = pics[i][..., 0] if pics.shape[-1] == 1 else pics[i]
        ax.imshow(
            pic,
            cmap="gray" if pics.shape[-1] == 1 else None,
            vmin=0,
            vmax=1,
            interpolation="nearest",
        )
        lines = [textwrap.fill(part, 22) for part in str(captions[i]).split("\n")]
        ax.set_title("\n".join(lines), fontsize=6.5)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
