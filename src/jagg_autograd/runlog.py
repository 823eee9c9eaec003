"""What a run keeps: the out folder, the atomic ``log.json``, the summary, the plots.

:class:`RunLog` owns the log dict of one :class:`~jagg_autograd.trainer.GRPOTrainer` run.
With ``out`` set, the folder is checked (and a previous run's pictures removed) before
anything is trained; ``log.json`` is written atomically (a temporary file and a rename)
after every step with a ``run_id``, ``started_at`` and ``status`` ("running", "finished",
"interrupted", "failed"), so Ctrl-C and errors leave a valid partial log with every
finished step.  :func:`summarize` is the one-paragraph summary the demo prints.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from jagg_autograd.estimators import ESTIMATORS, MinibatchResult
from jagg_autograd.grid import save_grid

__all__ = [
    "RunLog",
    "StepStats",
    "describe_method",
    "plot_rewards",
    "summarize",
    "write_json_atomic",
]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` through a temporary file and a rename (never half a file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


class RunLog:
    """The log of one run (``self.log``) and the files it writes to ``out`` (None: none)."""

    def __init__(self, task: str, config: dict[str, Any], out: str | None) -> None:
        self.out = Path(out) if out is not None else None
        self.run_id = uuid.uuid4().hex
        self.started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self._t_start = time.perf_counter()
        self.log: dict[str, Any] = {
            "run_id": self.run_id,
            "started_at": self.started_at,
            "status": "running",
            "task": task,
            "config": config,
            "steps": [],
            "evals": [],
            "eval": {},
            "rollout_seconds": 0.0,
            "train_seconds": 0.0,
            "total_seconds": 0.0,
            "summary": "",
            "out": str(self.out) if self.out is not None else None,
        }

    def prepare_out(self, keep: bool = False) -> None:
        """Check ``out`` before any model is built (a bad folder fails at once).

        ``keep``: a resumed run, whose folder's log and pictures stay until the
        checkpoint is loaded (the folder is only checked for writing)."""
        if self.out is None:
            return
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            for name in ("log.json", "reward.png", "grid.png"):
                if (self.out / name).is_dir():
                    raise OSError(f"{self.out / name} is a directory")
            if keep:
                probe = self.out / f".write-check.{os.getpid()}"
                probe.write_text("")
                probe.unlink()
                return
            for name in ("reward.png", "grid.png"):
                stale = self.out / name
                if stale.exists():
                    stale.unlink()  # a previous run's picture must not look like this run's
            self.write()
        except OSError as exc:
            raise ValueError(f"out={str(self.out)!r} is not a writable folder: {exc}") from exc

    def write(self) -> None:
        """``log.json`` now (atomically), with the total seconds so far."""
        if self.out is not None:
            self.log["total_seconds"] = time.perf_counter() - self._t_start
            write_json_atomic(self.out / "log.json", self.log)

    def resume_clock(self, total_seconds: float) -> None:
        """Continue ``total_seconds`` from a resumed run's."""
        self._t_start = time.perf_counter() - total_seconds

    def totals(self, rollout_seconds: float, train_seconds: float) -> None:
        self.log["rollout_seconds"] = rollout_seconds
        self.log["train_seconds"] = train_seconds
        self.log["total_seconds"] = time.perf_counter() - self._t_start

    def finish(self, status: str, error: BaseException | None = None) -> dict[str, Any]:
        """Close the log with ``status``: summary, ``log.json`` and (after a step) the plot."""
        log = self.log
        log["status"] = status
        if error is not None:
            log["error"] = f"{type(error).__name__}: {error}"
        log["summary"] = summarize(log)
        self.write()
        if self.out is not None and (status == "finished" or log["steps"]):
            plot_rewards(self.out / "reward.png", log)
        return log

    def save_grid(self, rows: list[tuple[torch.Tensor, list[str], int]], task_name: str) -> None:
        """``grid.png``: the first and the last evaluation's kept samples, one row each."""
        if len(rows) < 2 or self.out is None:
            return
        (a, ca, sa), (b, cb, sb) = rows[0], rows[-1]
        path = save_grid(
            self.out / "grid.png",
            torch.cat([a, b]),
            [f"step {sa}: {c}" for c in ca] + [f"step {sb}: {c}" for c in cb],
            ncols=a.shape[0],
            title=f"{task_name}: held-out samples before (top) and after "
            "(bottom) training, fixed noise",
        )
        self.log["grid"] = str(path)
        self.write()


