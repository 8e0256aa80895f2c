"""The two-data-center launch shared by the calibration matrix and the main job's --atlas rows: its
topology and buffer caps (the launch itself runs in tests/benchmarks/test_atlas_calibration.py and
tests/examples/test_gpt_atlas.py)."""

from types import SimpleNamespace

import pytest

from launch.net import two_dc
from launch.plan import topology


class _Ns:
    def __init__(self):
        self.set = {}

    def sysctl(self, key, value):
        self.set[key] = value


LINK = SimpleNamespace(a=_Ns(), b=_Ns(), addr_a="10.201.0.1", addr_b="10.201.0.2", ifname_a="ta",
                       ifname_b="tb")


def test_topology_parses_with_the_window_the_run_gets():
    model = {"layers": 2, "hidden": 8, "seq": 4, "micro_batch": 1, "global_batch": 8, "pp": 2, "tp": 1,
             "dp": 2}
    raw = two_dc.topology(LINK, 2, 40.0, 400.0, 192 * 1024, model)
    topo = topology.parse(raw, source="two_dc")
    assert [(h.name, h.slots, h.addr) for dc in ("west", "east") for h in topo.dc(dc).hosts] == [
        ("w0", 2, "10.201.0.1"), ("e0", 2, "10.201.0.2")]
    (wan,) = topo.wan
    assert wan.window == pytest.approx(192 * 1024) and wan.rtt == pytest.approx(0.040)
    assert wan.bandwidth == pytest.approx(400e6 / 8) and raw["model"] == model


def test_cap_buffers_sets_both_namespaces():
    two_dc.cap_buffers(LINK, 256 * 1024)
    for ns in (LINK.a, LINK.b):
        assert ns.set == {"net.ipv4.tcp_rmem": "4096 131072 262144", "net.ipv4.tcp_wmem": "4096 16384 262144",
                          "net.ipv4.tcp_slow_start_after_idle": "0"}
    with pytest.raises(ValueError, match="window_bytes=100 must be >= 4096"):
        two_dc.cap_buffers(LINK, 100)
