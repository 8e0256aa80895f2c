"""A WAN between two network namespaces: a set round-trip time and rate, on one machine.

``tc`` here has tbf/htb but no netem, so the delay is a user-space delay line (traps.md):

    ns A: tunA --(tbf rate R)--> [forwarder A->B: hold each packet RTT/2] --> tunB: ns B
    ns B: tunB --(tbf rate R)--> [forwarder B->A: hold each packet RTT/2] --> tunA: ns A

One TUN device per namespace (layer 3: no ARP, no veth), created here with TUNSETIFF and moved into
its namespace; the two forwarder processes hold the device file descriptors, each moving packets
one way through a FIFO that releases them RTT/2 after they arrived. The tbf on each TUN's egress
caps the rate below what the forwarder sustains, so the queue that builds is tbf's, not the
forwarder's. Silent drops are the failure mode to watch: txqueuelen 10000 (the default 500 dropped
about 20% of packets, visible only in ``ip -s link``), MTU 9000 (fewer packets per byte), a
forwarder queue capped above the bandwidth-delay product, and :meth:`WanLink.drops` reports TX drops,
forwarder drops and TCP retransmissions after a run.

    python -m launch.wanemu forward --in-fd 3 --out-fd 4 --delay-ms 20 --queue-bytes N --stats FILE
is the forwarder itself.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.netns import Lab, Netns, sh

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def open_tun(name: str) -> int:
    """Create TUN device ``name`` (no packet-info header) in this namespace; returns its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


