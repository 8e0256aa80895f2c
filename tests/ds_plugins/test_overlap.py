"""The exchanges' filled-row bookkeeping on one process (no groups: p = s = n = 1); the multi-rank paths
are checked against DeepSpeed's MoE and the ledger in test_schedules."""

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
    return overlap.FillExchange(torch.tensor(fills), LAYOUT).rows()


def test_fill_is_one_past_the_last_live_location():
    # k = 2 routes of 4 tokens; -1 = dropped (its location is not a slot)
    indices = torch.tensor([[0, 2, 0, -1], [1, 0, -1, -1]], dtype=torch.int32)
    locations = torch.tensor([[0, 0, 1, 5], [0, 2, 7, 7]], dtype=torch.int32)
    r = Routes(torch.zeros(()), 6, indices, locations, torch.ones(2, 4), torch.zeros(E), torch.zeros(E),
               torch.zeros(E))
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
