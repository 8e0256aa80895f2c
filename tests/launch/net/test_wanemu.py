"""The WAN emulator: the delay line holds packets for the round trip, the devices carry the settings
that avoid silent drops, and closing removes every namespace, device and forwarder.
(Throughput against the set rate is measured in benchmarks/wan.py.)"""

import json
import subprocess

import pytest

from launch.net.netns import sh
from launch.net.wanemu import WanLink

pytestmark = pytest.mark.netns


def test_delay_line_devices_and_cleanup(namespaces):
    with WanLink(rtt=0.030, rate=50e6) as w:
        rtt = w.probe_rtt(5)
        assert 0.0295 <= rtt < 0.25, rtt               # two 15 ms holds; never faster than the delay
        for ns, ifname in ((w.a, w.ifname_a), (w.b, w.ifname_b)):
            link = json.loads(ns.ip("-j", "link", "show", "dev", ifname).stdout)[0]
            assert (link["mtu"], link["txqlen"]) == (9000, 10000)
            assert "tbf" in ns.run("tc", "qdisc", "show", "dev", ifname).stdout
            assert "rate 400Mbit" in ns.run("tc", "qdisc", "show", "dev", ifname).stdout
        drops = w.drops()
        assert set(drops) == {f"{kind}_{side}" for kind in ("tx_dropped", "tbf_dropped", "tcp_retrans")
                              for side in "ab"} | {"forwarder_dropped_ab", "forwarder_dropped_ba"}
        assert drops["tx_dropped_a"] == drops["tx_dropped_b"] == 0
        names = [ns.name for ns in w.lab.namespaces]
        procs = list(w.lab.procs)
        assert all(p.poll() is None for p in procs)    # the two forwarders run
    listed = sh("ip", "netns", "list").stdout
    assert not any(n in listed for n in names)
    assert all(p.poll() is not None for p in procs)
    assert w.ifname_a not in subprocess.run(["ip", "link"], capture_output=True, text=True).stdout


def test_bad_link_settings():
    with pytest.raises(ValueError, match="rate=0"):
        WanLink(rtt=0.01, rate=0)
