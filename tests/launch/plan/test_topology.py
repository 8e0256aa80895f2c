"""The topology file: what it parses to, and a clear ValueError for every rule it breaks, including
hostile values (shell metacharacters, options, comments, host separators, non-ASCII) in every field."""

import copy
import json
import re

import pytest

from launch.plan import topology
from tests.launch.hostile import HOSTILE, hostile

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
    (lambda r: r["wan"][0].update(rtt_ms=0), "wan[0].rtt_ms=0: must be a finite number in [0.001, 100000]"),
    (lambda r: r["wan"][0].pop("bandwidth_gbps"), "wan[0].bandwidth_gbps: is required"),
    (lambda r: r["datacenters"]["west"]["hosts"].append({"name": "e0", "slots": 2}),
     "host 'e0' is already listed in data center 'east'"),
    (lambda r: r["datacenters"]["west"]["hosts"][0].update(slots=0), "slots=0: must be an integer in"),
    (lambda r: r["datacenters"]["west"]["hosts"][0].update(slots="4"), "slots='4': must be an integer in"),
    (lambda r: r["datacenters"]["west"].update(gpus=4), "unknown key(s) ['gpus']"),
    (lambda r: r["datacenters"]["west"].update(hosts=[]), "hosts: must be a non-empty list"),
    (lambda r: r["datacenters"]["east"].update(ifname="eth0,eth1"),
     "ifname='eth0,eth1': must be a Linux interface name"),
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


FIELDS = {   # where a value goes in the file -> (edit that puts it there, the file key named, the rule)
    "dc name": (lambda r, v: r["datacenters"].update({v: r["datacenters"].pop("west")}) or
                r["wan"][0].update(between=["east", v]), "datacenters", "is not a name of"),
    "host name": (lambda r, v: r["datacenters"]["west"]["hosts"][0].update(name=v),
                  "datacenters.west.hosts[0].name", "must be an RFC 1123 host name"),
    "addr": (lambda r, v: r["datacenters"]["east"]["hosts"][0].update(addr=v),
             "datacenters.east.hosts[0].addr", "must be a host name or an IP address"),
    "ifname": (lambda r, v: r["datacenters"]["east"].update(ifname=v),
               "datacenters.east.ifname", "must be a Linux interface name"),
    "wan between": (lambda r, v: r["wan"][0].update(between=["east", v]), "wan[0].between",
                    "unknown data center"),
}


@pytest.mark.parametrize("field", list(FIELDS))
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_values_in_every_field_are_refused(field, kind, tmp_path):
    """Each hostile value in each field: refused with the file, the key, the value and the rule."""
    edit, key, rule = FIELDS[field]
    value = hostile(kind, tmp_path / "mark")
    raw = copy.deepcopy(GOOD)
    edit(raw, value)
    with pytest.raises(ValueError) as e:
        topology.parse(raw, source="t.json")
    msg = str(e.value)
    assert msg.startswith(f"t.json: {key}") and repr(value) in msg and rule in msg, msg


@pytest.mark.parametrize("field, value", [
    ("host name", "east-0.dc1.example.com"), ("host name", "10.0.0.7"), ("host name", "A0"),
    ("addr", "10.1.0.1"), ("addr", "fd00::1"), ("addr", "east-0.example.com"),
    ("addr", "fe80::1%eth0"), ("addr", "fe80::1%3"), ("addr", "fe80::1%enp3s0f1.100"),
    ("ifname", "eth0.100"), ("ifname", "enp3s0f1"), ("ifname", "ib_0-x"),
    ("dc name", "us-east_1"),
])
def test_ordinary_values_pass(field, value):
    raw = copy.deepcopy(GOOD)
    FIELDS[field][0](raw, value)
    topology.parse(raw)


@pytest.mark.parametrize("raw_edit, message", [
    (lambda r: r["datacenters"]["east"]["hosts"][0].update(name="W0"),
     "host 'w0' is already listed in data center 'east' (host names ignore case)"),
    (lambda r: r["datacenters"]["east"]["hosts"][0].update(name="a" * 64), "must be an RFC 1123 host name"),
    (lambda r: r["datacenters"]["east"].update(ifname="a" * 16), "must be a Linux interface name"),
    (lambda r: r["datacenters"]["east"]["hosts"][0].pop("name"), "hosts[0].name: is required"),
    (lambda r: r["wan"][0].update(between=[["east"], "west"]), "wan[0].between: must name two different"),
    (lambda r: r.update(timeout_s=0), "timeout_s=0: the timeout must be a finite number of seconds"),
    (lambda r: r.update(timeout_s="30"), "timeout_s='30': the timeout must be a finite"),
])
def test_more_rules(raw_edit, message):
    raw = copy.deepcopy(GOOD)
    raw["datacenters"]["west"]["hosts"][0]["name"] = "w0"
    raw_edit(raw)
    with pytest.raises(ValueError, match=re.escape(message)):
        topology.parse(raw, source="t.json")


def test_timeout_key():
    assert topology.parse({**GOOD, "timeout_s": 45}).timeout_s == 45.0
    assert topology.parse(GOOD).timeout_s is None
