"""The runaway guard (jagg_autograd.runaway_guard): its rule against a numpy oracle, the
estimators' fallback chain, the config's checks, and the trainer switching estimators
mid-run (the switched steps' gradient is the fallback's, bit for bit)."""

from __future__ import annotations

import copy
import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from jagg_autograd.config import GRPOConfig
from jagg_autograd.demo import build_parser, config_from_args
from jagg_autograd.estimators import ESTIMATORS, JaggEstimator, register_estimator
from jagg_autograd.runaway_guard import RunawayGuard
from jagg_autograd.trainer import GRPOTrainer

# ---------------------------------------------------------------------------- the rule


def _oracle(norms: list[float], ratio: float, window: int) -> tuple[list[float | None], int | None]:
    """Each step's ratio (median of the last ``window`` over the first ``window`` positive
    ones) and the first step whose ratio exceeds ``ratio``, from numpy."""
    out: list[float | None] = []
    trip = None
    positive = [i for i, g in enumerate(norms) if g > 0]
    for i in range(len(norms)):
        if len(positive) < window or i < positive[window - 1]:
            out.append(None)
            continue
        base = float(np.median([norms[j] for j in positive[:window]]))
        r = float(np.median(norms[max(0, i + 1 - window) : i + 1])) / base
        out.append(r)
        if trip is None and r > ratio:
            trip = i
    return out, trip


@given(
    norms=st.lists(st.one_of(st.just(0.0), st.floats(0.01, 10.0)), min_size=1, max_size=40),
    ratio=st.floats(1.01, 3.0),
    window=st.integers(1, 7),
)
def test_ratio_and_trip_match_numpy(norms, ratio, window):
    want, trip = _oracle(norms, ratio, window)
    guard = RunawayGuard(ratio, window)
    got = []
    first = None
    for i, g in enumerate(norms):
        got.append(guard.observe(g))
        if guard.tripped and first is None:
            first = i
    assert [g is None for g in got] == [w is None for w in want]
    assert all(g is None or g == pytest.approx(w, rel=1e-12) for g, w in zip(got, want))
    assert first == trip


def test_docstring_example_and_reset():
    guard = RunawayGuard(ratio=1.5, window=3)
    for g in [1.0, 1.1, 0.9, 1.0]:
        guard.observe(g)
    assert not guard.tripped and guard.baseline == 1.0
    guard.observe(2.0)
    assert not guard.tripped  # median(0.9, 1.0, 2.0) = 1.0
    assert guard.observe(2.2) == pytest.approx(2.0) and guard.tripped
    guard.reset()  # a new estimator: a new baseline, at the new level
    assert guard.baseline is None and not guard.tripped
    assert [guard.observe(g) for g in [2.0, 2.2, 2.1]] == [None, None, 1.0]
    assert guard.baseline == pytest.approx(2.1) and not guard.tripped


def test_replay_equals_observing():
    norms = [1.0, 1.2, 0.8, 1.1, 1.9, 2.5, 3.0]
    a, b = RunawayGuard(1.5, 3), RunawayGuard(1.5, 3)
    last = [a.observe(g) for g in norms][-1]
    assert b.replay(norms) == last and (a.tripped, a.baseline) == (b.tripped, b.baseline)


def test_zero_norms_do_not_fill_the_baseline():
    """Steps whose advantages were all 0 (a zero gradient) say nothing of the norm's scale:
    the baseline waits for positive norms, then the guard works as usual."""
    guard = RunawayGuard(1.5, 2)
    assert [guard.observe(g) for g in [0.0, 0.0, 5.0, 5.0]] == [None, None, None, 1.0]
    assert guard.baseline == 5.0 and not guard.tripped
    assert guard.observe(20.0) == pytest.approx(2.5) and guard.tripped


@pytest.mark.parametrize("ratio", [1.0, 0.5, float("nan"), float("inf"), True, "2"])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match="ratio must be a finite number > 1"):
        RunawayGuard(ratio, 10)


@pytest.mark.parametrize("window", [0, -1, 2.0, True])
def test_bad_window(window):
    with pytest.raises(ValueError, match="window must be an int >= 1"):
        RunawayGuard(1.5, window)


# ---------------------------------------------------------------------------- the chain


