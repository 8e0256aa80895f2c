"""ZeRO 1/2 optimizer state in DeepSpeed's layout with ESP-sharded experts (for ds_plugins.checkpoint).

ZeRO 1/2 (``DeepSpeedZeroOptimizer``, deepspeed/runtime/zero/stage_1_and_2.py) keeps one flat vector per
parameter group: the group's parameters in order, each followed by its alignment padding, the whole padded
to a multiple of 2·d and split into d equal partitions over the group's data-parallel group (for an MoE
group: the expert-data-parallel group, of size d). Each rank saves its partition of the fp32 master
weights and of every optimizer state (Adam's exp_avg, exp_avg_sq). With ESP = s, an MoE group's vector
holds blocks of the expert parameters where DeepSpeed's MoE with the same model code holds them whole, so
the wrapped ``state_dict`` / ``load_state_dict`` convert, for every group with sharded parameters:

    save    partition --AG(dp group)--> Parm's whole vector --AG(ESP)--> every block of every parameter
            -> whole parameters, laid out as DeepSpeed lays them out -> this rank's DeepSpeed partition
    load    DeepSpeed partition --AG(dp group)--> DeepSpeed's whole vector -> this rank's block of each
            parameter, laid out as Parm lays them out -> the Parm partitions

together with the bookkeeping DeepSpeed checks on load (group padding, parameter alignment paddings) and
the slice mappings (universal checkpoints). Dense groups pass through untouched. Both of DeepSpeed's
formats are handled: rigid (the base optimizer's own state dict: padded partitions) and elastic (a list
per group: partitions without their padding). Memory: s whole vectors of the group during a save.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.checkpoint.constants import (
    BASE_OPTIMIZER_STATE,
    GROUP_PADDINGS,
    PARAM_ALIGNMENT_PADDINGS,
    PARAM_SLICE_MAPPINGS,
    SINGLE_PARTITION_OF_FP32_GROUPS,
)
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.utils.tensor_fragment import fragment_address

from commweave import comm

_LOAD_SIGNATURE = ["self", "state_dict_list", "load_optimizer_states", "load_from_fp32_weights",
                   "checkpoint_folder", "load_serial", "param_shapes"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a group sits in ZeRO's flat vector, and its d partitions."""

    shapes: tuple[tuple[int, ...], ...]
    paddings: tuple[int, ...]
    dp: int
    alignment: int

    @classmethod
    def of(cls, shapes, *, element_size: int, aligned: bool, dp: int, start_alignment: int) -> FlatLayout:
        """ZeRO's rule: a parameter but the last is padded to 16 bytes when ``parameter_alignment`` is on."""
        step = 16 // math.gcd(16, element_size) if aligned else 1
        paddings, offset = [], 0
        for k, shape in enumerate(shapes):
            offset += math.prod(shape)
            paddings.append(0 if k == len(shapes) - 1 else (-offset) % step)
            offset += paddings[-1]
        return cls(tuple(tuple(s) for s in shapes), tuple(paddings), dp, start_alignment * dp)

    @functools.cached_property
    def offsets(self) -> list[int]:
        out, offset = [], 0
        for shape, padding in zip(self.shapes, self.paddings, strict=True):
            out.append(offset)
            offset += math.prod(shape) + padding
        return out

    @property
    def used(self) -> int:
        return self.offsets[-1] + math.prod(self.shapes[-1]) + self.paddings[-1]

    @property
    def partition(self) -> int:
        return -(-self.used // self.alignment) * self.alignment // self.dp

    def lean(self, rank: int) -> int:
        """Elements of partition ``rank`` before the group's trailing padding."""
        return min(max(self.used - rank * self.partition, 0), self.partition)

    def params(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o: o + math.prod(s)].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    def flatten(self, params: list[torch.Tensor]) -> torch.Tensor:
        flat = params[0].new_zeros(self.partition * self.dp)
        for o, p in zip(self.offsets, params, strict=True):
            flat[o: o + p.numel()] = p.reshape(-1)
        return flat

    def slices(self, names: list[str], rank: int) -> OrderedDict:
        """DeepSpeed's PARAM_SLICE_MAPPINGS entry: each parameter's fragment in partition ``rank``."""
        lo, hi, out = rank * self.partition, (rank + 1) * self.partition, OrderedDict()
        for name, o, s in zip(names, self.offsets, self.shapes, strict=True):
            start, end = max(o, lo), min(o + math.prod(s), hi)
            if start < end:
                out[name] = fragment_address(start=start - lo, numel=end - start)
        return out


@dataclass
class _Group:
    """A parameter group with ESP-sharded parameters and its two layouts."""

    index: int
    parm: FlatLayout
    deepspeed: FlatLayout
    tags: list
    names: list[str]
    dp_group: object
    dp_rank: int
    entries: list[int]
    """The checkpoint entries (data-parallel ranks) of this group's dp group, in dp-group rank order."""
    name: str


def supports(optimizer) -> bool:
    return isinstance(optimizer, DeepSpeedZeroOptimizer)


def _groups(opt) -> list[_Group]:
    out = []
    for i, params in enumerate(opt.round_robin_bit16_groups):
        tags = [getattr(p, "esp_shard", None) for p in params]
        if not any(tags):
            continue
        dp_group = opt.real_dp_process_group[i]
        dp = dist.get_world_size(dp_group)
        layout = functools.partial(FlatLayout.of, element_size=params[0].element_size(),
                                   aligned=bool(opt.parameter_alignment), dp=dp,
                                   start_alignment=opt.nccl_start_alignment_factor)
        parm = layout([tuple(p.shape) for p in params])
        if list(parm.paddings) != list(opt.round_robin_bit16_padding[i]):
            raise RuntimeError(f"parm: ZeRO group {i}'s alignment paddings {opt.round_robin_bit16_padding[i]}"
                               f" differ from the layout rule's {list(parm.paddings)}")
        full = [tuple(p.shape) if t is None else tuple(t.full_shape(p.shape))
                for p, t in zip(params, tags, strict=True)]
        group = opt.optimizer.param_groups[i]
        entries = opt.get_ep_ranks(group_name=group["name"]) if opt.is_moe_group(group) else list(range(dp))
        out.append(_Group(i, parm, layout(full), tags, [opt.param_names[p] for p in params], dp_group,
                          dist.get_rank(dp_group), entries, group.get("name", "")))
    # DeepSpeed orders its MoE groups by iterating a set of names, which differs between processes: the
    # collectives go group by group in name order, the same on every rank
    return sorted(out, key=lambda g: g.name)


def _whole(partition: torch.Tensor, g: _Group) -> torch.Tensor:
    """The group's whole flat vector from every dp rank's padded partition, on the accelerator (ZeRO-Offload
    keeps the partitions in host memory, which NCCL cannot gather)."""
    partition = partition.to(get_accelerator().current_device_name())
    if g.parm.dp == 1:
        return partition
    out = partition.new_empty(partition.numel() * g.parm.dp)
    comm.all_gather(out, partition.contiguous(), g.dp_group)
    return out


def _to_deepspeed(partition: torch.Tensor, g: _Group) -> torch.Tensor:
    whole = _whole(partition, g)
    tag = next(t for t in g.tags if t is not None)
    peers = whole.new_empty((tag.size, whole.numel()))
    comm.all_gather(peers, whole, tag.group)
    blocks = [g.parm.params(peers[q]) for q in range(tag.size)]
    own = g.parm.params(whole)
    params = [own[k] if t is None else torch.cat([b[k] for b in blocks], dim=t.dim)
              for k, t in enumerate(g.tags)]
    flat = g.deepspeed.flatten(params)
    return flat.narrow(0, g.dp_rank * g.deepspeed.partition, g.deepspeed.partition).to(partition.device)


def _to_parm(partition: torch.Tensor, g: _Group) -> torch.Tensor:
    params = g.deepspeed.params(_whole(partition, g))
    parm = g.parm.flatten([p if t is None else t.block(p) for p, t in zip(params, g.tags, strict=True)])
    return parm.to(partition.device)


def _padded(t: torch.Tensor, padding: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(padding)]) if padding else t


