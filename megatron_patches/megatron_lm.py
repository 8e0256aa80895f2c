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
        return fn(*args, **kwargs)
    wrapper.__signature__ = inspect.signature(fn)
    return wrapper


def wallfacer_gpt_model_class():
    """A GPTModel subclass whose layer and MTP specs get WallFacerAttention as core attention."""
    from megatron.core.models.gpt import GPTModel

    from megatron_patches.attention import WallFacerAttention, with_wallfacer

    class WallFacerGPTModel(GPTModel):
        def __init__(self, config, transformer_layer_spec, *args, mtp_block_spec=None, **kwargs):
            mtp = None if mtp_block_spec is None else with_wallfacer(mtp_block_spec)
            layers = with_wallfacer(transformer_layer_spec)
            super().__init__(config, layers, *args, mtp_block_spec=mtp, **kwargs)
            cores = [m for m in self.modules() if isinstance(m, WallFacerAttention)]
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                team = cores[0].wallfacer.team_size if cores else "-"
                print(f"megatron_patches.megatron_lm: WallFacerAttention is the core attention of "
                      f"{len(cores)} layers (team size {team})", flush=True)

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