def _chain(config: GRPOConfig) -> list[str]:
    """The estimators a run walks through as its guard trips again and again."""
    est, names = config.estimator(), []
    while True:
        names.append(f"{est.config.mode}/{est.config.fold}")
        changes = est.fallback()
        if changes is None:
            return names
        est = dataclasses.replace(est.config, **changes).estimator()


@pytest.mark.parametrize(
    "mode, fold, want",
    [
        ("jagg", "linear", ["jagg/linear", "jagg/causal", "exact/causal"]),
        ("jagg", "causal", ["jagg/causal", "exact/causal"]),
        ("router", "linear", ["router/linear", "router/causal", "exact/causal"]),
        ("exact", "linear", ["exact/linear"]),
        ("subsample", "linear", ["subsample/linear"]),
        ("mixgrpo", "linear", ["mixgrpo/linear"]),
        ("nft", "linear", ["nft/linear"]),
    ],
)
def test_fallback_chain(mode, fold, want):
    assert _chain(GRPOConfig(mode=mode, fold=fold)) == want


# ---------------------------------------------------------------------------- the config


@pytest.mark.parametrize("bad", [1.0, 0.9, 0, float("nan"), True, "1.5"])
def test_config_refuses_bad_guard_ratio(bad):
    with pytest.raises(ValueError, match="guard_ratio must be None or a finite number > 1"):
        GRPOConfig(guard_ratio=bad).validate()


def test_config_refuses_bad_guard_window():
    with pytest.raises(ValueError, match="guard_window must be an int >= 1"):
        GRPOConfig(guard_window=0).validate()


def test_cli_guard_flags():
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--guard-ratio", "0"])).guard_ratio is None
    cfg = config_from_args(parser.parse_args(["--guard-ratio", "2", "--guard-window", "5"]))
    assert (cfg.guard_ratio, cfg.guard_window) == (2.0, 5)
    assert GRPOConfig().guard_ratio == 1.5 and GRPOConfig().guard_window == 10


class _BadFallback(JaggEstimator):
    name = "bad_fallback"

    def fallback(self):
        return {"window": 99}  # more than num_steps: the fallback cannot run


def test_config_refuses_a_fallback_that_cannot_run():
    register_estimator("bad_fallback", _BadFallback)
    try:
        with pytest.raises(ValueError, match="guard_ratio: the runaway guard's fallback"):
            GRPOConfig(mode="bad_fallback").validate()
        GRPOConfig(mode="bad_fallback", guard_ratio=None).validate()  # guard off: fine
    finally:
        del ESTIMATORS["bad_fallback"]


# ---------------------------------------------------------------------------- the trainer

TINY = dict(prompts_per_step=2, group_size=2, num_steps=4, window=3, eval_per_digit=0,
            grid_samples=0, progress=False, threads=1)  # fmt: skip


