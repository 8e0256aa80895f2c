"""What a prefill chunk costs: the fitted model, its running mean correction, and the tail the start rule
uses.

A chunk of c tokens into a cache of T costs ``a + b·c + e·c·T`` (:func:`fit_cost`: projections and MLP
per token, attention against the cache), timed when the service starts. Two corrections follow the
machine as it runs, both from each chunk's measured / fitted ratio r:

- the **mean** (``ratio``): a running mean of r (each chunk moves it a fifth of the way), which the
  counters report as "predicted" and which recovers within a few chunks from a step change;
- the **tail** (:meth:`CostModel.tail`): the ``quantile`` (default 0.9) of the r of the chunks that ended
  in the last ``horizon`` seconds, and never below the mean. A chunk starts only if its tail cost ends a
  guard band before its window closes (:meth:`launch.bubbletea.service.Service.run_window`), and the
  packer plans with the same cost, so plan and rule agree on what fits.

Why the tail and not the mean: a chunk is late only if it starts near its window's end and runs long,
and on a CPU rank chunks run long in bursts (another job takes the core: SCHED_IDLE yields to it). A rule
on the mean cost lets such a chunk start whenever the mean fits; ``benchmarks.bubbletea --hf-tiny gpt2``
once had 4% / 15% of its chunks late with measured / predicted p90 1.35 / 4.55 while the median was ~0.9:
the mean was right and the tail was not. With the p90 rule a chunk that starts at the latest allowed
moment overruns only if it is slower than nine in ten recent chunks *and* by more than the guard band.
Why a time horizon and not the last N chunks: a burst that makes every chunk look too long for its
window stops all chunks, so no new sample would ever replace the slow ones; after ``horizon`` seconds
with no chunk the tail falls back to the mean, which fades to the fit at every plan (``fade``).
"""

from __future__ import annotations

import math
import time
from collections import deque

import torch

from launch.bubbletea.model import PrefillModel
from launch.bubbletea.packer import Chunk


def fit_cost(model: PrefillModel, max_seq: int, vocab: int, chunk_tokens: int, stream=None,
             repeats: int = 3) -> tuple[float, float, float]:
    """Time chunks of two sizes into caches of two capacities; least squares of ``a + b·c + e·c·T``
    (projections and MLP per token, attention against the whole cache; :mod:`.model`). Each point is the
    *fastest* of its repeats: a busy machine only ever adds time, so the minimum is the least disturbed
    sample (a median taken while another job held the core once set a rank's cost 10x too high, and
    every window below it: see :meth:`launch.bubbletea.service.Service.calibrate`)."""
    from launch.bubbletea.device import synchronize

    caps = sorted({min(max_seq, chunk_tokens), min(max_seq, 4 * chunk_tokens)})
    rows, times = [], []
    g = torch.Generator().manual_seed(0)
    for cap in caps:
        for size in sorted({max(1, min(chunk_tokens, cap) // 2), min(chunk_tokens, cap)}):
            tokens = torch.randint(vocab, (size,), generator=g)
            if hasattr(model, "example_input"):         # a later stage of a pipelined model: activations
                tokens = model.example_input(tokens)
            samples = []
            for _ in range(repeats + 1):                      # the first run warms the kernels
                cache = model.new_cache(cap)
                # at the cache's end: CausalLM attends to the whole capacity wherever a chunk is, a model
                # that attends to the filled prefix only (hf.HFModel) shows its c·T term only there
                cache.length = cap - size
                t0 = time.perf_counter()
                model.prefill_chunk(tokens, cache)
                synchronize(stream)
                samples.append(time.perf_counter() - t0)
            rows.append([1.0, float(size), float(size * cap)])
            times.append(min(samples[1:]))
    sol = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                             torch.tensor(times, dtype=torch.float64)[:, None]).solution.flatten()
    a, b, e = (max(0.0, float(x)) for x in sol)
    return (a or 0.1 * min(times), b, e)


def check_quantile(quantile: float | None) -> float | None:
    """``quantile`` if it lies in (0, 1] or is None (the start rule on the mean cost), else ValueError."""
    if quantile is not None and (isinstance(quantile, bool) or not isinstance(quantile, (int, float))
                                 or not 0.0 < quantile <= 1.0):
        raise ValueError(f"tail_quantile={quantile!r}: must lie in (0, 1], or be None (start on the mean "
                         "cost)")
    return quantile


class CostModel:
    """The fit and its two corrections (module docstring). ``quantile`` None: the tail is the mean."""

    def __init__(self, fit: tuple[float, float, float], quantile: float | None = 0.9,
                 horizon: float = 2.0, keep: int = 512) -> None:
        if not horizon > 0:
            raise ValueError(f"horizon={horizon!r}: the tail's samples must live a positive time")
        self.fit, self.quantile, self.horizon = fit, check_quantile(quantile), horizon
        self.ratio = 1.0
        self._samples: deque = deque(maxlen=keep)       # (perf_counter at the chunk's end, r)
        self._sorted: list[float] | None = None           # the samples' r sorted; None: to sort again

    def fitted(self, chunk: Chunk) -> float:
        a, b, e = self.fit
        return a + b * chunk.tokens + e * chunk.tokens * chunk.total

    def mean(self, chunk: Chunk) -> float:
        return self.ratio * self.fitted(chunk)

    def tail_ratio(self, now: float | None = None) -> float:
        """The ``quantile`` of the recent measured / fitted ratios (nearest rank), at least the mean's."""
        if self.quantile is None:
            return self.ratio
        now = time.perf_counter() if now is None else now
        while self._samples and self._samples[0][0] < now - self.horizon:
            self._samples.popleft()
            self._sorted = None
        if self._sorted is None:      # sorted once per change, not per chunk the packer prices
            self._sorted = sorted(r for _, r in self._samples)
        rs = self._sorted
        q = rs[max(0, math.ceil(len(rs) * self.quantile) - 1)] if rs else 0.0
        return max(self.ratio, q)

    def tail(self, chunk: Chunk, now: float | None = None) -> float:
        return self.tail_ratio(now) * self.fitted(chunk)

    def observe(self, chunk: Chunk, seconds: float, now: float | None = None) -> None:
        r = seconds / self.fitted(chunk)
        self.ratio = 0.8 * self.ratio + 0.2 * r
        self._samples.append((time.perf_counter() if now is None else now, r))
        self._sorted = None

    def fade(self) -> None:
        """Once per plan: a slow spell that stopped all prefill fades from the mean."""
        self.ratio = 1.0 + 0.8 * (self.ratio - 1.0)

    def refit(self, fit: tuple[float, float, float]) -> None:
        self.fit, self.ratio = fit, 1.0
        self._samples.clear()
        self._sorted = None
