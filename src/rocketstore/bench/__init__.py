"""Benchmarks: rocketstore against the tools a Python user would pick instead.

``rocketstore bench`` (see :mod:`rocketstore.bench.cli`) runs every workload
in one process on this machine, measures the peers (SQLite, persist-queue,
diskcache, litequeue, Redis streams, Parquet via Spark) and the physical and
Python floors (raw write, fdatasync, bare mmap append/read loops) in the same
run, and reports each figure as a ratio to one of them.  Absolute numbers are
recorded but never asserted: the same kind of machine varies several-fold.
"""

from __future__ import annotations

__all__ = ["run_suite"]


def run_suite(*args, **kwargs):  # pragma: no cover - thin re-export
    from .suite import run_suite as _run
    return _run(*args, **kwargs)
