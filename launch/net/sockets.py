"""Multi-TCP settings (mechanism A, atlas.md §1.3, §2): NCCL's socket knobs, gloo's device lists, and
the TCP sockets a process holds.

This module sets what :mod:`launch.plan.socket_limits` knows (NCCL's limits, the buffer size, the
host's sysctls); :mod:`launch.net.striping` opens the gloo connections and splits transfers across them.

NCCL's socket settings are process-wide but only the socket transport reads them, so with Megatron's
per-group NCCL config (``net_name: socket``) on every group that crosses the WAN
(:func:`megatron_nccl_config`) and ATLAS's own WAN pair groups created with the same option
(:func:`launch.net.striping.nccl_wan_options`), they apply to the WAN groups while the others keep IB.
``NCCL_BUFFSIZE`` is process-wide too: its GPU memory is charged to the planner's memory estimate
(:func:`launch.plan.socket_limits.nccl_buffer_memory`).
"""

from __future__ import annotations

import os
import re
import socket
import struct
import subprocess
from collections.abc import Mapping
from pathlib import Path

from launch.plan.socket_limits import check_nccl_env, nccl_buffsize, nccl_split
from launch.plan.topology import WanLink

MEGATRON_WAN_GROUPS = ("pp", "mp", "embd", "pos_embd", "tp_ep_pp")   # megatron-core 0.16.1 names


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


def tcp_info(remote: set[str] | None = None, text: str | None = None) -> list[dict]:
    """The kernel's view of each TCP connection to the ``remote`` addresses (all: None) in this
    network namespace, from ``ss -tinmH`` (or its ``text``): the numeric tcp_info fields (``snd_wnd``:
    the window the peer advertises, ``rcv_space``, ``cwnd``, ``minrtt`` ms, ``bytes_acked``, ...), the
    socket buffers (``rb``/``tb``: SO_RCVBUF/SO_SNDBUF as autotuned), the congestion control, the
    peer. What tells whether a run's window is the one a model assumes."""
    if text is None:
        text = subprocess.run(["ss", "-tinmH"], capture_output=True, text=True, check=False).stdout
    lines, out = text.splitlines(), []
    for head, info in zip(lines[::2], lines[1::2], strict=False):
        peer = head.split()[4].rsplit(":", 1)[0] if len(head.split()) > 4 else ""
        if remote is not None and peer not in remote:
            continue
        fields: dict = {k: float(v) for k, v in re.findall(r"\b(\w+):([\d.]+)(?![\d./])", info)}
        fields.update({k: int(v) for k, v in re.findall(r"\b(rb|tb)(\d+)", info)})
        cc = re.search(r"\)\s+(\w+)\s+wscale", info)
        out.append({**fields, "peer": peer, "local": head.split()[3], "cc": cc.group(1) if cc else "?"})
    return out


def one_way_s(connections: list[dict]) -> float:
    """A path's one-way latency in seconds: half the median ``minrtt`` (ms) of :func:`tcp_info`'s
    connections over it (the kernel's smallest RTT sample of each: the path without queueing)."""
    rtts = sorted(c["minrtt"] for c in connections if c.get("minrtt"))
    if not rtts:
        raise ValueError("one_way_s: no connection reports a minrtt (ss -ti); is anything connected?")
    mid = len(rtts) // 2
    return (rtts[mid] if len(rtts) % 2 else (rtts[mid - 1] + rtts[mid]) / 2) / 2e3


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
