"""Held-out evaluation and the gradient probe of :class:`~jagg_autograd.trainer.GRPOTrainer`.

Both run on their own fixed-seed generators (``eval_seed``), never on the training noise
stream, and outside the step's timings: a run with them trains exactly as one without.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from jagg_autograd.bias import adamw_precondition, bias_statistics
from jagg_autograd.data_parallel import SampleLayout, ShardedGenerator, all_gather_samples
from jagg_autograd.diagnostics import compare_grads
from jagg_autograd.estimators import ExactEstimator, Minibatch
from jagg_autograd.grid import grid_caption
from jagg_autograd.grpo import group_advantages
from jagg_autograd.tracking import eval_scalars

__all__ = ["MeasurementMixin"]


def _flat(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float64 CPU vector of a parameter gradient (None: zeros)."""
    return torch.cat([
        (torch.zeros(p.numel(), dtype=torch.float64) if g is None
         else g.detach().reshape(-1).to("cpu", torch.float64))
        for g, p in zip(grads, params)
    ])  # fmt: skip


def _bias_keys(
    X: torch.Tensor, Y: torch.Tensor, pre: torch.Tensor | None, suffix: str
) -> dict[str, float]:
    """The probe's log keys from :func:`bias_statistics` (``suffix``: the metric's)."""
    if not bool((Y - X).abs().amax() > 0):  # the exact estimator: no error, 0 / 0
        nan = float("nan")
        keys = ["systematic_share", "systematic_share_floor_sd", "bias_to_signal"]
        if not suffix:
            keys += ["expected_cosine", "signal_fraction", "signal_fraction_floor_sd",
                     "mean_cosine", "min_cosine"]
        out = {f"probe_{k}{suffix}": nan for k in keys}
        if not suffix:
            out.update(probe_expected_cosine=1.0, probe_mean_cosine=1.0, probe_min_cosine=1.0)
        return out
    rep = bias_statistics(X, Y, precondition=pre)
    out = {
        f"probe_systematic_share{suffix}": rep.systematic_share.value,
        f"probe_systematic_share_floor_sd{suffix}": rep.systematic_share_floor_sd,
        f"probe_bias_to_signal{suffix}": rep.bias_to_signal.value,
    }
    if not suffix:
        out.update(
            probe_expected_cosine=rep.expected_cosine.value,
            probe_signal_fraction=rep.signal_fraction.value,
            probe_signal_fraction_floor_sd=rep.signal_fraction_floor_sd,
            probe_mean_cosine=rep.mean_cosine.value,
            probe_min_cosine=rep.min_cosine,
        )
    return out


