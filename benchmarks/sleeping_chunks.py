"""``python -m benchmarks.bubbletea --sleeping-chunks``: a prefill spec whose chunks sleep instead of
computing. In a module of its own because the prefill service unpickles the spec by its module's name,
and a class of the benchmark run as ``__main__`` would not load there."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class SleepingChunks:
    """``--sleeping-chunks``: ``spec``'s model, caches and outputs, but a chunk *sleeps* the time its
    shape (tokens, position) took when it first ran (the fastest of :data:`RUNS`) instead of computing
    it (no CPU, no cache traffic; the cache is filled with nothing, the outputs are zeros of the shape and
    dtype that first run gave). Every window, message, wake-up and hand-off happens as with prefill,
    without the chunk's work: what separates a slowdown the chunk's compute causes from one the rest of
    BubbleTea causes.

    ``spec`` may be one stage of a pipelined model (``--pipelined``, :mod:`launch.bubbletea.pipelined`):
    a stage before the last then still returns :class:`~launch.bubbletea.pipelined.Rows` of the real
    shape (zeros), which the service sends to the next stage as it sends computed rows, so the loopback
    messages, their pickling and the link threads' wake-ups stay and only the compute and its cache
    traffic go."""

    spec: object

    @property
    def vocab(self) -> int:
        return self.spec.vocab

    @property
    def max_seq(self) -> int:
        return self.spec.max_seq

    def build(self, device):
        return _Sleeping(self.spec.build(device))


# runs of a shape's first chunk, the fastest slept from then on: the first run alone (cold caches, first
# kernels of that shape) slept 1.5-3x a warm chunk's time, which cut --pipelined CausalLM's prefill to 4,100
# tokens/s against 12,000-14,000 computing, and with it the rows messages the run was to keep
RUNS = 3


class _Sleeping:
    def __init__(self, model) -> None:
        self.model, self.seconds, self.outputs = model, {}, {}    # (c, position) -> s; c -> output shape
        self.overshoot = 0.0
        if hasattr(model, "example_input"):      # a later stage: the cost fit feeds it rows (cost.fit_cost)
            self.example_input = model.example_input

    def new_cache(self, tokens: int):
        return self.model.new_cache(tokens)

    def prefill_chunk(self, inputs, cache):
        import torch

        from launch.bubbletea.pipelined import Rows

        c = inputs.real if isinstance(inputs, Rows) else inputs.numel()
        key = (c, cache.length)
        if key not in self.seconds:              # the shape's first chunk runs, on scratch caches
            times = []
            for _ in range(RUNS):
                scratch = self.model.new_cache(cache.capacity)
                scratch.length = cache.length
                t0 = time.perf_counter()
                out = self.model.prefill_chunk(inputs, scratch)
                times.append(time.perf_counter() - t0)
            self.seconds[key] = min(times)
            self.outputs[c] = (Rows, out.x.shape, out.x.dtype, out.real) if isinstance(out, Rows) else (
                None, out.shape, out.dtype, None)
        # time.sleep overshoots (0.1 ms of a 0.5 ms chunk, one core): sleep that much less, the overshoot
        # a running mean of the recent sleeps', so the chunks last as long as computed ones on average
        nap, t0 = max(0.0, self.seconds[key] - self.overshoot), time.perf_counter()
        time.sleep(nap)
        self.overshoot += 0.2 * (time.perf_counter() - t0 - nap - self.overshoot)
        cache.length += c
        rows, shape, dtype, real = self.outputs[c]          # an output's shape follows its tokens alone
        zeros = torch.zeros(shape, dtype=dtype)
        return zeros if rows is None else Rows(zeros, real)
