"""What the planner knows about TCP sockets (atlas.md §1.3, §2): NCCL's socket limits, the window one
WAN connection reaches, the GPU memory of NCCL's buffers, and the host's TCP sysctls checked against
them. Nothing here sets a socket: :mod:`launch.net.sockets` turns these into NCCL/gloo settings.

One TCP flow carries at most window/RTT; filling B bytes/s over a round trip RTT needs B·RTT bytes
in flight, so k flows each need a window of B·RTT/k.

NCCL (``src/transport/net_socket.cc``): ``NCCL_SOCKET_NTHREADS`` ≤ 16 helper threads, each driving
``NCCL_NSOCKS_PERTHREAD`` sockets, at most 64 sockets per connection (a static array); NCCL splits
every message across them. ``NCCL_BUFFSIZE`` is process-wide (NCCL's per-communicator config has no
buffer size): raising it for the WAN raises every communicator's staging buffers, which
:func:`nccl_buffer_memory` charges to the planner's memory estimate.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from launch.plan.topology import WanLink

NCCL_MAX_SOCKETS = 64
NCCL_MAX_THREADS = 16
NCCL_DEFAULT_BUFFSIZE = 4 * 2**20
NCCL_CHANNELS = 2            # NCCL_NCHANNELS_PER_NET_PEER's default
MAX_SOCKS_PER_THREAD = 8     # AWS's default split is 2 threads x 8 sockets; more per thread starves it
# ATLAS's gloo striping (launch.net.striping) sends a transfer below this whole, over one connection of
# its WAN group: striping would only add latency. The calibrated simulator models the same rule.
STRIPE_MIN_BYTES = 1 << 20

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


# -- Linux TCP advice (checked at start-up; the launcher warns but never changes the host) -----------

def read_sysctl(name: str, root: str = "/proc/sys") -> str | None:
    path = Path(root, *name.split("."))
    try:
        return path.read_text().strip()
    except OSError:
        return None


def host_window(read: Callable[[str], str | None] = read_sysctl, fraction: float = WINDOW_FRACTION) -> float:
    """The effective window one connection of this host reaches: min(tcp_rmem, tcp_wmem max) × fraction
    (``read`` may read another namespace's /proc/sys; ``fraction`` 1: the buffer limit itself)."""
    maxima = []
    for name in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
        v = read(name)
        if v:
            maxima.append(int(v.split()[-1]))
    return fraction * (min(maxima) if maxima else 4 * 2**20)


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
