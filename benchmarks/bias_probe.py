"""Bias of JAGG's folds and placements against the expected GRPO gradient (issue 18), probe level.

    python -m benchmarks.bias_probe [--train-steps 0 15] [--batches 24] [--out DIR]

Digits task at the study settings (8 prompts x 4, T = 10 SDE steps at eta = 0.7, the full
DiT, AdamW lr 1e-4, seed 0).  The policy is trained with exact GRPO for each of
``--train-steps`` (cumulative), then ``--batches`` fresh full-SDE batches are drawn from it
(same prompts and noise for every variant).  Per batch, with upstream gradients g = dL/dv
of the mean GRPO loss over all T steps at the rollout's velocities (ratio 1, as ``probe()``
takes them), under three advantage settings:

* ``grpo``: group-normalised advantages (what training uses);
* ``unit``: every A = 1 (the exact gradient is a score function, mean 0: any mean error
  is the estimator's own bias);
* ``raw``: A = the reward itself (no baseline: non-zero mean advantages),

the exact gradient sum_k J_k^T g_k and every estimator's gradient come from ONE with-grad
forward of all T x B pairs and one VJP each (the estimator's VJP puts the plan's folded
composites on its anchor pairs and 0 elsewhere: what the deferred backward computes; batch 0
checks that against ``jagg_trajectory`` itself). Estimators, all at 4 anchors per sample (40
% of exact's with-grad samples): placement uniform (steps 0, 3, 6, 9), for the causal fold
also causal-layout (causal_layout's 0, 3, 6, 8: what the trainer runs on a prefix of the
steps, compared here on the whole trajectory), adaptive-old (the former greedy split of the
budget, ``_greedy=True``), adaptive (the group-fair split; with a fractional budget also
adaptive-random: equal counts, the remainder to random samples); each with fold ``linear``,
``causal`` and the candidate ``centered`` (linear fold on A - mean(A), causal fold on
mean(A) h: needs the advantages, so not a library fold; equals linear for group-normalised A
and causal for unit A). Figures: :func:`jagg_autograd.bias_statistics`, plain and in the
metric of the trained AdamW state. Writes ``bias_probe.json`` and ``BIAS_PROBE.md`` to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from jagg_autograd import (
    bias_statistics,
    causal_layout,
    expected_anchor_count,
    jagg_trajectory,
    trajectory_layout,
)
from jagg_autograd.bias import adamw_precondition
from jagg_autograd.grpo import group_advantages, grpo_loss, sde_step_with_logprob
from jagg_autograd.mix import jagg_mix_slots_ref
from jagg_autograd.planner import adaptive_choice, make_plan, uniform_mask
from jagg_autograd.rollout import sample_trajectories
from jagg_autograd.trainer import GRPOConfig, GRPOTrainer

PLACEMENTS = ("uniform", "adaptive-old", "adaptive")
FOLDS = ("linear", "causal", "centered")
# The placements whose gradient batch 0 checks against jagg_trajectory itself.
CHECKED = ("uniform", "adaptive", "causal-layout")
ADVANTAGES = ("grpo", "unit", "raw")


def draw_batch(tr: GRPOTrainer, seed: int) -> dict[str, Any]:
    """A fresh full-SDE batch of the current policy and its rewards / group ids."""
    c = tr.config
    g = torch.Generator().manual_seed(seed)
    prompts = tr.task.sample_prompts(c.prompts_per_step, g)
    rep = [p for p in prompts for _ in range(c.group_size)]
    groups = torch.arange(len(prompts)).repeat_interleave(c.group_size)
    noise = torch.randn((len(rep), *tr.task.latent_shape), generator=g, dtype=torch.float32)
    with torch.no_grad():
        traj = sample_trajectories(
            tr.policy, noise, tr.sigmas, cond=tr.task.cond(rep),
            noise_level=c.noise_level, generator=g,
        )  # fmt: skip
        rewards = tr.task.reward(traj.latents[-1], rep).float()
    return {"traj": traj, "rewards": rewards, "groups": groups}


def upstream(traj: Any, adv: torch.Tensor, config: GRPOConfig) -> torch.Tensor:
    """g = dL/dv (T, B, *S) of the mean over steps of the clipped GRPO loss, at ratio 1."""
    T = traj.num_steps
    v = traj.velocities.detach().clone().requires_grad_(True)
    s = traj.sigmas.tolist()
    losses = []
    for k in range(T):
        _, lp, _, _ = sde_step_with_logprob(
            v[k], traj.latents[k], s[k], s[k + 1], noise_level=config.noise_level,
            sigma_max=s[1], prev_sample=traj.latents[k + 1],
        )  # fmt: skip
        loss, _ = grpo_loss(lp, traj.log_probs[k], adv, clip_range=config.clip_range,
                            adv_clip_max=config.adv_clip_max)  # fmt: skip
        losses.append(loss)
    (g,) = torch.autograd.grad(torch.stack(losses).mean(), v)
    return g


def _flat(gs: tuple[torch.Tensor | None, ...], params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(
        [(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(gs, params)]
    ).double()


def folded(plan: Any, g: torch.Tensor) -> torch.Tensor:
    """(T, B, N): the plan's composite on each anchor pair, 0 elsewhere."""
    T, B = plan.anchor_mask.shape
    g3 = g.reshape(T, B, -1)
    rows = jagg_mix_slots_ref(g3.double(), plan.w_cur, plan.w_nxt, plan.slots, plan.n_rows)
    out = torch.zeros_like(g3, dtype=torch.float64)
    on = plan.slots >= 0
    out[on] = rows[plan.slots[on]]
    return out.to(g.dtype).view_as(g)


