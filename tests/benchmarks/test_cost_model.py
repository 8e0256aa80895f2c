"""The cost model's calibration and its out-of-sample check on this machine (benchmarks.cost_model).

The derivations of calibrate.profile_from are checked on synthetic measurements with known α, β,
efficiencies and overlap (cheap); the ranking check itself — calibrate P = 4 ranks from the
microbenchmarks alone, measure every (U, C, order) candidate, compare — runs on a reduced set in CPU time
(the work, which the other users of this shared machine change less than the wall time), is slow, and is
skipped unless COMMWEAVE_COST_MODEL_RANKING=1:

    COMMWEAVE_COST_MODEL_RANKING=1 python -m pytest -q -m slow tests/benchmarks/test_cost_model.py
"""

import os
from dataclasses import replace

import pytest

from benchmarks.cost_model import (
    kendall_tau,
    kernel_drift,
    kernels_scaled,
    main,
    summarize,
    tied_pairs,
)
from megatron_patches.calibrate import config, profile_from
from megatron_patches.profile import BWD_FLOPS, FWD_FLOPS, load, save


def test_kendall_tau_b():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(4 / 6)
    # a tie in the model (two orders on one node): the pair counts in tau-b's denominator only
    assert kendall_tau([1, 1, 3], [1, 2, 3]) == pytest.approx(2 / (2 * 3) ** 0.5)
    # a measured tie (the tie rule): the discordant pair (1, 2) then counts in the denominator only
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    assert kendall_tau([1, 2, 3], [1, 3, 2], ties={(1, 2)}) == pytest.approx(2 / (3 * 2) ** 0.5)


def test_the_tie_rule_needs_three_rounds_in_four():
    a = [10.0, 10.0, 10.0, 10.0, 10.0]
    faster_in_4 = [9.0, 9.0, 9.0, 9.0, 11.0]   # ratios a/b: quartiles 1.11 and 1.11: resolved
    faster_in_3 = [9.0, 9.0, 9.0, 11.0, 11.0]  # quartiles 0.91 and 1.11: a tie
    assert tied_pairs([a, faster_in_4]) == set()
    assert tied_pairs([a, faster_in_3, faster_in_4]) == {(0, 1), (1, 2)}


def test_summary_ranks_and_the_pick():
    rows = [{"name": n, "measured_ms": m, "predicted_ms": p} for n, m, p in
            (("a", 10.0, 5.0), ("b", 9.8, 6.0), ("c", 20.0, 30.0))]
    t = summarize(rows)
    assert (t["pick"], t["best"]) == ("a", "b") and t["pick_over_best"] == pytest.approx(10 / 9.8)
    assert [r["measured_rank"] for r in t["rows"]] == [2, 1, 3]
    assert [r["predicted_rank"] for r in t["rows"]] == [1, 2, 3]
    assert not t["pick_tied_with_best"] and t["kendall_tau"] == t["kendall_tau_ties"] == pytest.approx(1 / 3)
    tied = summarize(rows, {(0, 1)})
    assert tied["pick_tied_with_best"] and tied["tied"] == [["a", "b"]]
    assert tied["kendall_tau_ties"] == pytest.approx(2 / (3 * 2) ** 0.5)


def _flops(name, rows, keys, heads, d):
    scores = rows * (rows + 1) / 2 if name.endswith("causal") else rows * keys
    return (BWD_FLOPS if name.startswith("bwd") else FWD_FLOPS) * scores * heads * d


