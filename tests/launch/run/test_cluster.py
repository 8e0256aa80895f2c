"""A real two-DC cluster on one machine: each host a network namespace, joined by a veth link, each
node started by deepspeed-atlas with --no_ssh (DeepSpeed's own launcher underneath, every node under
`timeout`), training examples/atlas_pipeline.py's PipelineModule for a few steps with gloo.

Checked: the plan put the larger data center first, so ranks 0-1 run on west's host and 2-3 on east's
(the topology file lists east first); the exported environment and the per-DC interface reach every
rank (over a GLOO_SOCKET_IFNAME=lo set on every node, which would not reach the other namespace);
each rank's WAN group opened exactly --wan-connections TCP connections to the other data center
(/proc/net/tcp); the losses equal the single-process run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples import atlas_pipeline as example
from launch.net.netns import Lab

pytestmark = [pytest.mark.netns, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
STEPS, CONNECTIONS, NODE_TIMEOUT = 3, 3, 240


def test_two_dc_cluster_trains_like_one_process(namespaces, tmp_path):
    with Lab() as lab:
        west, east = lab.netns("w"), lab.netns("e")
        if_w, if_e = lab.veth(west, "10.202.0.1", east, "10.202.0.2")
        topo = {
            "datacenters": {   # east first in the file; west has more GPUs, so the plan starts there
                "east": {"hosts": [{"name": "e0", "slots": 2, "addr": "10.202.0.2"}], "ifname": if_e},
                "west": {"hosts": [{"name": "w0", "slots": 3, "addr": "10.202.0.1"}], "ifname": if_w}},
            "wan": [{"between": ["east", "west"], "rtt_ms": 40, "bandwidth_gbps": 1}],
            "model": {"layers": len(example.layer_factories()), "hidden": example.HIDDEN, "seq": 1,
                      "micro_batch": example.MICRO_BATCH, "global_batch": 4 * 2 * example.MICRO_BATCH,
                      "pp": 2, "tp": 1, "dp": 2}}
        path = tmp_path / "topology.json"
        path.write_text(json.dumps(topo))
        out = tmp_path / "out"
        env = {**os.environ, "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
               "ATLAS_TEST_VALUE": "same on every rank"}
        env["GLOO_SOCKET_IFNAME"] = "lo"          # a global default on every node: each DC's ifname wins
        nodes = {}
        for ns, host, where in ((west, "w0", ["--atlas-host", "w0"]), (east, "e0", ["--node_rank", "1"])):
            cmd = ["timeout", str(NODE_TIMEOUT), sys.executable, "-m", "launch",
                   "--atlas-topology", str(path), "--wan-connections", str(CONNECTIONS), "--no_ssh", *where,
                   "--master_port", "29500",
                   "examples/atlas_pipeline.py", "--steps", str(STEPS), "--out", str(out)]
            nodes[host] = lab.popen(ns, cmd, cwd=REPO, env={**env, "ATLAS_TEST_NODE": host},
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        logs = {host: p.communicate(timeout=NODE_TIMEOUT + 30)[0] for host, p in nodes.items()}
        for host, p in nodes.items():
            assert p.returncode == 0, f"node {host} exited {p.returncode}:\n{logs[host][-6000:]}"

    ranks = {int(f.stem[4:]): json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))}
    assert sorted(ranks) == [0, 1, 2, 3]
    ref = example.reference_losses(STEPS, ranks[0]["micro_batches"])
    for rank, r in ranks.items():
        host, ifname = ("w0", if_w) if rank < 2 else ("e0", if_e)
        assert r["env"]["ATLAS_TEST_NODE"] == host                   # ran where the plan put it
        assert (r["stage"], r["dc"]) == ((0, "west") if rank < 2 else (1, "east"))
        assert r["env"]["ATLAS_TEST_VALUE"] == "same on every rank"
        assert r["env"]["ATLAS_WAN_CONNS"] == str(CONNECTIONS)
        assert r["env"]["NCCL_NSOCKS_PERTHREAD"] == str(CONNECTIONS)
        assert r["env"]["GLOO_SOCKET_IFNAME"] == ifname               # this DC's interface
        assert r["wan_connections_opened"] == CONNECTIONS            # to the other DC, per WAN pair
        assert r["losses"] == pytest.approx(ref, rel=1e-5, abs=1e-7)