def _weights(trainer: GRPOTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def test_trainer_switches_to_the_fallback_bit_for_bit(tmp_path):
    """A guard that trips at once: the run walks jagg -> causal fold -> exact, logs and
    warns each switch, and every step after a switch is the step a run started on the
    fallback estimator would take from the same state (same weights, optimizer, noise)."""
    cfg = GRPOConfig(**TINY, steps=6, guard_ratio=1.000001, guard_window=1,
                     out=str(tmp_path / "run"))  # fmt: skip
    trainer = GRPOTrainer(cfg)
    twin = GRPOTrainer(dataclasses.replace(cfg, guard_ratio=None, out=None))
    modes = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(cfg.steps):
            # The twin runs the estimator the guarded run uses now, from the same state.
            twin.estimator = trainer.estimator.config.estimator()
            twin.model.load_state_dict(trainer.model.state_dict())
            # (a copy: load_state_dict keeps the given tensors, which both would update)
            twin.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
            twin.generator.set_state(trainer.generator.get_state())
            twin.step_index = trainer.step_index
            twin.optimizer_step_index = trainer.optimizer_step_index
            modes.append((trainer.estimator.config.mode, trainer.estimator.config.fold))
            row, twin_row = trainer.step(), twin.step()
            assert row["grad_norm"] == twin_row["grad_norm"]
            assert all(torch.equal(a, b) for a, b in zip(_weights(trainer), _weights(twin)))
    log = trainer.finish()
    events = log["guard"]
    assert [e["changes"] for e in events] == [{"fold": "causal"}, {"mode": "exact"}]
    first, second = events[0]["step"], events[1]["step"]
    assert second < cfg.steps - 1  # steps ran on each of the three estimators
    assert modes == ([("jagg", "linear")] * (first + 1) + [("jagg", "causal")] * (second - first)
                     + [("exact", "causal")] * (cfg.steps - 1 - second))  # fmt: skip
    assert trainer.guard is None  # exact: nothing further to fall back to
    # The exact steps train every (step, sample) pair with grad; JAGG's fewer.
    rows = log["steps"]
    assert rows[0]["grad_samples"] < rows[-1]["grad_samples"]
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert sum("the gradient norm ran away" in m for m in msgs) == 2
    assert "The runaway guard switched" in log["summary"]
    on_disk = json.loads((tmp_path / "run" / "log.json").read_text())
    assert on_disk["guard"] == events


def test_guard_off_and_exact_runs_carry_no_guard():
    assert GRPOTrainer(GRPOConfig(**TINY, steps=1, guard_ratio=None)).guard is None
    assert GRPOTrainer(GRPOConfig(**TINY, steps=1, mode="exact")).guard is None
    trainer = GRPOTrainer(GRPOConfig(**TINY, steps=1))
    assert isinstance(trainer.guard, RunawayGuard) and trainer.guard.ratio == 1.5


# ---------------------------------------------------------------------------- the scan


def test_guard_scan_replays_the_trainers_rule(tmp_path, capsys):
    """benchmarks.guard_scan: a flat run never trips, a run whose norm triples trips where
    the numpy oracle says, nested study files are found, short runs are skipped."""
    from benchmarks.guard_scan import main, replay, scan

    flat = [1.0 + 0.01 * (i % 3) for i in range(40)]
    rising = [1.0] * 20 + [3.0] * 20
    cfg = {"task": "shapes", "mode": "jagg", "fold": "linear"}
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "log.json").write_text(
        json.dumps(
            {"config": cfg, "steps": [{"grad_norm": g} for g in rising], "guard": [{"step": 25}]}
        )
    )
    (tmp_path / "study.json").write_text(json.dumps({
        "exact": {"config": {**cfg, "mode": "exact"}, "steps": [{"grad_norm": g} for g in flat]},
        "short": {"config": cfg, "steps": [{"grad_norm": 1.0}] * 5},
    }))  # fmt: skip
    groups = scan(tmp_path, 1.5, 10)
    assert set(groups) == {("shapes", "jagg", "linear"), ("shapes", "exact", "linear")}
    (run,) = groups[("shapes", "jagg", "linear")]
    # steps 15-24: five 1.0 and five 3.0, median 2.0 > 1.5
    assert run["trip"] == _oracle(rising, 1.5, 10)[1] == 24 and run["switched"]
    assert run["max_ratio"] == pytest.approx(3.0)
    assert replay(flat, 1.5, 10)[1] is None
    assert main(["--root", str(tmp_path), "--out", str(tmp_path / "scan.md")]) == 0
    text = capsys.readouterr().out
    assert "| shapes | jagg | linear | 1 | 1 | 24-24 | 3.00 |" in text
    assert "| shapes | exact | linear | 1 | 0 | - |" in text
    assert (tmp_path / "scan.md").read_text().strip() == text.strip()


def test_resume_replays_the_logged_switch_not_a_new_fallback(tmp_path):
    """A resume applies the logged switch's changes: resumed with ``fold="causal"`` (a
    setting a resume may change) after a logged linear -> causal switch, the run goes on
    with the causal fold and a guard for it, not with the causal fold's own fallback."""
    out = tmp_path / "run"
    cfg = GRPOConfig(**TINY, steps=2, guard_ratio=1.000001, guard_window=1, save_every=2,
                     out=str(out))  # fmt: skip
    trainer = GRPOTrainer(cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(cfg.steps):
            trainer.step()
    log = trainer.finish()
    assert [e["changes"] for e in log["guard"]] == [{"fold": "causal"}]
    for fold in ("linear", "causal"):
        resumed = GRPOTrainer(dataclasses.replace(cfg, steps=4, fold=fold, resume_from="latest"))
        est = resumed.estimator.config
        assert (est.mode, est.fold) == ("jagg", "causal")
        assert isinstance(resumed.guard, RunawayGuard)  # watching the causal fold now
