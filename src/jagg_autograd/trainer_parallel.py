"""What :class:`~jagg_autograd.trainer.GRPOTrainer` needs on several processes.

Several processes (``torchrun`` / ``accelerate launch``): each rank runs this trainer on
its rows of every minibatch (:class:`~jagg_autograd.data_parallel.SampleLayout`), drawing
them from the one generator (:class:`~jagg_autograd.data_parallel.ShardedGenerator`);
rewards are all-gathered before the group statistics, gradients averaged once per
optimizer step, the evaluation sharded and gathered, log rows reduced; rank 0 writes.
"""

from __future__ import annotations

from typing import Any

from jagg_autograd.config import GRPOConfig
from jagg_autograd.data_parallel import SampleLayout, reduce_scalars

__all__ = ["check_world_size", "dist_device", "reduce_row"]

#: How a log row's numbers combine over the ranks (the rest are equal on every rank:
#: rewards and advantages are global, the gradient norm is the averaged gradient's).
ROW_MEAN = ("loss", "clipfrac", "approx_kl", "kl", "routed_frac", "anchor_frac")
ROW_SUM = ("forward_samples", "grad_samples")
ROW_MIN = ("ratio_min",)


def dist_device(device: str) -> str | None:
    """The device to join the process group with: CPU, or each rank's own GPU for
    ``device="cuda"`` (None: ``cuda:LOCAL_RANK``)."""
    return None if device == "cuda" else device


def check_world_size(config: GRPOConfig, world: int) -> None:
    """Refuse what cannot give the single-process run with ``world`` processes."""
    if world == 1:
        return
    if config.mode == "jagg" and config.placement != "uniform":
        raise ValueError(
            f"placement={config.placement!r} with {world} processes: the anchor budget is "
            "placed over the batch each process sees, so the run would depend on the number "
            "of processes; use placement='uniform' (the default) or one process"
        )
    if config.mode == "router" and config.jagg_frac is not None:
        raise ValueError(
            f"jagg_frac={config.jagg_frac} with {world} processes: the router ranks samples "
            "within the batch each process sees, so the run would depend on the number of "
            "processes; use --jagg-frac none (threshold only) or one process"
        )
    # The minibatch split (SampleLayout) is checked when the trainer is built.
    size = config.prompts_per_step * config.group_size // config.num_minibatches
    SampleLayout(config.prompts_per_step * config.group_size, size, 0, world)


def reduce_row(row: dict[str, Any]) -> dict[str, Any]:
    """A rank's log row combined over the ranks: means of the per-rank means (equal
    shares), sums of the sample counts, min / max of the ratios, max of the call counts
    and of the seconds (the slowest rank's)."""
    row = dict(row)
    groups = {
        "mean": [k for k in ROW_MEAN if k in row],
        "sum": [k for k in ROW_SUM if k in row],
        "min": [k for k in ROW_MIN if k in row],
        "max": ["ratio_max", "grad_forward_calls", "backward_calls", "backward_passes",
                *[k for k in row if k.endswith("_seconds")]],
    }  # fmt: skip
    for op, keys in groups.items():
        got = reduce_scalars({k: row[k] for k in keys if k in row}, op)
        for k, v in got.items():
            row[k] = type(row[k])(v) if isinstance(row[k], int) else v
    return row
