"""commweave.comm: results of every collective, and the ledger's bytes against the wire formulas."""

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from commweave.ledger import Ledger, recording

F32 = 4


def _groups():
    """Pairs [0,1],[2,3] named "pair" (every rank calls new_group for every group, as torch requires)."""
    me = dist.get_rank()
    mine = None
    for ranks in ([0, 1], [2, 3]):
        g = comm.new_group(ranks, name="pair")
        if me in ranks:
            mine = g
    return mine


def _collectives_and_ledger():
    me, world = dist.get_rank(), dist.group.WORLD
    pair = _groups()
    out = {}
    with recording() as led:
        # all_to_all, equal splits: rank r sends row block j to rank j.
        x = torch.arange(8, dtype=torch.float32).reshape(4, 2) + 100 * me
        y = torch.empty_like(x)
        comm.all_to_all(y, x, world)
        out["a2a"] = y[:, 0].tolist()
        # all_to_all, uneven splits: rank r sends (j+1) rows to rank j.
        rows_in = [j + 1 for j in range(4)]
        xin = torch.full((sum(rows_in), 3), float(me))
        yout = torch.empty(4 * (me + 1), 3)
        comm.all_to_all(yout, xin, world, output_splits=[me + 1] * 4, input_splits=rows_in)
        out["a2av"] = yout[:, 0].tolist()
        # all_gather of an N-d tensor into an N-d buffer inside the pair.
        ag = torch.empty(2, 2, 3)
        comm.all_gather(ag, torch.full((2, 3), float(me)), pair)
        out["ag"] = ag[:, 0, 0].tolist()
        # reduce_scatter inside the pair, bf16.
        rs = torch.empty(2, dtype=torch.bfloat16)
        comm.reduce_scatter(rs, torch.arange(4, dtype=torch.bfloat16) * (me + 1), pair)
        out["rs"] = rs.tolist()
        ar = torch.ones(5, dtype=torch.float64) * me
        comm.all_reduce(ar, world)
        out["ar"] = ar[0].item()
        b = torch.full((7,), float(me))
        comm.broadcast(b, 1, pair)
        out["bcast"] = b[0].item()
        # a ring step in the pair's coordinates, posted as a batch
        nxt, prv = (comm.rank(pair) + 1) % 2, (comm.rank(pair) - 1) % 2
        recv = torch.empty(6)
        comm.wait_all(comm.batch_p2p([comm.P2P("send", torch.full((6,), float(me)), nxt, pair),
                                      comm.P2P("recv", recv, prv, pair)]))
        out["p2p"] = recv[0].item()
    out["ledger"] = led.as_dict()
    return out


@pytest.mark.world_size(4)
def test_results_and_wire_bytes(world):
    res = world.run(_collectives_and_ledger)
    for me, r in enumerate(res):
        pair = me // 2 * 2
        assert r["a2a"] == [100 * j + 2 * me for j in range(4)]
        assert r["a2av"] == [float(j) for j in range(4) for _ in range(me + 1)]
        assert r["ag"] == [float(pair), float(pair + 1)]
        assert r["rs"] == [float(v * (pair + 1 + pair + 2)) for v in (2 * (me % 2), 2 * (me % 2) + 1)]
        assert r["ar"] == 6.0
        assert r["bcast"] == float(pair + 1)
        assert r["p2p"] == float(pair + 1 - me % 2)
        led = r["ledger"]
        # a2a equal: 4x2 f32 = 32 B, 3/4 leaves the rank; uneven: sends 1+2+3+4 rows of 3 f32, minus own
        assert led["all_to_all@world"] == {
            "calls": 2,
            "sent": 32 * 3 // 4 + (10 - (me + 1)) * 3 * F32,
            "received": 32 * 3 // 4 + 3 * (me + 1) * 3 * F32,
        }
        assert led["all_gather@pair"] == {"calls": 1, "sent": 6 * F32, "received": 6 * F32}
        assert led["reduce_scatter@pair"] == {"calls": 1, "sent": 2 * 2, "received": 2 * 2}
        assert led["all_reduce@world"]["sent"] == 2 * 5 * 8 * 3 // 4
        assert led["broadcast@pair"] == {"calls": 1, "sent": 7 * F32 if me % 2 else 0,
                                         "received": 0 if me % 2 else 7 * F32}
        assert led["send@pair"]["sent"] == 6 * F32 and led["recv@pair"]["received"] == 6 * F32