def _synthetic(cfg, ranks=2):
    """Per-rank measurements of a machine with known constants: ring α = 50 µs, 2 GB/s; all-gather at 50%
    of the link, α_2 = 80 µs; kernels at 1 TFLOP/s (2 heads) and 2 (8 heads) on the square blocks, and
    every exact call of cfg["calls"] at 0.5; block 4 ms, hop 2 ms, both 5 ms (overlap 1/2)."""
    def t(sec):
        return [(sec, sec / 2)] * cfg["reps"]   # (wall, cpu): the CPU clock sees half

    att = {}
    for name in ("fwd", "fwd_causal", "bwd", "bwd_causal"):
        for rows in cfg["rows"]:
            for h in cfg["heads"]:   # 1 TFLOP/s at 2 heads, 2 at 8
                scores = rows * (rows + 1) / 2 if name.endswith("causal") else rows * rows
                flops = (BWD_FLOPS if name.startswith("bwd") else FWD_FLOPS) * scores * h * cfg["head_dim"]
                att[name, rows, h] = t(flops / (1e12 if h == 2 else 2e12))
    for call in cfg["calls"]:
        att[tuple(call)] = t(_flops(*call, cfg["head_dim"]) / 0.5e12)
    coll = {}
    for kind, eff in (("all_gather", 0.5), ("reduce_scatter", 1.0), ("all_to_all", 0.25)):
        for n in cfg["sizes"]:
            coll[kind, 2, 2 * n] = t(80e-6 + 2 * n * 0.5 / (eff * 2e9))
    one = {"attention": att, "gemm": t(2 * 4096 * cfg["hidden"] ** 2 / 3e12),
           "ring": {n: t(50e-6 + n / 2e9) for n in cfg["sizes"]}, "coll": coll,
           "overlap": {"block": t(4e-3), "hop": t(2e-3), "both": t(5e-3)}}
    return [one] * ranks


def test_a_hop_that_costs_cpu_beside_a_block_is_priced_so_in_the_cpu_clock_only():
    """The overlap microbenchmark's block 4 ms, hop 2 ms, both 7 ms: the hop beside the block costs 1 ms
    more than apart. The CPU clock keeps (4 + 2 − 7) / 2 = −1/2, and one ring step of that block and hop
    is then priced as measured, 7 ms (the wall clock keeps its floor of 0: 6 ms). A profile holding the
    negative value saves and loads."""
    from megatron_patches.placement import Topology
    from megatron_patches.profile import from_json

    cfg = config(["--out", "x", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12", "16",
                  "--heads", "8", "2"])
    ranks = [{**r, "overlap": {"block": [(4e-3, 4e-3)] * 3, "hop": [(2e-3, 2e-3)] * 3,
                               "both": [(7e-3, 7e-3)] * 3}} for r in _synthetic(cfg)]
    cpu, wall = (profile_from(ranks, cfg, "synthetic", clock=c) for c in ("cpu", "wall"))
    assert cpu.overlap == pytest.approx(-0.5) and wall.overlap == 0.0
    assert Topology.from_profile(cpu, 2).step_s(4e-3, 2e-3) == pytest.approx(7e-3)
    assert Topology.from_profile(wall, 2).step_s(4e-3, 2e-3) == pytest.approx(6e-3)
    assert from_json(cpu.to_json()).overlap == pytest.approx(-0.5)


def test_the_overlap_pairs_each_repetitions_three_times():
    """A load swing that slows one repetition's block and its block + hop alike cancels in that repetition's
    block + hop − both: block 4 / 8 / 6 ms, hop 2, both 6.5 / 10.5 / 7.5 hide −0.5, −0.5, +0.5 ms, median
    −0.5 ms, overlap −0.5 / 2 = −1/4; the ratio of separate medians (6 + 2 − 7.5 = +0.5) said +1/4."""
    cfg = config(["--out", "x", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12", "16",
                  "--heads", "8", "2"])

    def t(*ms):
        return [(x * 1e-3, x * 1e-3) for x in ms]
    ranks = [{**r, "overlap": {"block": t(4, 8, 6), "hop": t(2, 2, 2), "both": t(6.5, 10.5, 7.5)}}
             for r in _synthetic(cfg)]
    cpu = profile_from(ranks, cfg, "synthetic", clock="cpu")
    assert cpu.overlap == pytest.approx(-0.25)
    assert cpu.provenance["overlap_s"]["hidden"] == pytest.approx(-0.5e-3)


