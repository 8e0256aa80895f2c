"""The calibrated cost model against the paper's reported runs, and the what-if command.

The paper (wallfacer.md §11) reports model throughput over ring attention: +114.33% for DiT on 32 A100
(8 per node, 100 Gb/s Ethernet, 512K tokens, the Fig. 10a endpoint) and up to +77.12% for GPT on 64 H100
(8 per node, 8x400 Gb/s InfiniBand; the Fig. 10b endpoint is 512K tokens). The model's throughput
gain — a layer's GEMMs plus its attention, ring attention against the best WallFacer alone — must have
the measured direction and size within [2/3, 3/2] of it, and ``auto`` must pick C > 1 there.
"""

import json
import shlex

import pytest

from megatron_patches.estimate import (
    Cluster,
    Model,
    choose_hybrid,
    dense_layer_s,
    hybrid_s,
    main,
    plans,
    report,
    ulysses_s,
)
from megatron_patches.layout import Layout
from megatron_patches.placement import ORDERS, choose, estimate

# name: (cluster, model, measured throughput over ring attention)
PAPER = {
    "DiT 1B, 32 A100, 100 Gb/s Ethernet, 512K": (
        Cluster(32, 8, intra_gbytes=300, inter_gbits=100, latency_us=25, tflops=312, network="ethernet"),
        Model(hidden=1536, heads=24, seq=524288, causal=False), 2.1433),
    "GPT 7B, 64 H100, 8x400 Gb/s IB, 512K": (
        Cluster(64, 8, intra_gbytes=450, inter_gbits=3200, latency_us=10, tflops=989, network="ib"),
        Model(hidden=4096, heads=32, seq=524288, causal=True), 1.7712),
}


def predicted_gain(cluster, model):
    rep = report(cluster, model)
    dense = dense_layer_s(cluster, model)
    return (dense + rep["ring_s"]) / (dense + rep["wallfacer"]["s"]), rep


@pytest.mark.parametrize("name", sorted(PAPER))
def test_model_agrees_with_the_paper(name):
    cluster, model, measured = PAPER[name]
    gain, rep = predicted_gain(cluster, model)
    assert gain > 1, f"{name}: the model predicts WallFacer slower ({gain:.2f}x), the paper: {measured}"
    assert 2 / 3 <= gain / measured <= 3 / 2, f"{name}: predicted {gain:.2f}x, measured {measured}x"
    assert rep["wallfacer"]["team_size"] > 1
    # WallFacerAttention's auto (placement.choose) makes the same choice.
    world, topo = cluster.gpus, cluster.topology()
    lay = choose(world, model.shard(world), cluster.nodes(), topo, "auto", "auto", causal=model.causal)
    assert lay.team_size == rep["wallfacer"]["team_size"] > 1


def test_ring_is_c1_and_wallfacer_alone_is_u1():
    cluster, model, _ = PAPER["GPT 7B, 64 H100, 8x400 Gb/s IB, 512K"]
    topo, nodes, sh = cluster.topology(), cluster.nodes(), model.shard(64)
    for c in (1, 2, 4, 8):
        want = min(estimate(Layout(64, c, order(64, c)), sh, nodes, topo) for order in ORDERS.values())
        assert hybrid_s(64, sh, nodes, topo, 1, c)[0] == pytest.approx(want)
    assert report(cluster, model)["ring_s"] == pytest.approx(hybrid_s(64, sh, nodes, topo, 1, 1)[0])


def test_hybrid_plans_and_choice():
    """GQA 32:8 on 4-GPU nodes: U in {2, 4} (K/V heads split without expansion), C over P/U ranks."""
    cluster = Cluster(16, 4, intra_gbytes=150, inter_gbits=200, latency_us=15, tflops=300)
    model = Model(hidden=4096, heads=32, kv_heads=8, seq=262144)
    topo, nodes, sh = cluster.topology(), cluster.nodes(), model.shard(16)
    got = {(p.ulysses_size, p.team_size) for p in plans(16, sh, nodes, topo)}
    assert got == {(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 1), (4, 2)}
    best = choose_hybrid(16, sh, nodes, topo)
    assert best.seconds == min(p.seconds for p in plans(16, sh, nodes, topo))
    # Ulysses over all 16 ranks: 32 heads split, 8 K/V heads repeated to 16.
    assert ulysses_s(16, sh, nodes, topo) is not None
    assert ulysses_s(32, Model(hidden=1536, heads=24, seq=524288).shard(32), list(range(32)), topo) is None


def test_the_issue_command_prints_the_table_and_a_json_line(capsys):
    line = main(shlex.split("--gpus 16 --gpus-per-node 4 --intra-GBps 150 --inter-Gbps 200 --latency-us 15 "
                            "--tflops 300 --hidden 4096 --heads 32 --kv-heads 8 --seq 262144"))
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1]) == json.loads(json.dumps(line))
    assert set(line) >= {"ring_s", "ulysses_s", "wallfacer", "best"}
    assert set(line["wallfacer"]) >= {"team_size", "s"}
    assert set(line["best"]) >= {"team_size", "ulysses_size", "s"}
    assert line["best"]["s"] <= min(line["ring_s"], line["wallfacer"]["s"], line["ulysses_s"])
    assert sum("<- best" in row for row in out) == 1
    assert any(row.strip().startswith("ring attention (C=1)") for row in out)


def test_no_causal_and_missing_ulysses(capsys):
    line = main(shlex.split("--gpus 32 --gpus-per-node 8 --heads 24 --hidden 1536 --seq 524288 --no-causal "
                            "--network ethernet --inter-Gbps 100"))
    assert line["ulysses_s"] is None
    assert "DeepSpeed-Ulysses: n/a" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    ("--gpus 16 --seq 1000", "--seq 1000 must be divisible by 2 x --gpus = 32"),
    ("--gpus 12 --gpus-per-node 8", "--gpus 12 must be a positive multiple of --gpus-per-node 8"),
    ("--heads 32 --kv-heads 5", "--kv-heads 5"),
])
def test_bad_arguments_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv.split())
    assert message in capsys.readouterr().err
