"""A job across two emulated data centers on one machine: ``deepspeed-atlas --no_ssh`` in both network
namespaces of a launch.net.wanemu link, one host per data center.

What benchmarks/atlas_calibration.py (the calibration matrix) and examples/gpt/atlas.py (the main job's
``--atlas`` rows) share: the TCP buffer caps that make one connection window-limited below the link
rate, as on a real long fat link (:func:`cap_buffers`), the two-DC topology the launcher plans from
(:func:`topology`), and the launch itself (:func:`launch`): each node under ``timeout``, its output kept
for the error when it fails, the ranks' ``rank<N>.json`` reports read back in rank order. Everything
runs inside the link's :class:`launch.net.netns.Lab`, which removes it on exit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a node inherits from an enclosing launcher (the main job's own ranks): each node gets its own.
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "ROLE_RANK", "GLOO_SOCKET_IFNAME",
             "NCCL_SOCKET_IFNAME")


def cap_buffers(link, window_bytes: int) -> None:
    """Cap both namespaces' TCP buffers (tcp_rmem/tcp_wmem max) at ``window_bytes`` and keep the
    congestion window across idle gaps (``tcp_slow_start_after_idle`` 0, as the launcher advises)."""
    if window_bytes < 4096:
        raise ValueError(f"cap_buffers: window_bytes={window_bytes} must be >= 4096 (tcp_rmem's minimum)")
    for ns in (link.a, link.b):
        ns.sysctl("net.ipv4.tcp_rmem", f"4096 131072 {window_bytes}")
        ns.sysctl("net.ipv4.tcp_wmem", f"4096 16384 {window_bytes}")
        ns.sysctl("net.ipv4.tcp_slow_start_after_idle", "0")


def topology(link, slots: int, rtt_ms: float, rate_mbit: float, window_bytes: float, model: Mapping) -> dict:
    """The launcher's topology: data centers ``west`` (host w0, namespace A) and ``east`` (e0, B) with
    ``slots`` ranks each, the WAN between them with the window the run gets (``window_mb``)."""
    def dc(host: str, addr: str, ifname: str) -> dict:
        return {"hosts": [{"name": host, "slots": slots, "addr": addr}], "ifname": ifname}

    return {"datacenters": {"west": dc("w0", link.addr_a, link.ifname_a),
                            "east": dc("e0", link.addr_b, link.ifname_b)},
            "wan": [{"between": ["west", "east"], "rtt_ms": rtt_ms, "bandwidth_gbps": rate_mbit / 1e3,
                     "window_mb": window_bytes / 2**20}],
            "model": dict(model)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(link, topo: Mapping, out: Path, script: Path, script_args: Sequence[str],
           launcher_args: Sequence[str] = (), timeout_s: float = 900) -> list[dict]:
    """Start ``script`` on both nodes through ``python -m launch --no_ssh`` (w0 by name, e0 as node 1),
    each with ``--out out`` and ``script_args``; wait; return the ranks' reports in rank order. Raises
    RuntimeError with the node's last output when a node fails or times out."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "topology.json"
    path.write_text(json.dumps(topo))
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env.update(PYTHONPATH=str(ROOT), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    port, procs = str(free_port()), []
    for ns, where in ((link.a, ["--atlas-host", "w0"]), (link.b, ["--node_rank", "1"])):
        cmd = ["timeout", str(int(timeout_s)), sys.executable, "-m", "launch", "--atlas-topology", str(path),
               *launcher_args, "--no_ssh", *where, "--master_port", port, str(script), "--out", str(out),
               *script_args]
        procs.append(link.lab.popen(ns, cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=timeout_s + 60)[0] for p in procs]
    for p, log in zip(procs, logs, strict=True):
        if p.returncode:
            raise RuntimeError(f"a node exited {p.returncode}:\n{log[-5000:]}")
    return [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"), key=lambda f: int(f.stem[4:]))]
