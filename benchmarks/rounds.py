"""Timed rounds for multi-rank benchmarks: every row once per round, rows interleaved, each round starting
one row later (so that no row always runs first, or always after the same one, as the machine's load
drifts); a barrier before and after each step, so the wall time is the slowest rank's."""

from __future__ import annotations

import time

import torch.distributed as dist


def interleaved(rows: dict, rounds: int) -> None:
    """``rows``: name -> {"step": callable, "times": [], "cpu": []}; appends each round's wall seconds (from
    barrier to barrier) and this process's CPU seconds, then drops the steps."""
    names = list(rows)
    for i in range(rounds):
        for r in (rows[n] for n in names[i % len(names):] + names[:i % len(names)]):
            dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            r["step"]()
            r["cpu"].append(time.process_time() - c)
            dist.barrier()
            r["times"].append(time.perf_counter() - t)
    for r in rows.values():
        del r["step"]
