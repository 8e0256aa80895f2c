"""Broken WAN links under multi-TCP striping, on the WAN emulator (two namespaces, a delay line,
a rate limit): a connection cut mid-transfer (a reset each way) and a connection that stalls (a black
hole) are detected, reported with the stripe, its TCP connection and the peer, and the transfer is
sent again on re-opened connections; what arrives is bit-identical to what was sent. With no retry
left (ATLAS_WAN_RETRIES=0) both ranks raise naming the stripe and the peer.

Each stripe is 8 MiB against 1 MiB socket buffers, so the fault lands while both ends still have the
stripe in progress (a failure only one end sees cannot be repaired: launch/net/recovery.py). gloo does not
report a reset connection to an operation already moving data, so a cut, like a stall, is found by
COMMWEAVE_TIMEOUT_S (the emulator's counters show both kernels took the reset)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from commweave.world import free_port
from launch.net.wanemu import WanLink

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
TIMEOUT_S = 4.0


def test_cut_and_stalled_stripes_are_resent_bit_identical(namespaces, tmp_path):
    with WanLink(rtt=0.010, rate=100e6) as w:
        for ns in (w.a, w.b):
            for key in ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"):
                ns.sysctl(key, "4096 65536 1048576")
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "COMMWEAVE_TIMEOUT_S": str(TIMEOUT_S)}
        procs = []
        for rank, (ns, ifname) in enumerate(((w.a, w.ifname_a), (w.b, w.ifname_b))):
            cmd = ["timeout", "240", sys.executable, "tests/launch/net/wan_fault_rank.py",
                   "--rank", str(rank), "--master", f"{w.addr_a}:{port}", "--ifname", ifname,
                   "--rules", str(w.rules), "--out", str(tmp_path)]
            procs.append(w.lab.popen(ns, cmd, cwd=REPO, env={**env, "GLOO_SOCKET_IFNAME": ifname},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        logs = [p.communicate(timeout=300)[0] for p in procs]
        fired = w.fired()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, f"rank {rank}:\n{logs[rank][-5000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    print()
    for r, report in enumerate(ranks):
        for case in report:
            print(f"rank {r} {case['case']:>7}: {case['outcome'][:90]} after {case['seconds']:.2f} s, "
                  f"{len(case['events'])} report(s), connections re-opened {case['generation']} time(s)")
    assert [(f["action"], f["direction"]) for f in fired] == [("cut", "ab"), ("stall", "ab"), ("cut", "ab")]
    for rank, report in enumerate(ranks):
        cut, stall, exhaust = report
        peer = 1 - rank
        for case, kinds in ((cut, ("timeout", "error")), (stall, ("timeout",))):
            assert case["outcome"] == "delivered" and case["equal"] in (None, True), case
            # reported once, with the stripe the emulator broke and that stripe's TCP connection
            assert [(e["stripe"], e["connection"]) for e in case["events"]] == \
                [(case["stripe"], case["connection"])], case["events"]
            assert case["events"][0]["kind"] in kinds and case["seconds"] <= TIMEOUT_S + 6, case
        assert rank == 0 or (cut["equal"] and stall["equal"])                   # bit-identical
        assert (cut["generation"], stall["generation"]) == (1, 2)             # fresh connections each time
        message = exhaust["outcome"]
        assert message.startswith("error: ATLAS WAN: case exhaust") and "after 0 retries" in message, message
        assert f"stripe 3 of 4 on {exhaust['connection']}" in message and f"peer rank {peer}" in message
