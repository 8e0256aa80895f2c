"""WallFacer for Megatron-core: multi-dimensional ring attention as a drop-in core attention.

``wallfacer_attention`` (the functional core) needs only torch; the Megatron pieces
(``WallFacerAttention``, ``get_gpt_layer_wallfacer_spec``, ``add_wallfacer_args``,
``WallFacerConfig``, ``watch_positions``, ``get_packed_batch_on_this_cp_rank``) import megatron-core on
first use.
"""

from megatron_patches.wallfacer import wallfacer_attention

_LAZY = {
    "WallFacerAttention": "megatron_patches.attention",
    "get_gpt_layer_wallfacer_spec": "megatron_patches.attention",
    "with_wallfacer": "megatron_patches.attention",
    "watch_positions": "megatron_patches.attention",
    "get_packed_batch_on_this_cp_rank": "megatron_patches.packed_batch",
    "add_wallfacer_args": "megatron_patches.args",
    "WallFacerConfig": "megatron_patches.args",
}

__all__ = ["wallfacer_attention", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatron_patches' has no attribute {name!r}")
