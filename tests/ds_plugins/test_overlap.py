"""The exchanges' filled-row bookkeeping on one process (no groups: p = s = n = 1), and on 4 ranks that the
chunked exchanges overlap; their results are checked against DeepSpeed's MoE and the ledger in
test_schedules."""

import pytest
import torch

from ds_plugins import overlap
from ds_plugins.groups import ParmGroups
from ds_plugins.routing import Routes, fill

E, M, CHUNKS, SLOTS = 3, 4, 2, 3   # C_buf = 6 slots per expert, in 2 chunks of 3

ALONE = ParmGroups(mp=None, esp=None, ep=None, mp_size=1, mp_rank=0, esp_size=1, esp_rank=0, ep_size=1,
                   ep_rank=0)
LAYOUT = overlap.Layout(ALONE, E, CHUNKS, SLOTS, mp_split=False)


def _rows(fills: list[int]) -> overlap.Rows:
    head = torch.tensor([7, 1, 0, 0, 0, 6, 2, 0], dtype=torch.int32)   # agreement.HEADER words
    exchange = overlap.FillExchange(torch.tensor(fills, dtype=torch.int32), head, ALONE, None)
    heads, counts = exchange.read()
    assert heads == [head.tolist()] and counts == [[fills]]   # p = s = 1: its own, header and counts
    return exchange.rows(counts, LAYOUT)


def test_fill_is_one_past_the_last_live_location():
    # k = 2 routes of 4 tokens; -1 = dropped (its location is not a slot)
    indices = torch.tensor([[0, 2, 0, -1], [1, 0, -1, -1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 1, 5], [0, 2, 7, 7]], dtype=torch.int32)
    r = Routes(torch.zeros(()), 6, indices, locations, torch.ones(2, 4), torch.zeros(E))
    assert fill(r, E).tolist() == [3, 1, 1]


def test_rows_are_each_experts_filled_prefix_chunk_by_chunk():
    rows = _rows([5, 0, 6])
    # expert 0: slots 0-2 (chunk 0) and 3-4 (chunk 1); expert 1: none; expert 2: all six
    assert rows.sizes == [5, 0, 6] and not rows.full
    assert [t.tolist() for t in rows.index[0]] == [[0, 1, 2], [], [6, 7, 8]]
    assert [t.tolist() for t in rows.index[1]] == [[0, 1], [], [6, 7, 8]]
    assert rows.offset == [[0, 0, 0], [3, 0, 3]]
    every = overlap.Rows.every(LAYOUT, torch.device("cpu"))
    assert every.full and every.sizes == [6, 6, 6]


@pytest.mark.parametrize("fills", [[5, 0, 6], [6, 6, 6], [0, 0, 0]])
def test_exchanges_keep_filled_rows_and_zero_the_rest(fills):
    rows = _rows(fills)
    buf = torch.randn(E, CHUNKS * SLOTS, M, requires_grad=True)
    hs = overlap.to_experts(buf, LAYOUT, rows)
    for e, h in enumerate(hs):
        torch.testing.assert_close(h, buf[e, :fills[e]], rtol=0, atol=0)
    ys = [2 * h for h in hs]
    out = overlap.from_experts(ys, LAYOUT, rows)
    live = (torch.arange(CHUNKS * SLOTS)[None, :] < torch.tensor(fills)[:, None]).unsqueeze(-1)
    torch.testing.assert_close(out, torch.where(live, 2 * buf, 0.0), rtol=0, atol=0)
    go = torch.randn_like(out)
    out.backward(go)
    torch.testing.assert_close(buf.grad, torch.where(live, 2 * go, 0.0), rtol=0, atol=0)


def test_buffer_must_match_the_layout():
    with pytest.raises(ValueError, match="capacity 5, the layout expects 6"):
        overlap.to_experts(torch.zeros(E, 5, M), LAYOUT, _rows([1, 1, 1]))


# The overlap itself (issue 9, item 6), on 4 gloo ranks (tp 2 x ep 2, ESP 2): the comm layer's asynchronous
# calls are recorded as they are issued and waited on. In a wavefront of L stages over r chunks, step t
# issues the a_t = |{j : 0 <= t - j < r}| stages' collectives (on different groups) before waiting on any,
# so a_t·(a_t - 1)/2 pairs of them are in flight together: chunk i + 1's all-to-all is issued before chunk
# i's all-gather is waited on. A schedule that waits on each collective before issuing the next has none.

