"""The topology file: what it parses to, and a clear ValueError for every rule it breaks."""

import copy
import json

import pytest

from launch import topology

GOOD = {
    "datacenters": {
        "east": {"hosts": [{"name": "e0", "slots": 4, "addr": "10.0.0.1"}, {"name": "e1", "slots": 4}],
                 "ifname": "eth0", "gpu_tflops": 200},
        "west": {"hosts": [{"name": "w0", "slots": 4}]},
    },
    "wan": [{"between": ["east", "west"], "rtt_ms": 40, "bandwidth_gbps": 10}],
}


def test_parses_hosts_links_and_units():
    t = topology.parse(GOOD)
    assert t.dc_names == ["east", "west"]
    assert [(h.name, h.slots, h.dc) for h in t.hosts] == [("e0", 4, "east"), ("e1", 4, "east"),
                                                         ("w0", 4, "west")]
    assert t.dc("east").gpus == 8 and t.dc("east").ifname == "eth0" and t.host("e0").addr == "10.0.0.1"
    assert t.dc("east").gpu_flops == 200e12
    w = t.link("west", "east")
    assert (w.rtt, w.bandwidth, w.latency) == (0.040, 10e9 / 8, 0.020)
    assert w.bdp == pytest.approx(50e6)   # 10 Gb/s x 40 ms = 50 MB in flight


def test_example_config_loads():
    t = topology.load("configs/atlas_two_dc.json")
    assert t.dc_names == ["east", "west"] and t.model["layers"] == 48


def _broken(edit):
    raw = copy.deepcopy(GOOD)
    edit(raw)
    return raw


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["wan"][0].update(between=["east", "mars"]), "unknown data center 'mars'"),
    (lambda r: r.update(wan=[]), "no WAN entry between 'east' and 'west'"),
    (lambda r: r["datacenters"].update(north={"hosts": [{"name": "n0", "slots": 1}]}),
     "no WAN entry between 'east' and 'north'"),
    (lambda r: r["wan"].append(dict(r["wan"][0])), "a second WAN entry"),
    (lambda r: r["wan"][0].update(rtt_ms=0), "wan[0].rtt_ms: must be a positive number"),
    (lambda r: r["wan"][0].pop("bandwidth_gbps"), "wan[0].bandwidth_gbps: is required"),
    (lambda r: r["datacenters"]["west"]["hosts"].append({"name": "e0", "slots": 2}),
     "host 'e0' is already listed in data center 'east'"),
    (lambda r: r["datacenters"]["west"]["hosts"][0].update(slots=0), "slots: must be a positive integer"),
    (lambda r: r["datacenters"]["west"]["hosts"][0].update(slots="4"), "slots: must be a positive integer"),
    (lambda r: r["datacenters"]["west"].update(gpus=4), "unknown key(s) ['gpus']"),
    (lambda r: r["datacenters"]["west"].update(hosts=[]), "hosts: must be a non-empty list"),
    (lambda r: r["datacenters"]["east"].update(ifname="eth0,eth1"), "ifname: must be one interface name"),
    (lambda r: r.update(datacenters={}), "datacenters: must be a non-empty object"),
])
def test_bad_files_name_the_entry_and_the_rule(edit, message):
    with pytest.raises(ValueError) as e:
        topology.parse(_broken(edit), source="t.json")
    assert message in str(e.value) and str(e.value).startswith("t.json: ")


def test_load_reports_missing_and_malformed_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        topology.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        topology.load(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(GOOD))
    assert topology.load(good).source == str(good)
