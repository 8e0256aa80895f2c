"""Every schedule against DeepSpeed's own MoE (outputs, l_aux, exp_counts, all gradients) and the ledger
against the volume formulas of parm.md §2, on 4 and 8 gloo ranks.

Layer: S = 24 tokens per rank, M = 8, H = 16, E = 8. The capacities the cases pick: k = 1, cf 1 gives
C = 3 (not divisible by tp: DeepSpeed's TP path cannot run it, the local oracle can); k = 2, cf 1.25 gives
C = 8; cf 4 gives C >= S (nothing drops, the only drop-mode setting where S1 may equal the baseline,
parm.md §2.5).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from commweave.ledger import recording
from ds_plugins import ParmMoE, routing
from ds_plugins.agreement import HEADER
from tests.ds_plugins.deepspeed_oracle import (
    LocalOracle,
    Weights,
    load_parm,
    mlp,
    tp_oracle,
    tp_rank,
    use_layout,
)

S, M, H, E = 24, 8, 16, 8
F32 = 4

# (name, schedule, k, drop_tokens, capacity_factor, top2 sampling, overlap chunks, skip empty slots)
CASES = [
    ("s2-k1-drop", "s2", 1, True, 1.0, True, 2, True),
    ("s2-k2-drop", "s2", 2, True, 1.25, True, 3, True),
    ("s2-k2-drop-all-slots", "s2", 2, True, 1.25, True, 3, False),
    ("s2-k2-nodrop", "s2", 2, False, 1.0, True, 4, True),
    ("s1-k1-nodrop", "s1", 1, False, 1.0, False, 2, True),
    ("s1-k2-drop-nonbinding", "s1", 2, True, 4.0, False, 4, True),
    ("s1-k2-drop-nonbinding-all-slots", "s1", 2, True, 4.0, False, 4, False),
    ("s1-k2-nodrop", "s1", 2, False, 1.0, False, 1, True),
    ("deepspeed-k1-drop", "deepspeed", 1, True, 1.0, True, 1, True),
    ("deepspeed-k2-drop", "deepspeed", 2, True, 1.25, True, 1, True),
    ("deepspeed-k2-drop-all-slots", "deepspeed", 2, True, 1.25, True, 1, False),
    ("deepspeed-k2-nodrop", "deepspeed", 2, False, 1.0, True, 1, True),
]


def _capacity(k: int, cf: float, tokens: int) -> int:
    return math.ceil(tokens / E * cf * k)


def _inputs():
    torch.manual_seed(1000 + dist.get_rank() // max(1, _tp()))  # one input per MP group
    return torch.randn(S, M), torch.randn(S, M)


def _tp() -> int:
    from deepspeed.utils import groups

    return 1 if groups.mpu is None else groups.mpu.get_tensor_model_parallel_world_size()


def _run(layer, x, go):
    x = x.clone().requires_grad_()
    torch.manual_seed(7)  # the same RNG stream for the gate's RTS / Gumbel draws in both layers
    out, l_aux, counts = layer(x)
    ((out * go).sum() + 0.5 * l_aux).backward()
    return out.detach(), l_aux.detach(), counts, x.grad


def _compare(tp: int, ep: int, shard: bool, case) -> dict:
    _, schedule, k, drop, cf, sampling, chunks, skip = case
    w = Weights.random(E, M, H)
    x, go = _inputs()
    kw = dict(k=k, capacity_factor=cf, eval_capacity_factor=cf, min_capacity=0, drop_tokens=drop,
              top2_2nd_expert_sampling=sampling)
    parm = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=ep, enable_expert_tensor_parallelism=shard,
                   schedule=schedule, overlap_chunks=chunks, skip_empty_slots=skip, debug=schedule == "s2",
                   **kw)
    load_parm(parm, w)
    parm.set_deepspeed_parallelism()
    got = _run(parm, x, go)
    s = parm.parm_groups.esp_size
    distributed = drop and (tp == 1 or (shard and _capacity(k, cf, S) % tp == 0))
    if distributed:
        oracle = tp_oracle(w, tp if shard else 1, ep, **kw)
        want = _run(oracle, x, go)
        ref_gate = oracle.deepspeed_moe.gate.wg.weight.grad
        ref_experts = [_grads(*_linears(ex)) for ex in oracle.deepspeed_moe.experts.deepspeed_experts]
    else:
        oracle = LocalOracle(w, **kw)
        want = _run(oracle, x, go)
        ref_gate = oracle.moe.gate.wg.weight.grad
        q, hs = tp_rank() if s > 1 else 0, H // s
        first = parm.parm_groups.ep_rank * parm.num_local_experts
        _sum_over_sources(oracle, parm.deepspeed_moe.ep_group, tp)
        ref_experts = [_grads(*_linears(oracle.expert(first + j)), slice(q * hs, (q + 1) * hs))
                       for j in range(parm.num_local_experts)]
    err = {"oracle": "deepspeed-distributed" if distributed else "deepspeed-local",
           "out": (got[0] - want[0]).abs().max().item(), "l_aux": abs(got[1].item() - want[1].item()),
           "counts_equal": torch.equal(got[2].long(), want[2].long()),
           "grad_x": (got[3] - want[3]).abs().max().item(),
           "grad_gate": (parm.gate.wg.weight.grad - ref_gate).abs().max().item(),
           "grad_experts": max((a - b).abs().max().item()
                               for ex, ref in zip(parm.local_experts, ref_experts, strict=True)
                               for a, b in zip(_grads(*_linears(ex)), ref, strict=True))}
    err["scale"] = want[0].abs().max().item()
    return err


def _linears(expert):
    return (expert.fc1, expert.fc2) if hasattr(expert, "fc1") else (expert[0], expert[2])


def _grads(fc1, fc2, rows=slice(None)):
    """Gradients of a two-layer MLP's parameters; ``rows`` picks one ESP shard of unsharded ones."""
    return fc1.weight.grad[rows], fc1.bias.grad[rows], fc2.weight.grad[:, rows], fc2.bias.grad


