"""``auto`` for the Ulysses size: WallFacerAttention picks (U, C) with the calibrated model
(choice.choose_hybrid), the same plan ``python -m megatron_patches.estimate`` marks, runs it exactly, and
every CP rank refuses a run whose ranks disagree on U, C, the backward variant, team_qkv, causal or the
shard shape (checks.check_inputs, wallfacer.check_settings).

One 8-rank world (the auto layouts against full attention, fp64) and one 4-rank world (the agreements).
"""

import json
import re
import shlex
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from commweave import ledger
from megatron_patches.choice import _all_to_all, choose_hybrid, hybrid_s, hybrid_sizes, plan
from megatron_patches.estimate import Cluster, Model, main, report
from megatron_patches.layout import Layout
from megatron_patches.placement import ORDERS, Topology
from megatron_patches.volume import META_BYTES, SETTINGS_BYTES, Shard, hybrid_bytes
from megatron_patches.wallfacer import wallfacer_attention
from tests.megatron_patches.test_estimate import PAPER
from tests.megatron_patches.test_wallfacer import _global_inputs, _reference, local_rows

# A CPU box as the cost model sees it: one node, loopback at ~2 GB/s with ~50 µs per message, ~50
# GFLOP/s of attention per rank (the 2-core machine these tests run on, roughly).
CPU = Cluster(8, 8, intra_gbytes=2, inter_gbits=16, latency_us=50, tflops=0.05, network="ethernet",
              intra_latency_us=50)

# name: (cluster, model, the (U, C) auto picks), under the spec model (specs.py), checked by hand:
# - GPT, 64 H100: Ulysses over 4 of a node's 8 GPUs leaves ring attention over 16 groups whose 4x larger
#   blocks hide most hops (370 ms); U = 8 is within 0.1% (370.0 ms), WallFacer C = 2 alone 6.7% behind.
# - DiT, 32 GPUs, 8 per node, the command's flags (400 GB/s Ethernet per node, one NIC): ring attention's
#   message across a node boundary rides NCCL's 2 TCP flows, at most 84 Gb/s (specs.py), in each of its 31
#   steps (928 ms); Ulysses over 2 halves the steps and doubles the block each hides (559 ms; U = 4 and 8
#   within 0.1%, WallFacer C = 2 alone 647 ms).
# - the CPU box at the shape of benchmarks.attention (P = 8, 4096 tokens, 8 heads x 64), and with 4 query
#   heads (MQA): ring attention, every plan within 0.5%: all calls are below FlashAttention-2's smallest
#   benchmark call, so they price alike, and the ring's hops hide behind blocks (spec overlap 1) where
#   the all-to-alls do not.
DIT, GPT = "DiT 1B, 32 A100, 100 Gb/s Ethernet, 512K", "GPT 7B, 64 H100, 8x400 Gb/s IB, 512K"
HAND_CHECKED = {
    DIT: (*PAPER[DIT][:2], (2, 1)),
    GPT: (*PAPER[GPT][:2], (4, 1)),
    "CPU, 8 ranks, 4096 tokens, 8 heads": (CPU, Model(hidden=512, heads=8, seq=4096, causal=True), (1, 1)),
    "CPU, 8 ranks, 4096 tokens, MQA 4:1": (CPU, Model(hidden=256, heads=4, kv_heads=1, seq=4096), (1, 1)),
}


def _command(cluster, model):
    c = cluster
    line = (f"--gpus {c.gpus} --gpus-per-node {c.gpus_per_node} --intra-GBps {c.intra_gbytes} "
            f"--inter-Gbps {c.inter_gbits} --latency-us {c.latency_us} --tflops {c.tflops} "
            f"--intra-latency-us {c.intra_latency_us} --network {c.network} --hidden {model.hidden} "
            f"--heads {model.heads} --seq {model.seq}")
    line += f" --kv-heads {model.kv_heads}" if model.kv_heads else ""
    return shlex.split(line + ("" if model.causal else " --no-causal"))


