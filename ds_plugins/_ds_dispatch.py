"""Temporary adapter: DeepSpeed's encode/decode behind the ``ds_plugins.dispatch`` API (until it lands)."""

from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode


def dispatch(x, indices, locations, num_experts, capacity):
    return _sparse_encode(x, _route_slots(indices, locations, num_experts, capacity), num_experts, capacity)


def combine(expert_output, indices, locations, gates):
    e, c, m = expert_output.shape
    slots = _route_slots(indices, locations, e, c)
    return _sparse_decode(expert_output.reshape(e * c, m), slots, gates, indices.shape[1])