def _sum_over_sources(oracle, ep_group, tp: int) -> None:
    """An expert's gradient sums over every MP group whose tokens reach it: the EP group's, each once."""
    ranks = dist.get_process_group_ranks(ep_group)
    copies = len(ranks) // len({r // tp for r in ranks})  # EP members that share one MP group's tokens
    for p in oracle.moe.experts.parameters():
        dist.all_reduce(p.grad, group=ep_group)
        p.grad /= copies


def _compare_all(tp: int, ep: int, shard: bool, names: list[str]) -> dict:
    use_layout(tp, ep, shard)
    return {case[0]: _compare(tp, ep, shard, case) for case in CASES if case[0] in names}


LAYOUTS = [pytest.param(4, 1, 4, True, marks=pytest.mark.world_size(4), id="ranks4-tp1-ep4"),
           pytest.param(4, 2, 2, True, marks=pytest.mark.world_size(4), id="ranks4-tp2-ep2"),
           pytest.param(8, 2, 4, True, marks=pytest.mark.world_size(8), id="ranks8-tp2-ep4"),
           pytest.param(8, 4, 2, True, marks=pytest.mark.world_size(8), id="ranks8-tp4-ep2")]


@pytest.mark.parametrize(("ranks", "tp", "ep", "shard"), LAYOUTS)
def test_schedules_equal_deepspeed_moe(world, ranks, tp, ep, shard):
    names = [c[0] for c in CASES]
    per_rank = world.run(_compare_all, tp, ep, shard, names)
    for rank, res in enumerate(per_rank):
        for name, err in res.items():
            where = f"rank {rank} case {name} vs {err['oracle']}: {err}"
            assert err["counts_equal"], where
            for key in ("out", "l_aux", "grad_x", "grad_gate", "grad_experts"):
                assert err[key] <= 2e-5 * max(1.0, err["scale"]), where
    oracles = {err["oracle"] for res in per_rank for err in res.values()}
    assert oracles == {"deepspeed-distributed", "deepspeed-local"}, oracles


