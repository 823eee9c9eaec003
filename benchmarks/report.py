"""Markdown table and PNG plots from a results dict (see :mod:`benchmarks.run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from benchmarks.timing import floors

TARGETS = {
    "bwd JAGG / exact per-step (W=4)": 0.55,
    "bwd JAGG / exact batched (W=4)": 0.58,
    "step JAGG / exact per-step (W=4)": 0.72,
    "bwd shared anchors / exact per-step (T=10, W=4)": 0.45,
    "saved bytes JAGG / exact batched (W=4)": 2 / 4 + 0.05,
    "kernels / JAGG bwd (W=4)": 0.03,
}


def ratios(rec: dict[str, Any], base: str = "exact_per_step") -> dict[str, dict[str, float]]:
    """Time ratios (fwd, bwd, step) of every variant to ``base``."""
    b = rec["times"][base]
    return {
        name: {k: t[k] / b[k] if b[k] > 0 else float("nan") for k in ("fwd", "bwd", "step")}
        for name, t in rec["times"].items()
    }


def target_rows(res: dict[str, Any]) -> list[tuple[str, float, float | None, float | None]]:
    """(target, limit, measured, floor) for every target that the run has the data for."""
    rows: list[tuple[str, float, float | None, float | None]] = []
    win = {r["W"]: r for r in res["timing"] if r["kind"] == "window"}
    traj = {(r["T"], r["W"]): r for r in res["timing"] if r["kind"] == "trajectory"}
    w4 = win.get(4)
    meas: dict[str, tuple[float | None, float | None]] = {}
    if w4:
        t = w4["times"]
        meas["bwd JAGG / exact per-step (W=4)"] = (
            t["jagg"]["bwd"] / t["exact_per_step"]["bwd"],
            0.5,
        )
        meas["bwd JAGG / exact batched (W=4)"] = (t["jagg"]["bwd"] / t["exact_batched"]["bwd"], 0.5)
        meas["step JAGG / exact per-step (W=4)"] = (
            t["jagg"]["step"] / t["exact_per_step"]["step"],
            (4 + 4) / (3 * 4),
        )
        m = w4["memory"]
        meas["saved bytes JAGG / exact batched (W=4)"] = (
            m["jagg"]["saved_bytes"] / m["exact_batched"]["saved_bytes"],
            0.5,
        )
    t10 = traj.get((10, 4))
    if t10:
        t = t10["times"]
        meas["bwd shared anchors / exact per-step (T=10, W=4)"] = (
            t["jagg_shared"]["bwd"] / t["exact_per_step"]["bwd"],
            floors("trajectory", 10, 4)["jagg_shared"],
        )
    k = res.get("kernels", {}).get("W4")
    if k:
        meas["kernels / JAGG bwd (W=4)"] = (k["frac_of_jagg_bwd"], 0.0)
    for name, lim in TARGETS.items():
        got, fl = meas.get(name, (None, None))
        rows.append((name, lim, got, fl))
    return rows


def _f(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def markdown(res: dict[str, Any]) -> str:
    """The results section as markdown."""
    mi = res["machine"]
    lines = [
        "## Results",
        "",
        f"Command: `{res['command']}` · {res['date']} · wall {res['wall_s']:.0f} s",
        "",
        f"Machine: {mi['platform']}, {mi['cpu_count']} CPUs ({mi['torch_threads']} torch "
        f"threads), device {mi['device']}{' ' + mi['gpu'] if 'gpu' in mi else ''}; torch "
        f"{mi['torch']}, triton {mi['triton']}, diffusers {mi['diffusers']}; commit "
        f"`{mi['git_commit']}`.",
        "",
        f"Timing model: diffusers SD3Transformer2DModel preset `{res['preset']['name']}` "
        f"(latent {res['preset']['latent']}x{res['preset']['latent']}x"
        f"{res['preset']['channels']}, {res['preset']['num_layers']} layers, "
        f"{res['preset']['heads']}x{res['preset']['head_dim']} heads, "
        f"{res['preset']['dtype']}), B = {res['batch']}, median of {res['reps']} interleaved "
        f"repetitions after {res['warmup']} warm-up.",
        "",
        "### Targets (W = 4)",
        "",
        "| target | limit | measured | floor | met |",
        "|---|---|---|---|---|",
    ]
    for name, lim, got, fl in target_rows(res):
        met = "n/a" if got is None else ("yes" if got <= lim else "**no**")
        lines.append(f"| {name} | {lim:.3f} | {_f(got)} | {_f(fl)} | {met} |")
    lines += [
        "",
        "### Time ratios to exact per-step (fwd / bwd / whole step)",
        "",
        "| case | floor (bwd) | exact batched | JAGG | JAGG shared | JAGG+router | "
        "subsample | per-step step time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rec in res["timing"]:
        r = ratios(rec)
        fl = floors(rec["kind"], rec["T"], rec["W"])
        case = (
            f"window W={rec['W']}"
            if rec["kind"] == "window"
            else (f"traj T={rec['T']} W={rec['W']}")
        )
        cells = []
        for v in ("exact_batched", "jagg", "jagg_shared", "jagg_router", "subsample"):
            if v in r:
                x = r[v]
                cells.append(f"{x['fwd']:.2f} / {x['bwd']:.2f} / {x['step']:.2f}")
            else:
                cells.append("–")
        flc = " · ".join(f"{k} {v:.2f}" for k, v in fl.items())
        step = rec["times"]["exact_per_step"]["step"]
        lines.append(f"| {case} | {flc} | " + " | ".join(cells) + f" | {step:.3f} |")
    lines += [
        "",
        "### Bytes saved for backward (parameters excluded), ratio to exact batched",
        "",
        "| case | exact batched (MiB) | per-step (1 step, MiB) | JAGG | JAGG shared | "
        "JAGG+router | subsample |",
        "|---|---|---|---|---|---|---|",
    ]
    for rec in res["timing"]:
        m = rec["memory"]
        base = m["exact_batched"]["saved_bytes"]
        case = (
            f"window W={rec['W']}"
            if rec["kind"] == "window"
            else (f"traj T={rec['T']} W={rec['W']}")
        )
        cells = [
            f"{m[v]['saved_bytes'] / base:.3f}" if v in m else "–"
            for v in ("jagg", "jagg_shared", "jagg_router", "subsample")
        ]
        lines.append(
            f"| {case} | {base / 2**20:.1f} | {m['exact_per_step']['saved_bytes'] / 2**20:.1f} | "
            + " | ".join(cells)
            + " |"
        )
    if res.get("kernels"):
        lines += [
            "",
            "### Kernel overhead (mixing + routing, backend "
            f"{next(iter(res['kernels'].values()))['backend']})",
            "",
            "| case | mix (ms) | route (ms) | fraction of JAGG bwd | mix GB/s | route GB/s |",
            "|---|---|---|---|---|---|",
        ]
        for key, k in res["kernels"].items():
            lines.append(
                f"| {key} | {k['mix_s'] * 1e3:.3f} | {k['route_s'] * 1e3:.3f} | "
                f"{k['frac_of_jagg_bwd']:.4f} | {k['mix_GBps']:.1f} | {k['route_GBps']:.1f} |"
            )
        if mi["device"] == "cpu":
            lines += [
                "",
                "On CPU the library runs the torch reference of both ops (backend 'auto'); "
                "the Triton kernels are measured by `benchmarks/gpu_check.sh` on CUDA.",
            ]
    fid = res.get("fidelity")
    if fid:
        lines += [
            "",
            f"### Gradient fidelity (digits DiT, T = {fid['T']}, B = {fid['batch']}, "
            f"{fid['rollouts']} SDE rollouts, {fid['draws']} subsample draws each)",
            "",
            "Cosine to the exact gradient, mean ± std (relative error in brackets); "
            "subsampling at the same backward budget (2 steps per window; the anchor count "
            "per trajectory).",
            "",
            "| W | window JAGG | window JAGG+router (exact frac) | window subsample | "
            "window MixGRPO | traj JAGG | traj shared | traj shared+router | traj subsample "
            "| traj MixGRPO |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        R = fid["results"]

        def cell(key: str, frac: bool = False) -> str:
            if key not in R:
                return "–"
            c, e = R[key]["cos"], R[key]["rel"]
            s = f"{c['mean']:.3f} ± {c['std']:.3f} ({e['mean']:.2f})"
            if frac and "exact_frac" in R[key]:
                s += f" [{R[key]['exact_frac']['mean']:.2f}]"
            return s

        for W in fid["windows"]:
            row = [
                cell(f"window/W{W}/jagg"),
                cell(f"window/W{W}/jagg_router", True),
                cell(f"window/W{W}/subsample"),
                cell(f"window/W{W}/mixgrpo"),
                cell(f"traj/W{W}/jagg"),
                cell(f"traj/W{W}/jagg_shared"),
                cell(f"traj/W{W}/jagg_router", True),
                cell(f"traj/W{W}/subsample"),
                cell(f"traj/W{W}/mixgrpo"),
            ]
            lines.append(f"| {W} | " + " | ".join(row) + " |")
        lines += ["", "Per window position (cosine of window JAGG / subsample):", ""]
        for W in fid["windows"]:
            pos = sorted({int(k.split("/")[2][3:]) for k in R if k.startswith(f"window/W{W}/pos")})
            parts = [
                f"s={p}: {R[f'window/W{W}/pos{p}/jagg']['cos']['mean']:.3f} / "
                f"{R[f'window/W{W}/pos{p}/subsample']['cos']['mean']:.3f}"
                for p in pos
            ]
            lines.append(f"- W={W}: " + "; ".join(parts))
    lines += ["", "Plots: " + ", ".join(f"![{p}]({p})" for p in res.get("plots", [])), ""]
    return "\n".join(lines)


def _style_axes(ax: Any, ylabel: str, title: str) -> None:
    """The look every W-sweep plot shares."""
    ax.set_xlabel("window W")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


def _save(fig: Any, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def plots(res: dict[str, Any], out: Path) -> list[str]:
    """Write the three PNGs into ``out``; return their file names."""
    names = []
    win = sorted((r for r in res["timing"] if r["kind"] == "window"), key=lambda r: r["W"])
    if win:
        Ws = [r["W"] for r in win]
        fig, ax = plt.subplots(figsize=(6, 4))
        for v, st in (
            ("exact_batched", "s-"),
            ("jagg", "o-"),
            ("jagg_router", "^-"),
            ("subsample", "x--"),
        ):
            ax.plot(Ws, [ratios(r)[v]["bwd"] for r in win], st, label=f"{v} (bwd)")
        ax.plot(Ws, [ratios(r)["jagg"]["step"] for r in win], "o:", label="jagg (whole step)")
        ax.plot(Ws, [2 / W for W in Ws], "k--", label="floor 2/W")
        _style_axes(ax, "time / exact per-step", "Backward time ratio vs W")
        names.append(_save(fig, out, "time_ratio_vs_W.png"))

        fig, ax = plt.subplots(figsize=(6, 4))
        for v, st in (("jagg", "o-"), ("jagg_router", "^-"), ("exact_per_step", "s-")):
            ax.plot(
                Ws,
                [
                    r["memory"][v]["saved_bytes"] / r["memory"]["exact_batched"]["saved_bytes"]
                    for r in win
                ],
                st,
                label=v,
            )
        ax.plot(Ws, [2 / W for W in Ws], "k--", label="2/W")
        _style_axes(ax, "saved bytes / exact batched", "Activations saved for backward")
        names.append(_save(fig, out, "saved_bytes_vs_W.png"))
    fid = res.get("fidelity")
    if fid:
        R = fid["results"]
        Ws = fid["windows"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, scope, vs in (
            (axes[0], "window", ("jagg", "jagg_router", "subsample", "mixgrpo")),
            (axes[1], "traj", ("jagg", "jagg_shared", "jagg_router", "subsample", "mixgrpo")),
        ):
            for v in vs:
                ks = [f"{scope}/W{W}/{v}" for W in Ws]
                m = [R[k]["cos"]["mean"] for k in ks]
                s = [R[k]["cos"]["std"] for k in ks]
                ax.errorbar(Ws, m, yerr=s, marker="o", capsize=3, label=v)
            ax.set_xlabel("window W")
            ax.set_title(f"gradient cosine vs exact ({scope}, T={fid['T']})")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        axes[0].set_ylabel("cosine (mean ± std)")
        names.append(_save(fig, out, "grad_cosine_vs_W.png"))
    return names
