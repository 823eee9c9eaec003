"""Benchmarks for jagg-autograd: time, saved memory, kernel overhead and gradient fidelity.

Run ``python -m benchmarks.run --quick`` (or the full mode without ``--quick``); see
:mod:`benchmarks.run` for the options and ``benchmarks/results/`` for the outputs.
"""