@pytest.mark.world_size(4)
def test_unsharded_experts_with_tensor_parallel_attention(world):
    """ESP = 1 with tp = 2 (enable_expert_tensor_parallelism off): DeepSpeed's legacy EP groups."""
    names = ["s2-k2-drop", "s2-k2-drop-all-slots", "s1-k2-nodrop", "deepspeed-k1-drop"]
    for rank, res in enumerate(world.run(_compare_all, 2, 2, False, names)):
        for name, err in res.items():
            assert err["counts_equal"], (rank, name, err)
            for key in ("out", "l_aux", "grad_x", "grad_gate", "grad_experts"):
                assert err[key] <= 2e-5 * max(1.0, err["scale"]), (rank, name, err)


def _ledger(tp: int, ep: int, shard: bool, tokens: int, k: int, cf: float, chunks: int) -> dict:
    use_layout(tp, ep, shard)
    torch.manual_seed(dist.get_rank() // tp)
    x, go = torch.randn(tokens, M), torch.randn(tokens, M)
    sent, rows, c1 = {}, {}, {}
    for skip in (True, False):
        for schedule in ("deepspeed", "s1", "s2"):
            layer = ParmMoE(M, mlp(M, H), num_experts=E, ep_size=ep, k=k, capacity_factor=cf, min_capacity=0,
                            enable_expert_tensor_parallelism=shard, schedule=schedule, overlap_chunks=chunks,
                            skip_empty_slots=skip)
            layer.set_deepspeed_parallelism()
            if schedule == "deepspeed":
                rows[skip] = _live_rows(layer, x) if skip else [ep * _capacity(k, cf, tokens)] * (E // ep)
            if schedule == "s1":
                c1[skip] = _s1_capacity(layer, x, tp)
            with recording() as led:
                _run(layer, x, go)
            sent[schedule, skip] = {key: v["sent"] for key, v in led.as_dict().items()}
    return sent, rows, c1


def _s1_capacity(layer, x, tp: int) -> int:
    """S1's buffer capacity, counted from the full batch's routes independently of the layer: the most
    live routes one of the tp token blocks sends one expert, the largest over the EP group."""
    torch.manual_seed(7)
    r = routing.route(layer.gate, x)
    blocks = torch.arange(x.shape[0]).tensor_split(tp)
    block = torch.cat([torch.full((t.numel(),), q) for q, t in enumerate(blocks)])
    live = r.indices >= 0
    pairs = block.expand_as(r.indices)[live] * E + r.indices[live].long()
    most = torch.bincount(pairs, minlength=tp * E).max().reshape(1)
    if layer.ep_size > 1:
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=layer.deepspeed_moe.ep_group)
    return int(most)


def _live_rows(layer, x) -> list[int]:
    """Rows the "deepspeed" schedule's local experts hold a token in: every EP source's live routes to
    them (counted from the routes, independently of the layer's fill counts)."""
    torch.manual_seed(7)
    r = routing.route(layer.gate, x)
    live = torch.bincount(r.indices[r.indices >= 0].long(), minlength=E)
    every = live.new_empty(layer.ep_size * E)
    comm.all_gather(every, live, layer.deepspeed_moe.ep_group)
    e_l, first = E // layer.ep_size, layer.parm_groups.ep_rank * (E // layer.ep_size)
    return every.view(layer.ep_size, E)[:, first: first + e_l].sum(0).tolist()


def _formula(schedule: str, tp: int, ep: int, shard: bool, tokens: int, k: int, cf: float,
             chunks: int, rows: list[int], c1: int, skip: bool = True) -> dict:
    """Bytes sent per rank in one forward + backward, parm.md §2 (forward) and §2.7 (backward); ``rows``:
    the filled rows of each local expert ("deepspeed" all-reduces them inside the expert); ``c1``: S1's
    buffer capacity (drop mode: no capacity agreement for S2 and "deepspeed", and where the fill counts
    carry the header, ds_plugins.schedules.sync_free, no token agreement either)."""
    n, p, s, b = tp, ep, tp if shard else 1, F32
    out: dict[str, int] = {}

    def add(key: str, value: int) -> None:
        if value:
            out[key] = out.get(key, 0) + value

    def agree(values: int) -> None:                                  # ds_plugins.agreement, int64
        add("all_reduce@mp", 2 * (2 * values * 8) * (n - 1) // n)
        add("all_reduce@ep", 2 * (3 * values * 8) * (p - 1) // p)

    if not (skip and (n == 1 or shard)):                              # drop mode: sync-free otherwise
        agree(2)                                                      # S and the training flag

    if skip:                                                          # fill counts + header, int32, forward
        words = (E + p * HEADER) * 4
        add("all_to_all@ep", words - words // p)
        add("all_gather@esp", words * (s - 1))
    c = _capacity(k, cf, tokens)
    if schedule == "s1":
        mine = math.ceil(tokens / n)
        if not (skip and (n == 1 or shard)):                          # else on the headers
            agree(1)                                                  # S1's capacity
        v1 = E * _pad(c1, min(chunks, c1)) * M * b                    # V₁: the buffer of S/N tokens
        add("all_to_all@ep", 4 * (v1 - v1 // p))                      # A2A fwd x2, bwd x2
        add("all_gather@esp", 2 * v1 * (s - 1))                       # AG fwd, RS's dual bwd
        add("reduce_scatter@esp", 2 * v1 * (s - 1))                   # RS fwd, AG's dual bwd
        add("all_gather@mp", 2 * mine * M * b * (n - 1))              # AG of S·M fwd, split's dual bwd
        add("all_reduce@mp", 2 * (E * M * b) * (n - 1) // n)          # gate-weight gradient bwd
    elif schedule == "s2" or s == 1 < n:
        chunk = 1 if schedule == "deepspeed" else min(chunks, math.ceil(c / n))
        v = E * _pad(c, n * chunk) * M * b // n                       # V/N
        add("all_to_all@ep", 4 * (v - v // p))
        add("all_gather@esp", 2 * v * (s - 1))
        add("reduce_scatter@esp", 2 * v * (s - 1))
        add("all_gather@mp", 2 * v * (n - 1))                         # AG fwd, split's dual bwd
    else:
        v = E * c * M * b
        add("all_to_all@ep", 4 * (v - v // p))
        add("all_reduce@esp", sum(2 * (2 * f * M * b * (s - 1) // s) for f in rows))  # per expert, fwd + bwd
    return out


def _pad(c: int, multiple: int) -> int:
    return -(-c // multiple) * multiple


@pytest.mark.parametrize(("ranks", "tp", "ep", "shard"), LAYOUTS)
def test_ledger_bytes_per_group_equal_formulas(world, ranks, tp, ep, shard):
    tokens, k, cf, chunks = 26, 2, 1.25, 3   # C = 9: odd, so S2 pads; S/N uneven for tp = 4
    for rank, (sent, rows, c1) in enumerate(world.run(_ledger, tp, ep, shard, tokens, k, cf, chunks)):
        assert sum(rows[True]) < sum(rows[False]), rows   # cf 1.25: some slots stay empty
        for (schedule, skip), got in sent.items():
            want = _formula(schedule, tp, ep, shard, tokens, k, cf, chunks, rows[skip], c1[skip], skip)
            assert got == want, (rank, schedule, skip)


@pytest.mark.world_size(4)
def test_ledger_unsharded_experts(world):
    sent, rows, c1 = world.run(_ledger, 2, 2, False, 24, 2, 1.25, 2)[0]
    for (schedule, skip), got in sent.items():
        want = _formula(schedule, 2, 2, False, 24, 2, 1.25, 2, rows[skip], c1[skip], skip)
        assert got == want, (schedule, skip)
