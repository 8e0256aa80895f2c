"""Memory traffic (memory.py): the traced count by hand on known ops, the kernel part, the message functions
and allocations left out, the per-row slope, the profile's field (round trip, refusals) and its price in
plan seconds."""

import re
from dataclasses import replace

import pytest
import torch

from megatron_patches import memory
from megatron_patches.profile import from_json, load, save
from megatron_patches.specs import spec_profile


def test_count_is_inputs_plus_new_outputs_and_skips_views_and_the_kernel_part():
    a, b = torch.ones(1000), torch.ones(1000)

    def ops():
        z = torch.zeros(1000)          # a new output: 4000
        b.copy_(a)                     # src + dst: 8000
        a.add_(b)                      # both operands, the result is a: 8000
        a[10:].zero_()                 # the slice is a view (0), its zeroing one buffer: 3960
        with memory.kernel_part():
            _ = a * b + z              # priced by the curves: 0
    assert memory.traced_bytes(ops) == 4000 + 8000 + 8000 + 3960


def test_allocations_and_unmarked_aliases_move_nothing():
    a, b = torch.ones(1000), torch.ones(1000)

    def ops():
        torch.empty(1000)                          # allocations: 0
        torch.empty_like(a)
        a.new_empty(500)
        torch.ops.aten._unsafe_view(a, (10, 100))  # a's storage again, nothing written: 0
        e = torch.empty(1000)
        e.copy_(b)                                 # the fill counts the buffer: src + dst, 8000
    assert memory.traced_bytes(ops) == 8000


def test_ops_inside_the_message_functions_are_priced_by_their_microbenchmarks_not_counted(monkeypatch):
    """Whatever comm's collectives, posts and waits run (the pairwise all-gather's copy, the reduce-scatter's
    sum) is not counted; the same ops outside them are; the functions are restored after the trace."""
    from commweave import comm

    a, b = torch.ones(1000), torch.ones(1000)

    def collective(out, inp, group):
        out.copy_(inp)
        return torch.sum(torch.stack((out, inp)), dim=0)

    def wait(self, timeout=None):
        a.add_(b)
        return True
    monkeypatch.setattr(comm, "all_gather", collective)
    monkeypatch.setattr(comm, "reduce_scatter", collective)
    monkeypatch.setattr(comm.Handle, "wait", wait)
    handle = comm.Handle([], "test", "nowhere")

    def ops():
        comm.all_gather(a, b, None)
        comm.reduce_scatter(a, b, None)
        handle.wait()
        a.add_(b)                                  # outside: both operands, 8000
    assert memory.traced_bytes(ops) == 8000
    assert (comm.all_gather, comm.reduce_scatter, comm.Handle.wait) == (collective, collective, wait)


def test_row_bytes_is_the_slope_between_two_sizes():
    def step(rows):
        x, acc = torch.ones(rows, 3), torch.empty(rows, 3)
        return lambda: acc.zero_().add_(x)     # 12 B/row zeroed, 24 B/row added
    per_row = memory.row_bytes(step(16), step(32), 16)
    assert per_row == 12 + 24                   # ones() happens outside the traced call
    assert memory.traced_bytes(memory.copy_step("cpu")) == 2 * memory.COPY_BYTES


def _with_memory(prof):
    return replace(prof, memory={"gbytes": 2.0, "rows": 16, "trace_bytes": 8 * 64 * 4,
                                 "row_bytes": {"8 1 2 team-major": 1e5}})


def test_memory_round_trips_and_prices_rows_above_the_host_run(tmp_path):
    prof = _with_memory(spec_profile(8, 10.0, 10.0))
    save(prof, str(tmp_path / "m.json"))
    assert load(str(tmp_path / "m.json")).memory == prof.memory
    # 1e5 B/row at the trace's 8x64 fp32 heads; 2x the bytes per row at 16 heads; 1e9·2 B/s
    assert prof.memory_s(8, 1, 2, "team-major", 528, 16 * 64 * 4) == pytest.approx(1e5 * 512 * 2 / 2e9)
    assert prof.memory_s(8, 1, 2, "team-major", 8, 8 * 64 * 4) == 0.0
    assert prof.memory_s(8, 1, 1, "team-major", 528, 8 * 64 * 4) == 0.0   # not traced: nothing
    assert spec_profile(8, 10.0, 10.0).memory_s(8, 1, 2, "team-major", 528, 2048) == 0.0


def test_plan_seconds_add_the_memory_term():
    from megatron_patches.choice import plan_s
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    prof = spec_profile(8, 10.0, 10.0)
    sh, nodes = Shard(528, 1, 8, 8, 64, 4, 4), [0] * 8
    base, got = (plan_s(8, sh, nodes, Topology.from_profile(p), 1, 2, "team-major")
                 for p in (prof, _with_memory(prof)))
    assert got == pytest.approx(base + 1e5 * 512 / 2e9, rel=1e-12)


@pytest.mark.parametrize("memory_field, message", [
    ({"gbytes": 2.0}, "must be {gbytes, rows, trace_bytes, row_bytes"),
    ({"gbytes": 0.0, "rows": 16, "trace_bytes": 1, "row_bytes": {}}, "memory.gbytes"),
    ({"gbytes": 1.0, "rows": 16, "trace_bytes": 1, "row_bytes": {"8 1": 1.0}}, "key '8 1' must be"),
    ({"gbytes": 1.0, "rows": 16, "trace_bytes": 1, "row_bytes": {"8 1 1 team-major": -1.0}},
     "memory.row_bytes['8 1 1 team-major']"),
])
def test_memory_refusals_name_the_field(memory_field, message):
    raw = spec_profile(8, 10.0, 10.0).to_json()
    raw["memory"] = memory_field
    with pytest.raises(ValueError, match=re.escape(message)):
        from_json(raw)
