"""The inference model pipelined over the training stages' ranks of one data center.

The default keeps a whole copy of the inference model beside every rank (:mod:`.engine`'s docstring says
why). A model larger than one rank's spare memory is split instead: stage j of the inference pipeline
holds layers [a_j, a_{j+1}) (the first also the embeddings, the last the final LayerNorm and the head)
and the KV cache of those layers only. A prefill chunk runs on stage j in that rank's window, and the
output rows of the window's chunks go, in one message when its chunks are done, to stage j+1's service
over a socket inside the data center (the training's WAN boundaries never carry it: :func:`link_stages`
takes the ranks of one data center; one message per window, not per chunk: :meth:`.service.Service.flush`
says why); the next stage runs them in *its* next window. The last stage hands off the first token;
each stage's callback receives its own layers' cache, where a decoder pipelined the same way continues.

Exactness: a stage runs exactly what the whole model runs for those layers — the same rows (a chunk
shorter than ``MIN_ROWS`` is padded on the first stage and its padding rows travel with it), the same
weights (every stage builds the whole model from the seed and keeps its layers), the same kernels — so
the last stage's logits and every stage's cache equal the whole model's bit for bit (tests).

Costs: one chunk's activations, ``(max(c, MIN_ROWS)) · D`` floats per hop; a request's time to first
token is at least one window per stage. Where the bubbles of consecutive stages do not line up (1F1B:
stage j+1 idles while stage j works) a chunk simply waits, queued at the next stage, for its next
window: no stage waits for another, so the chain costs latency, never training time.
"""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass

import torch

from launch.bubbletea.model import MIN_ROWS, CausalLM, KVCache, LMConfig, SizesFromConfig, embed_chunk


@dataclass(frozen=True)
class StageSpec(SizesFromConfig):
    """A :class:`launch.bubbletea.model.ModelSpec` for layers [lo, hi) of ``LMConfig``'s model."""

    cfg: LMConfig
    lo: int
    hi: int

    def __post_init__(self) -> None:
        check_layers("StageSpec", self.lo, self.hi, self.cfg.layers)

    def build(self, device=None) -> StageLM:
        return StageLM(CausalLM(self.cfg), self.lo, self.hi).to(device or "cpu")


def split(cfg: LMConfig, stages: int) -> list[StageSpec]:
    """Layers in ``stages`` contiguous runs (:func:`layer_runs`). A Hugging Face model:
    :func:`launch.bubbletea.hf_pipelined.split_hf`."""
    return [StageSpec(cfg, a, b) for a, b in layer_runs(cfg.layers, stages)]


def check_layers(spec: str, lo: int, hi: int, layers: int) -> None:
    """A stage's layers [lo, hi) must be a non-empty range of the model's ``layers``."""
    if not 0 <= lo < hi <= layers:
        raise ValueError(f"{spec}: layers [{lo}, {hi}) must be a non-empty range inside [0, {layers})")


