"""Shared test set-up: the Triton interpreter on CPU and hypothesis profiles."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

# Must be set before triton is imported anywhere: on CPU the kernels only run interpreted.
# JAGG_TEST_DEVICE=cuda (benchmarks/gpu_check.sh) runs the kernel tests compiled instead.
if os.environ.get("JAGG_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poison torch.empty with NaN so a kernel that leaves an output element unwritten fails."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", poisoned)


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_benchmark(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``run_benchmark("benchmarks.run", "--tiny")``: run a benchmark CLI, return its --out."""

    def run(module: str, *args: str) -> Path:
        out = tmp_path_factory.mktemp(module.rsplit(".", 1)[-1])
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)  # the harnesses use "auto": torch on CPU
        subprocess.run(
            [sys.executable, "-m", module, *args, "--no-progress", "--out", str(out)],
            cwd=REPO,
            env=env,
            check=True,
            timeout=600,
        )
        return out

    return run