class StepStats:
    """What one GRPO step's minibatches and optimizer steps add up to (its log row)."""

    KEYS = ("loss", "clipfrac", "approx_kl", "ratio_min", "ratio_max", "grad_norm", "kl")

    def __init__(self) -> None:
        self.acc: dict[str, list[float]] = {k: [] for k in self.KEYS}
        self.routed: list[float] = []
        self.paths: list[str] = []
        self.grad_calls = self.grad_samples = self.pairs = 0
        self.plan_seconds = 0.0  # adaptive placement's planning time (inside the backward)
        self.passes = 0  # loss.backward() calls (the step loops run one per trained step)
        self.optimizer_steps = 0
        self.phase = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}

    def add(self, res: MinibatchResult) -> None:
        """A minibatch's result, after its backward (deferred calls count their cost there)."""
        gs, calls = res.grad_cost()
        self.grad_samples += gs
        self.grad_calls += calls
        self.plan_seconds += res.plan_seconds
        self.pairs += res.pairs
        self.routed.append(res.routed_frac)
        self.paths.append(res.path)
        self.passes += calls if res.backward_done else 1
        acc, infos = self.acc, res.infos
        acc["loss"].append(float(res.loss.detach()))
        for k in ("clipfrac", "approx_kl"):
            acc[k].append(float(torch.stack([f[k] for f in infos]).mean()))
        acc["ratio_min"].append(float(torch.stack([f["ratio_min"] for f in infos]).min()))
        acc["ratio_max"].append(float(torch.stack([f["ratio_max"] for f in infos]).max()))
        if "kl" in infos[0]:
            acc["kl"].append(float(torch.stack([f["kl"] for f in infos]).mean()))

    def add_optimizer_step(self, grad_norm: torch.Tensor) -> None:
        self.optimizer_steps += 1
        self.acc["grad_norm"].append(float(grad_norm))

    def row(
        self,
        *,
        prompts: list[Any],
        rewards: torch.Tensor,
        forward_samples: int,
        rollout_seconds: float,
        train_seconds: float,
        reference_seconds: float,
    ) -> dict[str, Any]:
        """The step's log row: ``reward_mean``, ``reward_std``, ``loss``, ``clipfrac``,
        ``approx_kl``, ``ratio_min``/``ratio_max``, ``grad_norm``, ``routed_frac``
        (fraction of (window, sample) pairs given the exact gradient), ``anchor_frac``
        (trained (step, sample) pairs run with grad), ``forward_samples`` (model samples
        of the training phase), ``grad_samples`` (with grad), ``grad_forward_calls`` (=
        ``backward_calls``, the with-grad model calls), ``backward_passes``
        (``loss.backward()`` calls), ``optimizer_steps``, ``paths`` (per minibatch:
        "values+deferred", "deferred", "eager", "exact" or "nft"), the seconds of the
        rollout, the training and its phases (``reference``, ``plan``, ``forward``,
        ``backward``, ``optimizer``), and ``kl`` with a reference."""

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs)

        acc = self.acc
        row = {
            "prompts": list(prompts),
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "loss": mean(acc["loss"]),
            "clipfrac": mean(acc["clipfrac"]),
            "approx_kl": mean(acc["approx_kl"]),
            "ratio_min": min(acc["ratio_min"]),
            "ratio_max": max(acc["ratio_max"]),
            "grad_norm": mean(acc["grad_norm"]),
            "routed_frac": mean(self.routed),
            "anchor_frac": self.grad_samples / self.pairs,
            "forward_samples": forward_samples,
            "grad_samples": self.grad_samples,
            "grad_forward_calls": self.grad_calls,
            "backward_calls": self.grad_calls,
            "backward_passes": self.passes,
            "optimizer_steps": self.optimizer_steps,
            "paths": self.paths,
            "rollout_seconds": rollout_seconds,
            "train_seconds": train_seconds,
            "reference_seconds": reference_seconds,
            "plan_seconds": self.plan_seconds,
            **{f"{k}_seconds": v for k, v in self.phase.items()},
        }
        if acc["kl"]:
            row["kl"] = mean(acc["kl"])
        return row


def describe_method(cfg: dict[str, Any]) -> str:
    """The gradient settings that apply to a logged config's mode, in words (the
    estimator's :meth:`~jagg_autograd.estimators.Estimator.describe`)."""
    est = ESTIMATORS.get(cfg["mode"])
    return est.describe(cfg) if est is not None else str(cfg["mode"])


