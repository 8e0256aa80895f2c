"""A Hugging Face causal LM pipelined over the training stages' ranks of one data center.

:mod:`.pipelined` splits the project's CausalLM; this splits a local ``transformers`` model (:mod:`.hf`)
the same way, for a model larger than one rank's spare memory: stage j holds decoder layers
[a_j, a_{j+1}) (:func:`launch.bubbletea.pipelined.layer_runs`), the first also the token (and position)
embeddings, the last the final norm and the head, and the KV cache of its layers only. The stages'
services, their links inside the data center and the windows are :mod:`.pipelined`'s: a chunk's output
rows (:class:`launch.bubbletea.pipelined.Rows`, ``[c, hidden]``) go to the next stage's service, which runs
them in its own next window.

How a stage runs the model's own code: every stage loads the whole checkpoint (``local_files_only``),
keeps its decoder layers in the model's layer list and renumbers their ``layer_idx`` from 0, so the
attention writes into the stage's cache (which holds only those layers; the cache's first layer gives
the positions and the mask, and all its layers hold the same tokens). A later stage enters through the
model's ``inputs_embeds``: the previous stage's rows, which the model passes to its first kept layer
unchanged — for GPT-2 after adding its learned positions, which a later stage replaces by zeros
(``x + 0`` is ``x``), since the first stage added them already; a stage before the last replaces the final
norm by the identity and returns the base model's hidden states. So each stage runs exactly the
operations the whole model runs on those layers, on the same inputs: the last stage's logits and every
stage's cache equal the whole model's chunked prefill bit for bit (tests; the chunked prefill itself is
:mod:`.hf`'s, exact up to float32 reduction order against one full forward, and what ``generate()``
continues from).

Which models: the families listed in :data:`PARTS`, whose forward passes ``inputs_embeds`` to the layers
as they are. A family that scales or otherwise transforms the embeddings inside its forward (Gemma's
``sqrt(hidden)``) would apply that again on a later stage, so an unlisted ``model_type`` is refused
rather than split by guesswork; it can still run whole, one copy per rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from launch.bubbletea.hf import HFConfig, HFModel, in_place_cache
from launch.bubbletea.model import KVCache, SizesFromConfig
from launch.bubbletea.pipelined import Rows, check_layers, layer_runs

# model_type -> (the base model's attribute, its decoder layer list, its learned positions or None, its
# final norm): where a stage cuts the model
PARTS = {"gpt2": ("transformer", "h", "wpe", "ln_f"), "llama": ("model", "layers", None, "norm")}


@dataclass(frozen=True)
class HFStageSpec(SizesFromConfig):
    """A :class:`launch.bubbletea.model.ModelSpec` for decoder layers [lo, hi) of a local HF model."""

    cfg: HFConfig
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if self.cfg.model_type not in PARTS:
            raise ValueError(f"model_type {self.cfg.model_type!r}: a Hugging Face model splits into stages "
                             f"for {', '.join(PARTS)} only (families whose forward hands inputs_embeds to "
                             "the layers unchanged); run it whole, one copy per rank")
        check_layers("HFStageSpec", self.lo, self.hi, self.cfg.layers)

    def build(self, device=None) -> HFStage:
        return HFStage(self, device)


def split_hf(cfg: HFConfig, stages: int) -> list[HFStageSpec]:
    """The model's decoder layers in ``stages`` contiguous runs, as :func:`.pipelined.split` cuts CausalLM."""
    return [HFStageSpec(cfg, a, b) for a, b in layer_runs(cfg.layers, stages)]


class _ZeroPositions(torch.nn.Module):
    """GPT-2's position embedding on a later stage: zeros of its shape and dtype (the first stage added
    the positions)."""

    def __init__(self, like: torch.nn.Embedding) -> None:
        super().__init__()
        self.width, self.dtype = like.embedding_dim, like.weight.dtype

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*position_ids.shape, self.width, dtype=self.dtype, device=position_ids.device)


class HFStage(HFModel):
    """Layers [lo, hi) of a Hugging Face causal LM as a :class:`~launch.bubbletea.model.PrefillModel`:
    tokens in on the first stage, :class:`Rows` between stages, logits [c, V] out of the last."""

    def __init__(self, spec: HFStageSpec, device=None) -> None:
        super().__init__(spec.cfg, device)
        self.lo, self.hi = spec.lo, spec.hi
        self.first, self.last = spec.lo == 0, spec.hi == spec.cfg.layers
        base_name, layers_name, positions, norm = PARTS[spec.cfg.model_type]
        self.base = getattr(self.model, base_name)
        kept = getattr(self.base, layers_name)[spec.lo:spec.hi]
        for module in kept.modules():              # the stage's cache holds its layers only, from 0
            if isinstance(getattr(module, "layer_idx", None), int):
                module.layer_idx -= spec.lo
        setattr(self.base, layers_name, kept)
        if positions is not None and not self.first:
            setattr(self.base, positions, _ZeroPositions(getattr(self.base, positions)))
        if not self.last:
            setattr(self.base, norm, torch.nn.Identity())
        self.width = self.model.config.get_text_config().hidden_size
        self.layers = spec.hi - spec.lo

    def new_cache(self, tokens: int) -> KVCache:
        part = dataclasses.replace(self.cfg, layers=self.layers)
        return KVCache.empty(part, tokens, self.device, self.cfg.torch_dtype)

    def example_input(self, tokens: torch.Tensor):
        """What this stage receives for ``tokens`` (the cost fit's inputs): the tokens, or rows."""
        if self.first:
            return tokens
        x = torch.randn(tokens.numel(), self.width, generator=torch.Generator().manual_seed(0))
        return Rows(x.to(self.device, self.cfg.torch_dtype), tokens.numel())

    @torch.inference_mode()
    def prefill_chunk(self, inputs, cache: KVCache):
        """The next chunk into this stage's cache: tokens [c] (first stage) or :class:`Rows`; returns
        :class:`Rows` [c, hidden] for the next stage, or the float32 logits [c, V] on the last."""
        start = cache.length
        if self.first:
            c = inputs.numel()
            feed = {"input_ids": inputs.reshape(1, c).to(self.device)}
        else:
            c = inputs.real
            feed = {"inputs_embeds": inputs.x[None].to(self.device)}
        if not 1 <= c <= cache.capacity - start:
            raise ValueError(f"chunk of {c} tokens at position {start}: the cache holds {cache.capacity}")
        dyn = in_place_cache(cache)
        out = (self.model if self.last else self.base)(use_cache=True, **feed, **{self._cache_arg: dyn})
        filled = [layer.get_seq_length() for layer in dyn.layers]
        if filled != [start + c] * self.layers:
            raise ValueError(f"{self.cfg.model_type} layers [{self.lo}, {self.hi}): the stage filled its "
                             f"cache layers to {filled} tokens; {self.layers} layers of {start + c} expected")
        cache.length = start + c
        if self.last:
            return out.logits[0].float()
        return Rows(out.last_hidden_state[0], c)