def _refuses_none_group():
    with pytest.raises(ValueError, match="group=None"):
        comm.all_reduce(torch.ones(1), None)
    with pytest.raises(ValueError, match=r"input dim 0 \(3\) must divide by the group size 2"):
        comm.all_to_all(torch.empty(3), torch.empty(3), dist.group.WORLD)
    with pytest.raises(ValueError, match="output has 3 elements, expected 2 x 2"):
        comm.all_gather(torch.empty(3), torch.empty(2), dist.group.WORLD)
    with pytest.raises(ValueError, match="must be contiguous"):
        comm.all_gather(torch.empty(4, 2).t(), torch.empty(4), dist.group.WORLD)
    return True


@pytest.mark.world_size(2)
def test_bad_arguments_raise_before_communicating(world):
    assert world.run(_refuses_none_group) == [True, True]


def _trace_foreign():
    x = torch.ones(4, 4)
    with recording() as led, comm.trace_torch_distributed():
        dist.all_reduce(x)
        dist.all_to_all_single(torch.empty(4, 4), x)
        comm.all_reduce(x, dist.group.WORLD)  # ours: counted once, not twice
    restored = dist.all_reduce.__name__ == "all_reduce"
    return led.calls("all_reduce"), led.sent("all_to_all"), restored


@pytest.mark.world_size(2)
def test_trace_counts_foreign_collectives_once(world):
    assert world.run(_trace_foreign) == [(2, 32, True)] * 2


def test_ledger_nesting_and_kinds():
    with recording() as outer:
        from commweave import ledger

        with recording() as inner:
            ledger.record("send", "g", 10, 0)
        ledger.record("recv", "g", 0, 4)
    assert inner.sent() == 10 and outer.sent() == 10 and outer.received("recv") == 4
    assert outer.calls() == 2 and inner.calls() == 1
    with pytest.raises(ValueError, match="'gather' is not one of"):
        Ledger().add("gather", "g", 1, 1)


def test_timeout_setting(monkeypatch):
    monkeypatch.delenv("COMMWEAVE_TIMEOUT_S", raising=False)
    assert comm.timeout_s() == comm.DEFAULT_TIMEOUT_S
    monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", "2.5")
    assert comm.timeout_s() == 2.5
    # under 1 ms torch reads a wait's timeout as none at all, from 1e14 s it overflows: one range for all
    for bad in ("0", "-1", "abc", "inf", "nan", "", "0.0005", "0.999", "1e14", "604801", " 5", "1_0"):
        monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=rf"COMMWEAVE_TIMEOUT_S='{bad}': the communication timeout must "
                                             r"be a finite number of seconds in \[1, 604800\]"):
            comm.timeout_s()
    monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", "604800")
    assert comm.timeout_s() == 604800.0
    comm.set_timeout(7)
    try:
        assert comm.timeout_s() == 7.0  # the setting wins over the (bad) variable
    finally:
        comm.set_timeout(None)
    with pytest.raises(ValueError, match="timeout=0: "):
        comm.set_timeout(0)
    with pytest.raises(ValueError, match=r"timeout=True: .* finite number of seconds"):
        comm.set_timeout(True)
    assert comm.check_seconds("2.5", "--commweave-timeout-s") == 2.5
    for bad in (1e-4, 1e14, 0.5):
        with pytest.raises(ValueError, match=rf"timeout={bad!r}: .* seconds in \[1, 604800\]"):
            comm.set_timeout(bad)


def _frozen_peer(op):
    """Rank 1 does not take part for 3 s (a frozen peer); rank 0's wait is bounded at 1 s.

    gloo closes a pair whose receive timed out, so the test closes this world afterwards.
    """
    import time

    me, world = dist.get_rank(), dist.group.WORLD
    comm.set_timeout(1.0)
    x = torch.ones(8)
    try:
        if me == 1:
            time.sleep(3.0)
            return None
        t0 = time.monotonic()
        try:
            if op == "recv":
                comm.recv(x, 1, world)
            else:
                comm.all_reduce(x, world)
        except comm.CommTimeout as e:
            return time.monotonic() - t0, str(e)
        return None
    finally:
        comm.set_timeout(None)