@dataclass
class WanLink:
    """Two namespaces joined by an emulated WAN. Use as a context manager (or pass a :class:`Lab`)."""

    rtt: float                    # seconds
    rate: float                   # bytes/s per direction (tbf)
    mtu: int = 9000
    txqueuelen: int = 10000
    lab: Lab = field(default_factory=Lab)
    addr_a: str = "10.201.0.1"
    addr_b: str = "10.201.0.2"

    def __post_init__(self) -> None:
        if self.rtt < 0 or self.rate <= 0:
            raise ValueError(f"WanLink: rtt={self.rtt} must be >= 0 and rate={self.rate} > 0")
        self._stats = Path(tempfile.mkdtemp(prefix="wanemu-"))

    def __enter__(self) -> WanLink:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        self.a: Netns = self.lab.netns("a")
        self.b: Netns = self.lab.netns("b")
        tag = f"{os.getpid() % 100000}{self.lab.prefix[-2:]}"
        self.ifname_a, self.ifname_b = f"cwt{tag}a"[-15:], f"cwt{tag}b"[-15:]
        fds = [open_tun(self.ifname_a), open_tun(self.ifname_b)]
        try:
            bdp = int(self.rate * self.rtt)
            # the forwarder holds one direction's BDP; 4x leaves room for bursts and BBR's start-up
            queue = 4 * bdp + 64 * self.mtu
            for src, dst, label in ((0, 1, "ab"), (1, 0, "ba")):
                cmd = [sys.executable, "-m", "launch.wanemu", "forward", "--in-fd", str(fds[src]),
                       "--out-fd", str(fds[dst]), "--delay-ms", str(self.rtt * 1e3 / 2),
                       "--queue-bytes", str(queue), "--stats", str(self._stats / f"{label}.json")]
                self.lab.spawn(cmd, pass_fds=fds, cwd=Path(__file__).resolve().parents[1])
        finally:
            for fd in fds:
                os.close(fd)         # the forwarders hold them now; the devices live while they do
        burst = max(2 * self.mtu, int(self.rate / 250))   # >= MTU, and one 4 ms timer tick of rate
        for ns, ifname, me, peer in ((self.a, self.ifname_a, self.addr_a, self.addr_b),
                                     (self.b, self.ifname_b, self.addr_b, self.addr_a)):
            sh("ip", "link", "set", ifname, "netns", ns.name)
            ns.ip("addr", "add", me, "peer", f"{peer}/32", "dev", ifname)
            ns.ip("link", "set", ifname, "mtu", str(self.mtu), "txqueuelen", str(self.txqueuelen), "up")
            ns.run("tc", "qdisc", "add", "dev", ifname, "root", "tbf", "rate", f"{int(self.rate * 8)}bit",
                   "burst", str(burst), "limit", str(max(4 * int(self.rate * self.rtt), 1 << 20)))
        self._wait_reachable()

    def _wait_reachable(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.probe_rtt(1) is not None:
                return
        raise RuntimeError(f"WanLink: {self.addr_b} not reachable from {self.a.name} within {timeout} s")

    def probe_rtt(self, samples: int = 5) -> float | None:
        """Median round trip from A to B in seconds, timed as a TCP connect to a closed port of B
        (SYN out, RST back: one RTT, no server and no ping binary needed); None if B is unreachable."""
        code = ("import socket, statistics, time\n"
                "out = []\n"
                f"for _ in range({samples}):\n"
                "    s = socket.socket(); s.settimeout(2.0); t = time.monotonic()\n"
                "    try:\n"
                f"        s.connect(({self.addr_b!r}, 9))\n"
                "    except ConnectionRefusedError:\n"
                "        out.append(time.monotonic() - t)\n"
                "    except OSError:\n"
                "        pass\n"
                "    s.close()\n"
                "print(statistics.median(out) if out else -1)\n")
        rtt = float(self.a.run(sys.executable, "-c", code).stdout)
        return None if rtt < 0 else rtt

    def drops(self) -> dict[str, int]:
        """Where packets went missing: TX drops of each TUN, tbf's drops (its queue overflowing: the
        congestion signal TCP is meant to see), forwarder queue drops, TCP retransmissions."""
        out = {}
        for ns, ifname, side in ((self.a, self.ifname_a, "a"), (self.b, self.ifname_b, "b")):
            stats = json.loads(ns.ip("-j", "-s", "link", "show", "dev", ifname).stdout)[0]["stats64"]
            out[f"tx_dropped_{side}"] = stats["tx"]["dropped"]
            qdisc = json.loads(ns.run("tc", "-s", "-j", "qdisc", "show", "dev", ifname).stdout)
            out[f"tbf_dropped_{side}"] = sum(q.get("drops", 0) for q in qdisc if q.get("kind") == "tbf")
            snmp = ns.read("/proc/net/snmp").splitlines()
            tcp = [line.split() for line in snmp if line.startswith("Tcp:")]
            out[f"tcp_retrans_{side}"] = int(dict(zip(tcp[0], tcp[1], strict=True))["RetransSegs"])
        for label in ("ab", "ba"):
            path = self._stats / f"{label}.json"
            saved = json.loads(path.read_text()) if path.exists() else {"dropped": -1}
            out[f"forwarder_dropped_{label}"] = saved["dropped"]
        return out

    def close(self) -> None:
        self.lab.close()
        shutil.rmtree(self._stats, ignore_errors=True)


def forward(in_fd: int, out_fd: int, delay: float, queue_bytes: int, stats_path: str) -> None:
    """The delay line: read packets from ``in_fd``, write each to ``out_fd`` ``delay`` s later."""
    os.set_blocking(in_fd, False)
    # The emulated link stands for hardware: keep it from being starved by the processes it serves
    # (and by a busy machine), which would show up as extra delay and a lower rate.
    with contextlib.suppress(PermissionError):
        os.nice(-10)
    q: collections.deque = collections.deque()
    queued = moved = dropped = 0
    stop = False

    def on_term(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)

    def save():
        Path(stats_path).write_text(json.dumps({"moved": moved, "dropped": dropped}))

    last_save = time.monotonic()
    while not stop:
        timeout = max(0.0, q[0][0] - time.monotonic()) if q else 0.5
        try:
            ready, _, _ = select.select([in_fd], [], [], timeout)
        except InterruptedError:
            continue
        now = time.monotonic()
        if ready:
            for _ in range(256):
                try:
                    pkt = os.read(in_fd, 65536)
                except BlockingIOError:
                    break
                if queued + len(pkt) > queue_bytes:
                    dropped += 1
                    continue
                q.append((now + delay, pkt))
                queued += len(pkt)
        while q and q[0][0] <= now:
            _, pkt = q.popleft()
            queued -= len(pkt)
            try:
                os.write(out_fd, pkt)
                moved += 1
            except OSError:
                dropped += 1
        if now - last_save > 1.0:
            save()
            last_save = now
    save()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m launch.wanemu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forward", help="run one direction's delay line")
    f.add_argument("--in-fd", type=int, required=True)
    f.add_argument("--out-fd", type=int, required=True)
    f.add_argument("--delay-ms", type=float, required=True)
    f.add_argument("--queue-bytes", type=int, required=True)
    f.add_argument("--stats", required=True)
    args = ap.parse_args(argv)
    forward(args.in_fd, args.out_fd, args.delay_ms / 1e3, args.queue_bytes, args.stats)


if __name__ == "__main__":
    main()
