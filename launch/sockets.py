"""Multi-TCP settings (mechanism A, atlas.md §1.3, §2): NCCL's socket knobs, gloo's device lists, and
the Linux TCP sysctls a long fat WAN path needs.

One TCP flow carries at most window/RTT; filling B bytes/s over a round trip RTT needs B·RTT bytes
in flight, so k flows each need a window of B·RTT/k. This module chooses the settings and checks the
host; :mod:`launch.striping` opens the gloo connections and splits transfers across them.

NCCL (``src/transport/net_socket.cc``): ``NCCL_SOCKET_NTHREADS`` ≤ 16 helper threads, each driving
``NCCL_NSOCKS_PERTHREAD`` sockets, at most 64 sockets per connection (a static array); NCCL splits
every message across them. The settings are process-wide but only the socket transport reads them,
so with Megatron's per-group NCCL config (``net_name: socket`` for the pipeline groups, which are the
only groups that cross the WAN, IB for the rest) they apply exactly to the WAN groups.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

from launch.topology import WanLink

NCCL_MAX_SOCKETS = 64
NCCL_MAX_THREADS = 16
MAX_SOCKS_PER_THREAD = 8     # AWS's default split is 2 threads x 8 sockets; more per thread starves it

# Effective window of one connection = this fraction of the socket buffer maximum: Linux keeps part
# of the receive buffer for metadata (tcp_adv_win_scale / scaling_ratio); measured about 0.6 on this
# project's machines (traps.md), 0.5 is the classic value.
WINDOW_FRACTION = 0.5

# The window the planner assumes for one WAN connection when the topology gives no ``window_mb``:
# Linux's default autotuning maxima (tcp_wmem 4 MiB, tcp_rmem 6 MiB; ip-sysctl.rst) x the fraction
# above. A constant, so a plan never depends on the machine it is computed on.
DEFAULT_WINDOW = WINDOW_FRACTION * 4 * 2**20


def nccl_split(connections: int) -> tuple[int, int]:
    """``(NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD)`` whose product is ``connections``.

    The fewest threads that keep at most 8 sockets per thread, within NCCL's 16 threads / 64 sockets.
    """
    if not isinstance(connections, int) or connections < 1:
        raise ValueError(f"--wan-connections must be a positive integer, got {connections!r}")
    if connections > NCCL_MAX_SOCKETS:
        raise ValueError(f"--wan-connections {connections}: NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD "
                         f"must be <= {NCCL_MAX_SOCKETS} (NCCL's socket array)")
    for threads in range(1, NCCL_MAX_THREADS + 1):
        if connections % threads == 0 and connections // threads <= MAX_SOCKS_PER_THREAD:
            return threads, connections // threads
    # A prime above 8 (11, 13, ...): one thread per socket up to 16, else fewer threads, more sockets.
    for threads in range(NCCL_MAX_THREADS, 0, -1):
        if connections % threads == 0:
            return threads, connections // threads
    raise AssertionError("unreachable: threads=1 always divides")


def check_nccl_env(env: Mapping[str, str]) -> None:
    """Refuse user-set NCCL socket knobs beyond NCCL's limits (NCCL would silently clamp them)."""
    threads = _int_env(env, "NCCL_SOCKET_NTHREADS")
    socks = _int_env(env, "NCCL_NSOCKS_PERTHREAD")
    if threads is not None and not 1 <= threads <= NCCL_MAX_THREADS:
        raise ValueError(f"NCCL_SOCKET_NTHREADS={threads}: must be in 1..{NCCL_MAX_THREADS}")
    if socks is not None and socks < 1:
        raise ValueError(f"NCCL_NSOCKS_PERTHREAD={socks}: must be >= 1")
    if threads is not None and socks is not None and threads * socks > NCCL_MAX_SOCKETS:
        raise ValueError(f"NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS = {socks} x {threads} = "
                         f"{socks * threads}: must be <= {NCCL_MAX_SOCKETS}")


def nccl_env(connections: int, links: list[WanLink], env: Mapping[str, str]) -> dict[str, str]:
    """NCCL variables for ``connections`` sockets per WAN peer; user-set values win but are checked."""
    check_nccl_env(env)
    threads, socks = nccl_split(connections)
    out = {"NCCL_SOCKET_NTHREADS": str(threads), "NCCL_NSOCKS_PERTHREAD": str(socks)}
    if links:
        # NCCL keeps at most NCCL_BUFFSIZE in flight per channel (its credit protocol), so one
        # channel carries <= BUFFSIZE/RTT: raise it towards the path's BDP (inferred, atlas.md §2.2),
        # capped at 64 MiB of GPU memory per channel and peer.
        bdp = max(w.bdp for w in links)
        buff = min(64 * 2**20, max(4 * 2**20, 2 ** math.ceil(math.log2(bdp))))
        out["NCCL_BUFFSIZE"] = str(buff)
    for key in list(out):
        if key in env:
            out[key] = env[key]
    check_nccl_env(out)
    return out


