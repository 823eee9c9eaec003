"""Shared test set-up: the Triton interpreter on CPU and hypothesis profiles."""

import os

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