def _wallfacer_layout(cluster, model):
    """What WallFacerAttention's _layout plans under Megatron-LM's arguments for this cluster and model."""
    from megatron_patches.args import WallFacerConfig
    from megatron_patches.attention import plan_layout
    from tests.megatron_patches.test_args import _parse

    line = (f"--context-parallel-size {cluster.gpus} --seq-length {model.seq} --num-attention-heads "
            f"{model.heads} --num-query-groups {model.kv_heads or model.heads} --attention-dropout 0 "
            f"--wallfacer-ulysses-size auto --wallfacer-team-size auto --wallfacer-placement auto ")
    cfg = WallFacerConfig.from_args(_parse(line + " ".join(cluster.wallfacer_flags())))
    q_shape = (model.seq // cluster.gpus, model.batch, model.heads, model.hidden // model.heads)
    return plan_layout(cfg, list(range(cluster.gpus)), cluster.gpus, q_shape, model.kv_heads or model.heads,
                       torch.bfloat16, model.causal)


@pytest.mark.parametrize("name", sorted(HAND_CHECKED))
def test_auto_picks_and_the_estimate_command_marks_it(name, capsys):
    cluster, model, want = HAND_CHECKED[name]
    line = main(_command(cluster, model))
    out = capsys.readouterr().out.splitlines()
    assert (line["auto"]["ulysses_size"], line["auto"]["team_size"]) == want, line["auto"]
    u, c = want
    row = f"hybrid U={u} x WallFacer C={c}" if u > 1 else (f"WallFacer C={c}" if c > 1 else "ring attention")
    marked = [r for r in out if re.search(r"<- .*auto", r)]
    assert len(marked) == 1 and marked[0].strip().startswith(row), marked
    assert json.loads(out[-1]) == json.loads(json.dumps(line))
    # The same inputs through WallFacerAttention's planning (Megatron-LM's arguments, the flags the
    # command prints): the same (U, C), order and seconds.
    got = _wallfacer_layout(cluster, model)
    assert (got.ulysses_size, got.team_size, got.order) == (u, c, line["auto"]["order"])
    assert got.seconds == pytest.approx(line["auto"]["s"], rel=1e-12)
    assert got.layout == Layout(cluster.gpus // u, c, ORDERS[got.order](cluster.gpus // u, c))
    assert " ".join(cluster.wallfacer_flags()) in next(r for r in out if r.strip().startswith("auto:"))


def test_auto_is_the_fastest_plan_and_respects_a_fixed_team_size():
    cluster, model, _ = HAND_CHECKED[GPT]
    topo, nodes, sh = cluster.topology(), cluster.nodes(), model.shard(64)
    rep = report(cluster, model)
    assert rep["_auto"].seconds == min(p.seconds for p in rep["plans"])
    for c in (1, 2, 4, 8):
        fixed = choose_hybrid(64, sh, nodes, topo, ulysses_size="auto", team_size=c)
        assert fixed.team_size == c and 64 // fixed.ulysses_size % (c * c) == 0
        same_c = [p for p in rep["plans"] if p.team_size == c]
        assert fixed.seconds == min(p.seconds for p in same_c)
    contiguous = choose_hybrid(64, sh, nodes, topo, placement="contiguous")
    assert contiguous.order == "team-major"
    # Nothing left to the model: no topology needed, the plan is what was asked.
    given = choose_hybrid(64, sh, nodes, None, ulysses_size=2, team_size=4, placement="contiguous")
    assert (given.ulysses_size, given.team_size, given.seconds) == (2, 4, None)
    with pytest.raises(ValueError, match="needs a Topology"):
        choose_hybrid(64, sh, nodes, None)


def test_replicated_kv_heads_are_planned_and_priced():
    """K/V heads fewer than U (each replicated to U/g members, hybrid.py) are candidates, and the model's
    all-to-all bytes are volume.hybrid_bytes' (which the ledger test holds to the implementation)."""
    nodes = [0] * 8
    sh = Shard(64, 2, 8, 2, 16, 2, 4)
    assert hybrid_sizes(8, sh, nodes) == [2, 4, 8]   # g = 2: U = 2 splits them, 4 and 8 replicate
    assert hybrid_sizes(8, sh, [0, 0, 0, 0, 1, 1, 1, 1]) == [2, 4]   # Ulysses groups inside a node
    assert hybrid_sizes(8, Shard(64, 2, 6, 6, 16, 2, 4), nodes) == [2]
    assert hybrid_sizes(8, Shard(64, 2, 12, 6, 16, 2, 4), nodes) == [2]   # 6 K/V heads: not over 4
    bytes_per_second = Topology(8, *[_unit()] * 3, _no_collectives())
    for hq, hkv in ((8, 8), (8, 2), (8, 1), (16, 4)):
        sh = Shard(64, 2, hq, hkv, 16, 2, 4)
        for u in hybrid_sizes(8, sh, nodes):
            fwd, bwd = hybrid_bytes(8, u, Layout(8 // u, 1), sh, 0, "kv", checked=False)
            sent = fwd["all_to_all", "ulysses"] + bwd["all_to_all", "ulysses"]
            assert _all_to_all(sh, u, nodes, bytes_per_second) == pytest.approx(sent), (hq, hkv, u)


def _unit():
    from commweave.cost import AlphaBeta

    return AlphaBeta(0.0, 1.0)


def _no_collectives():
    """A spec profile: no measured collectives, each priced by its link at efficiency 1 (cost.py)."""
    from megatron_patches.specs import spec_profile

    return spec_profile(8, 1.0, 1.0)


@pytest.mark.parametrize("u, hq, hkv, c, message", [
    (3, 8, 8, 1, "ulysses_size U=3 must divide the P=8 context-parallel ranks"),
    (4, 6, 6, 1, "the 6 query heads (per tensor-parallel rank) must divide by U"),
    (4, 12, 6, 1, "the 6 K/V heads (per tensor-parallel rank) must be a multiple of U or divide U"),
    (4, 8, 8, 2, "team_size C=2 is invalid for P=2 ranks"),
])
def test_what_the_hybrid_refuses_the_model_refuses(u, hq, hkv, c, message):
    sh, topo = Shard(64, 1, hq, hkv, 16, 2, 4), CPU.topology()
    for call in (lambda: hybrid_s(8, sh, [0] * 8, topo, u, c),
                 lambda: plan(8, sh, [0] * 8, None, u, c, "contiguous"),
                 lambda: choose_hybrid(8, sh, [0] * 8, topo, ulysses_size=u, team_size=c)):
        with pytest.raises(ValueError, match=re.escape(message)):
            call()


# -- on ranks ----------------------------------------------------------------------------------------

def _module(wf, heads, kv_heads, d, causal=True):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import WallFacerAttention

    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=kv_heads, kv_channels=d, use_cpu_initialization=True,
                               attention_dropout=0.0, hidden_dropout=0.0,
                               context_parallel_size=dist.get_world_size())
    mask = AttnMaskType.causal if causal else AttnMaskType.no_mask
    return WallFacerAttention(config, 1, mask, "self", pg_collection=SimpleNamespace(cp=dist.group.WORLD),
                              wallfacer=wf)


def _cpu(ranks_per_node, **kw):
    from megatron_patches.args import WallFacerConfig

    net = dict(bandwidth_gbytes=(2.0, 2.0, 2.0), latency_us=(50.0, 50.0), tflops=0.05, network="ethernet")
    net.update(kw.pop("net", {}))
    return WallFacerConfig(ulysses_size="auto", placement="auto", ranks_per_node=ranks_per_node, **net, **kw)


# (ranks per node, team size, query heads, K/V heads, s_local, causal, net) -> the (U, C, order) auto picks
AUTO_CASES = {
    # one node, a fast kernel: Ulysses over 4, ring attention over the 2 groups
    (8, "auto", 8, 8, 16, True, (("latency_us", (5.0, 5.0)), ("tflops", 0.5))): (4, 1, "team-major"),
    # tiny rows, messages α-bound: U = 2, then C = 2 over the 4 groups (no sub-ring: a ring's backward hops
    # are 3 messages each, placement.hop_messages)
    (8, "auto", 8, 8, 4, True, ()): (2, 2, "team-major"),
    (8, 1, 4, 1, 4, True, ()): (2, 1, "team-major"),           # MQA, the K/V head replicated to 2
    (2, 1, 8, 8, 4, False, ()): (2, 1, "team-major"),          # nodes of 2 ranks: U <= 2
    (1, "auto", 8, 2, 4, True, ()): (1, 2, "team-major"),      # one rank per node: no Ulysses group
    # contrived (the network faster than the node's link): the ring-major order reaches the kernel
    (2, 2, 8, 2, 4, True, (("bandwidth_gbytes", (2.0, 10.0, 10.0)), ("tflops", 5.0))): (1, 2, "ring-major"),
}


def _auto_numerics(cases, b=2, d=8):
    world, me = dist.get_world_size(), dist.get_rank()
    out = {}
    for case in cases:
        rpn, team_size, hq, hkv, s_local, causal, net = case
        module = _module(_cpu(rpn, team_size=team_size, net=dict(net)), hq, hkv, d, causal)
        q, k, v, do = _global_inputs(world * s_local, b, hq, hkv, d)
        want = _reference(q, k, v, do, causal)
        rows = local_rows("zigzag", world, me, s_local)
        mine = [t[rows].clone().requires_grad_() for t in (q, k, v)]
        with ledger.recording() as led:
            o = module(*mine, None)
            o.backward(do[rows].reshape(o.shape))
        (plan_,) = module._plans.values()
        got = [o.view(s_local, b, hq, d)] + [t.grad for t in mine]
        out[case] = ((plan_.ulysses_size, plan_.team_size, plan_.order), sorted(led.as_dict()),
                     max((g - w[rows]).abs().max().item() for g, w in zip(got, want, strict=True)))
    return out


@pytest.mark.slow
@pytest.mark.world_size(8)
def test_auto_layouts_are_exact_against_full_attention_p8(world):
    per_rank = world.run(_auto_numerics, list(AUTO_CASES))
    for case, want in AUTO_CASES.items():
        plans_, groups, errors = zip(*(r[case] for r in per_rank), strict=True)
        assert set(plans_) == {want}, (case, plans_)
        assert max(errors) < 1e-10, (case, errors)
        u, c, _ = want
        assert ("all_to_all@wallfacer.ulysses" in groups[0]) == (u > 1), (case, groups[0])
        assert ("all_gather@wallfacer.team" in groups[0]) == (c > 1), (case, groups[0])


def _disagree(kind):
    """wallfacer_attention with one argument different on one rank: the error text (None if no error)."""
    me = dist.get_rank()
    kw = dict(team_size=1, ulysses_size=2, backward="kv", team_qkv="rebuild", causal=True)
    s = 4
    if kind == "ulysses_1_vs_2" and me == 2:
        kw["ulysses_size"] = 1
    elif kind == "backward" and me == 1:
        kw["backward"] = "q"
    elif kind == "team_qkv" and me == 3:
        kw["team_qkv"] = "keep"
    elif kind == "team_size":
        kw.update(ulysses_size=1, team_size=2 if me else 1)
    elif kind == "causal" and me == 1:
        kw["causal"] = False
    elif kind == "shape" and me == 3:
        s = 6
    q = torch.randn(s, 2, 4, 8)
    k = v = torch.randn(s, 2, 2, 8)
    c = kw.pop("team_size")
    with ledger.recording() as led:
        try:
            wallfacer_attention(q, k, v, dist.group.WORLD, c, **kw)
        except ValueError as e:
            assert set(led.as_dict()) == {"all_gather@world"}, led.as_dict()   # the checks only
            return str(e)
    return None


DISAGREE = {
    "ulysses_1_vs_2": ["must agree on ulysses_size, got ulysses_size: rank 0=2, rank 1=2, rank 2=1, "
                       "rank 3=2"],
    "backward": ["ranks disagree: rank 1 passes", "backward=q", "backward=kv"],   # checks.check_inputs
    "team_qkv": ["must agree on team_qkv, got team_qkv: rank 0=2, rank 1=2, rank 2=2, rank 3=1",
                 "team_qkv {0: 'auto', 1: 'keep', 2: 'rebuild'}"],
    "team_size": ["ranks disagree", "team_size=1", "team_size=2"],
    "causal": ["ranks disagree", "causal=False", "causal=True"],
    "shape": ["ranks disagree: rank 3 passes q [6, 2, 4, 8]"],
}


def _module_disagree(kind):
    """WallFacerAttention with one rank's config different: the first forward's error on this rank."""
    from megatron_patches.args import WallFacerConfig

    me = dist.get_rank()
    if kind == "config_ulysses_1_vs_2":
        wf = WallFacerConfig(ulysses_size=1 if me == 0 else 2)
    else:  # "config_ulysses_auto_vs_1": rank 3 lets the model pick (U = 2 here: 2 K/V heads, one CPU node,
        # a fast kernel), the others 1
        fast = {"latency_us": (5.0, 5.0), "tflops": 0.5}
        wf = _cpu(4, team_size=1, net=fast) if me == 3 else WallFacerConfig()
    module = _module(wf, 4, 2, 8)
    try:
        module(torch.randn(16, 2, 4, 8), torch.randn(16, 2, 2, 8), torch.randn(16, 2, 2, 8), None)
    except ValueError as e:
        return str(e)
    return None


def _checked_once():
    """Two forwards of one module with the same shapes: only the first one checks (and agrees)."""
    module = _module(_cpu(4, team_size="auto"), 4, 2, 8)
    x = [torch.randn(16, 2, h, 8) for h in (4, 2, 2)]
    calls = []
    for _ in range(2):
        with ledger.recording() as led:
            module(*x, None)
        calls.append(led.sent("all_gather", "world"))
    return calls


@pytest.mark.slow
@pytest.mark.world_size(4)
def test_disagreements_raise_on_every_rank_naming_each_value(world):
    for kind, wants in DISAGREE.items():
        messages = world.run(_disagree, kind)
        assert len(set(messages)) == 1 and messages[0] is not None, (kind, messages)
        for want in wants:
            assert want in messages[0], (kind, want, messages[0])
    for kind, want in (("config_ulysses_1_vs_2", "ulysses_size: rank 0=1, rank 1=2, rank 2=2, rank 3=2"),
                       ("config_ulysses_auto_vs_1", "ulysses_size: rank 0=1, rank 1=1, rank 2=1, rank 3=2")):
        messages = world.run(_module_disagree, kind)
        assert len(set(messages)) == 1 and messages[0] is not None and want in messages[0], (kind, messages)
    for first, second in world.run(_checked_once):
        assert (first, second) == ((META_BYTES + SETTINGS_BYTES) * 3, 0)
