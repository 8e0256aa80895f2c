"""Multi-TCP pipeline transfers over gloo: one process group per WAN pipeline pair with k gloo
devices, and large sends split into k stripes, one per device (atlas.md §2.3, traps.md).

gloo opens one TCP connection per rank pair *per device* (context), and point-to-point picks the
context by ``tag % devices``; DeepSpeed's and Megatron's p2p send with tag 0, i.e. on one connection.
Both halves are needed: the k-device group, and the tensor cut into k chunks sent with tags
``0..k−1``. Either alone stays at one connection's rate.

torch 2.13 ignores gloo ``pg_options`` in ``new_group``; the gloo constructor that ``new_group``
calls reads ``GLOO_SOCKET_IFNAME`` (one device per comma-separated entry) at construction, so the
WAN groups are created with that variable set to the interface repeated k times and restored after.
Groups stay registered with torch.distributed, so every transfer goes through :mod:`commweave.comm`
(and shows in its ledger under the group's name).

NCCL needs none of this: ``NCCL_NSOCKS_PERTHREAD`` x ``NCCL_SOCKET_NTHREADS`` already stripes each
message over that many sockets (:mod:`launch.sockets`), so on NCCL the pair groups are plain
communicators and a transfer goes whole (one stripe); they still carry the temporal-sharing turns.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commweave import comm
from launch.plan import Plan
from launch.sockets import gloo_ifname

STRIPE_MIN_BYTES = 1 << 20   # below this a transfer goes whole: striping would only add latency


@contextmanager
def _gloo_devices(value: str):
    saved = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = saved


@dataclass
class WanGroups:
    """The WAN pipeline pairs of a plan and, on gloo, their k-device groups."""

    connections: int
    stripes: int                  # transfers are cut in this many pieces: connections on gloo, 1 on NCCL
    stripe_min_bytes: int = STRIPE_MIN_BYTES
    groups: dict[frozenset, object] = field(default_factory=dict)   # {src, dst} -> process group

    def group(self, me: int, peer: int):
        """The WAN group of the pair (me, peer), or None when the pair does not cross the WAN."""
        return self.groups.get(frozenset((me, peer)))

    def isend(self, tensor: torch.Tensor, me: int, peer: int) -> list:
        group = self.groups[frozenset((me, peer))]
        return [comm.isend(c, _group_rank(group, peer), group, tag=i)
                for i, c in enumerate(self._stripes(tensor))]

    def irecv(self, tensor: torch.Tensor, me: int, peer: int) -> list:
        group = self.groups[frozenset((me, peer))]
        if not tensor.is_contiguous():
            raise ValueError(f"striped receive needs a contiguous buffer, got strides {tensor.stride()}")
        return [comm.irecv(c, _group_rank(group, peer), group, tag=i)
                for i, c in enumerate(self._stripes(tensor))]

    def _stripes(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """k views of the flat tensor (chunk i goes with tag i, hence over device i)."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if self.stripes == 1 or tensor.numel() * tensor.element_size() < self.stripe_min_bytes:
            return [flat]
        return list(flat.tensor_split(self.stripes))


def open_wan_groups(plan: Plan, connections: int, ifname: str | None = None,
                    stripe_min_bytes: int = STRIPE_MIN_BYTES) -> WanGroups:
    """Create the group of every WAN pipeline pair (k gloo devices each). Collective over the world.

    ``ifname``: the interface the WAN traffic leaves by (default: the first entry of this process's
    ``GLOO_SOCKET_IFNAME``, else the plan's interface for this rank's data center).
    """
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"open_wan_groups: the world has {dist.get_world_size()} ranks but the plan "
                         f"{plan.world_size} (pp={plan.pp} x tp={plan.tp} x dp={plan.dp})")
    me = dist.get_rank()
    if dist.get_backend() != "gloo":
        wan = WanGroups(connections, stripes=1, stripe_min_bytes=stripe_min_bytes)
        for src, dst in plan.wan_pairs():
            group = comm.new_group([src, dst], name=f"atlas-wan({src},{dst})")   # collective
            if me in (src, dst):
                wan.groups[frozenset((src, dst))] = group
        return wan
    if ifname is None:
        current = os.environ.get("GLOO_SOCKET_IFNAME", "")
        ifname = current.split(",")[0] or plan.host_of(me)[0].ifname
    if connections > 1 and not ifname:
        raise ValueError("open_wan_groups: several gloo connections need the interface name: set "
                         "GLOO_SOCKET_IFNAME or the data center's \"ifname\" in the topology file")
    wan = WanGroups(connections, stripes=connections, stripe_min_bytes=stripe_min_bytes)
    devices = gloo_ifname(ifname, connections) if ifname else os.environ.get("GLOO_SOCKET_IFNAME", "")
    for src, dst in plan.wan_pairs():
        # new_group is collective: every rank calls it for every pair, in the same order.
        with _gloo_devices(devices):
            group = comm.new_group([src, dst], name=f"atlas-wan({src},{dst})")
        if me in (src, dst):
            wan.groups[frozenset((src, dst))] = group
    return wan


def _group_rank(group, global_rank: int) -> int:
    return dist.get_group_rank(group, global_rank)
