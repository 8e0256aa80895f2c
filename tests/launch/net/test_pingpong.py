"""Link constants from ping-pongs: the two-size fit, the combination over a job's WAN pairs, the
sizes per way of sending, and the protocol itself between two threads."""

import math
import queue
import threading

import pytest

from launch.net import pingpong
from launch.plan.socket_limits import STRIPE_MIN_BYTES


def test_fit_recovers_alpha_and_rate():
    alpha, rate = 0.012, 4e6
    seconds = {str(k): alpha + k * 1024 / rate for k in (64, 2048)}
    got = pingpong.fit(seconds, (64, 2048))
    assert got["alpha_s"] == pytest.approx(alpha) and got["Bps"] == pytest.approx(rate)
    # a small transfer faster than the fitted rate allows would give a negative alpha: clipped at 0
    assert pingpong.fit({"64": 0.001, "2048": 0.5}, (64, 2048))["alpha_s"] == 0.0


def test_sizes_follow_striping():
    assert pingpong.sizes_kib(1) == (64, 2048)
    # with k > 1 both sizes are striped (a transfer below STRIPE_MIN_BYTES goes whole over one connection)
    assert min(pingpong.sizes_kib(8)) * 1024 >= STRIPE_MIN_BYTES
    with pytest.raises(ValueError, match="connections=0 must be >= 1"):
        pingpong.sizes_kib(0)


def test_combine_takes_the_median_over_pairs_per_size():
    pairs = [{"one_way": {"1024": a, "4096": b}, "send_return": {"1024": c, "4096": c}}
             for a, b, c in ((0.1, 0.2, 0.0), (0.3, 0.5, 0.02), (0.2, 0.3, 0.01))]
    got = pingpong.combine(pairs, 8)
    assert got == {**pingpong.fit({"1024": 0.2, "4096": 0.3}, (1024, 4096)),
                   "send_return_s": {"1024": 0.01, "4096": 0.01}, "pingpong_s": pairs}
    with pytest.raises(ValueError, match="no pair reported"):
        pingpong.combine([], 1)


def test_one_way_between_two_threads():
    """Both sides run the protocol to the end, the answer carries the data, only the first side times."""
    lanes = {0: queue.Queue(), 1: queue.Queue()}        # lanes[i]: what side i receives
    seen, out = [], {}

    def side(me):
        def send(t):
            lanes[1 - me].put(t.clone())

        def recv(t):
            got = lanes[me].get(timeout=10)
            t.copy_(got)
            seen.append((me, t.numel()))
        out[me] = pingpong.one_way(me == 0, send, recv, (1, 8), repeats=2)

    threads = [threading.Thread(target=side, args=(me,)) for me in (0, 1)]
    [t.start() for t in threads]
    [t.join(timeout=20) for t in threads]
    assert set(out) == {0, 1}
    for what in ("one_way", "send_return"):
        assert all(out[0][what][k] > 0 for k in ("1", "8")), out
        assert all(math.isnan(out[1][what][k]) for k in ("1", "8")), out
    # the send returns before the answer came back
    assert all(out[0]["send_return"][k] < 2 * out[0]["one_way"][k] for k in ("1", "8"))
    # per size and repeat: a sync element and the tensor each way
    assert sorted(seen) == sorted([(me, n) for me in (0, 1) for n in (1, 256, 1, 256, 1, 2048, 1, 2048)])


def test_ranks_outside_the_pair_compute_until_it_is_done():
    """Three ranks as threads: the pair (0, 1) ping-pongs while rank 2 runs its compute, which stops once
    rank 0's message says the pair is done; then every rank leaves the barrier."""
    lanes = {(a, b): queue.Queue() for a in range(3) for b in range(3)}       # lanes[(src, dst)]
    barrier, out, computed = threading.Barrier(3, timeout=20), {}, []

    class Sent:
        def wait(self):
            return True

    def rank(me):
        def send(t, peer):
            lanes[(me, peer)].put(t.clone())

        def recv(t, peer):
            t.copy_(lanes[(peer, me)].get(timeout=10))

        class Received:
            def __init__(self, t, peer):
                self.t, self.peer = t, peer

            def wait(self):
                recv(self.t, self.peer)

        beside = pingpong.Beside(lambda: computed.append(me), lambda t, r: send(t, r) or Sent(),
                                 lambda t, r: Received(t, r), range(3))
        out[me] = pingpong.pipeline_pingpong([(0, 1)], me, send, recv, 1, barrier.wait, repeats=1,
                                             beside=beside)

    threads = [threading.Thread(target=rank, args=(me,)) for me in range(3)]
    [t.start() for t in threads]
    [t.join(timeout=30) for t in threads]
    assert set(out) == {0, 1, 2} and out[1] is None and out[2] is None
    assert all(v > 0 for v in out[0]["one_way"].values()), out
    # only the rank outside the pair computed, and no message is left on any lane
    assert computed and set(computed) == {2}
    assert all(q.empty() for q in lanes.values())
