"""Issue 22's launch/ cases: topology files read strictly, numbers in stated ranges, a planner that answers
within seconds whatever the sizes, destinations and exported variables checked before anything is planned
or launched. Each case goes through the entry point a user reaches (``launch.plan.topology.load``,
``python -m launch.plan``'s ``main``, ``deepspeed-atlas``'s ``prepare``), not only through the rule.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest

from launch.plan import topology
from launch.plan.placement import load_model, make_plan
from tests.faults import corpus

GOOD = {
    "datacenters": {
        "east": {"hosts": [{"name": "e0", "slots": 2, "addr": "127.0.0.1"}, {"name": "e1", "slots": 2}],
                 "ifname": "lo"},
        "west": {"hosts": [{"name": "w0", "slots": 2}], "ifname": "lo"},
    },
    "wan": [{"between": ["east", "west"], "rtt_ms": 40, "bandwidth_gbps": 10}],
    "model": {"layers": 4, "hidden": 64, "seq": 32, "global_batch": 8},
}
GOOD_TEXT = json.dumps(GOOD)


def _file(tmp_path, raw=None, text=None, name="topology.json"):
    path = tmp_path / name
    path.write_text(text if text is not None else json.dumps(raw))
    return path


def _edited(edit):
    raw = copy.deepcopy(GOOD)
    edit(raw)
    return raw


# -- the file: strict JSON through commweave.values.load_json ----------------------------------------------

FILES = {  # case -> (file text, what the refusal says)
    "duplicated data center": (GOOD_TEXT.replace('"west": {', '"east": {'), "duplicate key 'east'"),
    "duplicated slots": (GOOD_TEXT.replace('"slots": 2,', '"slots": 8, "slots": 2,', 1),
                         "duplicate key 'slots'"),
    "duplicated wan": (GOOD_TEXT[:-1] + ', "wan": []}', "duplicate key 'wan'"),
    "2,000 deep": ('{"model": ' + "[" * 2000 + "]" * 2000 + "}", "nest at most 32"),
    "a 400-digit integer": (GOOD_TEXT.replace('"slots": 2,', '"slots": ' + "7" * 400 + ",", 1),
                            "does not fit in int64"),
    "bandwidth 1e400": (GOOD_TEXT.replace('"bandwidth_gbps": 10', '"bandwidth_gbps": 1e400'),
                        "1e400 overflows a double"),
    "NaN rtt": (GOOD_TEXT.replace('"rtt_ms": 40', '"rtt_ms": NaN'), "NaN is not JSON"),
    "a list": ("[1, 2]", "the top level must be a JSON object"),
}


@pytest.mark.fault("refused", kind="topology files")
@pytest.mark.parametrize("case", list(FILES))
def test_topology_json_is_read_strictly(case, tmp_path):
    text, says = FILES[case]
    path = _file(tmp_path, text=text)
    corpus.refused(lambda: topology.load(path), f"--atlas-topology={str(path)!r}", says)


@pytest.mark.fault("refused", kind="topology files")
@pytest.mark.parametrize("case", ["a directory", "/dev/zero", "a FIFO", "missing"])
def test_a_topology_that_is_not_a_file_is_refused_before_reading(case, tmp_path):
    path = {"a directory": tmp_path, "/dev/zero": "/dev/zero", "a FIFO": tmp_path / "fifo",
            "missing": tmp_path / "missing.json"}[case]
    if case == "a FIFO":
        os.mkfifo(path)
    corpus.refused(lambda: topology.load(path), "--atlas-topology=", "must be a readable regular JSON file")


@pytest.mark.fault("refused", kind="topology files")
def test_a_model_file_holding_a_list_is_refused(tmp_path):
    t = topology.parse(GOOD, "t.json")
    path = _file(tmp_path, text='{"model": [1, 2]}', name="model.json")
    corpus.refused(lambda: load_model(t, str(path)), "--atlas-model=", "must be a JSON object")
    path = _file(tmp_path, text='{"layers": 4, "layers": 8}', name="model2.json")
    corpus.refused(lambda: load_model(t, str(path)), "--atlas-model=", "duplicate key 'layers'")


# -- numbers: finite, in a stated range with a unit ---------------------------------------------------------

NUMBERS = {  # case -> (edit, what the refusal says)
    "bandwidth 1e308": (lambda r: r["wan"][0].update(bandwidth_gbps=1e308),
                        "wan[0].bandwidth_gbps=1e+308: must be a finite number in [0.001, 1e+06] Gbit/s"),
    "bandwidth 5e-324": (lambda r: r["wan"][0].update(bandwidth_gbps=5e-324), "[0.001, 1e+06] Gbit/s"),
    "rtt 5e-324": (lambda r: r["wan"][0].update(rtt_ms=5e-324),
                   "wan[0].rtt_ms=5e-324: must be a finite number in [0.001, 100000] ms"),
    "rtt 1e308": (lambda r: r["wan"][0].update(rtt_ms=1e308), "[0.001, 100000] ms"),
    "window 1e308": (lambda r: r["wan"][0].update(window_mb=1e308), "wan[0].window_mb=1e+308"),
    "gpu_tflops true": (lambda r: r["datacenters"]["east"].update(gpu_tflops=True), "gpu_tflops=True"),
    "intra latency -1": (lambda r: r["datacenters"]["east"].update(intra_latency_us=-1), "us"),
    "node bandwidth 1e308": (lambda r: r["datacenters"]["west"].update(node_bandwidth_gbps=1e308), "Gbit/s"),
    "timeout_s 1e-4": (lambda r: r.update(timeout_s=1e-4), "timeout_s=0.0001: the timeout must be"),
    "timeout_s 1e14": (lambda r: r.update(timeout_s=1e14), "seconds in [1, 604800]"),
}


@pytest.mark.fault("refused", kind="topology numbers")
@pytest.mark.parametrize("case", list(NUMBERS))
def test_topology_numbers_out_of_range_are_refused(case, tmp_path):
    edit, says = NUMBERS[case]
    path = _file(tmp_path, _edited(edit))
    corpus.refused(lambda: topology.load(path), str(path), says)


@pytest.mark.fault("harmless", kind="topology numbers")
@pytest.mark.parametrize("edge", ["fast", "slow"])
def test_numbers_at_the_edges_of_the_ranges_plan_finitely(edge):
    """The ends of the ranges give a finite plan: the WAN at 1e6 Gbit/s and 1 µs (or 1 Mbit/s and 100 s)."""
    bw, rtt = (1e6, 1e-3) if edge == "fast" else (1e-3, 1e5)
    t = topology.parse(_edited(lambda r: r["wan"][0].update(bandwidth_gbps=bw, rtt_ms=rtt)), "t")
    plan = make_plan(t, load_model(t, None))
    assert 0 < plan.estimate.iteration < float("inf") and plan.world_size <= 6


# -- the planner answers within seconds -------------------------------------------------------------------

def _hosts(n, slots=1):
    return [{"name": f"h{i}", "slots": slots} for i in range(n)]


def _plan(raw):
    t = topology.parse(raw, "t")
    return make_plan(t, load_model(t, None))


# Cases run in a spawned child with a bound: before the limits each ran for over 55 minutes (65536: > 60 s).
BOUNDS = {
    "slots 10**9": lambda: _plan(_edited(lambda r: r["datacenters"]["west"]["hosts"][0].update(slots=10**9))),
    "layers 10**7": lambda: _plan(_edited(lambda r: r["model"].update(layers=10**7))),
    "global_batch 10**12": lambda: _plan(_edited(lambda r: r["model"].update(global_batch=10**12))),
    "global_batch 65536": lambda: _plan(_edited(lambda r: r["model"].update(global_batch=65536))),
    "200,000 hosts": lambda: _plan(_edited(lambda r: r["datacenters"]["east"].update(hosts=_hosts(200_000)))),
    "4,000 hosts x 1,000 slots, 4,096 layers": lambda: _plan(_edited(lambda r: (
        r["datacenters"]["east"].update(hosts=_hosts(4000, 1000)), r["model"].update(layers=4096)))),
}
BOUND_SAYS = {
    "slots 10**9": "slots=1000000000: must be an integer in [1, 1024]",
    "layers 10**7": "model.layers=10000000: must be an integer in [1, 4096]",
    "global_batch 10**12": "model.global_batch=1000000000000: must be an integer in [1, 2147483648]",
    "global_batch 65536": "65536 sequences per iteration, more than the planner searches in seconds (4096)",
    "200,000 hosts": "200001 hosts, more than the planner takes (4096)",
    "4,000 hosts x 1,000 slots, 4,096 layers": "combinations to search, more than 2000",
}


@pytest.mark.fault("refused", kind="planner bounds", cases=len(BOUNDS))
def test_sizes_beyond_the_search_are_refused_within_seconds():
    started = time.monotonic()
    outcomes = corpus.isolated(__name__, "BOUNDS", list(BOUNDS), timeout=20.0)
    for case, outcome in outcomes.items():
        outcome.check_refused(BOUND_SAYS[case])
    assert time.monotonic() - started < 60


@pytest.mark.fault("harmless", kind="planner bounds")
def test_the_largest_accepted_batch_plans_within_seconds():
    """4096 sequences (the limit) on a small topology: planned, and quickly."""
    started = time.monotonic()
    plan = _plan(_edited(lambda r: r["model"].update(global_batch=4096)))
    elapsed = time.monotonic() - started
    assert plan.micro_batches * plan.dp == 4096
    if elapsed > 30:
        raise corpus.Hang(f"planning 4096 sequences took {elapsed:.1f} s")


# -- python -m launch.plan: destinations checked before planning ------------------------------------------

@pytest.mark.fault("refused", kind="plan and launcher flags")
@pytest.mark.parametrize("flag", ["--timeline", "--trace"])
@pytest.mark.parametrize("case", ["missing directory", "a directory", "a symlink"])
def test_plan_destinations_are_checked_before_planning(flag, case, tmp_path, capsys):
    from launch.plan.__main__ import main

    (tmp_path / "real.json").write_text("{}")
    dest = {"missing directory": tmp_path / "no" / "x.out", "a directory": tmp_path,
            "a symlink": tmp_path / "link.out"}[case]
    if case == "a symlink":
        os.symlink(tmp_path / "real.json", dest)
    topo = _file(tmp_path, GOOD)
    started = time.monotonic()
    with corpus.no_files_outside(tmp_path, tmp_path / "nothing"):
        code = main([str(topo), flag, str(dest)])
    err = capsys.readouterr().err
    if code != 2 or f"{flag}=" not in err or "must be a regular file (or a new one)" not in err:
        raise corpus.Obscure(f"exit {code}: {err}")
    assert time.monotonic() - started < 5          # refused before any search


# -- deepspeed-atlas: flags and exported variables ---------------------------------------------------------

LAUNCH = {  # case -> (extra arguments, environment, what the refusal says)
    "--atlas-timeout 1e-4": (["--atlas-timeout", "1e-4"], {}, "--atlas-timeout='1e-4': the timeout must be"),
    "--atlas-timeout 1e14": (["--atlas-timeout", "1e14"], {}, "seconds in [1, 604800]"),
    "--atlas-timeout 1_000": (["--atlas-timeout", "1_000"], {}, "--atlas-timeout='1_000'"),
    "--atlas-timeout inf": (["--atlas-timeout", "inf"], {}, "--atlas-timeout='inf'"),
    "COMMWEAVE_TIMEOUT_S 0.0001": ([], {"COMMWEAVE_TIMEOUT_S": "0.0001"}, "COMMWEAVE_TIMEOUT_S='0.0001'"),
    "NCCL_BUFFSIZE -1": ([], {"NCCL_BUFFSIZE": "-1"},
                         "NCCL_BUFFSIZE='-1': must be an integer in [4096, 1073741824]"),
    "NCCL_BUFFSIZE 4M": ([], {"NCCL_BUFFSIZE": "4M"}, "NCCL_BUFFSIZE='4M'"),
    "NCCL_NSOCKS_PERTHREAD 0": ([], {"NCCL_NSOCKS_PERTHREAD": "0"}, "NCCL_NSOCKS_PERTHREAD='0'"),
    "NCCL_MIN_NCHANNELS 10**9": ([], {"NCCL_MIN_NCHANNELS": "1000000000"}, "NCCL_MIN_NCHANNELS="),
    "NCCL_SOCKET_NTHREADS ' 4'": ([], {"NCCL_SOCKET_NTHREADS": " 4"}, "NCCL_SOCKET_NTHREADS=' 4'"),
    "--master_port 0": (["--master_port", "0"], {}, "--master_port=0: must be an integer in [1, 65535]"),
    "--master_addr zone id": (["--master_addr", "::1%y;id>OWNED;#"], {}, "zone id after '%'"),
}


@pytest.mark.fault("refused", kind="plan and launcher flags")
@pytest.mark.parametrize("case", list(LAUNCH))
def test_launcher_flags_and_exported_variables_are_checked(case, tmp_path):
    from launch.run.runner import prepare

    extra, env, says = LAUNCH[case]
    topo = _file(tmp_path, GOOD)
    corpus.refused(lambda: prepare(["--atlas-topology", str(topo), *extra, "train.py"], environ=env), says)
