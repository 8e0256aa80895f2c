"""A WAN direction as a fluid resource: per-connection fair sharing, window caps, token rings."""

import pytest

from launch.plan.fluid import Flow, WanDirection


def _flow(name, nbytes, streams=1, t=0.0):
    return Flow((name,), t, nbytes, streams, latency=0.5)


def _run(link, until=100.0):
    """Advance event by event; {name: done}."""
    done = {}
    while (t := link.next_event()) is not None and t <= until:
        done.update({f.key[0]: f.done for f in link.advance(t)})
    return done


def test_connections_share_the_link_fairly_and_each_is_capped():
    """4 B/s, per-connection cap 2: flows of 1 and 3 connections get 1 and 3 B/s; when the 3-connection
    flow ends (3 bytes at t=1) the other runs alone at its cap, 2 B/s: 2 bytes left end at t=2."""
    link = WanDirection(bandwidth=4.0, stream_cap=2.0)
    link.add(_flow("one", 3.0, 1), 0.0)
    link.add(_flow("three", 3.0, 3), 0.0)
    assert link.rate() == pytest.approx(1.0)
    assert _run(link) == pytest.approx({"three": 1.0, "one": 2.0})
    assert link.carried == pytest.approx(6.0)


def test_a_flow_joining_later_slows_the_first():
    link = WanDirection(bandwidth=2.0, stream_cap=10.0)
    link.add(_flow("a", 4.0), 0.0)
    link.advance(1.0)                      # a has 2 bytes left
    link.add(_flow("b", 1.0, t=1.0), 1.0)    # now 1 B/s each: b ends at 2, a then alone: 1 byte at 2 B/s
    assert _run(link) == pytest.approx({"b": 2.0, "a": 2.5})


def test_a_token_ring_serves_in_token_order_and_waits_for_the_next_token():
    link = WanDirection(bandwidth=1.0, stream_cap=10.0)
    link.add(_flow("t1", 1.0), 0.0, ring="r", token=1)     # released first, but token 1
    assert link.next_event() is None                       # the link waits for token 0
    link.advance(2.0)
    link.add(_flow("t0", 1.0, t=2.0), 2.0, ring="r", token=0)
    free = _flow("free", 1.0, t=2.0)
    link.add(free, 2.0)                                    # a flow outside the ring runs alongside
    done = _run(link)
    # t0 and free share 1 B/s until 4; then t1 (its turn now) runs alone until 5
    assert done == pytest.approx({"t0": 4.0, "free": 4.0, "t1": 5.0})
    assert free.arrives == pytest.approx(4.5)