def test_the_overlap_is_measured_at_ring_attentions_own_step():
    """With --calls-for S H the overlap's block is the call most of ring attention's ranks make in a step
    and its hop the K/V stack, 2·S·H·d·elt: P = 4, 512 rows of 8 x 64 fp32 (zigzag, causal): from the
    second step on, three ranks compute a 512 x 256 rectangle (their query chunk pair against the sender's
    early key chunk) and the hop is 2 MiB. An explicit --overlap-bytes wins; without --calls-for the
    square block and 1 MiB."""
    from megatron_patches.calibrate import ring_step

    assert ring_step(4, 512, 8, 64, "float32") == ([["fwd", 512, 256, 8]], 2 << 20)
    base = ["--out", "x", "--ranks", "4"]
    cfg = config([*base, "--calls-for", "512", "8"])
    assert (cfg["overlap_calls"], cfg["overlap_bytes"]) == ([["fwd", 512, 256, 8]], 2 << 20)
    assert config([*base, "--calls-for", "512", "8", "--overlap-bytes", "8192"])["overlap_bytes"] == 8192
    plain = config(base)
    assert (plain["overlap_calls"], plain["overlap_bytes"], plain["overlap_rows"]) == ([], 1 << 20, 512)


def test_the_all_gather_is_timed_in_place_as_the_team_gathers(monkeypatch):
    """calibrate's all-gather hands comm the rank's own slot of the gathered buffer as its input, as
    team.gather_team hands its wire (so the pairwise all-gather's copy onto the slot is a no-op in both);
    the other two collectives keep their separate input and output."""
    import torch

    from commweave import comm
    from megatron_patches.calibrate import _collective

    got = []
    monkeypatch.setattr(comm, "size", lambda group: 2)
    monkeypatch.setattr(comm, "rank", lambda group: 1)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        monkeypatch.setattr(comm, kind, lambda out, inp, group, kind=kind: got.append((kind, out, inp)))
        _collective(kind, "team", 1 << 16, torch.device("cpu"))()
    (_, out, inp), rs, a2a = got
    assert out.numel() == (1 << 16) // 4 and inp.numel() == out.numel() // 2
    assert inp.data_ptr() == out.view(2, -1)[1].data_ptr() and inp.is_contiguous()
    for _, out, inp in (rs, a2a):
        assert out.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()


def test_host_work_is_the_tiny_runs_less_the_models_price():
    """profile_from's host table: each plan's tiny time (host.py) minus choice.plan_s of that tiny problem
    under the profile without host work; at least 0."""
    from megatron_patches.choice import plan_s
    from megatron_patches.host import HOST_ROWS, host_plans, plan_key
    from megatron_patches.placement import Topology
    from megatron_patches.volume import Shard

    cfg = config(["--out", "x", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12", "16",
                  "--heads", "8", "2"])
    base = profile_from(_synthetic(cfg), cfg, "synthetic")
    assert base.host == {}
    plans = host_plans(2, 8, 64, 4, 4)
    assert plans == [(1, 1, "team-major"), (2, 1, "team-major")]
    sh = Shard(HOST_ROWS, 1, 8, 8, 64, 4, 4)
    model = {plan_key(2, *p): plan_s(2, sh, [0, 0], Topology.from_profile(base, 2), *p) for p in plans}
    extra = {plan_key(2, *plans[0]): 3e-3, plan_key(2, *plans[1]): -1e-3}
    ranks = _synthetic(cfg)
    ranks = [{**r, "host": {k: [(model[k] + extra[k], (model[k] + extra[k]) / 2)] * 3 for k in model}}
             for r in ranks]
    prof = profile_from(ranks, cfg, "synthetic")
    assert prof.host == {plan_key(2, *plans[0]): pytest.approx(3e-3, rel=1e-9), plan_key(2, *plans[1]): 0.0}
    assert prof.provenance["host_rows"] == HOST_ROWS


