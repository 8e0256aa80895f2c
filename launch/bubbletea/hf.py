"""Hugging Face causal LMs in BubbleTea: any ``transformers`` causal LM from a local directory.

    server = HFPrefillServer("/models/my-llama", chunk_tokens=32, callback=hand_off)
    server.submit("req-1", prompt_ids)          # prefilled in the bubbles, chunk by chunk
    # hand_off(result): result.cache is a transformers DynamicCache of the whole prompt, result.first_token
    # the greedy first token; a decoder continues where the prefill stopped:
    ids = torch.tensor([prompt + [result.first_token]])
    out = model.generate(ids, max_new_tokens=n - 1, do_sample=False, **{cache_argument(model): result.cache})

**How.** The prefill service loads the model itself (``AutoModelForCausalLM.from_pretrained(path,
local_files_only=True)``: nothing is downloaded, no weights cross the pipe) and runs every chunk
through the model's own forward against a transformers ``Cache`` whose layers are the request's
:class:`~launch.bubbletea.model.KVCache` (:func:`in_place_cache`: the attention writes the chunk's keys
and values into it and reads its filled prefix as views; no per-chunk copy). :class:`HFConfig` is a
:class:`~launch.bubbletea.model.ModelSpec` and :class:`HFModel` a
:class:`~launch.bubbletea.model.PrefillModel`, so the service, its memory cap, its cost model and the
packer run it as they run :class:`~launch.bubbletea.model.CausalLM` (a KVCache ``[L, H_kv, T, Dh]`` has
the ``length`` and ``nbytes`` the cap counts, preallocated), and only
the hand-off knows about Hugging Face: :func:`to_dynamic_cache` turns the finished KVCache into the
library's own format (:class:`HFPrefillServer` does it for every result).
The KVCache is in the model's dtype (the attention reads it as it is); the endpoint ships it as float32.

**Exact in what sense.** A chunk attends to the filled prefix only (i + c keys, the library's own
masking), so chunked prefill differs from one full forward in the last bits of a float32 reduction
(3e-8 on the test models), unlike CausalLM's bit-exact scheme. What a decoder needs holds and is
tested: greedy ``generate()`` continued from BubbleTea's cache gives the tokens of ``generate()`` from
scratch, for GPT-2 and LLaMA, for chunk sizes that do and do not divide the prompt.

**Which models.** Any model ``AutoModelForCausalLM`` loads whose cache is one full-attention
``DynamicLayer`` per layer (GPT-2, LLaMA, Mistral and Qwen2 without sliding windows, ...). A model
whose layers keep a sliding window or a recurrent state is refused with the layer's type: its cache
is not a prefix of keys and values, so a KVCache cannot hold it.

**The cost model.** The service fits ``a + b·c + e·c·T`` by timing chunks of c tokens at the end of
caches of T tokens. A Hugging Face chunk attends only to what is filled (its cost grows with its end,
not with T), so the fit is exact for a request's last chunk and an upper bound for the earlier ones:
the packer leaves them room to spare, never too little. (Timed into empty caches, ``e`` came out 0 and
late chunks ran over their predictions: see benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.bubbletea.model import CausalLM, KVCache
from launch.bubbletea.server import PrefillResult, PrefillServer

DTYPES = ("float32", "bfloat16", "float16", "float64")
FAMILIES = ("gpt2", "llama")


@dataclass(frozen=True, slots=True)
class HFConfig:
    """A local Hugging Face causal LM as the prefill service sees it; build it with :meth:`load`.

    ``heads`` and ``hidden`` describe the *cache*: key/value heads and their total width (KVCache's
    shape is ``[layers, heads, T, hidden // heads]``), which differ from the attention's for GQA."""

    path: str
    dtype: str
    model_type: str
    vocab: int
    max_seq: int
    layers: int
    heads: int
    hidden: int

    @classmethod
    def load(cls, path: str | Path, dtype: str = "float32", max_seq: int | None = None) -> HFConfig:
        """Read ``path/config.json``; ``max_seq`` caps the prompt length (default: the model's
        position limit)."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        where = Path(path).expanduser().resolve()
        if not (where / "config.json").is_file():
            raise ValueError(f"path={str(path)!r}: not a directory with a config.json (a Hugging Face model "
                             "saved with save_pretrained; nothing is downloaded)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r}: must be one of {', '.join(DTYPES)}")
        hf = AutoConfig.from_pretrained(where, local_files_only=True)
        if hf.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"path={str(path)!r}: model_type {hf.model_type!r} is not a causal LM "
                             "transformers' AutoModelForCausalLM can load")
        text = hf.get_text_config()
        limit = getattr(text, "max_position_embeddings", None)
        if max_seq is None:
            if not isinstance(limit, int):
                raise ValueError(f"path={str(path)!r}: the config states no max_position_embeddings; "
                                 "pass max_seq=")
            max_seq = limit
        elif isinstance(max_seq, bool) or not isinstance(max_seq, int) or max_seq < 1 or (
                isinstance(limit, int) and max_seq > limit):
            raise ValueError(f"max_seq={max_seq!r}: must be an integer in 1..{limit} (the model's "
                             "max_position_embeddings)")
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(str(where), dtype, hf.model_type, text.vocab_size, max_seq, text.num_hidden_layers,
                   kv_heads, kv_heads * head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def build(self, device=None) -> HFModel:
        """The model, loaded here onto ``device`` (the prefill service calls this where it runs)."""
        return HFModel(self, device)


class HFModel:
    """A Hugging Face causal LM as a :class:`~launch.bubbletea.model.PrefillModel` (``new_cache``,
    ``prefill_chunk``), with CausalLM's ``cfg`` and ``prefill`` besides."""

    def __init__(self, cfg: HFConfig, device=None) -> None:
        from transformers import AutoModelForCausalLM, DynamicCache

        self.cfg = cfg
        self.device = torch.device(device or "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=cfg.torch_dtype,
                                                          local_files_only=True).to(self.device)
        self.model.requires_grad_(False)
        self.model.eval()
        self._cache_arg = cache_argument(self.model)
        # the layers the model's own cache would have: anything but full attention keeps no prefix of keys
        # and values (a sliding window, a recurrent state), which neither a KVCache nor the hand-off holds
        kinds = [type(layer).__name__ for layer in DynamicCache(config=self.model.config).layers] or [
            "DynamicLayer"] * cfg.layers
        for i, kind in enumerate(kinds):
            if kind != "DynamicLayer":
                raise ValueError(f"{cfg.model_type}: layer {i}'s cache is a {kind}, not a full-attention "
                                 "DynamicLayer; BubbleTea hands off key/value prefixes only (no sliding "
                                 "windows or recurrent states)")

    def new_cache(self, tokens: int) -> KVCache:
        """An empty cache of ``tokens`` tokens in the model's dtype (the attention reads it in place)."""
        return KVCache.empty(self.cfg, tokens, self.device, self.cfg.torch_dtype)

    @torch.inference_mode()
    def prefill_chunk(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run tokens [c] at positions cache.length.. into the cache; returns their float32 logits [c, V].

        The model's attention writes the chunk's keys and values straight into the KVCache and reads the
        filled prefix as views of it (:func:`in_place_cache`): no copy of the prefix per chunk, where a
        ``DynamicCache`` concatenates a fresh i + c tokens in every layer (measured on the benchmark's
        LLaMA, 2 x 128 wide, chunks of 32: the chunk ending at token 256 took 0.1-0.15 ms of its ~2 ms
        less; same logits and cache, bit for bit)."""
        start, c = cache.length, tokens.numel()
        if not 1 <= c <= cache.capacity - start:
            raise ValueError(f"chunk of {c} tokens at position {start}: the cache holds {cache.capacity}")
        dyn = in_place_cache(cache)
        ids = tokens.reshape(1, c).to(self.device)
        out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: dyn})
        filled = [layer.get_seq_length() for layer in dyn.layers]
        if filled != [start + c] * self.cfg.layers:
            raise ValueError(f"{self.cfg.model_type}: the model filled its cache layers to {filled} tokens; "
                             f"{self.cfg.layers} layers of {start + c} expected (its config's)")
        cache.length = start + c
        return out.logits[0].float()

    # the prompt in chunks (one forward when None): (cache, last logits [V]); CausalLM's loop, which needs
    # only new_cache and prefill_chunk
    prefill = CausalLM.prefill


@functools.cache
def _prefix_layer():
    """transformers' ``DynamicLayer`` over a preallocated buffer (built on first use: transformers is
    imported only where a Hugging Face model runs)."""
    from transformers.cache_utils import DynamicLayer

    class PrefixLayer(DynamicLayer):
        """One layer of a KVCache as the model's attention sees it: ``update`` writes the new keys and
        values at the filled length and returns the filled prefix, views of k, v [H, T, Dh]."""

        def __init__(self, k: torch.Tensor, v: torch.Tensor, length: int) -> None:
            super().__init__()
            self.k, self.v, self.length = k, v, length
            self.keys, self.values = k[None, :, :length], v[None, :, :length]
            self.device, self.is_initialized = k.device, True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            lo, hi = self.length, self.length + key_states.shape[-2]   # states: [1, H, c, Dh]
            if hi > self.k.shape[1]:
                raise ValueError(f"a chunk up to token {hi}: the cache holds {self.k.shape[1]}")
            self.k[:, lo:hi] = key_states[0]
            self.v[:, lo:hi] = value_states[0]
            self.length = hi
            self.keys, self.values = self.k[None, :, :hi], self.v[None, :, :hi]
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.length

    return PrefixLayer


def in_place_cache(cache: KVCache):
    """A transformers ``Cache`` (batch 1) whose layers read and write ``cache``'s k, v in place: the
    model's forward appends to the KVCache itself."""
    from transformers.cache_utils import Cache

    layer = _prefix_layer()
    return Cache(layers=[layer(cache.k[i], cache.v[i], cache.length) for i in range(cache.k.shape[0])])


def cache_argument(model) -> str:
    """The name under which ``model.forward`` and ``model.generate`` take a cache: recent transformers
    renamed ``past_key_values`` to ``cache`` (and warn about the old name); older ones know only the first."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def to_dynamic_cache(cache: KVCache, dtype: torch.dtype = torch.float32):
    """The filled prefix of a KVCache [L, H, T, Dh] as a transformers ``DynamicCache`` of batch 1: views
    when ``dtype`` is the KVCache's, copies otherwise."""
    from transformers import DynamicCache

    n = cache.length
    if n == 0:
        return DynamicCache()
    return DynamicCache(ddp_cache_data=[(cache.k[i, None, :, :n].to(dtype), cache.v[i, None, :, :n].to(dtype))
                                        for i in range(cache.k.shape[0])])


def with_dynamic_cache(result: PrefillResult, dtype: torch.dtype) -> PrefillResult:
    return dataclasses.replace(result, cache=to_dynamic_cache(result.cache, dtype))


class HFPrefillServer(PrefillServer):
    """A :class:`PrefillServer` for a local Hugging Face model; ``callback`` gets results whose ``cache`` is
    a ``DynamicCache`` (in the model's dtype). ``options`` are PrefillServer's."""

    def __init__(self, model: str | Path | HFConfig, chunk_tokens: int,
                 callback: Callable[[PrefillResult], None], dtype: str = "float32",
                 max_seq: int | None = None, **options) -> None:
        cfg = model if isinstance(model, HFConfig) else HFConfig.load(model, dtype, max_seq)
        super().__init__(cfg, chunk_tokens, lambda r: callback(with_dynamic_cache(r, cfg.torch_dtype)),
                         **options)


def save_tiny(family: str, where: str | Path, vocab: int = 512, hidden: int = 128, layers: int = 2,
              heads: int = 4, max_seq: int = 1024, seed: int = 0) -> Path:
    """A small random GPT-2- or LLaMA-style causal LM saved with ``save_pretrained`` into ``where``
    (nothing is downloaded), sized like :class:`~launch.bubbletea.model.LMConfig`'s defaults: per layer
    12·hidden² weights (GPT-2: attention 4·D², MLP 2·D·4D; LLaMA: attention 4·D², gated MLP 3·D·I with
    I = 8·D/3 rounded up to a multiple of 8). Weights from ``seed``; the global RNG is left as it was."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"family={family!r}: must be one of {', '.join(FAMILIES)}")
    for name, v in (("vocab", vocab), ("hidden", hidden), ("layers", layers), ("heads", heads),
                    ("max_seq", max_seq)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    if hidden % heads:
        raise ValueError(f"hidden={hidden}: must be a multiple of heads={heads}")
    # no bos/eos: prompts are random ids, and generate() must not stop at one
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=max_seq, n_embd=hidden, n_layer=layers,
                                         n_head=heads, bos_token_id=None, eos_token_id=None)
        make = transformers.GPT2LMHeadModel
    else:
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                          intermediate_size=-(-hidden // 3) * 8, num_hidden_layers=layers,
                                          num_attention_heads=heads, num_key_value_heads=heads,
                                          max_position_embeddings=max_seq, bos_token_id=None,
                                          eos_token_id=None)
        make = transformers.LlamaForCausalLM
    where = Path(where)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        make(config).save_pretrained(where)
    return where
