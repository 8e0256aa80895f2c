"""The iteration as data: idle windows, the Chrome trace, the picture."""

import json

import pytest

from launch.plan.simulate import Link, Pipeline, simulate
from launch.plan.timeline import Op, chrome_trace, draw, idle_windows, write_trace

OPS = [Op(0, 0, "forward", 0.0, 1.0, 0), Op(0, 0, "backward", 3.0, 5.0, 0), Op(0, 0, "send", 1.0, 2.0, 0),
       Op(1, 0, "recv", 1.5, 2.5, 0), Op(1, 0, "forward", 2.5, 3.0, 0), Op(1, 0, "prefill", 3.2, 3.6),
       Op(1, 0, "backward", 3.0, 3.2, 0)]


def test_idle_windows_are_the_gaps_between_compute():
    """WAN transfers do not occupy the GPU; prefill does."""
    assert idle_windows(OPS, 6.0) == {(0, 0): [(1.0, 3.0), (5.0, 6.0)],
                                      (1, 0): [(0.0, 2.5), (3.6, 6.0)]}


def test_idle_windows_of_a_simulated_pipeline_complement_its_busy_time():
    r = simulate(Pipeline([1.0, 1.0], [2.0, 2.0], [Link(0.5, 1.0, shared=True)], 1.0, 4, replicas=2))
    windows = idle_windows(r.ops, r.iteration)
    assert len(windows) == 4
    for (s, d), gaps in windows.items():
        idle = sum(b - a for a, b in gaps)
        assert idle == pytest.approx(r.iteration - r.busy[s * 2 + d])


def test_chrome_trace_has_a_thread_per_row_and_a_wan_thread(tmp_path):
    trace = chrome_trace(OPS, {(0, 0): "east s0 r0"})
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"]
    assert names == ["east s0 r0", "east s0 r0 WAN", "stage 1 replica 0", "stage 1 replica 0 WAN"]
    send = next(e for e in trace["traceEvents"] if e.get("name") == "send")
    assert (send["tid"], send["ts"], send["dur"]) == (1, 1e6, 1e6)
    path = tmp_path / "t.json"
    write_trace(path, OPS)
    assert len(json.loads(path.read_text())["traceEvents"]) == len(OPS) + 4


def test_draw_writes_a_png(tmp_path):
    path = tmp_path / "t.png"
    draw(path, OPS, 6.0, "two stages", window=(0.5, 4.0))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
