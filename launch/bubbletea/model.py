"""The inference model BubbleTea prefills: a small GPT-style causal LM with a KV cache.

Its weights are its own (drawn from a private ``torch.Generator``, never the global RNG that training
seeds and consumes) and stay resident beside the training stage; prefill runs under
``torch.inference_mode`` so no autograd state is shared with training.

Chunked prefill is exact, bit for bit, not just close: prefilling a prompt of T tokens in chunks of c
(each chunk attending to the KV cache of the chunks before it) gives the same KV cache and the same
last-token logits as one forward over all T tokens. Two choices make that hold on a CPU BLAS:

- every chunk's attention runs against the *whole* cache, capacity T, with causal masking of the
  positions not written yet (zeros times a weight of exactly 0); a query row therefore reduces over
  the same T scores, in the same order, whichever chunk it is in. (Masked rows cost c·T instead of
  c·(i + c) multiply-adds; for the prompts of a bubble filler that is the price of a chunk time that
  does not grow with its position, which the packer also likes.)
- every other op is row-wise (embeddings, LayerNorm, the projections and the MLP, token by token), so
  a token's row does not depend on how many other rows share the GEMM — except that MKL computes
  GEMMs of very few rows with other kernels (measured here: fewer than 6 rows at K = 128, fewer than
  16 at K = 512 differ in the last bit). A chunk shorter than ``MIN_ROWS`` is therefore padded with
  throw-away rows (their cache writes and logits are dropped). :func:`chunk_exact` checks the whole
  property on the running kernels, and the tests assert it.

Shapes (legend): T prompt tokens, c chunk tokens, H heads, Dh head size, D = H·Dh hidden, V vocab,
L layers. The cache holds k, v as ``[L, H, T, Dh]``.

**The model interface the prefill service runs** (any model, e.g. a Hugging Face causal LM, plugs in
through it; :class:`CausalLM` is one implementation):

- a *spec* (:class:`ModelSpec`): picklable (it travels to the service's process), with ``vocab`` and
  ``max_seq`` (what :meth:`PrefillServer.submit` checks prompts against) and ``build(device)``, which
  makes the model in the process and on the device that runs the prefill. :class:`LMConfig` is a spec
  (fresh weights from its seed), so is :class:`Weights` (a given :class:`CausalLM`'s weights);
- the *model* (:class:`PrefillModel`): ``new_cache(tokens)`` returns an empty cache for a prompt of that
  many tokens, ``prefill_chunk(tokens [c], cache)`` runs the next c tokens into it and returns their
  logits [c, V];
- the *cache*: any object with ``length`` (tokens filled) and ``nbytes`` (what the memory cap counts);
  it is handed back as it is (``PrefillResult.cache``), so a decoder gets the model's own format.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn

MIN_ROWS = 16      # GEMMs of at least this many rows give every row the same bits (see above)


@runtime_checkable
class PrefillModel(Protocol):
    """What the prefill service runs (module docstring)."""

    def new_cache(self, tokens: int): ...

    def prefill_chunk(self, tokens: torch.Tensor, cache) -> torch.Tensor: ...


@runtime_checkable
class ModelSpec(Protocol):
    """How the service builds its model: picklable, ``vocab``/``max_seq``, ``build(device)``."""

    vocab: int
    max_seq: int

    def build(self, device: torch.device) -> PrefillModel: ...


@dataclass(frozen=True, slots=True)
class LMConfig:
    vocab: int = 512
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    max_seq: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "max_seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LMConfig.{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"LMConfig.hidden={self.hidden} must be a multiple of heads={self.heads}")

    @property
    def params(self) -> int:
        """Weights (embeddings, 12·D² per layer, the head); 2·params FLOPs per prefilled token."""
        d = self.hidden
        embeddings, head = (self.vocab + self.max_seq) * d, (d + 1) * self.vocab
        return embeddings + self.layers * (12 * d * d + 13 * d) + 2 * d + head

    def build(self, device=None) -> CausalLM:
        """The :class:`ModelSpec` side: this config's model (weights from ``seed``) on ``device``."""
        return CausalLM(self).to(device or "cpu")


class SizesFromConfig:
    """``vocab`` and ``max_seq`` of a ModelSpec or model that holds its :class:`LMConfig` as ``cfg``."""

    cfg: LMConfig

    @property
    def vocab(self) -> int:
        return self.cfg.vocab

    @property
    def max_seq(self) -> int:
        return self.cfg.max_seq


def embed_chunk(lm, tokens: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, int]:
    """Token + position embeddings of a chunk tokens [c] at positions cache.length..: rows
    [max(c, MIN_ROWS), D] (padded to MIN_ROWS, the padding's positions clamped into the table) and c.
    ``lm``: anything with ``tok``, ``pos`` and ``cfg`` (CausalLM, a pipelined first stage)."""
    start, c = cache.length, tokens.numel()
    if not 1 <= c <= cache.capacity - start:
        raise ValueError(f"chunk of {c} tokens at position {start}: the cache holds {cache.capacity}")
    pad = max(0, MIN_ROWS - c)
    if pad:
        tokens = torch.cat([tokens, tokens.new_zeros(pad)])
    positions = torch.arange(start, start + c + pad, device=tokens.device)
    positions.clamp_(max=lm.cfg.max_seq - 1)          # padding rows past the table
    return lm.tok(tokens) + lm.pos(positions), c


