"""JAGG at its floor: the deferred backward, velocity reuse and adaptive placement, measured
against the loop users run (Flow-GRPO's per-step forward + backward).

    python -m benchmarks.floor            # about 15 min on 2 CPU cores
    python -m benchmarks.floor --quick    # about 3 min
    python -m benchmarks.floor --tiny     # seconds: the test configuration

Four studies, each a table in ``FLOOR.md`` and a section of ``floor.json`` (``--out``,
default ``benchmarks/results/floor``):

* time: the training phase of one trajectory (T = 10, W = 4: forward + backward) for the
  per-step loop, today's eager JAGG, deferred, values + deferred (uniform) and values +
  deferred + adaptive (budget 4), repetitions interleaved (a rotating order), medians, as
  ratios to the per-step loop measured in the same run.  Models: a diffusers
  SD3Transformer2DModel (4 layers, 4 heads x 32, 32x32x16 latents, 8 text tokens, B = 2)
  called through a plain closure with ``params=``, and the ``cpu`` benchmark preset.
* memory: peak live saved-for-backward bytes through forward AND backward
  (``jagg_autograd.memory.SavedTensorTracker``), relative to the per-step loop.
* fidelity: cosine to the exact gradient at equal anchor budget on the pretrained digits
  DiT with real SDE rollouts and GRPO upstream gradients, over Flow-GRPO's 9-step training
  prefix of a 10-step rollout and over all 10 steps: uniform anchors, adaptive placement,
  DanceGRPO-style per-sample random steps; plus a tiny random SD3 with LoRA.
* planner: the adaptive planner's time against the deferred backward's, T = 10 and 40.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/floor.py`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import machine_info
from benchmarks.fidelity import rollout, sde_rollout
from benchmarks.models import PRESETS, SD3Preset, build_sd3, rollout_inputs
from jagg_autograd import jagg_trajectory
from jagg_autograd.memory import SavedTensorTracker
from jagg_autograd.mix import jagg_mix_ref
from jagg_autograd.planner import make_plan

# The small model: overheads show on it.
FLOOR = SD3Preset("floor", 32, 16, 4, 4, 32, 8, 128, 64)
# Memory at 16x16x16 latents, 2 layers.
MEM = SD3Preset("mem16", 16, 16, 2, 4, 32, 8, 128, 64)

VARIANTS = ("per_step", "eager", "deferred", "values_deferred", "values_deferred_adaptive")

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny": {
        "time_presets": ["tiny"],
        "mem_presets": ["tiny"],
        "reps": 1,
        "T": 5,
        "W": 3,
        "budget": 3,
        "planner_T": [5],
        "fid": {"rollouts": 1, "B": 4, "budgets": [3], "draws": 2, "sd3": False},
    },
    "quick": {
        "time_presets": ["floor"],
        "mem_presets": ["mem16", "floor"],
        "reps": 5,
        "T": 10,
        "W": 4,
        "budget": 4,
        "planner_T": [10, 40],
        "fid": {"rollouts": 2, "B": 16, "budgets": [3, 4, 5], "draws": 8, "sd3": True},
    },
    # One GPU (benchmarks/gpu_check.sh): the SD3.5-medium-like bf16 preset, no fidelity.
    "gpu": {
        "time_presets": ["gpu"],
        "mem_presets": ["gpu"],
        "reps": 3,
        "T": 10,
        "W": 4,
        "budget": 4,
        "planner_T": [],
        "fid": None,
    },
    "full": {
        "time_presets": ["floor", "cpu"],
        "mem_presets": ["mem16", "floor", "cpu"],
        "reps": 7,
        "T": 10,
        "W": 4,
        "budget": 4,
        "planner_T": [10, 40],
        "fid": {"rollouts": 6, "B": 16, "budgets": [3, 4, 5], "draws": 16, "sd3": True},
    },
}


def _preset(name: str) -> SD3Preset:
    return {"floor": FLOOR, "mem16": MEM}.get(name) or PRESETS[name]


def _setup(name: str, T: int, B: int = 2, dev: torch.device | None = None) -> dict[str, Any]:
    preset = _preset(name)
    dev = dev or torch.device("cpu")
    model, cond = build_sd3(preset, B, dev)
    params = [p for p in model.parameters() if p.requires_grad]
    lat, ts, up = rollout_inputs(preset, T, B, dev)

    def closure(z: torch.Tensor, t: torch.Tensor, **c: torch.Tensor) -> torch.Tensor:
        return model(z, t, **c)

    with torch.no_grad():
        values = jagg_trajectory(model, lat, ts, window=2, cond=cond, batching="per_step")
    return {
        "preset": preset,
        "model": model,
        "closure": closure,
        "params": params,
        "cond": cond,
        "lat": lat,
        "ts": ts,
        "up": up,
        "values": values,
    }


def _variant(s: dict[str, Any], name: str, W: int, budget: float) -> Callable[[], Any]:
    """One training phase (forward + backward) of variant ``name``; returns its stats."""
    lat, ts, up, cond = s["lat"], s["ts"], s["up"], s["cond"]
    f, ps = s["closure"], s["params"]

    def per_step() -> None:
        B = lat.shape[1]
        for k in range(lat.shape[0]):
            v = f(lat[k], ts[k].expand(B), **cond)
            (v * up[k]).sum().backward()

    kw: dict[str, Any] = {"window": W, "cond": cond, "return_stats": True}
    extra = {
        "eager": {},
        "deferred": {"deferred": True, "params": ps},
        "values_deferred": {"deferred": True, "params": ps, "values": s["values"]},
        "values_deferred_adaptive": {
            "deferred": True,
            "params": ps,
            "values": s["values"],
            "placement": "adaptive",
            "budget": budget,
        },
    }

    def jagg() -> Any:
        v, st = jagg_trajectory(f if extra[name] else s["model"], lat, ts, **kw, **extra[name])
        (v * up).sum().backward()
        return st

    return per_step if name == "per_step" else jagg


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_study(
    name: str, T: int, W: int, budget: float, reps: int, dev: torch.device
) -> dict[str, Any]:
    s = _setup(name, T, dev=dev)
    runs = {v: _variant(s, v, W, budget) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    plan_s: list[float] = []
    for v in VARIANTS:  # warm-up
        runs[v]()
    for r in range(reps):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for v in order:
            for p in s["params"]:
                p.grad = None
            _sync(dev)
            t0 = time.perf_counter()
            st = runs[v]()
            _sync(dev)
            times[v].append(time.perf_counter() - t0)
            if v == "values_deferred_adaptive":
                plan_s.append(st.plan_seconds)
    med = {v: statistics.median(x) for v, x in times.items()}
    return {
        "preset": s["preset"].to_dict(),
        "T": T,
        "W": W,
        "budget": budget,
        "reps": reps,
        "median_s": med,
        "ratio_to_per_step": {v: med[v] / med["per_step"] for v in VARIANTS},
        "planner_s_median": statistics.median(plan_s),
    }


def memory_study(name: str, T: int, W: int, budget: float, dev: torch.device) -> dict[str, Any]:
    """Peak saved bytes (any device) and, on CUDA, the peak allocated memory above what the
    model, inputs and gradients hold before the phase starts."""
    s = _setup(name, T, dev=dev)
    peaks, cuda = {}, {}
    for v in VARIANTS:
        run = _variant(s, v, W, budget)
        run()  # gradients allocated once, so every variant starts from the same state
        tr = SavedTensorTracker(exclude=s["params"])
        if dev.type == "cuda":
            _sync(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        with tr:
            run()
        if dev.type == "cuda":
            _sync(dev)
            cuda[v] = torch.cuda.max_memory_allocated(dev) - base
        for p in s["params"]:
            p.grad = None
        peaks[v] = tr.peak
    out = {
        "preset": s["preset"].to_dict(),
        "T": T,
        "peak_bytes": peaks,
        "ratio_to_per_step": {v: peaks[v] / peaks["per_step"] for v in VARIANTS},
    }
    if cuda:
        out["cuda_peak_bytes"] = cuda
        out["cuda_ratio_to_per_step"] = {v: cuda[v] / cuda["per_step"] for v in VARIANTS}
    return out


def planner_study(T: int, budget: float, reps: int) -> dict[str, Any]:
    """Planner seconds vs the deferred adaptive backward on the FLOOR model, T steps."""
    s = _setup("floor", T) if T > 5 else _setup("tiny", T)
    budget = max(2.0, budget * T / 10)  # the same anchors per 10 steps at any T
    run = _variant(s, "values_deferred_adaptive", min(4, T), budget)
    bwd, plan = [], []
    for _ in range(max(1, reps // 2)):
        t0 = time.perf_counter()
        st = run()
        bwd.append(time.perf_counter() - t0)
        plan.append(st.plan_seconds)
        for p in s["params"]:
            p.grad = None
    b, p_ = statistics.median(bwd), statistics.median(plan)
    return {"T": T, "budget": budget, "step_s": b, "planner_s": p_, "fraction": p_ / b}


# ----------------------------------------------------------------------------- fidelity


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))


def _vjp(model: Any, params: list[torch.Tensor], lat, ts, cond, up) -> torch.Tensor:
    """sum_k J_k^T up_k, one step at a time (the per-step loop), flattened float64."""
    T, B = lat.shape[:2]
    acc = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    for k in range(T):
        if not bool(up[k].ne(0).any()):
            continue
        v = model(lat[k], ts[k].expand(B).float(), **cond)
        gs = torch.autograd.grad(v, params, up[k], allow_unused=True)
        for a, g in zip(acc, gs):
            if g is not None:
                a += g.double()
    return torch.cat([a.flatten() for a in acc])


def _mask_grad(model, params, lat, ts, cond, up, mask) -> torch.Tensor:
    """The JAGG gradient of an anchor mask: J^T of the composites at the anchor pairs.

    sum_r J_r^T G_r equals the exact VJP of an upstream that holds G_r at each anchor pair
    and zero elsewhere (the deferred path computes exactly this, chunk by chunk).
    """
    T, B = mask.shape
    t64 = ts.double().unsqueeze(1).expand(T, B)
    plan = make_plan(mask, t64)
    G = jagg_mix_ref(up.reshape(T, B, -1), plan.w_cur, plan.w_nxt, mask)
    g2 = torch.zeros_like(up).reshape(T, B, -1)
    g2[mask] = G
    return _vjp(model, params, lat, ts, cond, g2.view_as(up))


def _uniform_mask(T: int, B: int, n: int, first_last: tuple[int, int]) -> torch.Tensor:
    lo, hi = first_last
    steps = torch.linspace(lo, hi, n).round().long().unique()
    m = torch.zeros(T, B, dtype=torch.bool)
    m[steps] = True
    return m


def _adaptive_grad(model, params, lat, ts, cond, up, values, budget) -> torch.Tensor:
    for p in params:
        p.grad = None
    v = jagg_trajectory(
        model,
        lat,
        ts.float(),
        window=2,
        cond=cond,
        batched_cond=list(cond),
        values=values,
        deferred=True,
        placement="adaptive",
        budget=budget,
        params=params,
    )
    (v * up).sum().backward()
    out = torch.cat([p.grad.double().flatten() for p in params])
    for p in params:
        p.grad = None
    return out


def _fidelity_on(
    model: Any,
    params: list[torch.Tensor],
    ro: dict[str, torch.Tensor],
    cond: dict,
    budgets: list[int],
    draws: int,
    gen: torch.Generator,
    prefix: int,
) -> dict[str, float]:
    lat = ro["latents"][:prefix]
    ts = ro["sigmas"][:prefix]
    up = ro["grads"][:prefix]
    vals = ro["velocities"][:prefix]
    T, B = lat.shape[:2]
    exact = _vjp(model, params, lat, ts, cond, up)
    out: dict[str, float] = {}
    for b in budgets:
        out[f"uniform{b}"] = _cos(
            _mask_grad(model, params, lat, ts, cond, up, _uniform_mask(T, B, b, (0, T - 1))),
            exact,
        )
        out[f"adaptive{b}"] = _cos(_adaptive_grad(model, params, lat, ts, cond, up, vals, b), exact)
        cs = []
        for _ in range(draws):
            # DanceGRPO: every sample its own b random steps (rescaled: cosine ignores it).
            keep = torch.rand(T, B, generator=gen).argsort(0).argsort(0) < b
            g2 = up * keep.view(T, B, *([1] * (up.dim() - 2)))
            cs.append(_cos(_vjp(model, params, lat, ts, cond, g2), exact))
        out[f"subsample{b}"] = statistics.mean(cs)
    return out


def fidelity_study(rollouts: int, B: int, budgets: list[int], draws: int, sd3: bool) -> dict:
    from jagg_autograd.models import load_digits_dit

    torch.manual_seed(0)
    model = load_digits_dit()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(123)
    per: dict[str, dict[str, list[float]]] = {"prefix9": {}, "all10": {}}
    for r in range(rollouts):
        ro = rollout(model, 10, B, seed=100 + r)
        cond = {"labels": ro["labels"]}
        for key, prefix in (("prefix9", 9), ("all10", 10)):
            res = _fidelity_on(model, params, ro, cond, budgets, draws, gen, prefix)
            for k, v in res.items():
                per[key].setdefault(k, []).append(v)
    out: dict[str, Any] = {
        "digits": {key: {k: statistics.mean(v) for k, v in d.items()} for key, d in per.items()},
        "rollouts": rollouts,
        "B": B,
    }
    if sd3:
        out["sd3_lora"] = _sd3_lora_fidelity(budgets, gen)
    return out


def _sd3_lora_fidelity(budgets: list[int], gen: torch.Generator) -> dict[str, float]:
    """A tiny random SD3 with peft LoRA (adapters perturbed so they matter), Flow-GRPO-style
    SDE rollout with CFG off, GRPO upstream gradients, 9-step prefix of 10."""
    from jagg_autograd.integrations.diffusers import add_lora

    preset = PRESETS["tiny"]
    model, cond = build_sd3(preset, 4, torch.device("cpu"), seed=3)
    model.requires_grad_(False)
    params = add_lora(model.transformer, rank=4)
    with torch.no_grad():
        for p in params:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.eval()
    shape = (4, preset.channels, preset.latent, preset.latent)
    ro = sde_rollout(model, cond, shape, 10, torch.Generator().manual_seed(5))
    return _fidelity_on(model, params, ro, cond, budgets, 4, gen, 9)


# --------------------------------------------------------------------------------- report


def _md(res: dict[str, Any]) -> str:
    lines = ["## JAGG at its floor", "", f"`{res['command']}` on {res['machine']['platform']}", ""]
    lines += ["### Training phase time / Flow-GRPO per-step loop (medians, interleaved)", ""]
    lines += ["| model | " + " | ".join(VARIANTS) + " | planner s |", "|---" * 7 + "|"]
    for r in res["time"]:
        rat = r["ratio_to_per_step"]
        lines.append(
            f"| {r['preset']['name']} T={r['T']} W={r['W']} | "
            + " | ".join(f"{rat[v]:.3f}" for v in VARIANTS)
            + f" | {r['planner_s_median']:.4f} |"
        )
    lines += ["", "### Peak saved-for-backward bytes / per-step loop (fwd + bwd)", ""]
    lines += ["| model | " + " | ".join(VARIANTS) + " |", "|---" * 6 + "|"]
    for r in res["memory"]:
        rat = r["ratio_to_per_step"]
        lines.append(
            f"| {r['preset']['name']} T={r['T']} | "
            + " | ".join(f"{rat[v]:.2f}" for v in VARIANTS)
            + " |"
        )
    lines += ["", "### Planner time / deferred adaptive training phase", ""]
    lines += ["| T | budget | planner s | phase s | fraction |", "|---|---|---|---|---|"]
    for r in res["planner"]:
        lines.append(
            f"| {r['T']} | {r['budget']:.1f} | {r['planner_s']:.4f} | {r['step_s']:.3f} | "
            f"{r['fraction']:.2%} |"
        )
    for r in res["memory"]:
        if "cuda_ratio_to_per_step" in r:
            rat = r["cuda_ratio_to_per_step"]
            lines.append(
                f"CUDA peak memory / per-step loop, {r['preset']['name']}: "
                + ", ".join(f"{v} {rat[v]:.2f}" for v in VARIANTS)
            )
    if "fidelity" not in res:
        return "\n".join(lines) + "\n"
    fid = res["fidelity"]
    lines += [
        "",
        f"### Gradient cosine to exact (digits DiT, B={fid['B']}, {fid['rollouts']} rollouts)",
        "",
    ]
    budgets = sorted(
        {int(k[len("uniform") :]) for k in fid["digits"]["all10"] if k.startswith("uniform")}
    )
    lines += [
        "| steps | anchors/sample | uniform | adaptive | DanceGRPO subsample |",
        "|---|---|---|---|---|",
    ]
    for key, label in (("prefix9", "9-step prefix of 10"), ("all10", "all 10")):
        d = fid["digits"][key]
        for b in budgets:
            lines.append(
                f"| {label} | {b} | {d[f'uniform{b}']:.3f} | {d[f'adaptive{b}']:.3f} | "
                f"{d[f'subsample{b}']:.3f} |"
            )
    if "sd3_lora" in fid:
        d = fid["sd3_lora"]
        lines += ["", "Tiny random SD3 + LoRA, 9-step prefix of a 10-step SDE rollout:", ""]
        lines += ["| anchors/sample | uniform | adaptive | subsample |", "|---|---|---|---|"]
        for b in budgets:
            lines.append(
                f"| {b} | {d[f'uniform{b}']:.3f} | {d[f'adaptive{b}']:.3f} | "
                f"{d[f'subsample{b}']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="about 3 min (default: full)")
    mode.add_argument("--tiny", action="store_true", help="seconds: the test configuration")
    mode.add_argument("--gpu", action="store_true", help="the GPU preset on --device cuda")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    ap.add_argument("--out", default="benchmarks/results/floor", help="output folder")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    ap.add_argument("--no-progress", action="store_true", help="no progress lines")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    name = "tiny" if args.tiny else "quick" if args.quick else "gpu" if args.gpu else "full"
    cfg = CONFIGS[name]
    dev = torch.device(args.device)
    say = (lambda *a: None) if args.no_progress else (lambda *a: print(*a, flush=True))
    t_start = time.perf_counter()
    res: dict[str, Any] = {
        "command": "python -m benchmarks.floor" + ("" if name == "full" else f" --{name}"),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(dev),
    }
    T, W, budget = cfg["T"], cfg["W"], cfg["budget"]
    res["time"] = []
    for p in cfg["time_presets"]:
        say("time", p)
        res["time"].append(time_study(p, T, W, budget, cfg["reps"], dev))
    res["memory"] = []
    for p in cfg["mem_presets"]:
        say("memory", p)
        res["memory"].append(memory_study(p, T, W, budget, dev))
    res["planner"] = []
    for t in cfg["planner_T"]:
        say("planner", t)
        res["planner"].append(planner_study(t, budget, cfg["reps"]))
    if cfg["fid"] is not None:
        say("fidelity")
        res["fidelity"] = fidelity_study(**cfg["fid"])
    res["seconds"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.json").write_text(json.dumps(res, indent=1))
    (out / "FLOOR.md").write_text(_md(res))
    say((out / "FLOOR.md").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