def _partitions(sd: dict, g: _Group, layout: FlatLayout) -> list:
    """Group ``g``'s partition tensors in the state dict ``sd``, padded to ``layout``'s partition size, each
    with a setter ``(value, rank, layout)`` that stores a padded partition back in ``sd``'s own format."""
    i, found = g.index, []
    padding = sd[GROUP_PADDINGS][i]
    fp32 = sd[SINGLE_PARTITION_OF_FP32_GROUPS]
    found.append((lambda v, rank, lay: fp32.__setitem__(i, v[: lay.lean(rank)]), _padded(fp32[i], padding)))
    base = sd[BASE_OPTIMIZER_STATE]
    if isinstance(base, dict):  # rigid: the base optimizer's state dict, padded partitions
        pid = base["param_groups"][i]["params"][0]
        state = base["state"][pid] = dict(base["state"].get(pid, {}))  # not the live optimizer's dict
        found += [(lambda v, rank, lay, key=key: state.__setitem__(key, v), t)
                  for key, t in state.items() if torch.is_tensor(t) and t.dim() > 0]
    else:       # elastic: one dict per group, partitions without their padding
        state = base[i] = dict(base[i])
        found += [(lambda v, rank, lay, key=key: state.__setitem__(key, v[: lay.lean(rank)]),
                   _padded(t, padding)) for key, t in state.items() if torch.is_tensor(t) and t.dim() > 0]
    for _, t in found:
        if t.numel() != layout.partition:
            raise ValueError(f"parm: the ZeRO state of parameter group {i} has a partition of {t.numel()} "
                             f"elements where the layout has {layout.partition}: it was saved from another "
                             "model or expert-data-parallel size")
    return found


