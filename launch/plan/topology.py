"""The ATLAS topology file: data centers, their hosts and GPU slots, and the WAN between them.

A JSON file (no new dependency), parsed once into frozen dataclasses and validated before anything
is launched; every mistake is a ``ValueError`` that names the file, the entry, the value and the rule::

    {
      "datacenters": {
        "east": {"hosts": [{"name": "e0", "slots": 8, "addr": "10.1.0.1"},
                           {"name": "e1", "slots": 8, "addr": "10.1.0.2"}],
                 "ifname": "eth0", "gpu_tflops": 300, "gpu_memory_gb": 80,
                 "node_bandwidth_gbps": 2400, "intra_bandwidth_gbps": 400, "intra_latency_us": 10},
        "west": {"hosts": [{"name": "w0", "slots": 8}]}
      },
      "wan": [{"between": ["east", "west"], "rtt_ms": 40, "bandwidth_gbps": 10}],
      "model": {"layers": 24, "hidden": 2048, "seq": 2048, "micro_batch": 1, "global_batch": 64}
    }

Rules: every pair of data centers has exactly one WAN entry (the pipeline may cross any pair the
planner picks); a host name appears once in the whole file (DNS names ignore case); slots are
positive integers; rates and latencies are positive. Names are checked against what the launchers
that receive them accept, so that nothing in the file can become a shell word, an option, a comment,
a second host or a second variable on a node (:func:`check_host_name` and its siblings): host names
are RFC 1123 host names, ``addr`` a host name or an IP literal, ``ifname`` a Linux interface name, a
data center name a plain identifier. The optional top-level ``timeout_s`` bounds every wait of the
job's collectives (``COMMWEAVE_TIMEOUT_S``; ``deepspeed-atlas --atlas-timeout`` overrides it).

``model`` is optional here (``deepspeed-atlas --atlas-model FILE`` may supply it instead); its
fields are documented on :class:`launch.plan.estimate.ModelSpec`. ``addr`` (the host's
address on the network the ranks use) lets the launcher pick ``--master_addr`` without ssh;
``ifname`` is the interface gloo and NCCL bind to in that data center. A WAN entry's optional
``window_mb`` is the effective TCP window of one connection on that path (the planner's per-connection
rate limit, window/RTT); without it the planner assumes Linux's default buffers
(``launch.plan.socket_limits.DEFAULT_WINDOW``), never the sysctls of the machine it runs on. ``gpu_tflops`` is
what one GPU of that DC sustains on the model: the planner splits layers in proportion to it.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

_DC_KEYS = {"hosts", "ifname", "gpu_tflops", "gpu_memory_gb", "node_bandwidth_gbps",
            "intra_bandwidth_gbps", "intra_latency_us"}
_HOST_KEYS = {"name", "slots", "addr"}
_WAN_KEYS = {"between", "rtt_ms", "bandwidth_gbps", "window_mb"}
_TOP_KEYS = {"datacenters", "wan", "model", "timeout_s"}

# RFC 1123 §2.1 host name: dot-separated labels of 1-63 ASCII letters, digits and hyphens, no label
# starting or ending with a hyphen, 253 characters at most. Nothing else is allowed: no shell
# metacharacter, no leading "-" (an ssh option), no "#" (a hostfile comment), no "," (a second host
# for pdsh -w), no ":" or "@" (DeepSpeed's --include syntax), no space, quote or non-ASCII letter.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*", re.ASCII)
HOST_NAME_RULE = ("an RFC 1123 host name: dot-separated labels of 1-63 letters, digits and '-', "
                  "not starting or ending with '-', at most 253 characters")
# Linux interface names (net/core/dev.c dev_valid_name): 1-15 bytes; the kernel also allows other
# bytes, but no interface a topology names needs them, and every one of them is a hazard on a node.
_IFNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}", re.ASCII)
IFNAME_RULE = ("a Linux interface name: 1-15 characters from A-Z a-z 0-9 _ . -, not starting "
               "with '.' or '-'")
_DC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}", re.ASCII)
DC_NAME_RULE = "a name of 1-63 characters from A-Z a-z 0-9 _ . -, not starting with '.' or '-'"


def is_host_name(value) -> bool:
    return isinstance(value, str) and len(value) <= 253 and _HOST_NAME.fullmatch(value) is not None


def is_ip_literal(value) -> bool:
    """An IPv4 or IPv6 literal. An IPv6 zone id (after ``%``, RFC 6874) must be a Linux interface
    name (:data:`IFNAME_RULE`) or a scope number: ``ipaddress`` accepts any text there, shell
    metacharacters and spaces included, and the address reaches a remote shell line on pdsh."""
    if not isinstance(value, str) or not value.isascii():
        return False
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return False
    zone = getattr(address, "scope_id", None)
    return zone is None or _IFNAME.fullmatch(zone) is not None


def check_host_name(value, where: str) -> str:
    """``value`` if it is an RFC 1123 host name, else a ValueError naming ``where``, it and the rule."""
    if not is_host_name(value):
        raise ValueError(f"{where}: {value!r} is not {HOST_NAME_RULE}")
    return value


def check_addr(value, where: str) -> str:
    """A host name or an IP literal (IPv4 or IPv6): what ``--master_addr`` and MASTER_ADDR accept."""
    if not (is_host_name(value) or is_ip_literal(value)):
        raise ValueError(f"{where}: {value!r} is neither {HOST_NAME_RULE} nor an IPv4/IPv6 address "
                         f"(an IPv6 zone id after '%' is {IFNAME_RULE})")
    return value


def check_ifname(value, where: str) -> str:
    if not isinstance(value, str) or _IFNAME.fullmatch(value) is None:
        raise ValueError(f"{where}: {value!r} is not {IFNAME_RULE}")
    return value


def check_seconds(value, where: str) -> float:
    """A finite number of seconds > 0 (JSON number or decimal string)."""
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{where}: {value!r} is not a finite number of seconds > 0")
    return seconds


@dataclass(frozen=True, slots=True)
class Host:
    name: str
    slots: int
    dc: str
    addr: str | None = None


@dataclass(frozen=True, slots=True)
class DataCenter:
    """One data center. Bandwidths are per direction, in bytes/s once parsed."""

    name: str
    hosts: tuple[Host, ...]
    ifname: str | None = None
    gpu_flops: float = 100e12          # sustained FLOP/s of one GPU on this model (not the peak)
    gpu_memory: float = 80 * 2**30     # bytes
    node_bandwidth: float = 300e9      # between GPUs of one host (NVLink), bytes/s
    intra_bandwidth: float = 25e9      # between hosts of this DC (IB/RoCE), bytes/s per GPU
    intra_latency: float = 10e-6       # seconds

    @property
    def gpus(self) -> int:
        return sum(h.slots for h in self.hosts)


@dataclass(frozen=True, slots=True)
class WanLink:
    """A WAN link between two data centers, the same in both directions (each direction separate)."""

    a: str
    b: str
    rtt: float          # seconds
    bandwidth: float    # bytes/s per direction
    window: float | None = None   # effective TCP window of one connection, bytes (None: this host's)

    @property
    def latency(self) -> float:
        """One-way latency (half the round trip)."""
        return self.rtt / 2

    @property
    def bdp(self) -> float:
        """Bandwidth-delay product in bytes: what must be in flight to fill the link."""
        return self.bandwidth * self.rtt


@dataclass(frozen=True, slots=True)
class Topology:
    datacenters: tuple[DataCenter, ...]
    wan: tuple[WanLink, ...]
    model: dict | None = None
    source: str = "<topology>"
    timeout_s: float | None = None   # bound on every collective wait (COMMWEAVE_TIMEOUT_S)

    def dc(self, name: str) -> DataCenter:
        for d in self.datacenters:
            if d.name == name:
                return d
        raise ValueError(f"{self.source}: unknown data center {name!r}; known: {self.dc_names}")

    @property
    def dc_names(self) -> list[str]:
        return [d.name for d in self.datacenters]

    @property
    def hosts(self) -> list[Host]:
        return [h for d in self.datacenters for h in d.hosts]

    def host(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise ValueError(f"{self.source}: unknown host {name!r}; known: {[h.name for h in self.hosts]}")

    def link(self, a: str, b: str) -> WanLink:
        for w in self.wan:
            if {w.a, w.b} == {a, b}:
                return w
        raise ValueError(f"{self.source}: no WAN entry between {a!r} and {b!r}")


def load(path: str | Path) -> Topology:
    """Read and validate a topology file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--atlas-topology {str(path)!r}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--atlas-topology {str(path)!r}: not valid JSON ({e})") from None
    return parse(raw, source=str(path))


