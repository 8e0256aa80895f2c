"""benchmarks.bubbletea_rank: where an iteration's time goes, prefill off against on, and how far the
chunks ran into training."""

import pytest

from benchmarks.bubbletea_rank import where_time_goes


def test_where_the_time_goes_per_instruction_and_into_training():
    from launch.bubbletea.engine import Iteration
    from launch.bubbletea.timeline import Op

    def it(on, recv_end, prefill):
        ops = [Op(0, "ForwardPass", 0.0, 0.002), Op(0, "RecvGrad", 0.002, recv_end),
               Op(0, "BackwardPass", recv_end, recv_end + 0.003)]
        return Iteration(recv_end + 0.003, ops, prefill, on)

    its = [it(False, 0.020, []), it(True, 0.030, [(0.003, 0.010), (0.011, 0.034)]),   # the 2nd ran 4 ms on
           it(True, 0.024, [(0.003, 0.020)])]
    got = where_time_goes(its)
    assert got["ms"]["RecvGrad"] == pytest.approx([18.0, 25.0])      # off; median of on (28, 22)
    assert got["ms"]["BackwardPass"] == pytest.approx([3.0, 3.0])
    assert (got["into_training"], got["into_training_ms"]) == (1, pytest.approx(4.0))
    assert got["wall_ms"] == {"off": [23.0, 1], "on_clear": [27.0, 1], "on_into": [33.0, 1]}
    assert got["into_slow"] == [[(1, "RecvGrad", 10.0)]]
