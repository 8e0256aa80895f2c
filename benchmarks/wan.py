"""ATLAS multi-TCP over an emulated WAN: a 256 MiB pipeline transfer with 1, 2, 4, 8, 16 connections.

    python -m benchmarks.wan [--rtt-ms 40] [--rate-mbit 800] [--mib 256] [--window-kib 1024] [--repeats 3]
        [--json link.json]

Two network namespaces joined by launch.net.wanemu (a TUN delay line for the RTT, tbf for the rate; needs
root). One gloo rank in each sends a 256 MiB tensor the way ATLAS's patched pipeline p2p does
(launch.net.striping: a k-device WAN group, the tensor cut into k stripes with tags 0..k−1), for each k.
Alongside, the anchors: the stock pipeline p2p (``dist.send`` on the world group, what DeepSpeed's
pipeline engine does: one connection), the link rate itself (32 plain TCP streams, as many as it
takes to fill it), and one connection's window/RTT limit (sampled from ``ss -ti`` during k=1).

The namespaces cap the TCP buffers at --window-kib (tcp_rmem/tcp_wmem max): with the emulator's
~100 MB/s link the bandwidth-delay product is 4 MB, so a 1 MiB buffer puts one flow at a fraction of
the link, as Linux's default 4-6 MiB buffers do on a real 10 Gb/s x 40 ms path (50 MB in flight).
``tcp_slow_start_after_idle`` is 0 in the namespaces, as the launcher advises. The two ranks and the
forwarders run at raised priority (they stand for dedicated hosts and a network); the machine's
load is still printed, and figures taken under load are not worth much.

Prints a table (medians of --repeats transfers) and ends with one JSON line of ratios; its
``window_fraction`` (the stock single-connection send's rate x minimum RTT / buffer) and ``link_MBps``
are the link constants the calibrated simulator uses (benchmarks/atlas_calibration.py, --json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STREAMS = 32


def _plan(conns: int):
    from launch.plan import topology
    from launch.plan.estimate import ModelSpec
    from launch.plan.placement import make_plan

    raw = {"datacenters": {"a": {"hosts": [{"name": "a0", "slots": 1}]},
                           "b": {"hosts": [{"name": "b0", "slots": 1}]}},
           "wan": [{"between": ["a", "b"], "rtt_ms": 40, "bandwidth_gbps": 1}]}
    model = ModelSpec(layers=2, hidden=8, seq=8, global_batch=1, pp=2, tp=1, dp=1)
    return make_plan(topology.parse(raw, source="wan-bench"), model, conns, "spatial")


def _pingpong(rank: int, send, recv, sizes_kib: list[int], repeats: int) -> dict[str, float]:
    """Median one-way seconds of a blocking send answered by a blocking send back, per size: how a
    pipeline transfer after an idle gap costs (launch.net.pingpong.one_way, on rank 0's clock)."""
    import torch.distributed as dist

    from launch.net.pingpong import one_way

    obj = [one_way(rank == 0, send, recv, sizes_kib, repeats)["one_way"]]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def worker(rank: int, master: str, peer: str, ifname: str, mib: int, conns: list[int], repeats: int,
           pingpong: list[int] = (), nice: bool = True) -> None:
    """One side of the transfer, inside its namespace. Rank 1 (the receiver) prints the timings."""
    if nice:
        with contextlib.suppress(PermissionError):
            os.nice(-10)    # stands for a dedicated host: a busy shared machine disturbs it less
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch
    import torch.distributed as dist

    from commweave import comm
    from launch.net.sockets import established_connections
    from launch.net.striping import open_wan_groups

    dist.init_process_group("gloo", init_method=f"tcp://{master}:29600", rank=rank, world_size=2)
    n = mib * 2**20 // 4
    x = torch.arange(n, dtype=torch.float32) if rank == 0 else torch.empty(n)
    # The anchor: what DeepSpeed's pipeline p2p does today, dist.send on the world group with tag 0,
    # i.e. one TCP connection.
    stock = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.monotonic()
        if rank == 0:
            comm.send(x, 1, dist.group.WORLD)
        else:
            comm.recv(x, 0, dist.group.WORLD)
            stock.append(time.monotonic() - t0)
    peer_rank = 1 - rank
    out = {"stock": {"seconds": stock, "pingpong": _pingpong(
        rank, lambda t: comm.send(t, peer_rank, dist.group.WORLD),
        lambda t: comm.recv(t, peer_rank, dist.group.WORLD), pingpong, repeats)}}
    for k in conns:
        dist.barrier()
        before = established_connections({peer})
        wan = open_wan_groups(_plan(k), k, ifname)
        dist.barrier()
        opened = established_connections({peer}) - before
        times, sample = [], {}
        for rep in range(repeats):
            dist.barrier()
            t0 = time.monotonic()
            if rank == 0:
                sampler = _Sampler(peer) if k == 1 and rep == repeats - 1 else None
                wan.isend(x, 0, 1).wait()
                if sampler is not None:
                    sample = sampler.stop()
            else:
                x.zero_()
                wan.irecv(x, 1, 0).wait()
                times.append(time.monotonic() - t0)
                if rep == 0 and not bool((x[:: 1 << 16] == torch.arange(0, n, 1 << 16)).all()):
                    raise RuntimeError(f"k={k}: the striped transfer arrived corrupted")
        obj = [sample]
        dist.broadcast_object_list(obj, src=0)
        out[k] = {"seconds": times, "opened": opened, "ss": obj[0], "pingpong": _pingpong(
            rank, lambda t, wan=wan: wan.isend(t, rank, peer_rank).wait(),
            lambda t, wan=wan: wan.irecv(t, rank, peer_rank).wait(), pingpong, repeats)}
    if rank == 1:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


class _Sampler:
    """``ss -ti`` of the busiest connection to ``peer`` while a transfer runs: its largest advertised
    window (snd_wnd), its minimum RTT, and how much of the time it was window- or buffer-limited."""

    def __init__(self, peer: str) -> None:
        self.peer, self.conns, self._stop = peer, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            lines = subprocess.run(["ss", "-tinH", "dst", self.peer], capture_output=True,
                                   text=True).stdout.splitlines()
            for head, info in zip(lines[::2], lines[1::2], strict=False):
                fields = dict(re.findall(r"(\w+):([\d.]+)", info))
                if "bytes_acked" not in fields or "snd_wnd" not in fields:
                    continue
                c = self.conns.setdefault(head.split()[3], {"snd_wnd": 0})
                c["bytes_acked"] = int(fields["bytes_acked"])
                c["snd_wnd"] = max(c["snd_wnd"], int(fields["snd_wnd"]))
                c["minrtt"] = float(fields.get("minrtt", fields.get("rtt", "nan")))
                c.update(re.findall(r"(rwnd_limited|sndbuf_limited):\d+ms\(([\d.]+)%\)", info))

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return max(self.conns.values(), key=lambda c: c["bytes_acked"], default={})


def link_rate(link, seconds: float = 3.0, port: int = 5201, streams: int = STREAMS) -> float:
    """Bytes/s that ``streams`` plain TCP streams push from A to B (with STREAMS: the emulated link's
    capacity; with 1: one connection's window/RTT)."""
    server = (f"import socket, threading\n"
              f"s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              f"s.bind(({link.addr_b!r}, {port})); s.listen({streams})\n"
              f"def drain(c):\n    while c.recv(1 << 20):\n        pass\n"
              f"while True:\n"
              f"    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()\n")
    link.lab.popen(link.b, [sys.executable, "-c", server])
    client = (f"import socket, threading, time\n"
              f"sent = [0] * {streams}; buf = bytes(1 << 20)\n"
              f"socks = [socket.create_connection(({link.addr_b!r}, {port})) for _ in range({streams})]\n"
              f"def push(i, end):\n    while time.monotonic() < end:\n"
              f"        sent[i] += socks[i].send(buf)\n"
              f"warm = time.monotonic() + 1.0\n"
              f"ts = [threading.Thread(target=push, args=(i, warm)) for i in range({streams})]\n"
              f"[t.start() for t in ts]; [t.join() for t in ts]\n"
              f"sent = [0] * {streams}; t0 = time.monotonic(); end = t0 + {seconds}\n"
              f"ts = [threading.Thread(target=push, args=(i, end)) for i in range({streams})]\n"
              f"[t.start() for t in ts]; [t.join() for t in ts]\n"
              f"print(sum(sent) / (time.monotonic() - t0))\n")
    for _ in range(50):
        try:
            return float(link.a.run(sys.executable, "-c", client).stdout)
        except RuntimeError:
            time.sleep(0.1)       # the server is not listening yet
    raise RuntimeError("link_rate: could not reach the stream server")


def measure_on(link, mib: int, connections: str, repeats: int, pingpong: str = "", nice: bool = True
               ) -> tuple[float, list[float], dict, dict]:
    """Everything the table reports, on a link already set up (its namespaces' sysctls included): the
    probed RTT, the link rate before and after, the workers' timings (and ping-pongs of ``pingpong``
    KiB), the drop counters. ``nice``: the workers run at raised priority."""
    rtt = link.probe_rtt(9)
    rate = link_rate(link)
    procs = []
    for rank, ns, peer, ifname in ((0, link.a, link.addr_b, link.ifname_a),
                                   (1, link.b, link.addr_a, link.ifname_b)):
        args = json.dumps([link.addr_a, peer, ifname])
        cmd = ["timeout", "1200", sys.executable, "-m", "benchmarks.wan", "--worker", str(rank),
               "--args", args, "--mib", str(mib), "--connections", connections, "--repeats", str(repeats),
               "--pingpong", pingpong, *([] if nice else ["--normal-priority"])]
        procs.append(link.lab.popen(ns, cmd, cwd=REPO, stdout=subprocess.PIPE, text=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"worker failed: {[p.returncode for p in procs]}\n{outs}")
    # the link rate again after the transfers: a busy machine lowers either measurement, the
    # larger one is the closer to what the link carries
    rates = [rate, link_rate(link, port=5202)]
    result = json.loads(next(line for line in outs[1].splitlines() if line.startswith("RESULT "))[7:])
    return rtt, rates, result, link.drops()


PINGPONG_KIB = (64, 1024, 2048, 4096)


def link_constants(link, mib: int = 2, connections: str = "1,8", repeats: int = 3) -> dict:
    """What the calibrated simulator takes from a link (launch.plan.calibrated.LinkMode), measured on
    it at the priority the job runs at: the link's bytes/s, and for the stock send and each ATLAS
    connection count, alpha and bytes/s of one transfer after an idle gap, from ping-pongs of two
    sizes (t = alpha + bytes / rate through both points): 64 KiB and 2 MiB on one connection, 1 and
    4 MiB with k > 1 (both striped: STRIPE_MIN_BYTES is 1 MiB)."""
    _, rates, result, _ = measure_on(link, mib, connections, repeats, ",".join(map(str, PINGPONG_KIB)),
                                     nice=False)
    from launch.net.pingpong import fit, sizes_kib

    out = {"link_Bps": max(rates), "modes": {}}
    for mode, r in result.items():
        out["modes"][mode] = {**fit(r["pingpong"], sizes_kib(1 if mode == "stock" else int(mode))),
                              "pingpong_s": r["pingpong"]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", type=float, default=40.0)
    ap.add_argument("--rate-mbit", type=float, default=800.0)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--window-kib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--connections", default="1,2,4,8,16")
    ap.add_argument("--json", default=None, help="also write the last JSON line to this file")
    ap.add_argument("--pingpong", default="", help="also time ping-pongs of these KiB (comma list)")
    ap.add_argument("--normal-priority", action="store_true", help="workers at normal priority")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--args", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    conns = [int(c) for c in a.connections.split(",")]
    if a.worker is not None:
        master, peer, ifname = json.loads(a.args)
        worker(a.worker, master, peer, ifname, a.mib, conns, a.repeats,
               [int(x) for x in a.pingpong.split(",") if x], not a.normal_priority)
        return

    from launch.net import netns, two_dc
    from launch.net.wanemu import WanLink

    ok, reason = netns.available()
    if not ok:
        print(json.dumps({"bench": "wan", "skipped": reason}))
        return
    load_before = os.getloadavg()
    window = a.window_kib * 1024
    with WanLink(rtt=a.rtt_ms / 1e3, rate=a.rate_mbit * 1e6 / 8) as link:
        two_dc.cap_buffers(link, window)
        rtt, rates, result, drops = measure_on(link, a.mib, a.connections, a.repeats, a.pingpong,
                                               not a.normal_priority)
    load_after = os.getloadavg()
    _report(a, rtt, max(rates), rates, window, result, drops, load_before, load_after)


def _report(a, rtt, rate, rates, window, result, drops, load_before, load_after) -> None:
    size = a.mib * 2**20
    stock_run = result.pop("stock")
    stock, pingpong = size / statistics.median(stock_run["seconds"]) / 1e6, stock_run.get("pingpong", {})
    mbps = {int(k): size / statistics.median(v["seconds"]) / 1e6 for k, v in result.items()}
    ss = result[min(result, key=int)]["ss"]
    wnd_rtt = ss["snd_wnd"] / (ss["minrtt"] / 1e3) / 1e6 if ss.get("snd_wnd") else float("nan")
    base_rtt = ss["minrtt"] / 1e3 if ss.get("minrtt") else rtt      # the path's RTT without queueing
    buf_rtt = window / base_rtt / 1e6
    print(f"emulated WAN: RTT {rtt * 1e3:.1f} ms (set {a.rtt_ms:g}), tbf {a.rate_mbit:g} Mbit/s, "
          f"TCP buffers capped at {a.window_kib} KiB, {a.mib} MiB per transfer, median of {a.repeats}")
    ceiling = a.rate_mbit * 1e6 / 8 * (9000 - 52) / 9000 / 1e6     # tbf's rate less IP+TCP headers
    print(f"link rate ({STREAMS} plain TCP streams, before/after): "
          f"{' / '.join(f'{r / 1e6:.1f}' for r in rates)} MB/s (tbf payload ceiling {ceiling:.1f} MB/s)")
    print(f"one connection's limits: buffer/RTT {buf_rtt:.1f} MB/s; advertised window/RTT {wnd_rtt:.1f} MB/s "
          f"(ss on the k=1 connection: max snd_wnd {ss.get('snd_wnd')} B, minrtt {ss.get('minrtt')} ms, "
          f"rwnd_limited {ss.get('rwnd_limited', '?')}%, sndbuf_limited {ss.get('sndbuf_limited', '?')}%)")
    print(f"stock pipeline p2p (dist.send on the world group, one connection): {stock:.1f} MB/s")
    print(f"{'connections':>11}  {'opened':>6}  {'MB/s':>8}  {'vs link':>7}  {'vs tbf':>7}  {'runs (s)':<24}")
    for k in sorted(mbps):
        runs = " ".join(f"{t:.2f}" for t in result[str(k)]["seconds"])
        share, of_tbf = mbps[k] / (rate / 1e6), mbps[k] / ceiling
        opened = result[str(k)]["opened"]
        print(f"{k:>11}  {opened:>6}  {mbps[k]:>8.1f}  {share:>7.1%}  {of_tbf:>7.1%}  {runs:<24}")
    print(f"drops: {drops}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    best = max(mbps.values())
    summary = {"bench": "wan", "rtt_ms": round(rtt * 1e3, 2), "link_MBps": round(rate / 1e6, 1),
               "MBps": {str(k): round(v, 1) for k, v in sorted(mbps.items())},
               "best_vs_link": round(best / (rate / 1e6), 3), "best_vs_tbf_ceiling": round(best / ceiling, 3),
               "one_vs_window_rtt": round(mbps[min(mbps)] / wnd_rtt, 3),
               "one_vs_buffer_rtt": round(mbps[min(mbps)] / buf_rtt, 3),
               "best_vs_one": round(best / mbps[min(mbps)], 2),
               "stock_MBps": round(stock, 1), "best_vs_stock": round(best / stock, 2),
               "load1": [round(load_before[0], 2), round(load_after[0], 2)],
               # one stock connection's effective window (its rate x the minimum RTT): the topology's
               # "window_mb" for this link, and its fraction of the TCP buffer maximum
               "window_mb": round(stock * 1e6 * base_rtt / 2**20, 3),
               "window_fraction": round(stock * 1e6 / (window / base_rtt), 3), "window_kib": a.window_kib,
               "rtt_set_ms": a.rtt_ms, "rate_mbit": a.rate_mbit,
               "pingpong_s": {"stock": pingpong, **{k: v.get("pingpong", {}) for k, v in result.items()}}}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