def megatron_nccl_config(wan: bool) -> str:
    """YAML for Megatron's ``--nccl-communicator-config-path``: the groups that cross the WAN use
    NCCL's socket transport (where the NSOCKS/NTHREADS knobs act), the others keep IB."""
    if not wan:
        return ""
    return "".join(f"{g}:\n  net_name: socket\n" for g in ("pp", "embd", "pos_embd"))


def gloo_ifname(ifname: str, devices: int) -> str:
    """``GLOO_SOCKET_IFNAME`` value that gives a gloo group ``devices`` contexts, i.e. that many TCP
    connections per rank pair (one context per comma-separated entry; pytorch/pytorch#22978)."""
    if devices < 1:
        raise ValueError(f"gloo devices must be >= 1, got {devices}")
    if not ifname or "," in ifname:
        raise ValueError(f"gloo interface must be one name, got {ifname!r}")
    return ",".join([ifname] * devices)


# -- Linux TCP advice (checked at start-up; the launcher warns but never changes the host) -----------

def read_sysctl(name: str, root: str = "/proc/sys") -> str | None:
    path = Path(root, *name.split("."))
    try:
        return path.read_text().strip()
    except OSError:
        return None


def host_window(read: Callable[[str], str | None] = read_sysctl) -> float:
    """The effective window one connection of this host reaches: min(tcp_rmem, tcp_wmem max) × 0.5."""
    maxima = []
    for name in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        v = read(name)
        if v:
            maxima.append(int(v.split()[-1]))
    return WINDOW_FRACTION * (min(maxima) if maxima else 4 * 2**20)


def tcp_advice(links: list[WanLink], connections: int,
               read: Callable[[str], str | None] = read_sysctl) -> list[str]:
    """Warnings, each naming the sysctl to change, where this host would keep ``connections`` TCP
    flows from filling the fastest WAN link (each flow needs a buffer of BDP/connections/0.5)."""
    if not links:
        return []
    worst = max(links, key=lambda w: w.bdp)
    need = int(worst.bdp / connections / WINDOW_FRACTION)
    where = (f"{worst.a}<->{worst.b}: {worst.bandwidth * 8 / 1e9:g} Gb/s x {worst.rtt * 1e3:g} ms RTT "
             f"over {connections} connection(s)")
    out = []
    for name in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        v = read(name)
        if v and int(v.split()[-1]) < need:
            lo, mid, _ = v.split()
            out.append(f"{name} max is {v.split()[-1]} bytes but {where} need {need} bytes per "
                       f"connection: sysctl -w {name}='{lo} {mid} {need}'")
    for name in ("net.core.rmem_max", "net.core.wmem_max"):
        v = read(name)
        if v and int(v) < need:
            out.append(f"{name} is {v} bytes, below the {need} bytes per connection {where} need "
                       f"(it caps SO_RCVBUF/SO_SNDBUF): sysctl -w {name}={need}")
    cc = read("net.ipv4.tcp_congestion_control")
    if cc and cc != "bbr":
        out.append(f"net.ipv4.tcp_congestion_control is {cc}; BBR tolerates the loss of long fat paths: "
                   "sysctl -w net.ipv4.tcp_congestion_control=bbr (with net.core.default_qdisc=fq)")
    if read("net.ipv4.tcp_slow_start_after_idle") == "1":
        out.append("net.ipv4.tcp_slow_start_after_idle is 1: pipeline transfers pause between "
                   "micro-batches and each would restart in slow start: "
                   "sysctl -w net.ipv4.tcp_slow_start_after_idle=0")
    return out


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    if key not in env:
        return None
    try:
        return int(env[key])
    except ValueError:
        raise ValueError(f"{key}={env[key]!r}: must be an integer") from None


def established_connections(remote: set[str] | None = None, net_dir: str = "/proc/self/net",
                            fd_dir: str | None = "/proc/self/fd") -> int:
    """ESTABLISHED IPv4 TCP connections in a network namespace's view (``/proc/<pid>/net/tcp``):
    only those whose socket the process of ``fd_dir`` holds (None: all), and only to the ``remote``
    addresses when given. How tests and benchmarks check that a WAN pair has k connections."""
    inodes = None
    if fd_dir is not None:
        inodes = set()
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    count = 0
    for line in Path(net_dir, "tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "01" or (inodes is not None and fields[9] not in inodes):   # 01: ESTABLISHED
            continue
        peer = socket.inet_ntoa(struct.pack("<I", int(fields[2].split(":")[0], 16)))
        if remote is None or peer in remote:
            count += 1
    return count
