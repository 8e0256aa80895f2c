"""k-device gloo WAN groups: k TCP connections per pipeline pair, stripes arrive intact, the ledger
shows one send per stripe on the WAN group."""

import pytest
import torch
import torch.distributed as dist

from commweave.ledger import recording
from launch.sockets import established_connections
from launch.striping import open_wan_groups
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