class _Recorder:
    """Wraps the comm layer's all_to_all / all_gather / reduce_scatter while active: every asynchronous
    call is logged as ("issue", n, group) and its Work's wait as ("wait", n, group)."""

    NAMES = ("all_to_all", "all_gather", "reduce_scatter")

    def __init__(self) -> None:
        self.events: list[tuple[str, int, str]] = []
        self._saved: dict = {}

    def __enter__(self):
        from commweave import comm

        for name in self.NAMES:
            self._saved[name] = getattr(comm, name)
            setattr(comm, name, self._wrap(self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        from commweave import comm

        for name, fn in self._saved.items():
            setattr(comm, name, fn)

    def _wrap(self, fn):
        from commweave import comm

        def call(output, input, group, *args, async_op=False, **kwargs):
            work = fn(output, input, group, *args, async_op=async_op, **kwargs)
            if not async_op:
                return work
            n, where = sum(e[0] == "issue" for e in self.events), comm.group_name(group)
            self.events.append(("issue", n, where))
            waited = ("wait", n, where)
            return comm.Handle([work], "recorded", where, finish=lambda: self.events.append(waited))
        return call

    def concurrent_pairs(self) -> int:
        """Pairs of collectives on different groups in flight at the same time (issued, not yet waited)."""
        flying: dict[int, str] = {}
        pairs = 0
        for kind, n, where in self.events:
            if kind == "issue":
                pairs += sum(other != where for other in flying.values())
                flying[n] = where
            else:
                flying.pop(n)
        return pairs


def _serial(chunks, stages, finish) -> None:
    """The regression the test must catch: every chunk through every stage, each collective waited on
    before the next is issued."""
    for i in range(chunks):
        for fn, _ in stages:
            work = fn(i)
            if work is not None:
                work.wait()
        finish(i)


def _wavefront_pairs(chunks: int, stages: int) -> int:
    active = [sum(0 <= t - j < chunks for j in range(stages)) for t in range(chunks + stages - 1)]
    return sum(a * (a - 1) // 2 for a in active)


def _recorded_step(serial: bool, chunks: int) -> dict:
    from ds_plugins import ParmMoE
    from tests.ds_plugins.deepspeed_oracle import mlp, use_layout

    use_layout(2, 2)
    torch.manual_seed(0)
    layer = ParmMoE(8, mlp(8, 16), num_experts=8, ep_size=2, k=2, capacity_factor=2.0, min_capacity=0,
                    enable_expert_tensor_parallelism=True, schedule="s2", overlap_chunks=chunks)
    layer.set_deepspeed_parallelism()
    torch.manual_seed(1 + torch.distributed.get_rank() // 2)
    x = torch.randn(48, 8, requires_grad=True)   # C = 24 slots: 12 per MP slice, in 3 chunks of 4
    saved = overlap._wavefront
    overlap._wavefront = _serial if serial else saved
    try:
        with _Recorder() as rec:
            torch.manual_seed(7)
            out, l_aux, _ = layer(x)
            (out.square().sum() + l_aux).backward()
    finally:
        overlap._wavefront = saved
    return {"pairs": rec.concurrent_pairs(), "issued": sum(e[0] == "issue" for e in rec.events),
            "waited": sum(e[0] == "wait" for e in rec.events), "out": out.detach(), "grad": x.grad}


def _both(chunks: int) -> dict:
    return {"pipelined": _recorded_step(False, chunks), "serial": _recorded_step(True, chunks)}


@pytest.mark.world_size(4)
def test_chunked_exchanges_overlap(world):
    chunks = 3
    # forward and backward each: to_experts (A2A ep -> AG esp) and from_experts (RS esp -> A2A ep -> AG mp)
    want = 2 * (_wavefront_pairs(chunks, 2) + _wavefront_pairs(chunks, 3))
    assert want == 2 * (2 + 5)
    for res in world.run(_both, chunks):
        run, serial = res["pipelined"], res["serial"]
        # 5 stages x r chunks x (forward, backward) + the fill counts' A2A; every call is waited on
        assert run["issued"] == run["waited"] == 2 * 5 * chunks + 1
        assert run["pairs"] == want
        assert serial["issued"] == run["issued"] and serial["pairs"] == 0
        torch.testing.assert_close(serial["out"], run["out"], rtol=0, atol=0)
        torch.testing.assert_close(serial["grad"], run["grad"], rtol=0, atol=0)
