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
(and shows in its ledger under the group's name), and every wait is bounded by its timeout.

A transfer is a :class:`Transfer`: its ``wait()`` completes every stripe or, when a connection breaks
(reset, closed) or stalls (no progress within ``COMMWEAVE_TIMEOUT_S``), hands the pair to
:mod:`launch.net.recovery`, which reports the stripe, its TCP connection and the peer, re-opens the pair's
connections (a fresh group, agreed by both ranks) and sends again, up to ``ATLAS_WAN_RETRIES`` times.

NCCL needs none of the striping: ``NCCL_NSOCKS_PERTHREAD`` x ``NCCL_SOCKET_NTHREADS`` already stripes
each message over that many sockets (:mod:`launch.net.sockets`), so on NCCL the pair groups are plain
communicators, created with Megatron's per-group NCCL options (``net_name: socket``: the WAN pairs
use NCCL's socket transport even on InfiniBand hosts) and a transfer goes whole (one stripe); they
still carry the temporal-sharing turns. Recovery is gloo-only (an NCCL error leaves the communicator
to be aborted, not reused): on NCCL a broken link is an error naming the stripe and the peer.
"""

from __future__ import annotations

import inspect
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from commweave import comm
from launch.net.recovery import recover
from launch.net.sockets import device_connections, gloo_ifname, group_sockets, socket_inodes
from launch.plan.plan import Plan
from launch.plan.socket_limits import STRIPE_MIN_BYTES


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


@contextmanager
def _unique_name(pair: Pair | None, generation: int, local: bool):
    """torch names a group made by its members only (``use_local_synchronization``) after its ranks
    alone, so a pair's second re-opened group would collide with its first (and reusing a name would
    reuse its store keys): such a group is named after the pair's original group and the generation,
    the same on both ranks."""
    if not local:
        yield
        return
    c10d = dist.distributed_c10d
    original = c10d._process_group_name
    if list(inspect.signature(original).parameters) != ["ranks", "use_hashed_name"]:
        raise RuntimeError("torch.distributed's _process_group_name changed; cannot re-open a WAN pair")
    name = c10d.GroupName(f"{pair.original}-atlas-reopen-{generation}")
    c10d._process_group_name = lambda ranks, use_hashed_name: name
    try:
        yield
    finally:
        c10d._process_group_name = original


_pool: ThreadPoolExecutor | None = None


def _waiters() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="atlas-stripe")
    return _pool


@dataclass
class Pair:
    """One WAN pipeline pair as this rank sees it: its current group and the transfers on it."""

    ranks: tuple[int, int]            # (lower, higher) global rank
    group: object
    name: str
    connections: list[str] = field(default_factory=list)  # gloo: the TCP connection of each device
    generation: int = 0               # how many times the connections were re-opened
    posted: dict[int, int] = field(default_factory=dict)   # sender rank -> transfers posted that way
    done: dict[int, int] = field(default_factory=dict)     # sender rank -> transfers completed here
    inflight: list[Transfer] = field(default_factory=list)
    last_sent: list | None = None     # this rank's last completed send (its stripes), for a resend
    last_index: int = -1
    original: str = ""                # torch's name of the pair's first group (unique in the job)

    def connection(self, stripe: int) -> str:
        return self.connections[stripe % len(self.connections)] if self.connections else "?"


@dataclass
class WanGroups:
    """The WAN pipeline pairs of a plan and, on gloo, their k-device groups."""

    connections: int
    stripes: int                  # transfers are cut in this many pieces: connections on gloo, 1 on NCCL
    stripe_min_bytes: int = STRIPE_MIN_BYTES
    devices: str = ""             # GLOO_SOCKET_IFNAME for (re-)opening a pair's groups
    pairs: dict[frozenset, Pair] = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)      # broken stripes and retries, as reported

    @property
    def groups(self) -> dict[frozenset, object]:
        return {k: p.group for k, p in self.pairs.items()}

    def group(self, me: int, peer: int):
        """The WAN group of the pair (me, peer), or None when the pair does not cross the WAN."""
        pair = self.pairs.get(frozenset((me, peer)))
        return None if pair is None else pair.group

    def isend(self, tensor: torch.Tensor, me: int, peer: int, what: str = "") -> Transfer:
        pair = self.pairs[frozenset((me, peer))]
        return Transfer(self, pair, "send", self._stripes(tensor), me, peer, what)

    def irecv(self, tensor: torch.Tensor, me: int, peer: int, what: str = "") -> Transfer:
        if not tensor.is_contiguous():
            raise ValueError(f"striped receive needs a contiguous buffer, got strides {tensor.stride()}")
        pair = self.pairs[frozenset((me, peer))]
        return Transfer(self, pair, "recv", self._stripes(tensor), me, peer, what)

    def _stripes(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """k views of the flat tensor (chunk i goes with tag i, hence over device i)."""
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        if self.stripes == 1 or tensor.numel() * tensor.element_size() < self.stripe_min_bytes:
            return [flat]
        return list(flat.tensor_split(self.stripes))

    def open_pair(self, ranks: tuple[int, int], local: bool) -> object:
        """A group for the pair: collective over the world (``local`` False, at set-up) or over the two
        ranks only (``local`` True: re-opening after a broken connection); returns the group."""
        lo, hi = ranks
        pair = self.pairs.get(frozenset(ranks))
        generation = 0 if pair is None else pair.generation + 1
        name = f"atlas-wan({lo},{hi})" + (f"#{generation}" if generation else "")
        member = dist.get_rank() in ranks
        before = socket_inodes() if member and dist.get_backend() == "gloo" else None
        if dist.get_backend() != "gloo":
            group = dist.new_group([lo, hi], pg_options=nccl_wan_options(), use_local_synchronization=local)
            if member:
                comm.set_group_name(group, name)
        else:
            with _gloo_devices(self.devices), _unique_name(pair, generation, local):
                group = comm.new_group([lo, hi], name=name, local_sync=local)
        if member:
            found = self._connections(group, before, lo if dist.get_rank() == hi else hi) \
                if before is not None else []
            if pair is None:
                self.pairs[frozenset(ranks)] = Pair(ranks, group, name, found,
                                                    original=dist.distributed_c10d._get_process_group_name(group))
            else:
                pair.group, pair.name, pair.connections, pair.generation = group, name, found, generation
        return group


    @staticmethod
    def _connections(group, before: set[int], peer: int) -> list[str]:
        """The TCP connection of each device of a new two-rank gloo group (for reports, and for tests
        that break one): the two ranks swap their listening ports in device order through the store."""
        mine, conns = group_sockets(before)
        store = dist.distributed_c10d._get_default_store()
        key = f"atlas-wan-listeners/{dist.distributed_c10d._get_process_group_name(group)}"
        store.set(f"{key}/{dist.get_rank()}", json.dumps(mine))
        store.wait([f"{key}/{peer}"], timedelta(seconds=comm.timeout_s()))
        return device_connections(mine, json.loads(store.get(f"{key}/{peer}")), conns)


class _Failed:
    """A stripe whose post already failed (gloo raises at once on a pair it knows is closed)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def wait(self) -> bool:
        raise comm.CommError(f"commweave: post failed: {self.error}") from self.error

    def is_completed(self) -> bool:
        return True


