"""commweave.values and commweave.files: each rule accepts what it should, refuses the rest with the name,
the value and the rule (issue 22)."""

from __future__ import annotations

import math
import os
import re

import numpy as np
import pytest
import torch

from commweave import files, values


def _refused(fn, *args, match: str = "", **kwargs) -> ValueError:
    with pytest.raises(ValueError) as info:
        fn(*args, **kwargs)
    assert type(info.value) is ValueError, type(info.value)       # plain: callers compare the type's name
    assert str(info.value).startswith(f"{info.value.name}={info.value.value!r}: "), str(info.value)
    assert str(info.value).endswith(info.value.rule)
    assert re.search(match, str(info.value)), (match, str(info.value))
    return info.value


# --- names ----------------------------------------------------------------------------------------

HOSTILE = ["a;touch x", "a$(id)", "a`id`", "-oProxyCommand=x", "#a", "a,b", "a b", "a\nb", "ä", "",
           "a" * 64, "a." * 127 + "a", "a_b", "a:1", "a@b"]


@pytest.mark.parametrize("good", ["a", "node-01", "n0.dc1.example.com", "A1", "a" * 63])
def test_host_name_accepts_rfc1123(good):
    assert values.host_name(good, "host") == good


@pytest.mark.parametrize("bad", [*HOSTILE, 5, None, "-a", "a-"])
def test_host_name_refuses(bad):
    _refused(values.host_name, bad, "hosts[0].name", match=r"^hosts\[0\]\.name=.*RFC 1123 host name")


@pytest.mark.parametrize("good", ["10.0.0.1", "::1", "fe80::1%eth0", "fe80::1%3", "fe80::1%enp0s31f6",
                                  "2001:db8::2"])
def test_ip_address_accepts(good):
    assert values.ip_address(good, "--master_addr") == good


@pytest.mark.parametrize("bad", ["fe80::1%x;touch${IFS}PWNED;#", "::1%y;id>OWNED;#", "::1%y$(id>OWNED)",
                                 "::1%y`touch${IFS}PWNED`", "fe80::1%eth0 touch PWNED", "fe80::1%-x",
                                 "fe80::1%" + "a" * 16, "10.0.0.256", "1.2.3", "::1%", "host", 1, None])
def test_ip_address_refuses_zone_ids_that_are_not_interface_names(bad):
    _refused(values.ip_address, bad, "--master_addr", match="zone id after '%'")


def test_address_is_a_host_name_or_an_ip():
    assert values.address("node1", "addr") == "node1"
    assert values.address("fe80::1%eth0", "addr") == "fe80::1%eth0"
    _refused(values.address, "fe80::1%x;touch${IFS}PWNED;#", "addr", match="host name or an IP address")


@pytest.mark.parametrize("bad", ["eth0;id", "a" * 16, ".eth", "-eth", "eth 0", "", None, "eth0\n"])
def test_ifname(bad):
    assert values.ifname("enp0s31f6", "ifname") == "enp0s31f6"
    assert values.ifname("wan0.1", "ifname") == "wan0.1"
    _refused(values.ifname, bad, "GLOO_SOCKET_IFNAME", match="Linux interface name")


def test_port():
    assert values.port(29500, "--master_port") == 29500
    assert values.port("29500", "MASTER_PORT", strings=True) == 29500
    for bad in (0, 65536, -1, True, 29500.0, "29500", None):
        _refused(values.port, bad, "--master_port", match=r"integer in \[1, 65535\] \(TCP port\)")
    for bad in ("0", "65536", " 1", "1_000", "0x10", "١٢"):
        _refused(values.port, bad, "MASTER_PORT", strings=True, match="TCP port")


# --- numbers --------------------------------------------------------------------------------------

def test_number_is_finite_and_in_its_range():
    kw = dict(lo=0.0, hi=1e6, unit="Gbit/s", lo_open=True)
    assert values.number(10, "bandwidth_gbps", **kw) == 10.0
    assert values.number(0.5, "bandwidth_gbps", **kw) == 0.5
    for bad in (0, -1, 1e308, math.inf, math.nan, True, "10", None, [1], 10**400):
        _refused(values.number, bad, "bandwidth_gbps", **kw, match=r"finite number in \(0, 1e\+06\] Gbit/s")
    assert values.number("2.5e1", "X", lo=0, hi=100, unit="ms", strings=True) == 25.0
    for bad in ("inf", "nan", "Infinity", " 1", "1_0", "1e400", "", "0x1"):
        _refused(values.number, bad, "X", lo=0, hi=1e300, unit="ms", strings=True,
                 match="finite number")


