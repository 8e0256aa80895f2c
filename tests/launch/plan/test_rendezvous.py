"""gloo's receiver-driven rendezvous for small messages and the one-number all-reduce over a
pipeline's stages, against hand-derived times (launch.plan.rendezvous's docstring)."""

import pytest

from launch.plan.rendezvous import pipe_all_reduce, tiny_message


def test_a_late_receive_costs_a_round_trip():
    # the sender waits in its call from 1.0; the receive is posted at 3.0, its notice lands at 3.5
    assert tiny_message(1.0, 3.0, 0.5, 0.5) == pytest.approx((3.5, 4.0))
    # the receive was posted first and its notice is there before the send: only the trip
    assert tiny_message(3.0, 1.0, 0.5, 0.5) == pytest.approx((3.0, 3.5))
    # no notice modelled: eager, whatever the receiver does
    assert tiny_message(1.0, 3.0, 0.5, 0.0) == pytest.approx((1.0, 1.5))


def test_two_stages_as_measured_in_the_main_jobs_atlas_row():
    """The trace of 2026-12-02 (ms, one way 21): stage 1 waited from 2346.5, stage 0 came at 2490.2.
    Stage 1's value leaves once stage 0's notice reached it (2511.2), lands 2532.2; stage 0 sends the
    sum at once (stage 1's all-gather notice, posted at 2511.2, is there at 2532.2): stage 0 leaves at
    2532.2 (measured 2532.9), stage 1 at 2553.2 (measured 2553.2)."""
    assert pipe_all_reduce([2490.2, 2346.5], [0, 21.0], [0, 21.0]) == pytest.approx([2532.2, 2553.2])
    # the second all-reduce: stage 0 first (2535.6), stage 1 at 2555.3 before stage 0's notice
    # (2556.6): sent 2556.6, held 2577.6; stage 1's all-gather notice (from 2556.6) lands 2577.6
    assert pipe_all_reduce([2535.6, 2555.3], [0, 21.0], [0, 21.0]) == pytest.approx([2577.6, 2598.6])


def test_three_stages_are_a_star_on_stage_zero():
    # h = 1 to stage 1, 3 to stage 2 (two boundaries), no notice: eager. Arrivals 0, 5, 2:
    # stage 1's value lands at 6, stage 2's at 5: stage 0 holds the sum at 6 and sends it back at once
    assert pipe_all_reduce([0.0, 5.0, 2.0], [0, 1.0, 3.0], [0, 0, 0]) == pytest.approx([6.0, 7.0, 9.0])
    # with the notices: stage 1 sends at max(5, 0 + 1) = 5 (lands 6), stage 2 at max(2, 0 + 3) = 3
    # (lands 6); held 6; back to 1 at max(6, 5 + 1) = 6 -> 7, to 2 at max(6, 3 + 3) = 6 -> 9
    assert pipe_all_reduce([0.0, 5.0, 2.0], [0, 1.0, 3.0], [0, 1.0, 3.0]) == pytest.approx([6.0, 7.0, 9.0])
    # stage 0 last (at 10): 1 sends at 11 -> 12, 2 at 13 -> 16; held 16; back 16 -> 17 and 19
    got = pipe_all_reduce([10.0, 5.0, 2.0], [0, 1.0, 3.0], [0, 1.0, 3.0])
    assert got == pytest.approx([16.0, 17.0, 19.0])


def test_a_single_stage_and_bad_inputs():
    assert pipe_all_reduce([4.0], [0.0], [0.0]) == [4.0]
    with pytest.raises(ValueError, match="one entry per stage"):
        pipe_all_reduce([0.0, 1.0], [0.0], [0.0, 0.0])
    with pytest.raises(ValueError, match="must be >= 0"):
        tiny_message(0.0, 0.0, -1.0, 0.0)
