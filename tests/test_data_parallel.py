"""jagg_autograd.data_parallel: the rank's slice of the global batch and noise stream, the
all-gather in global order, the process group from the launcher's environment, and a dead
peer failing the others' collectives with a clear error (2 spawned gloo processes).

Ranks run as ``spawn`` processes with torchrun's environment variables; results come back
through files; the parent kills whatever is still alive at its deadline.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from jagg_autograd.data_parallel import (
    CollectiveError,
    SampleLayout,
    ShardedGenerator,
    all_gather_samples,
    destroy_process_group,
    get_rank,
    get_world_size,
    init_process_group_from_env,
    is_main_process,
    reduce_scalars,
)

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed+gloo"
)

WORLD = 2
GLOBAL, MB = 24, 12  # 6 prompts x group 4, two minibatches of 12
SHAPE = (2, 3)  # a latent's shape
TIMEOUT_S = 3.0  # the process group's collective timeout in the fault test
RUN_TIMEOUT_S = 90.0


# ------------------------------------------------------------------------------ harness


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, port: int, out: str, timeout_s: float) -> None:
    """Child main: torchrun's environment, init from it, run fn(ctx), write the result."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    try:
        ctx = init_process_group_from_env(timeout_s=timeout_s, device="cpu")
        result = {"ok": True, "value": fn(ctx)}
    except BaseException as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "type": type(e).__name__,
                  "tb": traceback.format_exc(), "t": time.monotonic()}  # fmt: skip
    torch.save(result, out + ".tmp")
    os.replace(out + ".tmp", out)
    try:
        destroy_process_group()
    except Exception:
        pass


