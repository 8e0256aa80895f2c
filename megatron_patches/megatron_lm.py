"""Megatron-LM's own ``pretrain_gpt.py`` training loop with WallFacer as core attention.

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 -m megatron_patches.megatron_lm \\
        <pretrain_gpt.py's arguments> --context-parallel-size 8 --attention-dropout 0 \\
        --wallfacer-team-size 2

runs ``$MEGATRON_LM_PATH/pretrain_gpt.py`` as its ``__main__`` (tested against the core_v0.16.1 tag),
with two hooks, both undone when it returns:

- ``add_wallfacer_args`` chained after whatever ``extra_args_provider`` pretrain_gpt.py passes (modelopt's
  or None), on ``megatron.training.pretrain`` and, where it exists (later Megatron-LM),
  ``megatron.training.arguments.parse_and_validate_args``; the chain adds the arguments once;
- the GPT model class gpt_builders.py builds becomes :class:`WallFacerGPTModel`, which swaps the core
  attention of the layer (and MTP) spec Megatron-LM built from the run's own arguments —
  ``--transformer-impl``, ``--qk-layernorm``, ``--num-experts``, ``--normalization``, ``--spec`` ... —
  for WallFacerAttention (attention.with_wallfacer), so nothing of the run's model is frozen.

WallFacerAttention reads its settings from the parsed ``--wallfacer-*`` arguments and validates them
against the run's (``WallFacerConfig.from_args``) on every rank before any communication: attention
dropout must be 0 (``--attention-dropout 0``; WallFacer has none), ``--seq-length`` divisible by
2 x ``--context-parallel-size``, no explicit masks (``--no-create-attention-mask-in-dataloader``).

Packed documents: with ``--reset-attention-mask`` (and usually ``--reset-position-ids``) the batches'
documents go to WallFacer as a packed (THD) batch instead of a dense document mask
(:func:`_packed_documents`);
Megatron-LM's own THD path (SFT packing: ``cu_seqlens`` in the batch, ``get_thd_batch_on_this_cp_rank``)
reaches WallFacerAttention as it is.
"""

from __future__ import annotations

import argparse
import inspect
import os
import runpy
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch

from megatron_patches.args import add_wallfacer_args

ENV = "MEGATRON_LM_PATH"


def megatron_lm_path(path: str | os.PathLike | None = None) -> Path:
    """The Megatron-LM source tree: ``path``, else $MEGATRON_LM_PATH; it must hold pretrain_gpt.py."""
    root = path or os.environ.get(ENV)
    if not root:
        raise ValueError(f"set {ENV} to a Megatron-LM source tree (a checkout holding pretrain_gpt.py)")
    root = Path(root).resolve()
    if not (root / "pretrain_gpt.py").is_file():
        raise ValueError(f"{ENV}={root}: no pretrain_gpt.py there; point it at a Megatron-LM checkout")
    return root


