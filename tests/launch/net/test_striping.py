"""k-device gloo WAN groups: k TCP connections per pipeline pair, stripes arrive intact, the ledger
shows one send per stripe on the WAN group."""

import pytest
import torch
import torch.distributed as dist

from commweave.ledger import recording
from launch.net.sockets import established_connections
from launch.net.striping import open_wan_groups
from tests.launch.plans import two_dc_plan

LO = {"GLOO_SOCKET_IFNAME": "lo"}


def _connections_per_pair(k):
    plan = two_dc_plan(connections=k)                 # pp=2, dp=2: pairs (0, 2) and (1, 3)
    dist.barrier()
    before = established_connections()
    dist.barrier()
    wan = open_wan_groups(plan, k)
    dist.barrier()
    return established_connections() - before, len(wan.groups)


@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("k", [1, 3])
def test_each_wan_pair_gets_k_connections(world, k):
    assert world.run(_connections_per_pair, k) == [(k, 1)] * 4


def _roundtrip(k):
    plan = two_dc_plan(connections=k)
    wan = open_wan_groups(plan, k)
    me = dist.get_rank()
    peer = {0: 2, 2: 0, 1: 3, 3: 1}[me]
    big_n = (3 << 20) // 4 + 3                       # 3 MiB and 3 floats: stripes of unequal size
    out = {}
    with recording() as led:
        for n in (big_n, 256):
            if me < 2:
                x = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2).t() + me  # not contiguous
                wan.isend(x, me, peer).wait()
            else:
                y = torch.empty(2, n)
                wan.irecv(y, me, peer).wait()
                ref = torch.arange(2 * n, dtype=torch.float32).reshape(n, 2).t() + (me - 2)
                out[n] = torch.equal(y, ref)
    name = f"atlas-wan({min(me, peer)},{max(me, peer)})"
    kind = "send" if me < 2 else "recv"
    out["calls"] = led.calls(kind, name)
    out["bytes"] = led.sent(kind, name) if me < 2 else led.received(kind, name)
    if me >= 2:
        with pytest.raises(ValueError, match="contiguous"):
            wan.irecv(torch.empty(4, 4).t(), me, peer)
    return out


@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("k", [1, 4])
def test_striped_transfer_is_exact_and_uses_k_stripes(world, k):
    results = world.run(_roundtrip, k)
    big = (3 << 20) // 4 + 3
    for me, r in enumerate(results):
        assert r["calls"] == k + 1                   # the big tensor in k stripes, the small one whole
        assert r["bytes"] == 4 * 2 * (big + 256)
        if me >= 2:
            assert r[big] and r[256]


def _mismatch():
    with pytest.raises(ValueError, match="the world has 4 ranks but the plan 6"):
        open_wan_groups(two_dc_plan(pp=3, dp=2), 2)
    return True


@pytest.mark.world_size(4, env=LO)
def test_plan_must_match_the_world(world):
    assert world.run(_mismatch) == [True] * 4


class _FakeNCCLOptions:
    """Stands in for torch.distributed.ProcessGroupNCCL.Options, absent from CPU builds of torch."""

    def __init__(self, is_high_priority_stream=False):
        self.is_high_priority_stream = is_high_priority_stream
        self.config = type("Config", (), {})()


def test_nccl_wan_groups_get_megatrons_socket_options(monkeypatch):
    """On NCCL every WAN pair group is made with the options megatron-core builds for a group configured
    `net_name: socket`; transfers go whole (NCCL stripes over its own sockets)."""
    from types import SimpleNamespace

    from megatron.core.parallel_state import get_nccl_options

    made = []
    monkeypatch.setattr(dist, "ProcessGroupNCCL", SimpleNamespace(Options=_FakeNCCLOptions), raising=False)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or object())
    wan = open_wan_groups(two_dc_plan(connections=8), 8)
    assert [ranks for ranks, _ in made] == [[0, 2], [1, 3]] and wan.stripes == 1
    megatron = get_nccl_options("pp", {"pp": {"net_name": "socket"}})
    for _, kw in made:
        assert vars(kw["pg_options"].config) == vars(megatron.config) == {"net_name": "socket"}
        assert kw["pg_options"].is_high_priority_stream is megatron.is_high_priority_stream is False
    assert list(wan.pairs) == [frozenset((0, 2))]            # rank 0's own pair


def _connections_of_each_device():
    plan = two_dc_plan(connections=3)
    wan = open_wan_groups(plan, 3)
    (pair,) = wan.pairs.values()
    return pair.connections


@pytest.mark.world_size(4, env=LO)
def test_each_device_connection_is_known_on_both_ranks(world):
    """Rank 0's view of device i's connection is rank 2's, reversed (the same for ranks 1 and 3)."""
    conns = world.run(_connections_of_each_device)
    for a, b in ((0, 2), (1, 3)):
        assert len(set(conns[a])) == 3 and "?" not in conns[a]
        assert [c.split("->")[::-1] for c in conns[a]] == [c.split("->") for c in conns[b]]


def _shutdown(connection: str) -> None:
    """Break one TCP connection from this end, as a network fault would (ports from the group's record)."""
    import os
    import socket

    local, remote = (int(end.rsplit(":", 1)[1]) for end in connection.split("->"))
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            tcp = s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
            if tcp and s.getsockname()[1] == local and s.getpeername()[1] == remote:
                s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            s.close()


def _repair_one_broken_connection():
    import warnings

    plan = two_dc_plan(connections=3)              # pairs (0, 2) and (1, 3)
    wan = open_wan_groups(plan, 3)
    me = dist.get_rank()
    peer = {0: 2, 2: 0, 1: 3, 3: 1}[me]
    (pair,) = wan.pairs.values()
    broken = pair.connection(1)
    if me == 0:
        _shutdown(broken)                          # pair (0, 2) loses device 1; pair (1, 3) is untouched
    dist.barrier()
    sent = torch.randint(-2**31, 2**31 - 1, (3 << 20,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(7))         # every bit pattern counts
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if me < 2:
            wan.isend(sent, me, peer).wait()
            equal = None
        else:
            got = torch.empty_like(sent)
            wan.irecv(got, me, peer).wait()
            equal = torch.equal(got, sent)
        again = torch.full((3 << 20,), float(me))     # the next transfer goes over the new connections
        if me < 2:
            wan.isend(again, me, peer).wait()
        else:
            wan.irecv(again, me, peer).wait()
            equal = equal and bool((again == peer).all())
    return ([(e["stripe"], e["connection"]) for e in wan.events], broken, pair.generation, equal,
            [str(w.message) for w in caught if "ATLAS WAN" in str(w.message)])


@pytest.mark.world_size(4, env=LO)
def test_a_broken_connection_is_reported_and_the_transfer_resent(world):
    results = world.run(_repair_one_broken_connection)
    for me, (events, broken, generation, equal, warned) in enumerate(results):
        if me in (0, 2):
            assert events == [(1, broken)] and generation == 1 and len(warned) == 1
            assert f"stripe(s) 1 ({broken})" in warned[0] and "retry 1 of 2" in warned[0]
        else:
            assert events == [] and generation == 0 and warned == []
        assert equal in (None, True) and (me < 2 or equal)       # bit-identical, and the next one too
