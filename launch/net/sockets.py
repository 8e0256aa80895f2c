"""Multi-TCP settings (mechanism A, atlas.md §1.3, §2): NCCL's socket knobs, gloo's device lists, and
the Linux TCP sysctls a long fat WAN path needs.

One TCP flow carries at most window/RTT; filling B bytes/s over a round trip RTT needs B·RTT bytes
in flight, so k flows each need a window of B·RTT/k. This module chooses the settings and checks the
host; :mod:`launch.net.striping` opens the gloo connections and splits transfers across them.

NCCL (``src/transport/net_socket.cc``): ``NCCL_SOCKET_NTHREADS`` ≤ 16 helper threads, each driving
``NCCL_NSOCKS_PERTHREAD`` sockets, at most 64 sockets per connection (a static array); NCCL splits
every message across them. The settings are process-wide but only the socket transport reads them,
so with Megatron's per-group NCCL config (``net_name: socket``) on every group that crosses the WAN
(:func:`megatron_nccl_config`) and ATLAS's own WAN pair groups created with the same option
(:func:`launch.net.striping.nccl_wan_options`), they apply to the WAN groups while the others keep IB.
``NCCL_BUFFSIZE`` is process-wide too (NCCL's per-communicator config has no buffer size): raising it
for the WAN raises every communicator's staging buffers, which :func:`nccl_buffer_memory` charges
to the planner's memory estimate.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Callable, Mapping
from pathlib import Path

from launch.plan.topology import WanLink

NCCL_MAX_SOCKETS = 64
NCCL_MAX_THREADS = 16
NCCL_DEFAULT_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS = 2            # NCCL_NCHANNELS_PER_NET_PEER's default
MEGATRON_WAN_GROUPS = ("pp", "mp", "embd", "pos_embd", "tp_ep_pp")   # megatron-core 0.16.1 names
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
        out["NCCL_BUFFSIZE"] = str(nccl_buffsize(links))
    for key in list(out):
        if key in env:
            out[key] = env[key]
    check_nccl_env(out)
    return out


def nccl_buffsize(links: list[WanLink], env: Mapping[str, str] | None = None) -> int:
    """``NCCL_BUFFSIZE`` for WAN links: NCCL keeps at most BUFFSIZE in flight per channel (its credit
    protocol), so one channel carries <= BUFFSIZE/RTT: raised towards the path's BDP (inferred, atlas.md
    §2.2), between NCCL's default 4 MiB and 64 MiB; a user-set value wins."""
    env = os.environ if env is None else env
    if "NCCL_BUFFSIZE" in env:
        return _int_env(env, "NCCL_BUFFSIZE")
    if not links:
        return NCCL_DEFAULT_BUFFSIZE
    bdp = max(w.bdp for w in links)
    return min(64 * 2**20, max(NCCL_DEFAULT_BUFFSIZE, 2 ** math.ceil(math.log2(bdp))))


def nccl_communicators(pp: int, tp: int, dp: int, stage: int, wan_neighbours: int) -> int:
    """NCCL communicators a GPU of ``stage`` uses in a Megatron/DeepSpeed step on an ATLAS layout: the
    world, tp, dp, pp and Megatron's model-parallel (tp x pp) group where they have more than one rank,
    the embedding group on the first and last stage, and per WAN neighbour ATLAS's pair group and (with
    several replicas) that direction's token ring."""
    count = 1 + (tp > 1) + (dp > 1) + (pp > 1) + (tp * pp > 1) + (pp > 1 and stage in (0, pp - 1))
    return count + wan_neighbours * (1 + (dp > 1))


def nccl_buffer_memory(buffsize: int, communicators: int, channels: int = NCCL_CHANNELS) -> float:
    """GPU memory of NCCL's staging buffers on one GPU: every communicator holds, per channel, a buffer
    of NCCL_BUFFSIZE for each direction to each of its two ring neighbours (or p2p peers): 4 x channels
    x BUFFSIZE. ``channels``: NCCL's per-peer default for network transfers; intra-node collectives may
    open more (up to 32), so this is a lower bound for them."""
    return 4.0 * channels * buffsize * communicators


def megatron_nccl_config(wan: bool) -> str:
    """YAML for Megatron's ``--nccl-communicator-config-path``: every group Megatron creates that
    crosses the WAN with pipe outermost (pp; mp = tp x pp; the embedding groups of the first and last
    stage; tp_ep_pp) uses NCCL's socket transport (where the NSOCKS/NTHREADS knobs act); the groups
    inside a stage (tp, dp, cp, ep, ...) keep IB. The world group crosses the WAN too but is created by
    ``init_process_group``, not by Megatron: pass ``pg_options=launch.net.striping.nccl_wan_options()``."""
    if not wan:
        return ""
    return "".join(f"{g}:\n  net_name: socket\n" for g in MEGATRON_WAN_GROUPS)


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
    inodes = None if fd_dir is None else socket_inodes(fd_dir)
    count = 0
    for line in Path(net_dir, "tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] != "01" or (inodes is not None and int(fields[9]) not in inodes):   # 01: ESTABLISHED
            continue
        peer = socket.inet_ntoa(struct.pack("<I", int(fields[2].split(":")[0], 16)))
        if remote is None or peer in remote:
            count += 1
    return count


def socket_inodes(fd_dir: str = "/proc/self/fd") -> set[int]:
    """Inodes of the sockets this process holds."""
    return set(_socket_fds(fd_dir))


def _socket_fds(fd_dir: str = "/proc/self/fd") -> dict[int, int]:
    out = {}
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def group_sockets(before: set[int], net_dir: str = "/proc/self/net") -> tuple[list[int], list[tuple]]:
    """The TCP sockets this process opened since ``before`` (:func:`socket_inodes`): the listening
    ports in the order they were opened (gloo opens one per device, one device after the other), and
    the ESTABLISHED connections as ``(local, remote, local port, remote port)``."""
    fds = {ino: fd for ino, fd in _socket_fds().items() if ino not in before}
    listeners, connections = [], []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            lines = Path(net_dir, table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            inode = int(fields[9])
            if inode not in fds:
                continue
            local, remote = _endpoint(fields[1], family), _endpoint(fields[2], family)
            port = int(fields[1].split(":")[1], 16)
            if fields[3] == "0A":                                  # LISTEN
                listeners.append((fds[inode], port))
            elif fields[3] == "01":                                # ESTABLISHED
                connections.append((local, remote, port, int(fields[2].split(":")[1], 16)))
    return [port for _, port in sorted(listeners)], connections


def device_connections(mine: list[int], peers: list[int], connections: list[tuple]) -> list[str]:
    """Each gloo device's connection of a two-rank group, ``"local:port->remote:port"``, in device order:
    a connection this rank accepted arrived on its listener of that device, one it opened goes to the
    peer's listener of that device (``mine``/``peers``: the listening ports in device order)."""
    found = {}
    for local, remote, local_port, remote_port in connections:
        device = (mine.index(local_port) if local_port in mine else
                  peers.index(remote_port) if remote_port in peers else None)
        if device is not None:
            found[device] = f"{local}->{remote}"
    return [found.get(i, "?") for i in range(len(mine))]


def _endpoint(hex_addr: str, family: int) -> str:
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    if family == socket.AF_INET:
        host = socket.inet_ntop(family, raw[::-1])
    else:   # /proc prints IPv6 as four host-order 32-bit words
        host = "[" + socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))) + "]"
    return f"{host}:{int(port, 16)}"