def test_rtt_of_5e_324_is_refused_by_a_stated_floor():
    _refused(values.number, 5e-324, "rtt_ms", lo=1e-3, hi=1e6, unit="ms", match=r"\[0.001, 1e\+06\] ms")


def test_integer_refuses_bools_floats_and_out_of_range():
    assert values.integer(7, "slots", lo=1, hi=1024) == 7
    assert values.integer(np.int64(7), "slots", lo=1, hi=1024) == 7
    assert values.integer(torch.tensor(7), "slots", lo=1, hi=1024) == 7
    for bad in (0, 1025, True, 7.0, "7", None, 10**400, torch.tensor(7.0)):
        _refused(values.integer, bad, "slots", lo=1, hi=1024, match=r"integer in \[1, 1024\]")
    assert values.integer("-3", "n", lo=-5, hi=5, strings=True) == -3
    for bad in ("1" * 20, "3.0", "+", "1e3"):
        _refused(values.integer, bad, "n", lo=-5, hi=5, strings=True)


def test_product_is_exact_beyond_int64():
    assert values.product("E x C", [2**31 - 1, 2**31 - 1]) == (2**31 - 1) ** 2
    e = _refused(values.product, "num_experts x capacity", [2**32, 2**32], match="18446744073709551616")
    assert e.value == "4294967296 x 4294967296" and "int64" in str(e)
    _refused(values.product, "output bytes", [2**20, 2**20, 2**8], limit=values.MAX_ALLOC_BYTES, unit="bytes",
             match="more than 140737488355328")


def test_boolean_never_reads_a_string_as_true():
    assert values.boolean(False, "causal") is False
    for bad in ("false", "no", "0", "", 0, 1, None):
        _refused(values.boolean, bad, "causal", match="true or false")


def test_choice():
    assert values.choice("s1", "schedule", ("s1", "s2")) == "s1"
    for bad in ("S1", " s1", 1, None):
        _refused(values.choice, bad, "schedule", ("s1", "s2"), match=r"one of \('s1', 's2'\)")


@pytest.mark.parametrize("bad", [0, 1e-4, 0.999, -1, 604801, 1e14, 1e400, math.inf, math.nan, True, [5], "3"])
def test_seconds_range(bad):
    assert values.seconds(1, "t") == 1.0 and values.seconds(604800, "t") == 604800.0
    assert values.seconds("2.5", "COMMWEAVE_TIMEOUT_S", strings=True) == 2.5
    _refused(values.seconds, bad, "COMMWEAVE_TIMEOUT_S", match=r"finite number of seconds in \[1, 604800\]")


# --- paths ----------------------------------------------------------------------------------------

def test_directory_and_regular_file(tmp_path):
    f = tmp_path / "f.json"
    f.write_text("{}")
    os.mkfifo(tmp_path / "fifo")
    assert values.directory(tmp_path, "--out") == tmp_path
    assert values.regular_file(str(f), "--config") == f
    _refused(values.directory, f, "--out", match="existing directory, not a regular file")
    _refused(values.directory, tmp_path / "missing", "--out", match="existing directory")
    _refused(values.regular_file, tmp_path, "--config", match="not a directory")
    _refused(values.regular_file, tmp_path / "fifo", "--config", match="not a FIFO")
    _refused(values.regular_file, "/dev/zero", "--config", match="not a character device")
    for bad in ("", "a\0b", 3, None):
        _refused(values.regular_file, bad, "--config")


def test_write_target_refuses_symlinks_and_special_files(tmp_path):
    (tmp_path / "victim").write_text("keep")
    os.symlink(tmp_path / "victim", tmp_path / "link")
    assert values.write_target(tmp_path / "new.json", "cost_cache") == tmp_path / "new.json"
    _refused(values.write_target, tmp_path / "link", "cost_cache", match="it is a symlink")
    _refused(values.write_target, tmp_path, "cost_cache", match="it is a directory")
    _refused(values.write_target, tmp_path / "no" / "x", "cost_cache", match="not an existing directory")