@dataclass(frozen=True)
class Weights(SizesFromConfig):
    """A :class:`ModelSpec` carrying a given model's weights (a :class:`CausalLM` passed to the server)."""

    cfg: LMConfig
    state_dict: dict

    def build(self, device=None) -> CausalLM:
        model = CausalLM(self.cfg)
        model.load_state_dict(self.state_dict)
        return model.to(device or "cpu")


@dataclass
class KVCache:
    """One request's cache; ``length`` tokens of ``k``/``v`` [L, H, T, Dh] are filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, cfg: LMConfig, tokens: int, device=None, dtype=torch.float32) -> KVCache:
        if not 1 <= tokens <= cfg.max_seq:
            raise ValueError(f"prompt of {tokens} tokens: the model takes 1..{cfg.max_seq} "
                             "(LMConfig.max_seq)")
        shape = (cfg.layers, cfg.heads, tokens, cfg.hidden // cfg.heads)
        return cls(torch.zeros(shape, device=device, dtype=dtype),
                   torch.zeros(shape, device=device, dtype=dtype))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def to(self, device) -> KVCache:
        return KVCache(self.k.to(device), self.v.to(device), self.length)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        d = cfg.hidden
        self.heads = cfg.heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                real: int) -> torch.Tensor:
        """x [c, D] at positions start..start+c−1, of which the first ``real`` rows are tokens (the rest
        padding: computed, never written to the cache)."""
        c, d = x.shape
        h, dh = self.heads, d // self.heads
        q, k, v = self.qkv(self.ln1(x)).view(c, 3, h, dh).permute(1, 2, 0, 3)   # each [H, c, Dh]
        k_cache[:, start:start + real] = k[:, :real]                 # caches: [H, T, Dh]
        v_cache[:, start:start + real] = v[:, :real]
        scores = q @ k_cache.transpose(1, 2) / math.sqrt(dh)         # [H, c, T]
        t = k_cache.shape[1]
        pos = torch.arange(start, start + c, device=x.device)[:, None]
        future = torch.arange(t, device=x.device)[None, :] > pos     # [c, T]: keys after the query
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        att = (probs @ v_cache).transpose(0, 1).reshape(c, d)        # [c, D]
        x = x + self.proj(att)
        return x + self.fc2(nn.functional.gelu(self.fc1(self.ln2(x))))


class CausalLM(SizesFromConfig, nn.Module):
    """Token and learned position embeddings, ``layers`` blocks, final LayerNorm, untied LM head."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):   # the modules' default init draws from the global RNG
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.max_seq, cfg.hidden)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab)
        g = torch.Generator().manual_seed(cfg.seed)                  # the weights: never the global RNG
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    continue
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if p.dim() > 1 else 0.01))
        self.requires_grad_(False)
        self.eval()

    def new_cache(self, tokens: int) -> KVCache:
        """An empty cache for a prompt of ``tokens`` tokens, on the model's device and in its dtype."""
        return KVCache.empty(self.cfg, tokens, self.head.weight.device, self.head.weight.dtype)

    @torch.inference_mode()
    def prefill_chunk(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run tokens [c] at positions cache.length.. into the cache; returns their logits [c, V]."""
        start = cache.length
        x, c = embed_chunk(self, tokens.to(self.head.weight.device), cache)
        for i, block in enumerate(self.blocks):
            x = block(x, cache.k[i], cache.v[i], start, c)
        cache.length = start + c
        return self.head(self.ln_f(x))[:c]

    def prefill(self, tokens: torch.Tensor, chunk: int | None = None) -> tuple[KVCache, torch.Tensor]:
        """The whole prompt, in chunks of ``chunk`` tokens (one forward when None); returns the cache and
        the last token's logits [V] (the first generated token is their argmax)."""
        cache = self.new_cache(tokens.numel())
        step = chunk or tokens.numel()
        logits = None
        for lo in range(0, tokens.numel(), step):
            logits = self.prefill_chunk(tokens[lo:lo + step], cache)
        return cache, logits[-1]


@torch.inference_mode()
def reference_logits(model: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """An independent oracle: the same weights through a textbook causal forward without a cache
    (``scaled_dot_product_attention(is_causal=True)``); logits [T, V]. Equal to the cached path up to
    float rounding, not bit for bit (different kernels)."""
    t = tokens.numel()
    x = model.tok(tokens) + model.pos(torch.arange(t, device=tokens.device))
    for b in model.blocks:
        h, dh = b.heads, model.cfg.hidden // b.heads
        q, k, v = b.qkv(b.ln1(x)).view(t, 3, h, dh).permute(1, 2, 0, 3)
        att = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + b.proj(att.transpose(0, 1).reshape(t, -1))
        x = x + b.fc2(nn.functional.gelu(b.fc1(b.ln2(x))))
    return model.head(model.ln_f(x))


def chunk_exact(model: CausalLM, tokens: int = 48, chunk: int = 16) -> bool:
    """Whether chunked prefill reproduces one full forward bit for bit on this machine's kernels."""
    prompt = torch.randint(model.cfg.vocab, (tokens,), generator=torch.Generator().manual_seed(1))
    full_cache, full = model.prefill(prompt)
    part_cache, part = model.prefill(prompt, chunk)
    return (torch.equal(full, part) and torch.equal(full_cache.k, part_cache.k)
            and torch.equal(full_cache.v, part_cache.v))
