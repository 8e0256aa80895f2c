"""Hosts as Linux network namespaces, for one-machine cluster tests and the WAN benchmark.

Every namespace, device and process made here is owned by a :class:`Lab` and removed by
``Lab.close()`` (a context manager), processes first (by their own pid, process group included),
then the namespaces, which take their devices with them. Names carry this process's pid, so labs of
concurrent test runs never collide. Nothing here routes outside the lab: namespaces get no default
route and only the addresses the caller gives them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from itertools import count

_serial = count()


def available() -> tuple[bool, str]:
    """Whether this machine lets us create network namespaces (root + ``ip netns``), and why not."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (euid is not 0)"
    name = f"cwprobe{os.getpid()}"
    res = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if res.returncode != 0:
        return False, f"'ip netns add' failed: {res.stderr.strip() or res.returncode}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return True, ""


def sh(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(list(cmd), capture_output=True, text=True, **kw)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


@dataclass
class Netns:
    name: str

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh("ip", "-n", self.name, *args, check=check)

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return sh("ip", "netns", "exec", self.name, *cmd, check=check, **kw)

    def sysctl(self, key: str, value: str) -> None:
        self.run("sysctl", "-q", "-w", f"{key}={value}")

    def read(self, path: str) -> str:
        return self.run("cat", path).stdout


@dataclass
class Lab:
    """A set of namespaces and the processes started in them."""

    prefix: str = field(default_factory=lambda: f"cw{os.getpid() % 100000}x{next(_serial)}")
    namespaces: list[Netns] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)

    def netns(self, label: str) -> Netns:
        ns = Netns(f"{self.prefix}{label}")
        sh("ip", "netns", "add", ns.name)
        self.namespaces.append(ns)
        ns.ip("link", "set", "lo", "up")
        return ns

    def veth(self, a: Netns, addr_a: str, b: Netns, addr_b: str, prefix_len: int = 24,
             mtu: int = 1500) -> tuple[str, str]:
        """A veth pair between two namespaces; returns its two interface names (in a, in b)."""
        base = f"cv{os.getpid() % 100000}n{next(_serial)}"
        name_a, name_b = base + "a", base + "b"
        sh("ip", "link", "add", name_a, "netns", a.name, "type", "veth", "peer", "name", name_b,
           "netns", b.name)
        for ns, name, addr in ((a, name_a, addr_a), (b, name_b, addr_b)):
            ns.ip("addr", "add", f"{addr}/{prefix_len}", "dev", name)
            ns.ip("link", "set", name, "mtu", str(mtu), "up")
        return name_a, name_b

    def popen(self, ns: Netns, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a process inside a namespace, in its own process group (so a close kills its tree)."""
        p = subprocess.Popen(["ip", "netns", "exec", ns.name, *cmd], start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def spawn(self, cmd: list[str], **kw) -> subprocess.Popen:
        """Start a helper process in this (the root) namespace, owned by the lab."""
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        self.procs.clear()
        for ns in self.namespaces:
            sh("ip", "netns", "delete", ns.name, check=False)
        self.namespaces.clear()

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)       # the group we created with start_new_session: p and its children
