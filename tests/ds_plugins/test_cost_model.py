"""The alpha-beta layer model: the wavefront formula, the volumes it charges, and its projections."""

import pytest

from commweave.cost import AlphaBeta
from ds_plugins import agreement, cost_model
from ds_plugins.cost_model import CLUSTERS, LayerShape, OpCosts, cluster_costs, predict

SHAPE = LayerShape(tokens=4096, hidden=1024, ffn=4096, experts=8, k=2, capacity_factor=1.25, mp=2, ep=2,
                   esp=2, chunks=4)


def _only(op: str, overlap: float = 0.0, beta: float = 1.0) -> OpCosts:
    """Every operation free except ``op`` at one unit per byte."""
    return OpCosts({name: AlphaBeta(0.0, beta if name == op else 0.0) for name in cost_model.OPS}, overlap)


def test_wavefront_is_the_saa_time_model():
    # two stages a=1, b=3 per chunk, r=4: a + (r-1)·max(a, b) + b with perfect overlap, r·(a+b) serial
    assert cost_model._wavefront(_only("gemm", 0.0), 4, [1.0, 3.0]) == 1 + 3 * 3 + 3
    assert cost_model._wavefront(_only("gemm", 1.0), 4, [1.0, 3.0]) == 4 * (1 + 3)
    assert cost_model._wavefront(_only("gemm", 0.0), 1, [1.0, 3.0]) == 4


def _without_agreement(schedule: str, sh: LayerShape, costs: OpCosts) -> float:
    parts = predict(schedule, sh, costs).parts
    return sum(v for part, v in parts.items() if part != "agree")


def test_s1_and_s2_charge_n_times_fewer_all_to_all_bytes():
    a2a = _only("a2a@ep")
    base = _without_agreement("deepspeed", SHAPE, a2a)
    assert base / _without_agreement("s2", SHAPE, a2a) == pytest.approx(SHAPE.mp)
    # S1's buffer holds the routes one block of S/N tokens keeps per expert, k·S/E / N = 512 of C / N = 640
    c, c1 = SHAPE.capacity(SHAPE.tokens), SHAPE.k * SHAPE.tokens // SHAPE.experts // SHAPE.mp
    assert base / _without_agreement("s1", SHAPE, a2a) == pytest.approx(SHAPE.mp * c / (c1 * SHAPE.mp))
    assert predict("ds-installed", SHAPE, a2a).total == pytest.approx(base / SHAPE.mp)
    # the agreements: none where S and the capacity travel in the fill counts' headers, which reach every
    # rank (ESP = MP, or no MP: ds_plugins.schedules.sync_free); without the fill counts one round (S) of
    # 48 bytes over EP, and S1 a second (its capacity)
    no_mp = LayerShape(**{**SHAPE.__dict__, "mp": 1, "esp": 1})
    for schedule in ("s1", "s2", "deepspeed"):
        assert predict(schedule, SHAPE, a2a).parts["agree"] == 0
        assert predict(schedule, no_mp, a2a).parts.get("agree", 0) == 0
    dense = LayerShape(**{**SHAPE.__dict__, "skip_empty_slots": False})
    assert predict("s2", dense, a2a).parts["agree"] == predict("deepspeed", dense, a2a).parts["agree"] == 48
    assert predict("s1", dense, a2a).parts["agree"] == 96


def test_the_fill_exchange_is_charged_the_headers_the_code_sends():
    assert cost_model.HEADER == agreement.HEADER


def test_mp_all_gather_volume_decides_between_s1_and_s2():
    # S2 gathers k·f·S·M over MP, S1 S·M: with only that cost, S1 wins iff k·f > 1 (parm.md §2.5)
    mp_only = _only("ag@mp")
    big = predict("s2", SHAPE, mp_only).total / predict("s1", SHAPE, mp_only).total
    assert big == pytest.approx(2 * 1.25, rel=0.01)
    small = LayerShape(**{**SHAPE.__dict__, "k": 1, "capacity_factor": 0.5})
    assert predict("s2", small, mp_only).total < predict("s1", small, mp_only).total


def test_skipping_charges_the_experts_the_filled_rows_only():
    # k = 2, f = 1.25: k·S/E = 1024 routes per expert and source fill 1024 of its C = 1280 slots (1/f);
    # DeepSpeed's own MoE runs every slot either way
    gemm = _only("gemm")
    for schedule in ("s2", "deepspeed"):
        every = predict(schedule, LayerShape(**{**SHAPE.__dict__, "skip_empty_slots": False}), gemm)
        assert predict(schedule, SHAPE, gemm).parts["experts"] == pytest.approx(every.parts["experts"] / 1.25)
    # S1's buffer is sized by the routes its blocks keep (balanced: all of its slots hold one)
    every = predict("s1", LayerShape(**{**SHAPE.__dict__, "skip_empty_slots": False}), gemm)
    assert predict("s1", SHAPE, gemm).parts["experts"] == every.parts["experts"]
    all_slots = LayerShape(**{**SHAPE.__dict__, "skip_empty_slots": False})
    assert predict("ds-installed", SHAPE, gemm).total == predict("ds-installed", all_slots, gemm).total
    # f < 1: every slot holds a token, nothing to skip
    tight = LayerShape(**{**SHAPE.__dict__, "capacity_factor": 0.5})
    assert predict("s2", tight, gemm).total == \
        predict("s2", LayerShape(**{**tight.__dict__, "skip_empty_slots": False}), gemm).total
    # the fill counts with this rank's header per EP peer: one A2A over EP of E + p·HEADER int32, forward
    # only (without them the token count is agreed instead: "agree")
    a2a = _only("a2a@ep")
    assert _without_agreement("s2", SHAPE, a2a) - _without_agreement("s2", all_slots, a2a) == \
        pytest.approx(4 * (SHAPE.experts + SHAPE.ep * agreement.HEADER))


@pytest.mark.parametrize("cluster", CLUSTERS, ids=lambda c: c.name.split(":")[0])
def test_cluster_projection_orders_the_schedules(cluster):
    sh = LayerShape(**{**SHAPE.__dict__, "mp": cluster.gpus_per_node, "esp": cluster.gpus_per_node,
                       "ep": cluster.nodes})
    t = {s: predict(s, sh, cluster_costs(cluster, sh)).total
         for s in ("ds-installed", "deepspeed", "s1", "s2")}
    assert all(v > 0 for v in t.values())
    assert min(t["s1"], t["s2"]) < t["deepspeed"]  # the A2A of V instead of V/N dominates baseline A


def test_costs_must_cover_every_operation():
    with pytest.raises(ValueError, match="missing"):
        OpCosts({"gemm": AlphaBeta(0, 1)})
    with pytest.raises(ValueError, match="overlap inefficiency"):
        OpCosts({name: AlphaBeta(0, 1) for name in cost_model.OPS}, overlap=1.5)
