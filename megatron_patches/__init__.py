"""WallFacer for Megatron-core: multi-dimensional ring attention as a drop-in core attention."""
