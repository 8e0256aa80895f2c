"""benchmarks/start_rules.py: two start rules alternated within one run, balanced over the arm orders,
each chunk counted for the rule it started under, and each rule's slowdown from its own cycles' pairs."""

import pytest

from benchmarks.start_rules import ORDERS, attribute, check_pairs, compare, paired_difference, rule_of


def test_the_rules_alternate_and_each_meets_every_arm_order_once_per_round():
    rules = (0.9, None)
    got = [rule_of(i, rules) for i in range(4 * ORDERS)]
    assert got[:2 * ORDERS] == [0.9, None] * 3 + [None, 0.9] * 3 == got[2 * ORDERS:]
    for rule in rules:                     # cycle i runs the arms in order i mod 6
        assert sorted(i % ORDERS for i in range(2 * ORDERS) if got[i] == rule) == list(range(ORDERS))
    assert all(got[k] != got[k + 1] for k in range(0, len(got), 2))
    check_pairs(48)
    with pytest.raises(ValueError, match=r"--pairs=50 with --versus-quantile: a multiple of 12"):
        check_pairs(50)


def test_a_chunk_is_its_starting_iterations_rule():
    spans = [(0.0, 1.0, 0.9), (2.0, 3.0, None), (4.0, 5.0, 0.9)]
    chunks = [  # (t0, t1, tokens, predicted, tail, deadline)
        (0.1, 0.2, 32, 0.1, 0.12, 0.5),        # p90: on time, within its tail
        (0.9, 1.2, 16, 0.1, 0.12, 1.0),        # p90: runs past its iteration, late by 0.2 s, over its tail
        (2.5, 2.6, 32, 0.1, 0.05, 0.0),        # mean: over its tail, no window (deadline 0): not late
        (1.5, 1.6, 32, 0.1, 0.05, 1.55),       # between the compared iterations: nobody's
        (4.0, 4.05, 8, 0.1, 0.12, 4.01),       # p90, at its iteration's first instant: late by 0.04 s
    ]
    p90, mean = attribute(chunks, spans)
    assert {k: p90[k] for k in ("rule", "chunks", "tokens", "late", "over_tail")} == {
        "rule": 0.9, "chunks": 3, "tokens": 56, "late": 2, "over_tail": 1}
    assert p90["late_s"] == pytest.approx(0.24) and p90["wall"] == pytest.approx(2.0)
    assert p90["tokens_per_s"] == pytest.approx(28.0)
    assert [mean[k] for k in ("rule", "chunks", "tokens", "late", "over_tail")] == [None, 1, 32, 0, 1]
    assert mean["tokens_per_s"] == pytest.approx(32.0)


def _rank(on, stock, cycle_rules, counts):
    rules = [{"rule": rule, "chunks": c, "tokens": 32 * c, "late": late, "late_s": 1e-3 * late,
              "over_tail": over, "wall": 1.0, "tokens_per_s": 32.0 * c} for rule, (c, late, over) in counts]
    return {"on": on, "stock": stock, "cycle_rules": cycle_rules, "rules": rules}


def test_each_rule_is_priced_on_its_own_cycles_and_pairs_give_the_difference(capsys):
    rules = (0.9, None)
    cycle_rules = [rule_of(i, rules) for i in range(4)]            # 0.9, None, 0.9, None
    stock = [1.0, 2.0, 1.0, 2.0]               # the second and fourth cycles ran on a slower machine
    # p90 +1% and +3% (median +2%); mean +2% and +4% (median +3%): per pair, p90 - mean = -1 pt both times
    r0 = _rank([1.01, 2.04, 1.03, 2.08], stock, cycle_rules, [(0.9, (10, 1, 1)), (None, (12, 3, 6))])
    r1 = _rank([1.0, 2.0, 1.0, 2.0], stock, cycle_rules, [(0.9, (9, 0, 1)), (None, (11, 2, 5))])
    assert paired_difference([1.01, 1.02, 1.03, 1.04], cycle_rules, rules) == pytest.approx([-0.01, -0.01])
    out = compare([r0, r1], rules)
    p90, mean = out["rules"]
    assert (p90["rule"], mean["rule"]) == ("p90", "mean") and p90["cycles"] == mean["cycles"] == 2
    assert p90["slowdown"] == pytest.approx(0.02) and mean["slowdown"] == pytest.approx(0.03)
    assert p90["slowdown_per_rank"] == pytest.approx([0.02, 0.0])
    assert (p90["tokens_per_s"], mean["tokens_per_s"]) == pytest.approx((32.0 * 19, 32.0 * 23))
    assert out["paired_difference"] == pytest.approx(-0.01) and out["pairs"] == 2
    text = capsys.readouterr().out
    assert "| p90 | +2.00% (" in text and "| 1/10 (1.0 ms), 0/9 (0.0 ms) | 1/10, 1/9 |" in text
    assert "| mean | +3.00% (" in text and "| 3/12 (3.0 ms), 2/11 (2.0 ms) | 6/12, 5/11 |" in text
    assert "paired p90 - mean (cycles 2k, 2k+1; rank 0): median -1.00 pt" in text


def test_the_benchmark_refuses_a_comparison_it_cannot_balance():
    from benchmarks import bubbletea as bench

    with pytest.raises(SystemExit, match=r"--versus-quantile=0\.9: the same rule as --tail-quantile"):
        bench.main(["--versus-quantile", "0.9"])
    with pytest.raises(SystemExit, match=r"--pairs=50 with --versus-quantile: a multiple of 12"):
        bench.main(["--versus-quantile", "0", "--pairs", "50"])
    with pytest.raises(SystemExit, match=r"--versus-quantile=1\.5: in \[0, 1\]"):
        bench.main(["--versus-quantile", "1.5"])