def test_profile_from_recovers_the_constants(tmp_path):
    cfg = config(["--out", "x", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12", "16",
                  "--heads", "8", "2"])
    prof = profile_from(_synthetic(cfg), cfg, "synthetic")
    assert prof.intra.alpha_s == pytest.approx(50e-6) and prof.intra.gbytes == pytest.approx(2.0)
    assert prof.collectives["all_gather"][2].efficiency == pytest.approx(0.5)
    assert prof.collectives["all_gather"][2].alpha_s == pytest.approx(80e-6)
    assert prof.collectives["all_to_all"][2].efficiency == pytest.approx(0.25)
    for kernel in prof.attention.values():   # per head count, against the work scores x heads
        assert [t for _, t in kernel.curves[2].points] == [pytest.approx(1.0)] * 2
        assert [t for _, t in kernel.curves[8].points] == [pytest.approx(2.0)] * 2
        assert kernel.curves[8].points[0][0] == 4 * kernel.curves[2].points[0][0]
    assert prof.gemm_tflops == pytest.approx(3.0) and prof.overlap == pytest.approx(0.5)
    # the fitted points kept (bytes -> seconds), and a profile holding them saves and loads
    points = prof.provenance["message_s"]
    assert points["ring"]["4096"] == pytest.approx(50e-6 + 4096 / 2e9)
    assert points["all_gather 2"]["8192"] == pytest.approx(80e-6 + 8192 * 0.5 / (0.5 * 2e9))
    path = tmp_path / "p.json"
    save(prof, str(path))
    assert load(str(path)).provenance["message_s"] == points
    cpu = profile_from(_synthetic(cfg), cfg, "synthetic", clock="cpu")   # every time halved
    assert cpu.intra.gbytes == pytest.approx(4.0) and cpu.gemm_tflops == pytest.approx(6.0)
    assert cpu.provenance["clock"] == "cpu"


def test_the_calibration_measures_every_call_the_plans_make_and_prices_them_so():
    """--calls-for: the block calls of every P = 4 plan at 512 rows x 8 heads (counted by hand from the
    zigzag layout: ring's diagonal 512² and half-chunk rectangles 256 x 512 / 512 x 256 at 8 heads; C = 2's
    team blocks of 1024 rows; U = 2's 1024 rows of 4 heads; U = 4's one diagonal 2048² of 2 heads), each
    forward and backward; profile_from keeps each one's seconds (the synthetic 0.5 TFLOP/s, not the curves'
    1 or 2), and a plan's kernels are priced from them: its estimate grows by exactly the difference."""
    from megatron_patches.choice import _hybrid_parts, candidates, plan_s
    from megatron_patches.layout import Layout
    from megatron_patches.placement import ORDERS, Topology, compute_steps
    from megatron_patches.profile import call_key
    from megatron_patches.volume import Shard

    cfg = config(["--out", "x", "--ranks", "4", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12",
                  "16", "--heads", "8", "2", "--calls-for", "512", "8"])
    by_hand = {(512, 512, True, 8), (256, 512, False, 8), (512, 256, False, 8), (512, 1024, False, 8),
               (1024, 512, False, 8), (1024, 1024, True, 8), (1024, 1024, True, 4), (512, 1024, False, 4),
               (1024, 512, False, 4), (2048, 2048, True, 2)}
    want = sorted([b + ("_causal" if diag else ""), r, k, h] for r, k, diag, h in by_hand
                  for b in ("fwd", "bwd"))
    assert sorted(cfg["calls"]) == want
    prof = profile_from(_synthetic(cfg, 4), cfg, "synthetic")
    assert prof.calls == {call_key(*c, 64): pytest.approx(_flops(*c, 64) / 0.5e12) for c in want}
    curves = profile_from(_synthetic({**cfg, "calls": []}, 4), cfg | {"calls": []}, "synthetic")
    sh, nodes = Shard(512, 1, 8, 8, 64, 4, 4), [0] * 4
    # no overlap: a step is its block plus its hop, so the kernels' difference passes through whole
    exact, curve = (Topology.from_profile(replace(pr, overlap=0.0), 4) for pr in (prof, curves))
    for u, c, order in candidates(4, sh, nodes):
        inner, p = _hybrid_parts(sh, u, nodes, None)[0], 4 // u
        lay = Layout(p, c, ORDERS[order](p, c), "zigzag")
        e, k = ([sum(compute_steps(lay, inner, t, True, back)) for back in (False, True)]
                for t in (exact, curve))
        assert e[0] > k[0] and e[1] > k[1]   # 0.5 TFLOP/s against the curves' 1 and 2
        gap = sum(e) - sum(k)
        assert plan_s(4, sh, nodes, exact, u, c, order) == pytest.approx(
            plan_s(4, sh, nodes, curve, u, c, order) + gap, rel=1e-9)