class Transfer:
    """One striped send or receive on a WAN pair; ``wait()`` completes it or raises naming the stripe,
    its connection, the peer and the pipeline coordinates (``what``)."""

    def __init__(self, wan: WanGroups, pair: Pair, kind: str, views: list, me: int, peer: int,
                 what: str, resend_of: int | None = None) -> None:
        self.wan, self.pair, self.kind, self.views, self.me, self.peer = wan, pair, kind, views, me, peer
        self.sender = me if kind == "send" else peer
        self.what = what or f"WAN {kind} {'to' if kind == 'send' else 'from'} rank {peer}"
        self.attempts, self.done, self.handles = 0, False, []
        if resend_of is None:
            self.index = pair.posted.get(self.sender, 0)
            pair.posted[self.sender] = self.index + 1
            pair.inflight.append(self)
        else:                       # a repair's resend of a completed transfer: not counted again
            self.index = resend_of
        self.post()

    def post(self) -> None:
        group, post = self.pair.group, comm.isend if self.kind == "send" else comm.irecv
        peer = dist.get_group_rank(group, self.peer)
        self.handles = []
        for i, view in enumerate(self.views):
            try:
                self.handles.append(post(view, peer, group, tag=i))
            except RuntimeError as e:
                self.handles.append(_Failed(e))

    def wait_stripes(self) -> dict[int, Exception]:
        """Wait on every stripe, all at once (one thread each: a gloo wait releases the GIL), so that k
        stuck stripes cost one timeout, not k; the ones that failed, by index."""
        handles, self.handles = self.handles, []

        def wait(h) -> Exception | None:
            try:
                h.wait()
            except comm.CommError as e:
                return e
            return None

        outcomes = [wait(handles[0])] if len(handles) == 1 else list(_waiters().map(wait, handles))
        return {i: e for i, e in enumerate(outcomes) if e is not None}

    def finish(self) -> None:
        self.done = True
        if self in self.pair.inflight:
            self.pair.inflight.remove(self)
        self.pair.done[self.sender] = max(self.pair.done.get(self.sender, 0), self.index + 1)
        if self.kind == "send" and self.index > self.pair.last_index:
            self.pair.last_sent, self.pair.last_index = self.views, self.index

    def wait(self) -> bool:
        if self.done:
            return True
        failed = self.wait_stripes()
        if not failed:
            self.finish()
            return True
        recover(self.wan, self.pair, self, failed)
        return True

    def is_completed(self) -> bool:
        return self.done


