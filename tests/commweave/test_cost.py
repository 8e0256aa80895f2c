import pytest

from commweave import cost


def test_fit_recovers_a_line_and_reports_r2():
    true = cost.AlphaBeta(2e-5, 3e-10)
    sizes = [2**18 * i for i in range(1, 25)]
    f = cost.fit(sizes, [true(n) for n in sizes])
    assert f.model.alpha == pytest.approx(true.alpha, rel=1e-9)
    assert f.model.beta == pytest.approx(true.beta, rel=1e-9)
    assert f.r2 == pytest.approx(1.0)


def test_fit_clamps_negative_intercept_and_rejects_bad_samples():
    assert cost.fit([1.0, 2.0, 3.0], [0.5, 1.6, 2.7]).model.alpha == 0.0
    with pytest.raises(ValueError, match="two distinct sizes"):
        cost.fit([4, 4], [1, 2])
    with pytest.raises(ValueError, match=">= 2 paired samples, got 1 sizes and 2 times"):
        cost.fit([4], [1, 2])
    with pytest.raises(ValueError, match="alpha=-1"):
        cost.AlphaBeta(-1, 0)


def test_collective_formulas_match_the_ledger_conventions():
    link = cost.AlphaBeta.from_link(1e-5, 1e9)
    n, g = 8e6, 4
    assert cost.all_to_all(link, n, g) == pytest.approx(3e-5 + n * 3 / 4 / 1e9)
    assert cost.all_gather(link, n, g) == pytest.approx(3e-5 + n * 3 / 4 / 1e9)
    assert cost.all_reduce(link, n, g) == pytest.approx(
        cost.reduce_scatter(link, n, g) + cost.all_gather(link, n, g))
    assert cost.all_to_all(link, n, 1) == 0.0
    assert cost.p2p(link, n) == pytest.approx(1e-5 + 8e-3)


def test_exchange_shares_a_node_nic_between_its_flows():
    intra, nic = cost.AlphaBeta(1e-6, 1e-10), cost.AlphaBeta(1e-5, 1e-9)
    node = [0, 0, 1, 1]
    assert cost.exchange(intra, nic, [(0, 1), (1, 0)], node, 1e6) == pytest.approx(intra(1e6))
    # A ring over both nodes: one flow leaves each node; the NIC carries it alone.
    ring = [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert cost.exchange(intra, nic, ring, node, 1e6) == pytest.approx(nic(1e6))
    # A transpose: both ranks of node 0 send to node 1 at once, each at half the NIC.
    transpose = [(0, 2), (1, 3), (2, 0), (3, 1)]
    assert cost.exchange(intra, nic, transpose, node, 1e6) == pytest.approx(1e-5 + 2e-3)
    assert cost.exchange(intra, nic, [(0, 0)], node, 1e6) == 0.0
    # One NIC per rank at a quarter of the node's: the lone ring flow is capped by it.
    rank_nic = cost.AlphaBeta(1e-5, 4e-9)
    assert cost.exchange(intra, nic, ring, node, 1e6, rank_nic) == pytest.approx(1e-5 + 4e-3)
