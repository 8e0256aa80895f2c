"""``python -m benchmarks.bubbletea --sleeping-chunks``: a prefill spec whose chunks sleep instead of
computing. In a module of its own because the prefill service unpickles the spec by its module's name,
and a class of the benchmark run as ``__main__`` would not load there."""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass(frozen=True)
class SleepingChunks:
    """``--sleeping-chunks``: ``spec``'s model, caches and outputs, but a chunk *sleeps* the time its
    shape (tokens, position) took the first time it ran instead of computing it again (no CPU, no cache
    traffic; the cache is filled with nothing, the logits are zeros). Every window, message, wake-up and
    hand-off happens as with prefill, without the chunk's work: what separates a slowdown the chunk's
    compute causes from one the rest of BubbleTea causes."""

    spec: object

    @property
    def vocab(self) -> int:
        return self.spec.vocab

    @property
    def max_seq(self) -> int:
        return self.spec.max_seq

    def build(self, device):
        return _Sleeping(self.spec.build(device), self.vocab)


class _Sleeping:
    def __init__(self, model, vocab: int) -> None:
        self.model, self.vocab, self.seconds = model, vocab, {}

    def new_cache(self, tokens: int):
        return self.model.new_cache(tokens)

    def prefill_chunk(self, tokens, cache):
        import torch

        key = (tokens.numel(), cache.length)
        if key not in self.seconds:              # the shape's first chunk runs, on a scratch cache
            scratch = self.model.new_cache(cache.capacity)
            scratch.length = cache.length
            t0 = time.perf_counter()
            self.model.prefill_chunk(tokens, scratch)
            self.seconds[key] = time.perf_counter() - t0
        time.sleep(self.seconds[key])
        cache.length += tokens.numel()
        return torch.zeros(tokens.numel(), self.vocab)