def parse(raw: dict, source: str = "<topology>") -> Topology:
    """Validate a decoded topology (see the module docstring for the format and the rules)."""

    def fail(where: str, msg: str):
        raise ValueError(f"{source}: {where}: {msg}")

    if not isinstance(raw, dict):
        fail("top level", f"must be a JSON object, got {type(raw).__name__}")
    _no_unknown(raw, _TOP_KEYS, "top level", fail)
    dcs_raw = raw.get("datacenters")
    if not isinstance(dcs_raw, dict) or not dcs_raw:
        fail("datacenters", "must be a non-empty object {name: {hosts: [...]}}")

    seen_hosts: dict[str, str] = {}
    dcs = []
    for name, d in dcs_raw.items():
        where = f"datacenters.{name}"
        if not isinstance(name, str) or _DC_NAME.fullmatch(name) is None:
            fail("datacenters", f"data center name {name!r} is not {DC_NAME_RULE}")
        if not isinstance(d, dict):
            fail(where, f"must be an object, got {d!r}")
        _no_unknown(d, _DC_KEYS, where, fail)
        hosts_raw = d.get("hosts")
        if not isinstance(hosts_raw, list) or not hosts_raw:
            fail(f"{where}.hosts", "must be a non-empty list of {name, slots[, addr]}")
        hosts = []
        for i, h in enumerate(hosts_raw):
            hw = f"{where}.hosts[{i}]"
            if not isinstance(h, dict):
                fail(hw, f"must be an object {{name, slots[, addr]}}, got {h!r}")
            _no_unknown(h, _HOST_KEYS, hw, fail)
            hname, slots = h.get("name"), h.get("slots")
            if "name" not in h:
                fail(f"{hw}.name", "is required (the host name the launcher reaches it by)")
            if not is_host_name(hname):
                fail(f"{hw}.name", f"{hname!r} is not {HOST_NAME_RULE}")
            if hname.lower() in seen_hosts:
                fail(f"{hw}.name", f"host {hname!r} is already listed in data center "
                                   f"{seen_hosts[hname.lower()]!r} (host names ignore case)")
            if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
                fail(f"{hw}.slots", f"must be a positive integer, got {slots!r}")
            addr = h.get("addr")
            if addr is not None and not (is_host_name(addr) or is_ip_literal(addr)):
                fail(f"{hw}.addr", f"{addr!r} is neither {HOST_NAME_RULE} nor an IPv4/IPv6 address")
            seen_hosts[hname.lower()] = name
            hosts.append(Host(hname, slots, name, addr))
        ifname = d.get("ifname")
        if ifname is not None and (not isinstance(ifname, str) or _IFNAME.fullmatch(ifname) is None):
            fail(f"{where}.ifname", f"{ifname!r} is not one interface name, {IFNAME_RULE}")
        dcs.append(DataCenter(
            name, tuple(hosts), ifname,
            gpu_flops=_positive(d, "gpu_tflops", 100.0, where, fail) * 1e12,
            gpu_memory=_positive(d, "gpu_memory_gb", 80.0, where, fail) * 2**30,
            node_bandwidth=_positive(d, "node_bandwidth_gbps", 2400.0, where, fail) * 1e9 / 8,
            intra_bandwidth=_positive(d, "intra_bandwidth_gbps", 200.0, where, fail) * 1e9 / 8,
            intra_latency=_positive(d, "intra_latency_us", 10.0, where, fail) * 1e-6))

    names = [d.name for d in dcs]
    wan_raw = raw.get("wan", [])
    if not isinstance(wan_raw, list):
        fail("wan", f"must be a list of {{between: [a, b], rtt_ms, bandwidth_gbps}}, got {wan_raw!r}")
    links: dict[frozenset, WanLink] = {}
    for i, w in enumerate(wan_raw):
        where = f"wan[{i}]"
        if not isinstance(w, dict):
            fail(where, f"must be an object, got {w!r}")
        _no_unknown(w, _WAN_KEYS, where, fail)
        pair = w.get("between")
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(p, str) for p in pair)
                or pair[0] == pair[1]):
            fail(f"{where}.between", f"must name two different data centers, got {pair!r}")
        for dc in pair:
            if dc not in names:
                fail(f"{where}.between", f"unknown data center {dc!r}; known: {names}")
        key = frozenset(pair)
        if key in links:
            fail(where, f"a second WAN entry between {pair[0]!r} and {pair[1]!r}")
        links[key] = WanLink(pair[0], pair[1],
                             rtt=_positive(w, "rtt_ms", None, where, fail) * 1e-3,
                             bandwidth=_positive(w, "bandwidth_gbps", None, where, fail) * 1e9 / 8,
                             window=(_positive(w, "window_mb", None, where, fail) * 2**20
                                     if "window_mb" in w else None))
    for a, b in combinations(names, 2):
        if frozenset((a, b)) not in links:
            fail("wan", f"no WAN entry between {a!r} and {b!r}: every pair of data centers needs one "
                        "(rtt_ms, bandwidth_gbps)")
    model = raw.get("model")
    if model is not None and not isinstance(model, dict):
        fail("model", f"must be an object, got {model!r}")
    timeout = raw.get("timeout_s")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout <= 0):
        fail("timeout_s", f"{timeout!r} is not a finite number of seconds > 0")
    return Topology(tuple(dcs), tuple(links.values()), model, source,
                    None if timeout is None else float(timeout))


def _no_unknown(d: dict, allowed: set, where: str, fail) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        fail(where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")


def _positive(d: dict, key: str, default, where: str, fail) -> float:
    v = d.get(key, default)
    if v is None:
        fail(f"{where}.{key}", "is required (a positive number)")
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
        fail(f"{where}.{key}", f"must be a positive number, got {v!r}")
    return float(v)