def wan_devices(plan: Plan, connections: int, ifname: str | None = None) -> str:
    """``GLOO_SOCKET_IFNAME`` for this rank's WAN groups: ``ifname`` (default: the first entry of this
    process's ``GLOO_SOCKET_IFNAME``, else the plan's interface for this rank's data center) repeated
    ``connections`` times. Local: every rank checks it before the collective set-up."""
    if dist.get_world_size() != plan.world_size:
        raise ValueError(f"open_wan_groups: the world has {dist.get_world_size()} ranks but the plan "
                         f"{plan.world_size} (pp={plan.pp} x tp={plan.tp} x dp={plan.dp})")
    if dist.get_backend() != "gloo":
        return ""
    if ifname is None:
        current = os.environ.get("GLOO_SOCKET_IFNAME", "")
        ifname = current.split(",")[0] or plan.host_of(dist.get_rank())[0].ifname
    if connections > 1 and not ifname:
        raise ValueError("open_wan_groups: several gloo connections need the interface name: set "
                         "GLOO_SOCKET_IFNAME or the data center's \"ifname\" in the topology file")
    return gloo_ifname(ifname, connections) if ifname else os.environ.get("GLOO_SOCKET_IFNAME", "")


def open_wan_groups(plan: Plan, connections: int, ifname: str | None = None,
                    stripe_min_bytes: int = STRIPE_MIN_BYTES, devices: str | None = None) -> WanGroups:
    """Create the group of every WAN pipeline pair (k gloo devices each). Collective over the world:
    every rank calls it, for every pair, in the same order (``devices`` from :func:`wan_devices`)."""
    devices = wan_devices(plan, connections, ifname) if devices is None else devices
    gloo = dist.get_backend() == "gloo"
    wan = WanGroups(connections, stripes=connections if gloo else 1, stripe_min_bytes=stripe_min_bytes,
                    devices=devices)
    for src, dst in plan.wan_pairs():
        wan.open_pair((min(src, dst), max(src, dst)), local=False)
    return wan


def nccl_wan_options():
    """``ProcessGroupNCCL.Options`` for a group that crosses the WAN, built as megatron-core's
    ``get_nccl_options`` builds them from ``nccl_communicator_config_path`` (``net_name: socket``):
    NCCL's socket transport, where NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS stripe each message."""
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=False)
    options.config.net_name = "socket"
    return options