def chain_wallfacer_args(provider):
    """``provider`` (or None) followed by add_wallfacer_args; adds the arguments once per parser."""
    def chained(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
        if not any("--wallfacer-team-size" in a.option_strings for a in parser._actions):
            parser = add_wallfacer_args(parser)
        return parser
    chained.wallfacer = True
    return chained


@contextmanager
def _patched(owner, name: str, wrap):
    """``owner.name`` replaced by ``wrap(original)`` for the block; checks it takes extra_args_provider."""
    original = getattr(owner, name)
    if "extra_args_provider" not in inspect.signature(original).parameters:
        raise RuntimeError(f"{owner.__name__}.{name} no longer takes extra_args_provider; this Megatron-LM "
                           f"is not supported by megatron_patches.megatron_lm")
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def _with_provider(fn):
    def wrapper(*args, **kwargs):
        given = kwargs.get("extra_args_provider")
        if given is None or not getattr(given, "wallfacer", False):
            kwargs["extra_args_provider"] = chain_wallfacer_args(given)
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
        step = bound.get("forward_step_func", bound.get("forward_step"))
        with _packed_documents(getattr(step, "__globals__", {})):
            return fn(*args, **kwargs)
    wrapper.__signature__ = inspect.signature(fn)
    return wrapper


_PENDING: list = [None, None]  # (the tokens of the batch just sharded, its PackedSeqParams)
_ANNOUNCED = [False]


@contextmanager
def _packed_documents(script: dict):
    """pretrain_gpt.py's ``get_batch_on_this_cp_rank`` (the dense zigzag slicing its get_batch calls) takes,
    under ``--reset-attention-mask``, the batch's documents (packed_batch.documents: from the dense mask, or
    the end-of-document tokens under --no-create-attention-mask-in-dataloader) and shards them as a packed
    batch (packed_batch.get_packed_batch_on_this_cp_rank, --wallfacer-layout); the model's forward, called
    next with those tokens, gets their PackedSeqParams (WallFacerGPTModel). So no s x s mask reaches the
    attention and no score between two documents is computed; without the flag nothing changes."""
    original = script.get("get_batch_on_this_cp_rank")
    if original is None:
        yield
        return

    def get_batch_on_this_cp_rank(batch, *args, **kwargs):
        from megatron.training import get_args, get_tokenizer

        from megatron_patches.packed_batch import documents, get_packed_batch_on_this_cp_rank

        run = get_args()
        if not getattr(run, "reset_attention_mask", False):
            return original(batch, *args, **kwargs)
        flat, cu = documents(batch, get_tokenizer().eod)
        out, params = get_packed_batch_on_this_cp_rank(flat, cu, layout=run.wallfacer_layout)
        if not _ANNOUNCED[0] and torch.distributed.get_rank() == 0:
            print(f"megatron_patches.megatron_lm: --reset-attention-mask: the {cu.numel() - 1} documents of "
                  f"the first batch go to WallFacer as a packed batch", flush=True)
        _ANNOUNCED[0] = True
        _PENDING[:] = [out["tokens"], params]
        return out

    script["get_batch_on_this_cp_rank"] = get_batch_on_this_cp_rank
    try:
        yield
    finally:
        script["get_batch_on_this_cp_rank"] = original


def _take_packed(input_ids):
    """The PackedSeqParams of the batch whose tokens are ``input_ids``, if _packed_documents made it."""
    tokens, params = _PENDING
    if params is None or tokens is not input_ids:
        return None
    _PENDING[:] = [None, None]
    return params


def wallfacer_gpt_model_class():
    """A GPTModel subclass whose layer and MTP specs get WallFacerAttention as core attention."""
    from megatron.core.models.gpt import GPTModel

    from megatron_patches.attention import WallFacerAttention, watch_positions, with_wallfacer

    class WallFacerGPTModel(GPTModel):
        def __init__(self, config, transformer_layer_spec, *args, mtp_block_spec=None, **kwargs):
            mtp = None if mtp_block_spec is None else with_wallfacer(mtp_block_spec)
            layers = with_wallfacer(transformer_layer_spec)
            super().__init__(config, layers, *args, mtp_block_spec=mtp, **kwargs)
            watch_positions(self)  # the position ids checked against --wallfacer-layout
            cores = [m for m in self.modules() if isinstance(m, WallFacerAttention)]
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                team = cores[0].wallfacer.team_size if cores else "-"
                print(f"megatron_patches.megatron_lm: WallFacerAttention is the core attention of "
                      f"{len(cores)} layers (team size {team})", flush=True)

        def forward(self, input_ids, position_ids, attention_mask, *args, packed_seq_params=None, **kwargs):
            if packed_seq_params is None:
                packed_seq_params = _take_packed(input_ids)
            return super().forward(input_ids, position_ids, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)

    return WallFacerGPTModel


@contextmanager
def wallfacer_hooks(root: Path):
    """The two hooks (arguments, model class) around a run of ``root``/pretrain_gpt.py."""
    sys.path.insert(0, str(root))
    try:
        import gpt_builders
        import megatron.training
        from megatron.training import arguments

        with ExitStack() as stack:
            stack.enter_context(_patched(megatron.training, "pretrain", _with_provider))
            if hasattr(arguments, "parse_and_validate_args"):
                stack.enter_context(_patched(arguments, "parse_and_validate_args", _with_provider))
            original = gpt_builders.GPTModel
            gpt_builders.GPTModel = wallfacer_gpt_model_class()
            stack.callback(setattr, gpt_builders, "GPTModel", original)
            yield
    finally:
        sys.path.remove(str(root))


def main(argv: list[str] | None = None, path: str | None = None) -> None:
    """Run Megatron-LM's pretrain_gpt.py with ``argv`` (default: this process's arguments)."""
    root = megatron_lm_path(path)
    script = root / "pretrain_gpt.py"
    saved = sys.argv
    sys.argv = [str(script), *(sys.argv[1:] if argv is None else argv)]
    try:
        with wallfacer_hooks(root):
            if "--use-legacy-models" in sys.argv:
                raise ValueError("--use-legacy-models: WallFacer replaces megatron-core's core attention; "
                                 "drop the flag")
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