def plot_rewards(path: Path, log: dict[str, Any]) -> None:
    """``reward.png``: the rollout reward per step (mean, std, moving average) and the
    held-out evaluations before and after."""
    import matplotlib

    matplotlib.use("Agg")  # no display on CI machines
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log["steps"]]
    mean = [r["reward_mean"] for r in log["steps"]]
    std = [r["reward_std"] for r in log["steps"]]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    ax.fill_between(steps, lo, hi, alpha=0.2, label="rollout reward ± std")
    ax.plot(steps, mean, marker=".", label="rollout reward (mean)")
    k = max(1, len(mean) // 8)
    if len(mean) >= 2 * k and k > 1:
        smooth = [
            sum(mean[max(0, i - k + 1) : i + 1]) / len(mean[max(0, i - k + 1) : i + 1])
            for i in range(len(mean))
        ]
        ax.plot(steps, smooth, label=f"moving average ({k})")
    ev = log.get("eval") or {}
    if "initial" in ev and "final" in ev:
        ax.scatter(
            [0, steps[-1]],
            [ev["initial"]["mean_reward"], ev["final"]["mean_reward"]],
            color="black",
            zorder=3,
            label="held-out eval",
        )
    cfg = log["config"]
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward")
    ax.set_ylim(0.0, 1.0)
    status = "" if log.get("status") in (None, "finished") else f" [{log['status']}]"
    ax.set_title(f"GRPO on {cfg.get('task', 'digits')}: {describe_method(cfg)}{status}",
                 fontsize=9)  # fmt: skip
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _settings(cfg: dict[str, Any]) -> str:
    """The summary's head: task, method, batching, tuning, lr and what is not default."""
    opt = f"{cfg['tuning']} fine-tuning" + (
        f" (rank {cfg['lora_rank']})" if cfg["tuning"] == "lora" else ""
    )
    extra = []
    if cfg.get("lr_scheduler_type", "constant") != "constant" or cfg.get("warmup_steps", 0):
        extra.append(f"{cfg.get('lr_scheduler_type', 'constant')} lr schedule"
                     + (f", {cfg['warmup_steps']} warm-up steps" if cfg.get("warmup_steps")
                        else ""))  # fmt: skip
    if cfg.get("beta", 0.0) > 0:
        extra.append(f"KL beta {cfg['beta']:g}")
    if cfg.get("optimizer_steps_per_rollout", 1) > 1:
        extra.append(f"{cfg['optimizer_steps_per_rollout']} optimizer steps per rollout")
    if cfg.get("gradient_accumulation_steps", 1) > 1:
        extra.append(f"accumulation {cfg['gradient_accumulation_steps']}")
    if cfg.get("num_inner_epochs", 1) > 1:
        extra.append(f"{cfg['num_inner_epochs']} inner epochs")
    if cfg.get("precision", "fp32") != "fp32" or cfg.get("device", "cpu") != "cpu":
        extra.append(f"{cfg.get('precision')} on {cfg.get('device')}")
    return (
        f"GRPO on {cfg.get('task', 'digits')} ({describe_method(cfg)}, {cfg['batching']} "
        f"batching, {opt}, lr {cfg['lr']:g}{''.join(', ' + e for e in extra)})"
    )


def summarize(log: dict[str, Any]) -> str:
    """The one-paragraph summary the demo prints (only the settings that apply to the mode)."""
    cfg = log["config"]
    rows = log["steps"]
    n = len(rows)
    status = log.get("status", "finished")
    head = _settings(cfg)
    est = ESTIMATORS.get(cfg["mode"])
    sde = est.sampler_words if est is not None else "SDE"
    if n == 0:
        txt = f"{head}: {status} before the first step finished."
    else:
        k = max(1, min(5, n // 4))
        first = sum(r["reward_mean"] for r in rows[:k]) / k
        last = sum(r["reward_mean"] for r in rows[-k:]) / k
        done = "ran" if status == "finished" else f"{status} after"
        txt = (
            f"{head} {done} {n} steps of {cfg['prompts_per_step']}x{cfg['group_size']} "
            f"trajectories of {cfg['num_steps']} {sde} steps in {log['total_seconds']:.1f} s "
            f"(rollout {log['rollout_seconds']:.1f} s, training {log['train_seconds']:.1f} s). "
            f"Rollout reward: {first:.3f} (mean of the first {k} steps) -> {last:.3f} "
            f"(last {k}), change {last - first:+.3f}."
        )
    ev = log.get("eval") or {}
    if "initial" in ev and "final" in ev:
        a, b = ev["initial"]["mean_reward"], ev["final"]["mean_reward"]
        txt += (
            f" Held-out evaluation ({ev['initial']['samples']} samples, fixed noise): "
            f"{a:.3f} -> {b:.3f} ({b - a:+.3f})"
        )
        if "strict_accuracy" in ev["initial"] and "strict_accuracy" in ev["final"]:
            sa, sb = ev["initial"]["strict_accuracy"], ev["final"]["strict_accuracy"]
            txt += f", strict accuracy {sa:.3f} -> {sb:.3f} ({sb - sa:+.3f})"
        txt += "."
    if n:
        if est is not None:
            txt += est.summary_note(cfg, rows)
        txt += (
            f" Mean model samples with grad per step "
            f"{sum(r['grad_samples'] for r in rows) / n:.0f}."
        )
    for ev in log.get("guard", []):
        txt += (
            f" The runaway guard switched {ev['from']} to {ev['to']} after step {ev['step']} "
            f"(gradient norm {ev['ratio']:.2f}x its start)."
        )
    probes = [r["probe_cosine"] for r in rows if "probe_cosine" in r]
    if probes:
        txt += (
            f" Gradient cosine to exact over {len(probes)} probes: mean "
            f"{sum(probes) / len(probes):.3f}, min {min(probes):.3f}."
        )
    shares = [r["probe_systematic_share"] for r in rows
              if math.isfinite(r.get("probe_systematic_share", math.nan))]  # fmt: skip
    if shares:
        txt += (
            f" Systematic share of the gradient error (bias; 0 = unbiased): mean "
            f"{sum(shares) / len(shares):+.3f}, max {max(shares):+.3f}."
        )
    if log.get("error"):
        txt += f" Stopped by {log['error']}"
    if log.get("out"):
        txt += f" Log{' and plot' if n else ''} in {log['out']}."
    return txt