def test_kernel_drift_is_the_reference_calls_over_their_calibrated_price():
    """kernel_drift: per round, the reference calls' seconds over their price in the profile (the synthetic
    machine: the exact calls at 0.5 TFLOP/s; a call it did not measure at 2 TFLOP/s at 8 heads, held beyond
    the largest measured block), counted by hand; and kernels_scaled makes every kernel call that factor
    longer and nothing else."""
    from megatron_patches.placement import Topology

    cfg = config(["--out", "x", "--ranks", "2", "--reps", "3", "--rows", "64", "256", "--sizes-log2", "12",
                  "16", "--heads", "8", "2", "--calls-for", "256", "8"])
    prof = profile_from(_synthetic(cfg), cfg, "synthetic")
    exact = [("fwd_causal", 256, 256, 8), ("bwd", 128, 256, 8)]   # P = 2's ring: diagonal, half chunk
    assert all(list(c) in cfg["calls"] for c in exact)
    n = 512   # not a call of the plans, beyond the largest measured block: the curve's held throughput
    price = {c: _flops(*c, 64) / 0.5e12 for c in exact}
    price.update({c: _flops(*c, 64) / 2e12 for c in (("fwd", n, n, 8), ("bwd_causal", n, n, 8))})
    refs = {c: [1.25 * t, 0.8 * t, t] for c, t in price.items()}
    assert kernel_drift(refs, prof, 64) == [pytest.approx(1.25), pytest.approx(0.8), pytest.approx(1.0)]
    slow = kernels_scaled(prof, 1.5)
    a, b = Topology.from_profile(prof), Topology.from_profile(slow)
    for rows, keys, diag, heads, back in ((n, n, True, 8, False), (128, 300, False, 2, True),
                                          (64, 64, True, 4, True), (256, 256, True, 8, False),
                                          (128, 256, False, 8, True)):   # the last two: exact calls
        assert b.call_s(rows, keys, diag, heads, 64, back) == pytest.approx(1.5 * a.call_s(rows, keys, diag,
                                                                                         heads, 64, back))
    assert (slow.intra, slow.collectives, slow.overlap, slow.host, slow.memory) == \
        (prof.intra, prof.collectives, prof.overlap, prof.host, prof.memory)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("COMMWEAVE_COST_MODEL_RANKING") != "1",
                    reason="a timed check (about 90 s alone here; speed lives in benchmarks, README "
                    "'The cost model'); COMMWEAVE_COST_MODEL_RANKING=1 runs it, strictly")
def test_the_model_ranks_the_candidates_as_measured_p4(capsys):
    """P = 4 as the README's runs (8 heads x 64, 512 rows per rank; U = 1 C = 1 / 2, U = 2 C = 1,
    U = 4 C = 1), with their calibration (block sizes 128 .. 4096 at 8, 4, 2, 1 heads, every exact call of
    the plans, messages 2^12 .. 2^22, 9 repetitions, host work) and their 11 rounds; the bar is asserted
    strictly, without the tie rule. 11 rounds, not 3: one round's paired ratio of two candidates spreads
    by 5-7% (the SD of its log, median over 8 runs of 11 rounds on 2026-12-03; 3-11% per run), so a 3%
    difference (ring attention against C = 2 measured 3-6% apart in session 9) takes about 10 rounds to
    resolve (the paired mean, 95% one-sided), and 3-round subsets of runs whose 11 rounds met the bar met
    it in 65-96% of them. Skipped unless COMMWEAVE_COST_MODEL_RANKING=1: it times the machine, and on this
    shared 2-core machine its result depends on the load. Through session 9 it held at P = 4 in about half
    the README's runs (tau-b 0.33-1.00, the misses mostly ring and C = 2 a few % apart, swapped); with the
    memory count and the in-place all-gather of session 10 in 8 of 8 benchmark runs and 4 of 4 runs of this
    test (README, "Latest runs")."""
    out = main(["--worlds", "4", "--seq-per-rank", "512", "--heads", "8", "--head-dim", "64", "--reps", "11",
                "--calib-reps", "9", "--rows", "128", "256", "512", "1024", "2048", "4096",
                "--sizes-log2", "12", "22"])
    t = out["P4"]["cpu"]
    assert len(t["rows"]) == 4
    assert t["kendall_tau"] >= 0.8, capsys.readouterr().out
    assert t["pick_over_best"] <= 1.05, capsys.readouterr().out