@pytest.mark.world_size(2, env={"COMMWEAVE_TEST_WORLD": "timeouts"})
@pytest.mark.parametrize("op, names", [("all_reduce", "all_reduce on group world "),
                                       ("recv", "recv on group world with peer rank 1 ")])
def test_a_frozen_peer_is_an_error_within_the_timeout(world, op, names):
    try:
        (elapsed, msg), none = world.run(_frozen_peer, op)
    finally:
        world.close(force=True)
    assert none is None
    assert 1.0 <= elapsed < 2.5, elapsed
    assert msg.startswith(f"commweave: {names}did not complete within COMMWEAVE_TIMEOUT_S=1 s"), msg


def _agree(shift):
    me, world = dist.get_rank(), dist.group.WORLD
    comm.check_agree(world, "agreement test", rows=16, team=2)  # agreeing values pass
    comm.agree(world, "agreement test", None)
    out = []
    for error, rows in ((None, 16 + (me == shift)),                          # values differ
                        ("x=3 must be even" if me in (1, 2) else None, 16),  # ranks 1 and 2 refuse
                        ("x=3 must be even", 16 + me),                       # every rank refuses alike
                        ("é" * 400 if me == 0 else None, 16)):               # cut at 512 bytes
        try:
            comm.agree(world, "agreement test", error, rows=rows, team=2)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.world_size(4)
def test_disagreeing_sizes_and_refusals_raise_on_every_rank(world):
    msgs = world.run(_agree, 3)
    for i in range(4):
        assert len({m[i] for m in msgs}) == 1, msgs
    assert msgs[0][0] == ("agreement test: the ranks of group world must agree on rows, got rows: "
                          "rank 0=16, rank 1=16, rank 2=16, rank 3=17")
    assert msgs[0][1] == "rank 1 (and 1 other rank(s)): x=3 must be even"
    assert msgs[0][2] == "x=3 must be even"  # a refusal comes before a disagreement on values
    assert msgs[0][3] == "rank 0: " + "é" * 256


def _timeout_cases():
    """Each rank's verdict on one set-up agreement per case: a rank with another timeout, a rank whose
    COMMWEAVE_TIMEOUT_S is refused, and the same for the values-only agreement (check_agree)."""
    import os

    me, world, out = dist.get_rank(), dist.group.WORLD, []
    for case in ("another timeout", "refused variable", "check_agree: another timeout"):
        try:
            if case.endswith("another timeout"):
                comm.set_timeout(5 if me == 2 else 300)
            elif me == 1:
                os.environ["COMMWEAVE_TIMEOUT_S"] = "0.0005"   # torch would read it as "no timeout"
            if case.startswith("check_agree"):
                comm.check_agree(world, "set-up", rows=16)
            else:
                comm.agree(world, "set-up", None, rows=16)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
        finally:
            comm.set_timeout(None)
            os.environ.pop("COMMWEAVE_TIMEOUT_S", None)
    return out


@pytest.mark.world_size(4)
def test_the_communication_timeout_is_agreed_on_every_rank(world):
    msgs = world.run(_timeout_cases)
    assert all(m == msgs[0] for m in msgs), msgs
    assert msgs[0][0] == ("set-up: the ranks of group world must agree on the communication timeout (s), got "
                          "the communication timeout (s): rank 0=300.0, rank 1=300.0, rank 2=5.0, "
                          "rank 3=300.0")
    assert msgs[0][1] == ("rank 1: COMMWEAVE_TIMEOUT_S='0.0005': the communication timeout must be a finite "
                          "number of seconds in [1, 604800] (1 s to 1 week: shorter would fail healthy waits "
                          "and under 1 ms means no timeout to torch)")
    assert msgs[0][2].startswith("set-up: the ranks of group world must agree on the communication timeout")
