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

    python -m launch.net.wanemu forward --in-fd 3 --out-fd 4 --delay-ms 20 --queue-bytes N --stats FILE
is the forwarder itself.

Faults: :meth:`WanLink.fault` adds a rule for one TCP connection (its two ports) that fires once that
connection has carried ``after_bytes`` of payload in one direction: ``cut`` replaces the packet by a
reset to the receiver (queued behind the packets before it, so its sequence number is the one the
receiver expects) and sends a reset straight back to the sender (its sequence number is the
sender's acknowledgement), then drops the connection's packets; ``stall`` drops every later packet
of that direction (a black hole: the sender's window fills and nothing moves). The forwarders read
the rules file while they run and list the rules that fired in their stats.
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

from launch.net.netns import Lab, Netns, sh

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
                cmd = [sys.executable, "-m", "launch.net.wanemu", "forward", "--in-fd", str(fds[src]),
                       "--out-fd", str(fds[dst]), "--delay-ms", str(self.rtt * 1e3 / 2),
                       "--queue-bytes", str(queue), "--stats", str(self._stats / f"{label}.json"),
                       "--rules", str(self.rules)]
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

    def fault(self, action: str, ports: tuple[int, int], after_bytes: int = 0) -> None:
        """Break one TCP connection (by its two ports) once it carried ``after_bytes`` one way."""
        if action not in ("cut", "stall"):
            raise ValueError(f"WanLink.fault: action {action!r}: use 'cut' or 'stall'")
        add_rule(self.rules, action, ports, after_bytes)

    @property
    def rules(self) -> Path:
        return self._stats / "rules.json"

    def fired(self) -> list[dict]:
        """The fault rules that fired, with the direction and byte count they fired at."""
        out = []
        for label in ("ab", "ba"):
            path = self._stats / f"{label}.json"
            if path.exists():
                out += [{**f, "direction": label} for f in json.loads(path.read_text()).get("fired", [])]
        return out

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


def add_rule(path: Path, action: str, ports: tuple[int, int], after_bytes: int) -> None:
    """Append a fault rule to a forwarders' rules file (atomically: they may read it at any time)."""
    path = Path(path)
    rules = json.loads(path.read_text()) if path.exists() else []
    rules.append({"id": len(rules), "action": action, "ports": sorted(int(p) for p in ports),
                  "after": int(after_bytes)})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rules))
    os.replace(tmp, path)


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _reset(src: bytes, dst: bytes, sport: int, dport: int, seq: int) -> bytes:
    """An IPv4 TCP segment with only RST set, checksums filled in."""
    tcp = struct.pack("!HHIIBBHHH", sport, dport, seq, 0, 5 << 4, 0x04, 0, 0, 0)
    pseudo = src + dst + struct.pack("!BBH", 0, 6, len(tcp))        # the TCP checksum covers these too
    tcp = tcp[:16] + struct.pack("!H", _checksum(pseudo + tcp)) + tcp[18:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp), 0, 0x4000, 64, 6, 0, src, dst)
    return ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:] + tcp


