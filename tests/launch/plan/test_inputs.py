"""Where the planner's WAN window comes from (launch/plan/inputs.py): measured on the link by
benchmarks.wan, stated by the topology's window_mb, or Linux's default; a bad --link is refused."""

import json

import pytest

from launch.plan import inputs, topology
from launch.plan.socket_limits import DEFAULT_WINDOW

RAW = {"datacenters": {d: {"hosts": [{"name": f"{d}0", "slots": 2}]} for d in ("a", "b", "c")},
       "wan": [{"between": ["a", "b"], "rtt_ms": 40, "bandwidth_gbps": 1},
               {"between": ["b", "c"], "rtt_ms": 20, "bandwidth_gbps": 1, "window_mb": 0.5},
               {"between": ["a", "c"], "rtt_ms": 60, "bandwidth_gbps": 1}]}


def test_measured_stated_and_assumed_windows(tmp_path):
    link = tmp_path / "link.json"
    link.write_text(json.dumps({"bench": "wan", "window_mb": 0.25}))
    topo, measured = inputs.apply_links(topology.parse(RAW), [f"c:a={link}"])
    got = {(w.a, w.b): (w.bytes, w.source) for w in inputs.windows(topo, measured)}
    assert got == {("a", "b"): (DEFAULT_WINDOW, "assumed"), ("b", "c"): (0.5 * 2**20, "stated"),
                   ("a", "c"): (0.25 * 2**20, "measured")}
    assert topo.link("a", "c").window == 0.25 * 2**20                  # what every system's build reads
    text = "\n".join(inputs.render(topo, measured))
    assert "a<->c" in text and "measured" in text and "one connection carries 3.5% of the link" in text


@pytest.mark.parametrize("spec, message", [("a-b=x.json", "use A:B=FILE"),
                                           ("a:z=x.json", "no WAN entry between"),
                                           ("a:b=missing.json", "no such file")])
def test_bad_links_are_refused(spec, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        inputs.apply_links(topology.parse(RAW), [spec])
    (tmp_path / "w.json").write_text(json.dumps({"bench": "wan"}))
    with pytest.raises(ValueError, match="has no window_mb"):
        inputs.apply_links(topology.parse(RAW), ["a:b=w.json"])
