"""The classes of value behind issue 22's launcher, config and topology cases, through the rules every entry
point is to call (commweave.values): names that would become a second shell command, an option, a comment
or a second host; JSON that Python's json reads silently wrong or fails on obscurely; numbers that
overflow or switch a bound off; files that are not files. The launch/ entry points (topology, deepspeed-
atlas flags, the planner's bounds) call these rules in a later change; their own cases go into
tests/faults/test_launch_inputs.py, counted by the same harness.
"""

from __future__ import annotations

import math
import os

import pytest

from commweave import values
from tests.faults import corpus
from tests.launch.hostile import HOSTILE

pytestmark = pytest.mark.fault("refused", kind="value rules")

NAMES = {kind: text.format(mark="/tmp/PWNED") for kind, text in HOSTILE.items()}


@pytest.mark.parametrize("kind", list(NAMES))
def test_a_hostile_name_is_no_host_address_or_interface(kind):
    value = NAMES[kind]
    for rule, what in ((values.host_name, "RFC 1123 host name"), (values.address, "host name or an IP"),
                       (values.ifname, "Linux interface name")):
        corpus.refused(lambda rule=rule: rule(value, "hosts[0].addr"), f"hosts[0].addr={value!r}", what)


@pytest.mark.parametrize("value", ["fe80::1%x;touch${IFS}PWNED;#", "::1%y;id>OWNED;#", "::1%y$(id>OWNED)",
                                   "fe80::1%eth0 touch PWNED", "fe80::1%" + "e" * 16])
def test_an_ipv6_zone_id_must_be_an_interface_name(value):
    corpus.refused(lambda: values.ip_address(value, "--master_addr"), "zone id after '%'")


JSON = {  # case -> (text, what the refusal says)
    "duplicated data center": ('{"datacenters": {"east": {"slots": 1}, "east": {"slots": 2}}}',
                               "duplicate key 'east'"),
    "duplicated slots": ('{"hosts": [{"name": "a", "slots": 8, "slots": 1}]}', "duplicate key 'slots'"),
    "bandwidth 1e400": ('{"bandwidth_gbps": 1e400}', "1e400 overflows a double"),
    "a 400-digit integer": ('{"slots": ' + "7" * 400 + "}", "does not fit in int64"),
    "NaN": ('{"rtt_ms": NaN}', "NaN is not JSON"),
    "-Infinity": ('{"rtt_ms": -Infinity}', "-Infinity is not JSON"),
    "2,000 deep": ("[" * 2000 + "]" * 2000, "nest at most 32"),
    "a list where an object belongs": ("[1, 2]", "top level must be a JSON object"),
}


@pytest.mark.parametrize("case", list(JSON))
def test_json_that_python_reads_wrong_or_fails_on(case, tmp_path):
    text, says = JSON[case]
    path = tmp_path / "topology.json"
    path.write_text(text)
    corpus.refused(lambda: values.load_json(path, "--atlas-topology", top=dict), "--atlas-topology=", says)


@pytest.mark.parametrize("case", ["a directory", "/dev/zero", "a FIFO", "missing"])
def test_a_file_that_is_not_a_file_is_refused_before_reading(case, tmp_path):
    path = {"a directory": tmp_path, "/dev/zero": "/dev/zero", "a FIFO": tmp_path / "fifo",
            "missing": tmp_path / "missing.json"}[case]
    if case == "a FIFO":
        os.mkfifo(path)        # a read would wait for a writer forever
    corpus.refused(lambda: values.load_json(path, "--atlas-topology"), "must be a readable regular JSON file")


NUMBERS = {  # case -> (call, what the refusal says)
    "rtt 5e-324 ms": (lambda: values.number(5e-324, "rtt_ms", lo=1e-3, hi=1e6, unit="ms"),
                      "[0.001, 1e+06] ms"),
    "bandwidth 1e308": (lambda: values.number(1e308, "bandwidth_gbps", lo=0, hi=1e6, unit="Gbit/s",
                                              lo_open=True), "(0, 1e+06] Gbit/s"),
    "bandwidth inf": (lambda: values.number(math.inf, "bandwidth_gbps", lo=0, hi=1e6, unit="Gbit/s"),
                      "finite number"),
    "slots true": (lambda: values.integer(True, "slots", lo=1, hi=1024), "integer in [1, 1024]"),
    "slots 8.0": (lambda: values.integer(8.0, "slots", lo=1, hi=1024), "integer in [1, 1024]"),
    "port 0": (lambda: values.port(0, "--master_port"), "TCP port"),
    "port '29500 ; id'": (lambda: values.port("29500 ; id", "MASTER_PORT", strings=True), "TCP port"),
    "E x C = 2**64": (lambda: values.product("num_experts x capacity", [2**32, 2**32]), "int64"),
    "causal 'false'": (lambda: values.boolean("false", "causal"), "strings such as 'false'"),
    "schedule 'S1'": (lambda: values.choice("S1", "schedule", ("s1", "s2")), "one of ('s1', 's2')"),
    "timeout 1e-4 s": (lambda: values.seconds(1e-4, "--atlas-timeout"), "seconds in [1, 604800]"),
    "timeout 1e14 s": (lambda: values.seconds(1e14, "--atlas-timeout"), "seconds in [1, 604800]"),
}


@pytest.mark.parametrize("case", list(NUMBERS))
def test_numbers_that_overflow_or_read_wrong(case):
    call, says = NUMBERS[case]
    corpus.refused(call, says)


@pytest.mark.parametrize("case", ["a symlink", "a directory"])
def test_a_write_never_goes_through_a_link_or_into_a_directory(case, tmp_path):
    from commweave import files

    (tmp_path / "ds_config.json").write_text("{}")
    target = tmp_path / "cost_cache.json"
    if case == "a symlink":
        os.symlink(tmp_path / "ds_config.json", target)
    else:
        target.mkdir()
    with corpus.no_files_outside(tmp_path, tmp_path / "nothing"):
        corpus.refused(lambda: files.write_atomic(target, "{}", "cost_cache"), "cost_cache=", "not a symlink")
