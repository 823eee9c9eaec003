"""Backend resolution shared by every op: "torch" reference, "triton" kernels, or "auto"."""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "triton")
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def triton_available() -> bool:
    """True when ``triton`` and the package's kernels import."""
    try:
        import jagg_autograd.kernels.jagg_mix  # noqa: F401
    except Exception:  # triton missing or broken: the reference path still works
        return False
    return True


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_backend(backend: object) -> str:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def check_backend_runnable(backend: object, device: torch.device, dtype: torch.dtype) -> str:
    """:func:`check_backend`, and for "triton" also that it can run on ``device``/``dtype``.

    The ops run in the forward (routing) and in the backward (mixing); calling this before
    the first model call turns a "triton" that cannot run (CPU without TRITON_INTERPRET=1,
    float64, triton missing) into an immediate ``ValueError`` instead of a failure in
    ``backward()`` after the forward has been paid for.
    """
    backend = check_backend(backend)
    if backend == "triton":
        resolve_backend(backend, device, dtype)
    return backend


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """Pick the implementation for tensors on ``device`` of ``dtype``.

    "auto" takes Triton only on CUDA for fp16/bf16/fp32 (the interpreter is far slower
    than the reference, so CPU never gets it implicitly).  "triton" on CPU tensors needs
    TRITON_INTERPRET=1 and is how the tests exercise the kernels.
    """
    check_backend(backend)
    if backend == "torch":
        return "torch"
    if backend == "auto":
        ok = device.type == "cuda" and dtype in _TRITON_DTYPES and triton_available()
        return "triton" if ok else "torch"
    if dtype not in _TRITON_DTYPES:
        raise ValueError(f"backend='triton' supports float16/bfloat16/float32, got {dtype}")
    if device.type != "cuda" and not interpreter_on():
        raise ValueError(
            "backend='triton' on non-CUDA tensors needs TRITON_INTERPRET=1 "
            f"(got tensors on {device}); use backend='torch' or 'auto'"
        )
    if not triton_available():
        raise ValueError("backend='triton' requested but triton could not be imported")
    return "triton"
