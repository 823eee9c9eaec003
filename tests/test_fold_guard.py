"""The linear fold's guard (jagg_autograd.fold_guard): advantages of non-zero mean through
a linear-fold JAGG call warn once; zero-mean-per-group advantages, the causal fold and
calls without JAGG do not."""

from __future__ import annotations

import warnings

import pytest
import torch
from fields import MLPField

from jagg_autograd import jagg_trajectory
from jagg_autograd.advantages import group_advantages
from jagg_autograd.fold_guard import Z_WARN, folds_in_graph, reset_guard
from jagg_autograd.grpo import grpo_loss

F64 = torch.float64
T, B, G = 7, 8, 4  # 2 groups of 4 per minibatch


@pytest.fixture(autouse=True)
def _fresh_guard():
    reset_guard()
    yield
    reset_guard()


def _log_prob(path: str, fold: str, seed: int) -> torch.Tensor:
    """A (B,) log-prob whose graph runs through one call of ``path`` (or none: "exact")."""
    model = MLPField(3, seed=1)
    gen = torch.Generator().manual_seed(seed)
    lat = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    t = torch.linspace(1.0, 0.1, T, dtype=F64)
    if path == "exact":
        v = torch.stack([model(lat[k], t[k : k + 1].expand(B)) for k in range(T)])
    else:
        kw: dict = {"deferred": True} if path == "deferred" else {}
        v = jagg_trajectory(model, lat, t, window=3, fold=fold, **kw)
    target = torch.randn(T, B, 2, 3, generator=gen, dtype=F64)
    return -(v - target).square().sum(dim=(0, 2, 3))


def _run(path: str, fold: str, advantages, calls: int = 6) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for i in range(calls):
            lp = _log_prob(path, fold, i)
            loss, _ = grpo_loss(lp, lp.detach(), advantages(i))
            loss.backward()
    return [w for w in rec if "fold='linear'" in str(w.message)]


def _raw_rewards(i: int) -> torch.Tensor:
    # Raw rewards in [0, 1] used as advantages: mean ~0.5, the failure the guard is for.
    return torch.rand(B, generator=torch.Generator().manual_seed(100 + i), dtype=F64)


def _group_normalised(i: int) -> torch.Tensor:
    return group_advantages(_raw_rewards(i), torch.arange(B) // G)


@pytest.mark.parametrize("path", ["eager", "deferred"])
def test_raw_rewards_through_the_linear_fold_warn_once(path):
    got = _run(path, "linear", _raw_rewards)
    assert len(got) == 1, [str(w.message) for w in got]
    msg = str(got[0].message)
    assert "fold='causal'" in msg and "group_advantages" in msg
    assert got[0].category is RuntimeWarning


@pytest.mark.parametrize("path", ["eager", "deferred"])
def test_zero_mean_group_advantages_do_not_warn(path):
    assert _run(path, "linear", _group_normalised, calls=12) == []


def test_half_groups_per_minibatch_do_not_warn():
    # A minibatch holding half of each group: its mean is not 0, but the two halves of a
    # rollout take it back, so the accumulated z stays O(1).
    full = [_group_normalised(i) for i in range(6)]
    order = torch.tensor([0, 1, 4, 5, 2, 3, 6, 7])  # first halves of both groups, then second

    def halves(i: int) -> torch.Tensor:
        a = full[i // 2][order]
        return torch.cat([a[:4], a[:4]]) if i % 2 == 0 else torch.cat([a[4:], a[4:]])

    assert _run("eager", "linear", halves, calls=12) == []


def test_a_minibatch_repeated_per_timestep_counts_once():
    # Flow-GRPO's loop: the loss per timestep with the same advantages.  A minibatch of the
    # top halves of its groups (then one of the bottom halves) has z ~ 2.5; counted once
    # per timestep (T = 10) it would read sqrt(10) * 2.5 ~ 8 > Z_WARN and warn falsely.
    norm = [_group_normalised(i) for i in range(4)]

    def halves(i: int) -> torch.Tensor:
        a = norm[i // 20]
        top = torch.cat([g.sort(descending=True).values[:2] for g in a.view(2, G)])
        bottom = torch.cat([g.sort(descending=True).values[2:] for g in a.view(2, G)])
        part = top if (i // 10) % 2 == 0 else bottom
        return torch.cat([part, part])

    z_first = float(halves(0).sum() / halves(0).square().sum().sqrt())
    assert 2.0 < z_first < Z_WARN < 10**0.5 * z_first  # the case the dedupe is for
    assert _run("eager", "linear", halves, calls=80) == []


def test_causal_fold_and_no_jagg_do_not_warn():
    assert _run("eager", "causal", _raw_rewards) == []
    assert _run("exact", "linear", _raw_rewards) == []


def test_folds_in_graph_finds_the_call_and_its_fold():
    assert folds_in_graph(_log_prob("eager", "linear", 0)) == {"linear"}
    assert folds_in_graph(_log_prob("deferred", "causal", 0)) == {"causal"}
    assert folds_in_graph(_log_prob("exact", "linear", 0)) == set()


def test_threshold_separates_the_two_cases():
    # The statistic behind the warning, on the two inputs above: raw rewards pass Z_WARN
    # within the first minibatches, group-normalised ones stay far below it.
    raw = torch.cat([_raw_rewards(i) for i in range(6)])
    norm = torch.cat([_group_normalised(i) for i in range(6)])
    z_raw = float(raw.sum() / raw.square().sum().sqrt())
    z_norm = float(norm.sum() / norm.square().sum().sqrt())
    assert z_raw > Z_WARN and abs(z_norm) < 1e-6