def layer_runs(layers: int, stages: int) -> list[tuple[int, int]]:
    """[a_j, a_{j+1}) for j < ``stages``: contiguous, as even as they go (the first runs one longer)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"split: stages={stages} must lie in 1..{layers} (the model's layers)")
    q, r = divmod(layers, stages)
    bounds = [0]
    for j in range(stages):
        bounds.append(bounds[-1] + q + (j < r))
    return list(itertools.pairwise(bounds))


class StageLM(torch.nn.Module):
    """Layers [lo, hi) of a :class:`CausalLM`: tokens in on the first stage, rows [c + pad, D] between
    stages, logits [c, V] out of the last. ``prefill_chunk`` returns what goes on."""

    def __init__(self, whole: CausalLM, lo: int, hi: int) -> None:
        super().__init__()
        self.cfg, self.lo, self.hi = whole.cfg, lo, hi
        self.first, self.last = lo == 0, hi == whole.cfg.layers
        self.blocks = torch.nn.ModuleList(whole.blocks[lo:hi])
        self.tok, self.pos = (whole.tok, whole.pos) if self.first else (None, None)
        self.ln_f, self.head = (whole.ln_f, whole.head) if self.last else (None, None)
        self.requires_grad_(False)
        self.eval()

    def new_cache(self, tokens: int) -> KVCache:
        w = self.blocks[0].qkv.weight
        cache = KVCache.empty(self.cfg, tokens, w.device, w.dtype)
        return KVCache(cache.k[:self.hi - self.lo].clone(), cache.v[:self.hi - self.lo].clone())

    def example_input(self, tokens: torch.Tensor):
        """What this stage receives for ``tokens`` (the cost fit's inputs): the tokens, or rows."""
        if self.first:
            return tokens
        w = self.blocks[0].qkv.weight
        rows = max(tokens.numel(), MIN_ROWS)
        return Rows(torch.randn(rows, self.cfg.hidden, generator=torch.Generator().manual_seed(0)).to(w),
                    tokens.numel())

    @torch.inference_mode()
    def prefill_chunk(self, inputs, cache: KVCache):
        """The next chunk into this stage's cache: tokens [c] (first stage) or :class:`Rows`; returns
        :class:`Rows` for the next stage, or the logits [c, V] on the last."""
        start = cache.length
        if self.first:
            x, c = embed_chunk(self, inputs.to(self.blocks[0].qkv.weight.device), cache)
        else:
            x, c = inputs.x.to(self.blocks[0].qkv.weight.device), inputs.real
        for i, block in enumerate(self.blocks):
            x = block(x, cache.k[i], cache.v[i], start, c)
        cache.length = start + c
        if self.last:
            return self.head(self.ln_f(x))[:c]
        return Rows(x, c)


@dataclass
class Rows:
    """A chunk's rows between stages: ``x`` [c + pad, D], of which the first ``real`` are tokens."""

    x: torch.Tensor
    real: int


# The default back-pressure bound, from measurement (README, "back-pressure"): what a stage has in flight
# downstream is its request rate times the feedback latency (Little's law: start of a request here ->
# its "finished" from the next stage, seen at this stage's next plan). In benchmarks.bubbletea --pipelined
# (prompts of 256 in chunks of 32, ~0.11 s iterations) the latency was 0.25-0.32 s, about 2.5
# iterations, also with the rows and "finished" sent once per window (ahead x prompt / tokens/s with the
# bound binding, ahead 4-12) and the first stage's unbounded rate 36 (GPT-2) and 58 (CausalLM)
# requests/s: 9-12 and 15-19 in flight. 24 gained nothing over 16 beyond the repeats' spread and queued
# more (stage 1 up to 20-24, TTFT up); 16 kept the queue at or under 16 (unbounded: 26-65 and growing);
# 4 cut the tokens/s to about a quarter.
AHEAD = 16


def pipeline_setup(stage: int, stages: int, host: str, authkey: bytes, ahead: int | None = AHEAD) -> dict:
    """The service settings of one stage: a later stage listens on ``host`` (inside the data center).
    ``ahead``: the requests a stage may have started that the next stage has not finished; a stage with
    that many in flight admits no new request until the next one reports one finished (back-pressure),
    so a later stage with less room in its windows than the first queues at most ``ahead`` requests.
    None: no bound (such a stage's queue then grows without bound: 82 at the end of one run). The bound
    must cover the rate times the feedback latency or it starves the stages (:data:`AHEAD`); for other
    prompt lengths or windows, about (requests the first stage prefills per iteration) x 2.5."""
    if ahead is not None and (isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 1):
        raise ValueError(f"ahead={ahead!r}: a stage must be allowed one request or more in flight downstream")
    return {"listen": host if stage > 0 else None, "authkey": authkey, "ahead": ahead}


def link_stages(server, group, hosts: list[str] | None = None) -> None:
    """Connect the stages' services in order (``group``: the inference pipeline's ranks, stage = group
    rank; ``hosts``: each stage's address inside the data center, default loopback). The ports are
    all-gathered over ``group``; each service accepts the previous stage before it reaches the next one,
    so the chain comes up from the first stage on without waiting in a cycle."""
    from commweave import comm

    stage, stages = comm.rank(group), comm.size(group)
    mine = torch.tensor([server.address[1] if server.address else 0], dtype=torch.int64)
    ports = torch.zeros(stages, dtype=torch.int64)
    comm.all_gather(ports, mine, group)
    if stage > 0:
        server.link("accept")
    if stage + 1 < stages:
        server.link(((hosts or ["127.0.0.1"] * stages)[stage + 1], int(ports[stage + 1])))


def shared_key(group) -> bytes:
    """One random key for the stages' sockets, drawn on the group's first rank and broadcast."""
    from commweave import comm

    key = torch.tensor(list(secrets.token_bytes(16)), dtype=torch.uint8).to(torch.int64)
    comm.broadcast(key, comm.global_rank(group, 0), group)
    return bytes(int(b) for b in key)
