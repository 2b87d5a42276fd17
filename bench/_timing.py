"""The benchmarks' one timing loop: calls interleaved, so load on a shared machine hits all."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def interleaved(fns: dict[str, Callable], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Seconds per call of each function over ``rounds`` rounds of one call each, after
    ``warmup`` untimed rounds (tapegrad compiles a repeated eager structure at its 3rd call)."""
    for _ in range(warmup):
        for f in fns.values():
            jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    return times