def _set_layout(sd: dict, g: _Group, layout: FlatLayout, rank: int) -> None:
    sd[GROUP_PADDINGS][g.index] = layout.partition - layout.lean(rank)
    if PARAM_ALIGNMENT_PADDINGS in sd:
        sd[PARAM_ALIGNMENT_PADDINGS][g.index] = list(layout.paddings)


def _state_dict(opt, original):
    sd = original()
    for g in _groups(opt):
        for setter, t in _partitions(sd, g, g.parm):
            setter(_to_deepspeed(t, g), g.dp_rank, g.deepspeed)
        _set_layout(sd, g, g.deepspeed, g.dp_rank)
        if PARAM_SLICE_MAPPINGS in sd:
            sd[PARAM_SLICE_MAPPINGS][g.index] = g.deepspeed.slices(g.names, g.dp_rank)
    return sd


def _load_state_dict(opt, original, state_dict_list, *args, **kwargs):
    """Rewrite every loaded entry of the sharded groups (the rigid format loads only this rank's, the
    elastic one all of them) from this rank's entry and its dp peers', then load as DeepSpeed does."""
    mine = state_dict_list[dist.get_rank(opt.dp_process_group)] if state_dict_list else None
    if mine is not None:
        for g in _groups(opt):
            wholes = [_to_parm(t, g) for _, t in _partitions(mine, g, g.deepspeed)]
            for rank, entry in enumerate(g.entries):
                sd = state_dict_list[entry]
                if sd is None:
                    continue
                for (setter, _), whole in zip(_partitions(sd, g, g.deepspeed), wholes, strict=True):
                    setter(whole.narrow(0, rank * g.parm.partition, g.parm.partition).clone(), rank, g.parm)
                _set_layout(sd, g, g.parm, rank)
    return original(state_dict_list, *args, **kwargs)


def _full_param_shapes(engine, original):
    """The model file's ``param_shapes`` (zero_to_fp32 reads the flat vectors with them): whole experts."""
    by_name = {engine.param_names[p]: p for p in engine.module.parameters() if p in engine.param_names}
    shapes = original()
    for group in shapes:
        for name, shape in group.items():
            tag = getattr(by_name.get(name), "esp_shard", None)
            if tag is not None:
                group[name] = torch.Size(tag.full_shape(shape))
    return shapes


def install(engine) -> None:
    """Wrap the engine's ZeRO optimizer (this instance only) so that its checkpoints are DeepSpeed's."""
    opt = engine.optimizer
    params = list(inspect.signature(type(opt).load_state_dict).parameters)
    if params != _LOAD_SIGNATURE:
        raise RuntimeError(f"parm: DeepSpeedZeroOptimizer.load_state_dict{params} is not the signature "
                           f"{_LOAD_SIGNATURE} this conversion was written for")
    opt.state_dict = functools.partial(_state_dict, opt, opt.state_dict)
    opt.load_state_dict = functools.partial(_load_state_dict, opt, opt.load_state_dict)
    shapes = engine._get_zero_param_shapes
    engine._get_zero_param_shapes = functools.partial(_full_param_shapes, engine, shapes)