def test_confined(tmp_path):
    (tmp_path / "ckpt" / "step2").mkdir(parents=True)
    (tmp_path / "outside_ckpt").mkdir()
    os.symlink(tmp_path / "outside_ckpt", tmp_path / "ckpt" / "escape")
    root = tmp_path / "ckpt"
    assert values.confined(root, "step2", "committed") == root / "step2"
    for bad in ("../outside_ckpt", "/etc", "step2/../../outside_ckpt", "escape", "", "a\0"):
        _refused(values.confined, root, bad, "committed", match="relative path inside")


def test_write_atomic_never_follows_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    target = tmp_path / "cache.json"
    # a symlink at every name an attacker could guess from the pid
    for name in (f"{target.name}.{os.getpid()}.tmp", f".{target.name}.{os.getpid()}.tmp"):
        os.symlink(victim, tmp_path / name)
    files.write_atomic(target, '{"a": 1}', "cost_cache")
    assert target.read_text() == '{"a": 1}' and victim.read_text() == "keep"
    os.symlink(victim, tmp_path / "link.json")
    _refused(files.write_atomic, tmp_path / "link.json", "x", "cost_cache", match="symlink")
    assert victim.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()) == []


# --- JSON -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, match", [
    ('{"a": 1, "a": 2}', "duplicate key 'a'"),
    ('{"dc": {"east": {"slots": 1, "slots": 2}}}', "duplicate key 'slots'"),
    ('[{"x": [{"k": 1, "k": 1}]}]', "duplicate key 'k'"),
    ('{"rtt_ms": 1e400}', "1e400 overflows a double"),
    ('{"rtt_ms": -1e400}', "overflows a double"),
    ('{"slots": ' + "9" * 400 + "}", r"\(400 digits\) does not fit in int64"),
    ('{"slots": 9223372036854775808}', "does not fit in int64"),
    ('{"x": NaN}', "NaN is not JSON"),
    ('{"x": Infinity}', "Infinity is not JSON"),
    ('{"x": -Infinity}', "-Infinity is not JSON"),
    ("[" * 2000 + "]" * 2000, "nest at most 32"),
    ('{"a": ', "not valid JSON: Expecting value at line 1"),
    ("", "not valid JSON"),
])
def test_parse_json_refuses(text, match):
    _refused(values.parse_json, text, "--atlas-topology", match=match)


def test_parse_json_accepts_and_checks_the_top_level():
    text = '{"a": [1, 2.5, "[[[{{{", {"b": null}], "c": true, "d": -9223372036854775808}'
    assert values.parse_json(text, "x") == {"a": [1, 2.5, "[[[{{{", {"b": None}], "c": True, "d": -2**63}
    assert values.parse_json("[" * 32 + "]" * 32, "x") is not None
    _refused(values.parse_json, "[1]", "model file", top=dict, match="top level must be a JSON object")
    _refused(values.parse_json, "1" * 100, "x", max_bytes=50, match="larger than 50 bytes")


def test_load_json_refuses_non_files_before_reading(tmp_path):
    os.mkfifo(tmp_path / "fifo")          # a read would block until a writer comes: never opened for it
    (tmp_path / "big.json").write_text(" " * 101)
    (tmp_path / "bad.json").write_bytes(b'{"a": "\xff"}')
    (tmp_path / "ok.json").write_text('{"a": 1}')
    assert values.load_json(tmp_path / "ok.json", "--config", top=dict) == {"a": 1}
    for path, match in ((tmp_path, "not a directory"), ("/dev/zero", "not a character device"),
                        (tmp_path / "fifo", "not a FIFO"), (tmp_path / "missing.json", "no such file"),
                        (tmp_path / "bad.json", "not UTF-8")):
        e = _refused(values.load_json, path, "--atlas-topology", match=match)
        assert e.value == str(path)
    _refused(values.load_json, tmp_path / "big.json", "x", max_bytes=100, match="101 bytes, more than 100")


def test_is_valid():
    assert values.is_valid(values.ip_address, "fe80::1%eth0")
    assert not values.is_valid(values.ip_address, "fe80::1%x;id")
    assert not values.is_valid(values.integer, 5, lo=6)