@dataclass
class _Faults:
    """The rules file as one forwarder applies it to its direction."""

    path: str | None
    rules: list = field(default_factory=list)
    carried: dict = field(default_factory=dict)     # rule id -> payload bytes seen
    dead: dict = field(default_factory=dict)        # (src, dst, sport, dport) -> action
    fired: list = field(default_factory=list)
    mtime: float = -1.0
    checked: float = 0.0

    def reload(self, now: float) -> None:
        if self.path is None or now - self.checked < 0.05:
            return
        self.checked = now
        try:
            mtime = os.stat(self.path).st_mtime
        except FileNotFoundError:
            return
        if mtime != self.mtime:
            self.mtime, self.rules = mtime, json.loads(Path(self.path).read_text())

    def apply(self, pkt: bytes) -> tuple[str, bytes | None, bytes | None]:
        """("pass" | "drop" | "cut", reset for the receiver, reset for the sender)."""
        if not self.rules or len(pkt) < 40 or pkt[0] >> 4 != 4 or pkt[9] != 6:
            return "pass", None, None
        ihl = (pkt[0] & 0xF) * 4
        src, dst = pkt[12:16], pkt[16:20]
        sport, dport, seq, ack = struct.unpack("!HHII", pkt[ihl:ihl + 12])
        flow = (src, dst, sport, dport)
        if flow in self.dead:
            return "drop", None, None
        payload = struct.unpack("!H", pkt[2:4])[0] - ihl - (pkt[ihl + 12] >> 4) * 4
        for rule in self.rules:
            done = self.carried.get(rule["id"], 0) < 0                 # a rule fires once
            if done or payload <= 0 or sorted((sport, dport)) != rule["ports"]:
                continue
            seen = self.carried.get(rule["id"], 0) + payload
            self.carried[rule["id"]] = seen
            if seen <= rule["after"]:
                continue
            self.carried[rule["id"]] = -1
            self.dead[flow] = rule["action"]
            self.fired.append({"id": rule["id"], "action": rule["action"], "ports": rule["ports"],
                               "at": seen})
            if rule["action"] == "stall":
                return "drop", None, None
            return "cut", _reset(src, dst, sport, dport, seq), _reset(dst, src, dport, sport, ack)
        return "pass", None, None


def forward(in_fd: int, out_fd: int, delay: float, queue_bytes: int, stats_path: str,
            rules_path: str | None = None) -> None:
    """The delay line: read packets from ``in_fd``, write each to ``out_fd`` ``delay`` s later."""
    os.set_blocking(in_fd, False)
    # The emulated link stands for hardware: keep it from being starved by the processes it serves
    # (and by a busy machine), which would show up as extra delay and a lower rate.
    with contextlib.suppress(PermissionError):
        os.nice(-10)
    q: collections.deque = collections.deque()
    queued = moved = dropped = 0
    stop = False
    faults = _Faults(rules_path)

    def on_term(signum, frame):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)

    def save():  # atomically: drops() and fired() may read it at any time (a bare write shows them "")
        tmp = Path(stats_path).with_suffix(".tmp")
        tmp.write_text(json.dumps({"moved": moved, "dropped": dropped, "fired": faults.fired}))
        os.replace(tmp, stats_path)

    last_save = time.monotonic()
    while not stop:
        timeout = max(0.0, q[0][0] - time.monotonic()) if q else 0.5
        try:
            ready, _, _ = select.select([in_fd], [], [], min(timeout, 0.05))
        except InterruptedError:
            continue
        now = time.monotonic()
        faults.reload(now)
        if ready:
            for _ in range(256):
                try:
                    pkt = os.read(in_fd, 65536)
                except BlockingIOError:
                    break
                verdict, to_receiver, to_sender = faults.apply(pkt)
                if verdict == "drop":
                    continue
                if verdict == "cut":
                    pkt = to_receiver                              # in the packet's place in the line
                    with contextlib.suppress(OSError):
                        os.write(in_fd, to_sender)                # straight back into the sender's stack
                    save()
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
    ap = argparse.ArgumentParser(prog="python -m launch.net.wanemu")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("forward", help="run one direction's delay line")
    f.add_argument("--in-fd", type=int, required=True)
    f.add_argument("--out-fd", type=int, required=True)
    f.add_argument("--delay-ms", type=float, required=True)
    f.add_argument("--queue-bytes", type=int, required=True)
    f.add_argument("--stats", required=True)
    f.add_argument("--rules", default=None, help="fault rules file (WanLink.fault)")
    args = ap.parse_args(argv)
    forward(args.in_fd, args.out_fd, args.delay_ms / 1e3, args.queue_bytes, args.stats, args.rules)


if __name__ == "__main__":
    main()