def masks(
    traj: Any,
    g: torch.Tensor,
    t64: torch.Tensor,
    fold: str,
    budget: float,
    gen: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    T, B = t64.shape
    vals = traj.velocities
    mold = adaptive_choice(vals, g, t64, round(budget * B), fold=fold, _greedy=True).mask
    mnew = adaptive_choice(vals, g, t64, round(budget * B), fold=fold).mask
    # What jagg_trajectory(window=4) runs: the window layout (0, 3, 6, 9 for T = 10).
    anchors, windows = trajectory_layout(T, 4, True)
    uni = uniform_mask(T, B, anchors, windows, None, t64.device)
    out = {"uniform": uni, "adaptive-old": mold, "adaptive": mnew}
    if fold == "causal":
        # The same count placed by causal_layout (0, 3, 6, 8): what the trainer passes as
        # anchors= on a prefix of the steps; here, on the whole trajectory, for comparison.
        ca, cw = causal_layout(T, len(anchors))
        out["causal-layout"] = uniform_mask(T, B, ca, cw, None, t64.device)
    level, rem = divmod(round(budget * B), B)
    if rem and gen is not None:
        # Equal counts, the remainder to random samples: each sample's optimal set for
        # level or level + 1 anchors (the DP's sets are per sample, so this is exact).
        lo = adaptive_choice(vals, g, t64, level * B, fold=fold).mask
        hi = adaptive_choice(vals, g, t64, (level + 1) * B, fold=fold).mask
        pick = torch.zeros(B, dtype=torch.bool)
        pick[torch.randperm(B, generator=gen)[:rem]] = True
        out["adaptive-random"] = torch.where(pick[None, :], hi, lo)
    return out


def probe(tr: GRPOTrainer, n_batches: int, seed0: int, budget: float) -> dict[str, Any]:
    c = tr.config
    params = tr.params
    T = c.num_steps
    X: dict[str, list[torch.Tensor]] = {a: [] for a in ADVANTAGES}
    Y: dict[tuple[str, str, str], list[torch.Tensor]] = {}
    counts_corr: dict[str, list[float]] = {p: [] for p in (*PLACEMENTS, "adaptive-random")}
    checked = False
    for i in range(n_batches):
        b = draw_batch(tr, seed0 + i)
        traj = b["traj"]
        B = traj.batch_size
        t64 = traj.sigmas[:T].to(torch.float64)[:, None].expand(T, B).contiguous()
        cond = {k: v.repeat(T, *([1] * (v.dim() - 1))) for k, v in traj.cond.items()}
        z = traj.latents[:T].flatten(0, 1)
        tt = traj.sigmas[:T].to(z.dtype).repeat_interleave(B)
        with torch.enable_grad():
            v_all = tr.policy(z, tt, **cond)
        dv = float((v_all.detach() - traj.velocities.flatten(0, 1)).abs().max())
        assert dv < 1e-4, f"recomputed velocities differ from the rollout's by {dv}"
        A = {
            "grpo": group_advantages(b["rewards"], b["groups"]),
            "unit": torch.ones(B),
            "raw": b["rewards"].clone(),
        }
        h = upstream(traj, torch.ones(B), c)  # unit advantages: g = A_b * h_b at ratio 1
        for a_name, adv in A.items():
            g = upstream(traj, adv, c)
            x = _flat(torch.autograd.grad(v_all, params, g.flatten(0, 1), retain_graph=True),
                      params)  # fmt: skip
            X[a_name].append(x.float())
            a_clip = adv.clamp(-c.adv_clip_max, c.adv_clip_max)
            a_bar = float(a_clip.mean())
            for fold in ("linear", "causal"):
                rgen = torch.Generator().manual_seed(seed0 + 7919 * i)  # same draw per fold
                for pl, m in masks(traj, g, t64, fold, budget, rgen).items():
                    if a_name == "grpo" and fold == "linear":
                        n_b = m.sum(0).float()
                        rk = lambda u: u.argsort().argsort().float()  # noqa: E731
                        ra, rn = rk(adv.abs()), rk(n_b)
                        rho = float(torch.corrcoef(torch.stack([ra, rn]))[0, 1])
                        counts_corr[pl].append(rho if n_b.std() > 0 else 0.0)
                    plan = make_plan(m, t64, fold=fold)
                    G = folded(plan, g)
                    if fold == "linear":
                        # candidate "centered": linear fold on (A - mean A) h, causal on mean(A) h
                        plan_c = make_plan(m, t64, fold="causal")
                        Gc = folded(plan, g - a_bar * h) + folded(plan_c, a_bar * h)
                        yc = torch.autograd.grad(v_all, params, Gc.flatten(0, 1).to(v_all.dtype),
                                                 retain_graph=True)  # fmt: skip
                        Y.setdefault((a_name, pl, "centered"), []).append(
                            _flat(yc, params).float()
                        )
                    y = torch.autograd.grad(v_all, params, G.flatten(0, 1).to(v_all.dtype),
                                            retain_graph=True)  # fmt: skip
                    Y.setdefault((a_name, pl, fold), []).append(_flat(y, params).float())
                    if not checked and pl in CHECKED and a_name == "grpo":
                        _check_library(tr, traj, g, pl, fold, budget, _flat(y, params))
            checked = True
        del v_all
    pre = adamw_precondition(tr.optimizer, params)
    B = c.prompts_per_step * c.group_size
    rows = []
    for (a_name, pl, fold), ys in sorted(Y.items()):
        xs = torch.stack(X[a_name])
        ys_ = torch.stack(ys)
        est = 4 * B if pl in ("uniform", "causal-layout") else round(budget * B)
        rep = bias_statistics(xs, ys_, grad_samples={"exact": T * B, "estimate": est})
        row = {"advantages": a_name, "placement": pl, "fold": fold, **_figures(rep)}
        if pre is not None:
            rp = bias_statistics(xs, ys_, precondition=pre.float())
            row["adamw"] = _figures(rp)
        rows.append(row)
    return {
        "rows": rows,
        "spearman_counts_abs_adv": {k: sum(v) / max(len(v), 1) for k, v in counts_corr.items()},
    }


def _check_library(
    tr: GRPOTrainer, traj: Any, g: torch.Tensor, pl: str, fold: str, budget: float,
    y: torch.Tensor,
) -> None:  # fmt: skip
    """Batch 0: the VJP above equals jagg_trajectory's own gradient (values + deferred)."""
    T = traj.num_steps
    kw: dict[str, Any] = {"fold": fold}
    if pl == "adaptive":
        kw.update(placement="adaptive", budget=budget)
    if pl == "causal-layout":
        kw["anchors"] = causal_layout(T, expected_anchor_count(T, 4))[0]
    with torch.enable_grad():
        v = jagg_trajectory(
            tr.policy, traj.latents[:T], traj.sigmas[:T], window=4,
            cond=traj.cond, values=traj.velocities, deferred=True, params=tr.params, **kw,
        )  # fmt: skip
        ref = _flat(torch.autograd.grad(v, tr.params, g.to(v.dtype)), tr.params)
    cos = float(ref @ y / (ref.norm() * y.norm()))
    assert cos > 1 - 1e-6, f"library check {pl}/{fold}: cosine {cos}"


def _figures(rep: Any) -> dict[str, Any]:
    return {
        "systematic_share": rep.systematic_share.value,
        "systematic_share_ci": [rep.systematic_share.lo, rep.systematic_share.hi],
        "floor_sd": rep.systematic_share_floor_sd,
        "bias_to_signal": rep.bias_to_signal.value,
        "bias_to_signal_ci": [rep.bias_to_signal.lo, rep.bias_to_signal.hi],
        "expected_cosine": rep.expected_cosine.value,
        "expected_cosine_ci": [rep.expected_cosine.lo, rep.expected_cosine.hi],
        "signal_fraction": rep.signal_fraction.value,
        "bias_to_rms": rep.bias_to_rms.value,
        "mean_cosine": rep.mean_cosine.value,
        "mean_cosine_se": rep.mean_cosine.se,
        "min_cosine": rep.min_cosine,
        "grad_samples": rep.grad_samples,
    }


def _table(res: dict[str, Any]) -> list[str]:
    out = []
    for stage in res["stages"]:
        out.append(f"\n### after {stage['trained_steps']} exact GRPO steps "
                   f"({stage['batches']} batches, {stage['seconds']:.0f} s)\n")  # fmt: skip
        sp = stage["spearman_counts_abs_adv"]
        out.append("Spearman(anchor count, |A|), grpo advantages, mean over batches: "
                   + ", ".join(f"{k} {v:+.2f}" for k, v in sp.items()) + "\n")  # fmt: skip
        has_pre = any("adamw" in r for r in stage["rows"])
        head = ("| advantages | placement | fold | systematic share (floor SD) | bias/signal "
                "[95 % hi] | bias/RMS | cos(E est, E exact) [95 % lo] | per-batch cosine "
                "(min) |")  # fmt: skip
        if has_pre:
            head += " AdamW metric: share / bias/signal / cos(E, E) |"
        out.append(head)
        out.append("|" + "---|" * (head.count("|") - 1))
        for r in stage["rows"]:
            line = (
                f"| {r['advantages']} | {r['placement']} | {r['fold']} | "
                f"{r['systematic_share']:+.4f} ({r['floor_sd']:.4f}) | "
                f"{r['bias_to_signal']:.3f} [{r['bias_to_signal_ci'][1]:.2f}] | "
                f"{r['bias_to_rms']:.3f} | "
                f"{r['expected_cosine']:+.3f} [{r['expected_cosine_ci'][0]:+.2f}] | "
                f"{r['mean_cosine']:.4f} ({r['min_cosine']:.3f}) |"
            )
            if "adamw" in r:
                p = r["adamw"]
                line += (f" {p['systematic_share']:+.4f} / {p['bias_to_signal']:.3f} / "
                         f"{p['expected_cosine']:+.3f} |")  # fmt: skip
            out.append(line)
        fr = {r["advantages"]: r["signal_fraction"] for r in stage["rows"]}
        out.append("\nsignal fraction ||E g||^2 / E||g||^2 of the exact gradient: "
                   + ", ".join(f"{k} {v:.4f}" for k, v in fr.items()))  # fmt: skip
    return out


def render(res: dict[str, Any]) -> str:
    """BIAS_PROBE.md from the results (``--render bias_probe.json`` redraws it)."""
    md = ["# Bias probe (issue 18)", "", f"`{res['command'].strip()}` on {res['machine']}, "
          f"torch {res['torch']}; settings {res['settings']}.", "",
          "Figures: `jagg_autograd.bias_statistics` (systematic share debiased for n: 0 at "
          "the noise floor; its floor SD in brackets; bias/signal and cos(E est, E exact) "
          "with debiased norms, NaN where the exact mean is not detectable, e.g. unit "
          "advantages; 0.000 / +1.000 where the bias is not detectable). Every estimator "
          "runs 4 anchors per sample (40 % of exact's with-grad samples) unless the budget "
          "says otherwise (uniform stays at 4).", *_table(res)]  # fmt: skip
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--render", default=None, help="redraw BIAS_PROBE.md from this json")
    ap.add_argument("--no-progress", action="store_true", help="(no progress bar is shown)")
    ap.add_argument("--train-steps", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--budget", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/bias_probe")
    args = ap.parse_args(argv)
    if args.render:
        res = json.loads(Path(args.render).read_text())
        (Path(args.render).parent / "BIAS_PROBE.md").write_text(render(res))
        return res
    torch.set_num_threads(1)
    cfg = GRPOConfig(mode="exact", steps=max(1, *args.train_steps), eval_per_digit=0,
                     grid_samples=0, progress=False, seed=args.seed)  # fmt: skip
    tr = GRPOTrainer(cfg)
    res: dict[str, Any] = {
        "command": "python -m benchmarks.bias_probe " + " ".join(argv or sys.argv[1:]),
        "machine": platform.platform(),
        "torch": torch.__version__,
        "settings": {"task": "digits", "prompts": cfg.prompts_per_step, "group": cfg.group_size,
                     "T": cfg.num_steps, "eta": cfg.noise_level, "lr": cfg.lr,
                     "budget": args.budget, "seed": args.seed},
        "stages": [],
    }
    done = 0
    for s in sorted(args.train_steps):
        while done < s:
            tr.step()
            done += 1
        t0 = time.perf_counter()
        st = probe(tr, args.batches, seed0=10_000 * (s + 1), budget=args.budget)
        st.update(trained_steps=s, batches=args.batches, seconds=time.perf_counter() - t0)
        res["stages"].append(st)
        print(f"stage {s}: {st['seconds']:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bias_probe.json").write_text(json.dumps(res, indent=1))
    md = render(res)
    (out / "BIAS_PROBE.md").write_text(md)
    print(md)
    return res


if __name__ == "__main__":
    main()