def run_ranks(fn: Callable[..., Any], tmp: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    outs = [str(tmp / f"rank{r}.pt") for r in range(WORLD)]
    procs = [ctx.Process(target=_entry, args=(fn, r, port, outs[r], timeout_s), daemon=True)
             for r in range(WORLD)]  # fmt: skip
    for p in procs:
        p.start()
    deadline = time.monotonic() + RUN_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        killed = p.is_alive()
        if killed:
            p.kill()
            p.join(10)
        res = {"ok": False, "error": "no result (killed at deadline)"}
        if os.path.exists(outs[r]):
            res = torch.load(outs[r], weights_only=False)
        res["killed"] = killed
        results.append(res)
    return results


# ------------------------------------------------------------------ what a rollout draws


def single_process_stream(seed: int = 5) -> dict[str, torch.Tensor]:
    """What one process draws for a step: per minibatch x0, two SDE noises, a step subset."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, list[torch.Tensor]] = {"x0": [], "eps": [], "steps": []}
    for _ in range(GLOBAL // MB):
        out["x0"].append(torch.randn((MB, *SHAPE), generator=g))
        out["eps"].append(torch.cat([torch.randn((MB, *SHAPE), generator=g) for _ in range(2)], 1))
        out["steps"].append(torch.rand((MB, 5), generator=g))
    out_t = {k: torch.cat(v) for k, v in out.items()}
    out_t["after"] = torch.randn(4, generator=g)  # the stream continues identically
    return out_t


def sharded_stream(layout: SampleLayout, seed: int = 5) -> dict[str, torch.Tensor]:
    """The same calls, with this rank's local shapes through a ShardedGenerator."""
    g = torch.Generator().manual_seed(seed)
    sg = ShardedGenerator(g, layout)
    n = layout.local_minibatch
    out: dict[str, list[torch.Tensor]] = {"x0": [], "eps": [], "steps": []}
    for _ in range(layout.num_minibatches):
        out["x0"].append(sg.randn((n, *SHAPE)))
        out["eps"].append(torch.cat([sg.randn((n, *SHAPE)) for _ in range(2)], 1))
        out["steps"].append(sg.rand((n, 5)))
    out_t = {k: torch.cat(v) for k, v in out.items()}
    out_t["after"] = torch.randn(4, generator=g)
    return out_t


def toy_grpo(rank: int, world: int, steps: int = 2) -> torch.Tensor:
    """A GRPO-shaped loop wired as the integration plan says: prompts from the shared
    generator, noise through ShardedGenerator, rewards all-gathered for the group
    advantages, every minibatch split over ranks with a per-rank mean loss / GA, DDP
    (world > 1) synced once per optimizer step.  Returns the final parameters."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from jagg_autograd.distributed import accumulate_windows
    from jagg_autograd.grpo import group_advantages

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    emb = torch.randn(10, 4, generator=torch.Generator().manual_seed(9))
    net = DDP(model) if world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    gen = torch.Generator().manual_seed(1)
    group, n_prompts, ga = 4, 3, 2  # 12 samples, 2 minibatches of 6, one optimizer step
    layout = SampleLayout(n_prompts * group, n_prompts * group // ga, rank, world)
    sg = ShardedGenerator(gen, layout)
    lm = layout.local_minibatch
    for _ in range(steps):
        prompts = torch.randperm(10, generator=gen)[:n_prompts]  # same on every rank
        rep = layout.take(prompts.repeat_interleave(group))
        mbs = []
        for j in range(ga):  # rollout, minibatch by minibatch (the single-process cut)
            c = emb[rep[j * lm : (j + 1) * lm]]
            x0 = sg.randn((lm, 4))
            with torch.no_grad():
                mean = model(x0 + c)
            sample = mean + 0.5 * sg.randn((lm, 4))
            mbs.append((x0, c, sample, -((sample - c) ** 2).sum(1)))
        rewards = all_gather_samples(torch.cat([m[3] for m in mbs]), layout)
        groups = torch.arange(n_prompts).repeat_interleave(group)
        adv = layout.take(group_advantages(rewards, groups))
        for j in accumulate_windows(net, ga):
            x0, c, sample, _ = mbs[j]
            logp = -((sample - net(x0 + c)) ** 2).sum(1) / (2 * 0.25)
            (-(adv[j * lm : (j + 1) * lm] * logp).mean() / ga).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _program(ctx: Any) -> dict[str, Any]:
    layout = SampleLayout(GLOBAL, MB, ctx.rank, ctx.world_size)
    drawn = sharded_stream(layout)
    # A per-sample "reward" computed locally from this rank's samples, then gathered.
    reward = drawn["x0"].flatten(1).sum(1)
    gathered = all_gather_samples(reward, layout)
    uneven = SampleLayout(7, 7, ctx.rank, ctx.world_size, even=False)
    g_uneven = all_gather_samples(uneven.indices().double() * 10, uneven)
    scal = {"a": float(ctx.rank), "b": 2.0 * ctx.rank + 1}
    return {
        "ctx": (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend, ctx.is_main),
        "fns": (get_rank(), get_world_size(), is_main_process()),
        "indices": layout.indices(),
        "drawn": drawn,
        "gathered": gathered,
        "uneven": g_uneven,
        "mean": reduce_scalars(scal),
        "max": reduce_scalars(scal, "max"),
        "min": reduce_scalars(scal, "min"),
        "toy": toy_grpo(ctx.rank, ctx.world_size),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    res = run_ranks(_program, tmp_path_factory.mktemp("dp"))
    for r, x in enumerate(res):
        assert x["ok"], f"rank {r}: {x.get('tb', x['error'])}"
    return [x["value"] for x in res]


def test_process_group_from_launcher_env(two_ranks):
    assert [v["ctx"] for v in two_ranks] == [(0, 2, 0, "gloo", True), (1, 2, 1, "gloo", False)]
    assert [v["fns"] for v in two_ranks] == [(0, 2, True), (1, 2, False)]


def test_each_rank_draws_its_slice_of_the_single_process_stream(two_ranks):
    want = single_process_stream()
    layout = SampleLayout(GLOBAL, MB, 0, WORLD)
    for r, v in enumerate(two_ranks):
        idx = SampleLayout(GLOBAL, MB, r, WORLD).indices()
        assert torch.equal(v["indices"], idx)
        for k in ("x0", "eps", "steps"):
            assert torch.equal(v["drawn"][k], want[k][idx]), (r, k)  # bit for bit
        assert torch.equal(v["drawn"]["after"], want["after"])
    # The two ranks' samples partition the batch; each minibatch is split, not given whole.
    both = torch.cat([SampleLayout(GLOBAL, MB, r, WORLD).indices() for r in range(WORLD)])
    assert sorted(both.tolist()) == list(range(GLOBAL))
    assert layout.indices().tolist() == [*range(0, 6), *range(12, 18)]


def test_gather_returns_global_sample_order(two_ranks):
    want = single_process_stream()["x0"].flatten(1).sum(1)
    for v in two_ranks:
        assert torch.equal(v["gathered"], want)
        # Uneven evaluation split (7 samples: 4 + 3) comes back whole and in order.
        assert torch.equal(v["uneven"], torch.arange(7).double() * 10)


def test_reduce_scalars_over_ranks(two_ranks):
    for v in two_ranks:
        assert v["mean"] == {"a": 0.5, "b": 2.0}
        assert v["max"] == {"a": 1.0, "b": 3.0} and v["min"] == {"a": 0.0, "b": 1.0}


def test_toy_grpo_two_processes_equal_one(two_ranks):
    ref = toy_grpo(0, 1)
    start = toy_grpo(0, 1, steps=0)
    errs = [float((v["toy"] - ref).norm() / ref.norm()) for v in two_ranks]
    print("FIGURE toy GRPO 2 processes vs 1, rel err per rank:", errs)
    assert float((ref - start).norm()) > 1e-3  # it trained
    assert torch.equal(two_ranks[0]["toy"], two_ranks[1]["toy"])
    assert max(errs) < 1e-6


def _dead_peer_program(ctx: Any) -> Any:
    layout = SampleLayout(4, 4, ctx.rank, ctx.world_size)
    all_gather_samples(torch.ones(2), layout)  # both ranks alive: fine
    if ctx.rank == 1:
        time.sleep(3 * TIMEOUT_S)  # stuck: never joins the next collective, then exits
        return "slept"
    t0 = time.monotonic()
    try:
        all_gather_samples(torch.ones(2), layout)
    except CollectiveError as e:
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def test_dead_peer_fails_collectives_with_clear_error(tmp_path):
    t0 = time.monotonic()
    res = run_ranks(_dead_peer_program, tmp_path, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - t0
    assert res[0]["ok"], res[0].get("tb", res[0]["error"])
    got = res[0]["value"]
    print("FIGURE dead peer:", round(got["seconds"], 2), "s |", got["error"][:200])
    assert got["error"] is not None and "rank 0/2: all_gather" in got["error"]
    assert "another process probably died" in got["error"]
    assert got["seconds"] < 3 * TIMEOUT_S  # bounded by the group's timeout, not a hang
    assert elapsed < RUN_TIMEOUT_S and not res[0]["killed"]


# ------------------------------------------------------------------ single process, no spawn


def test_single_process_is_the_plain_draw():
    layout = SampleLayout(GLOBAL, MB)
    assert sharded_stream(layout).keys() == single_process_stream().keys()
    for k, v in sharded_stream(layout).items():
        assert torch.equal(v, single_process_stream()[k])
    assert torch.equal(all_gather_samples(torch.arange(24.0), layout), torch.arange(24.0))
    assert reduce_scalars({"x": 3}) == {"x": 3.0}
    ctx = init_process_group_from_env(env={}, device="cpu")
    assert (ctx.rank, ctx.world_size, ctx.backend, ctx.is_main) == (0, 1, None, True)
    assert get_rank() == 0 and get_world_size() == 1 and is_main_process()


def test_layout_contract_errors():
    with pytest.raises(ValueError, match="does not split over 4 processes"):
        SampleLayout(24, 6, 0, 4)
    with pytest.raises(ValueError, match="minibatches of 5"):
        SampleLayout(24, 5)
    with pytest.raises(ValueError, match="bad layout"):
        SampleLayout(24, 12, 2, 2)
    lay = SampleLayout(7, 7, 1, 2, even=False)
    assert lay.rows() == (4, 7) and lay.rows(0) == (0, 4)
    assert lay.take(list("abcdefg")) == ["e", "f", "g"]
    assert torch.equal(lay.take(torch.arange(7)), torch.tensor([4, 5, 6]))
    with pytest.raises(ValueError, match="global rows"):
        lay.take([1, 2])
    sg = ShardedGenerator(torch.Generator(), SampleLayout(24, 12, 1, 2))
    with pytest.raises(ValueError, match="6 rows"):
        sg.randn((12, 3))
    with pytest.raises(TypeError):
        ShardedGenerator(object(), lay)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owns 6 samples"):
        all_gather_samples(torch.ones(5), SampleLayout(12, 12, 1, 2))


def test_env_errors():
    with pytest.raises(ValueError, match="RANK"):
        init_process_group_from_env(env={"WORLD_SIZE": "2"}, device="cpu")
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        init_process_group_from_env(env={"WORLD_SIZE": "2", "RANK": "0"}, device="cpu")
    with pytest.raises(ValueError, match="inconsistent"):
        init_process_group_from_env(env={"WORLD_SIZE": "2", "RANK": "2"}, device="cpu")
    with pytest.raises(ValueError, match="timeout"):
        init_process_group_from_env(env={}, timeout_s=0)