class MeasurementMixin:
    """The measurement half of :class:`~jagg_autograd.trainer.GRPOTrainer` (it reads the
    trainer's ``config``, ``task``, ``policy``, ``params``, ``estimator``, ``optimizer``,
    ``eval_seed``, ``step_index`` and its sampling helpers)."""

    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Held-out reward of the current policy on the fixed evaluation noise."""
        prompts = self.task.eval_prompts()
        g = torch.Generator().manual_seed(self.eval_seed)
        sde_steps = [] if self.config.eval_sampler == "ode" else None
        if self.world_size == 1:
            final = self._sample(prompts, g, sde_steps=sde_steps).latents[-1]
        else:  # sharded over the ranks (uneven allowed), gathered in the global order
            n = len(prompts)
            lay = SampleLayout(n, n, self.rank, self.world_size, even=False)
            traj = self._sample(lay.take(list(prompts)), ShardedGenerator(g, lay),
                                sde_steps=sde_steps)  # fmt: skip
            final = all_gather_samples(traj.latents[-1].contiguous(), lay)
        r = self.task.reward(final, prompts)
        if self.config.grid_samples:
            # Evenly spread over the evaluation set (tasks order it by category / label).
            k = min(self.config.grid_samples, len(prompts))
            idx = torch.linspace(0, len(prompts) - 1, k).round().long().tolist()
            pics = self.task.decode(final[idx].detach().cpu())
            if pics is not None:  # None: the task's latents are not pictures
                row = (pics, [grid_caption(prompts[i], float(r[i])) for i in idx], self.step_index)
                # grid.png shows the first evaluation and the latest: keep only those two.
                self._grid_rows = [*self._grid_rows[:1], row]
        return {
            "mean_reward": float(r.mean()),
            **self.task.eval_breakdown(final, prompts),
            "samples": len(prompts),
        }

    def _record_eval(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        counts = self.policy.forward_samples, self.policy.grad_samples
        raw: dict[str, Any] = {}
        if self.ema is not None:
            # The raw weights too (what the rollouts use), first: the grid keeps the EMA's.
            r = self.evaluate()
            raw = {f"raw_{k}": r[k] for k in ("mean_reward", "strict_accuracy") if k in r}
        # Flow-GRPO evaluates its EMA weights when train.ema is on (ema_decay > 0).
        ev = self.evaluate() if self.ema is None else self.ema.call(self.evaluate)
        ev.update(raw)
        self.policy.forward_samples, self.policy.grad_samples = counts
        ev.update(
            step=self.step_index,
            wall_seconds=self.rollout_seconds + self.train_seconds,
            train_seconds=self.train_seconds,
            sampler=self.config.eval_sampler,
            eval_seconds=time.perf_counter() - t0,
        )
        self.log["evals"].append(ev)
        self.tracker.log_scalars(self.step_index, {"eval": eval_scalars(ev)})
        return ev

    def probe_seed(self, batch: int) -> int:
        """Seed of the prompts and noise of probe batch ``batch`` at the current step: from
        ``eval_seed``, the step and the batch index only (batch 0 is the one-batch probe's
        seed), so every run with this ``eval_seed`` probes the same batches at a step."""
        return (self.eval_seed + 1) * 1_000_003 + self.step_index + batch * 100_000_007

    def _probe_batch(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Flattened exact and estimated gradients of probe batch ``batch``, and its
        cosine, relative error and routed fraction."""
        c = self.config
        g = torch.Generator().manual_seed(self.probe_seed(batch))
        prompts, groups = self._group(self.task.sample_prompts(c.prompts_per_step, g))
        traj = self._sample(prompts, g)
        adv = group_advantages(self.task.reward(traj.latents[-1], prompts), groups)
        mb = Minibatch(traj, adv, None)
        # The oracle is exact GRPO on the steps the run trains when they are a fixed prefix
        # (Flow-GRPO's timestep_fraction makes the prefix's loss the objective: against all
        # T, a 5-of-10-step run's estimator scored a cosine of 0.08 on shapes, its prefix
        # against the whole); random per-sample steps (DanceGRPO), subsample and MixGRPO
        # estimate the all-T gradient.
        ref_steps = None
        if c.timestep_selection == "prefix" and self.estimator.uses_timestep_fraction:
            ref_steps = self.estimator.train_steps(traj.batch_size, g)  # (0, T'): no draw
        ref = ExactEstimator(c).batched(self, mb, ref_steps)
        g_ref = torch.autograd.grad(ref.loss, self.params, allow_unused=True)
        mb.steps = self.estimator.train_steps(traj.batch_size, g)
        est = self.estimator.loss(self, mb, generator=g, on_policy=True)
        g_est = torch.autograd.grad(est.loss, self.params, allow_unused=True)
        cos, rel, _, _ = compare_grads(g_ref, g_est, self.params)
        figs = {"cos": cos, "rel": rel, "routed": est.routed_frac}
        return _flat(g_ref, self.params), _flat(g_est, self.params), figs

    def probe(self) -> dict[str, float]:
        """This run's gradient estimator against the exact GRPO gradient, now.

        On ``probe_batches`` fresh full-SDE batches of the current policy (prompts and noise
        from :meth:`probe_seed`: the same for every run with this ``eval_seed`` at this
        step, and never from the training generator): the exact gradient of the mean GRPO
        loss over all T steps (the batched oracle) against this run's estimator of it on
        the same batch (the routed/JAGG gradient, the subsampled one, or MixGRPO's window of
        this step).  With ``timestep_fraction < 1`` and prefix selection the oracle is
        exact GRPO over the trained prefix (the objective the run optimises).  Nothing is
        accumulated into ``.grad``; the timings and the training noise stream are untouched.

        Keys: ``probe_cosine`` / ``probe_rel_error`` (per-batch cosine / relative error,
        the MEAN over the batches: with one batch, that batch's, as before),
        ``probe_routed_frac``, ``probe_batches``, ``probe_seconds``; with
        ``probe_batches >= 3`` also :func:`~jagg_autograd.bias.bias_statistics`' figures
        ``probe_systematic_share`` (debiased ``||E err||^2 / E||err||^2``, floor 0),
        ``probe_systematic_share_floor_sd`` (its random floor's SD),
        ``probe_bias_to_signal`` (``||E err|| / ||E exact||``), ``probe_expected_cosine``
        (``cos(E est, E exact)``), ``probe_signal_fraction`` and
        ``probe_signal_fraction_floor_sd`` (its floor's SD: the ratios to the signal mean
        something only where it exceeds 2 of them), ``probe_mean_cosine`` (= the
        mean per-batch cosine), ``probe_min_cosine``; and, once AdamW has a state, the
        share and bias to signal in its metric (:func:`~jagg_autograd.bias.adamw_precondition`)
        as ``probe_systematic_share_adam`` / ``probe_bias_to_signal_adam``.  The exact
        estimator's error is 0: its bias figures are NaN (0 / 0), its share's floor too.
        """
        c = self.config
        t0 = time.perf_counter()
        counts = self.policy.forward_samples, self.policy.grad_samples
        xs, ys, figs = [], [], []
        for b in range(c.probe_batches):
            x, y, f = self._probe_batch(b)
            xs.append(x)
            ys.append(y)
            figs.append(f)
        self.policy.forward_samples, self.policy.grad_samples = counts
        X, Y = torch.stack(xs), torch.stack(ys)
        n = len(figs)
        out = {
            "probe_cosine": sum(f["cos"] for f in figs) / n,
            "probe_rel_error": sum(f["rel"] for f in figs) / n,
            "probe_routed_frac": sum(f["routed"] for f in figs) / n,
            "probe_batches": n,
        }
        if c.probe_batches >= 3:
            out.update(_bias_keys(X, Y, None, ""))
            pre = adamw_precondition(self.optimizer, self.params)
            if pre is not None:
                out.update(_bias_keys(X, Y, pre, "_adam"))
        out["probe_seconds"] = time.perf_counter() - t0
        return out
