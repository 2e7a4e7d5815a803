"""How the benchmarks time: the median of repeated calls after warm-up, on the wall clock or, on a GPU, between
CUDA events; and two or more runs timed in turns, so that both sides of a ratio meet the same machine conditions.
``benchmarks/run.py``, ``benchmarks/device.py``, ``benchmarks/peers.py`` and ``benchmarks/profile_step.py`` share
them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def wall_seconds(run: Callable[[], Any]) -> float:
    """The wall time of one call of ``run``."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def median_seconds(run: Callable[[], Any], *, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall time of ``run`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    return statistics.median(wall_seconds(run) for _ in range(repeats))


def paired_median_seconds(runs: dict[str, Callable[[], Any]], *, repeats: int = 5, warmup: int = 2,
                          seconds: Callable[[Callable[[], Any]], float] = wall_seconds) -> dict[str, float]:
    """Median wall time of each of ``runs``, timed in turns (a, b, a, b, ...) after warm-up.

    Taking turns puts both sides of a ratio under the same machine conditions: timed one block after the
    other, a slow minute of a shared or throttled CPU (or a warmer GPU) falls on one side only. ``seconds``
    times one call (default: the wall clock; ``median_times`` passes CUDA events on a GPU).
    """
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(seconds(run))
    return {name: statistics.median(values) for name, values in times.items()}


def median_time(device: torch.device, run: Callable[[], Any], *, repeats: int, warmup: int) -> float:
    """Median seconds of ``run`` after ``warmup`` calls; on a GPU between CUDA events, synchronised."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            start_s = time.perf_counter()
            run()
            times.append(time.perf_counter() - start_s)
    return statistics.median(times)


def median_times(device: torch.device, runs: dict[str, Callable[[], Any]], *, repeats: int,
                 warmup: int) -> dict[str, float]:
    """``median_time`` of each of ``runs``, their timed calls taken in turns (``paired_median_seconds``), so
    that neither is always the one measured later."""
    return paired_median_seconds(runs, repeats=repeats, warmup=warmup,
                                 seconds=lambda run: median_time(device, run, repeats=1, warmup=0))
