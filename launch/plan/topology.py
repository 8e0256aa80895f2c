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
planner picks); a host name appears once in the whole file (DNS names ignore case). Every value goes
through its rule in :mod:`commweave.values`, so that nothing in the file can become a shell word, an
option, a comment, a second host or a second variable on a node, and no number can overflow or stall
the planner: host names are RFC 1123 host names, ``addr`` a host name or an IP literal (an IPv6 zone
id an interface name), ``ifname`` a Linux interface name, a data center name a plain identifier;
numbers are finite and inside the ranges of :data:`RANGES` (units in the key names), slots
an integer in 1..1024, at most :data:`MAX_HOSTS` hosts and :data:`MAX_DATACENTERS` data centers. The
file itself is strict JSON (:func:`commweave.values.load_json`: a duplicated key is refused, not
silently dropped; nesting, size and numbers bounded; a directory, FIFO or device refused before any
read). The optional top-level ``timeout_s`` bounds every wait of the job's collectives
(``COMMWEAVE_TIMEOUT_S``, 1 s .. 1 week; ``deepspeed-atlas --atlas-timeout`` overrides it).

``model`` is optional here (``deepspeed-atlas --atlas-model FILE`` may supply it instead); its
fields are documented on :class:`launch.plan.estimate.ModelSpec` and bounded by :data:`MODEL_RANGES`
(:func:`check_model`: what the planner can search in seconds). ``addr`` (the host's
address on the network the ranks use) lets the launcher pick ``--master_addr`` without ssh;
``ifname`` is the interface gloo and NCCL bind to in that data center. A WAN entry's optional
``window_mb`` is the effective TCP window of one connection on that path (the planner's per-connection
rate limit, window/RTT); without it the planner assumes Linux's default buffers
(``launch.plan.socket_limits.DEFAULT_WINDOW``), never the sysctls of the machine it runs on. ``gpu_tflops`` is
what one GPU of that DC sustains on the model: the planner splits layers in proportion to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from commweave import values

_DC_KEYS = {"hosts", "ifname", "gpu_tflops", "gpu_memory_gb", "node_bandwidth_gbps",
            "intra_bandwidth_gbps", "intra_latency_us"}
_HOST_KEYS = {"name", "slots", "addr"}
_WAN_KEYS = {"between", "rtt_ms", "bandwidth_gbps", "window_mb"}
_TOP_KEYS = {"datacenters", "wan", "model", "timeout_s"}

_DC_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,62}", re.ASCII)
DC_NAME_RULE = "a name of 1-63 characters from A-Z a-z 0-9 _ . -, not starting with '.' or '-'"

# key -> (low, high, unit, default). Wide enough for any real cluster, narrow enough that every product the
# planner forms stays finite (5e-324 ms made log() fail, 1e308 Gb/s overflowed a conversion to int).
RANGES = {
    "gpu_tflops": (1e-3, 1e5, "TFLOP/s", 100.0),
    "gpu_memory_gb": (1e-3, 1e5, "GiB", 80.0),
    "node_bandwidth_gbps": (1e-3, 1e6, "Gbit/s", 2400.0),
    "intra_bandwidth_gbps": (1e-3, 1e6, "Gbit/s", 200.0),
    "intra_latency_us": (1e-3, 1e7, "us", 10.0),
    "rtt_ms": (1e-3, 1e5, "ms", None),
    "bandwidth_gbps": (1e-3, 1e6, "Gbit/s", None),
    "window_mb": (1e-3, 4096.0, "MiB", None),
}
MAX_SLOTS = 1024          # GPUs per host
MAX_HOSTS = 4096          # hosts in the file
MAX_DATACENTERS = 64
# The model section: every size the planner loops over or multiplies is bounded (a topology with 10**7
# layers or 10**12 sequences ran for hours). The search costs grow with pp (<= layers), the divisors of
# the sequences per iteration and, per simulation, with the micro-batches: 4096 sequences plan in about
# 7 s on two_dc; beyond that, raise micro_batch.
MODEL_RANGES = {"layers": 4096, "hidden": 2**20, "seq": 2**24, "micro_batch": 2**16, "global_batch": 2**31,
                "dtype_bytes": 16, "pp": 4096, "tp": MAX_SLOTS, "dp": 2**20}
MAX_SEQUENCES = 4096      # global_batch / micro_batch


def check_model(raw: dict, source: str) -> dict:
    """The model section's sizes within :data:`MODEL_RANGES` (the rest: launch.plan.estimate.ModelSpec)."""
    for key, hi in MODEL_RANGES.items():
        if raw.get(key) is not None:
            values.integer(raw[key], f"{source}.{key}", lo=1, hi=hi)
    if "global_batch" in raw:
        seqs = raw["global_batch"] // raw.get("micro_batch", 1)
        if seqs > MAX_SEQUENCES:
            values.refuse(f"{source}.global_batch", raw["global_batch"],
                          f"global_batch / micro_batch = {seqs} sequences per iteration, more than the "
                          f"planner searches in seconds ({MAX_SEQUENCES}); raise micro_batch")
    return raw


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


def load(path: str | Path, name: str = "--atlas-topology") -> Topology:
    """Read (strict JSON, commweave.values.load_json) and validate a topology file."""
    return parse(values.load_json(path, name, top=dict), source=str(path))


def parse(raw: dict, source: str = "<topology>") -> Topology:
    """Validate a decoded topology (see the module docstring for the format and the rules)."""

    def fail(where: str, msg: str):
        raise ValueError(f"{source}: {where}: {msg}")

    def value(check, v, where: str, *args, **kwargs):
        """A commweave.values rule, its refusal prefixed with the file: "FILE: KEY=VALUE: RULE"."""
        try:
            return check(v, where, *args, **kwargs)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def number(d: dict, key: str, where: str) -> float | None:
        lo, hi, unit, default = RANGES[key]
        v = d.get(key, default)
        if v is None:
            fail(f"{where}.{key}", f"is required (a number in [{lo:g}, {hi:g}] {unit})")
        return value(values.number, v, f"{where}.{key}", lo=lo, hi=hi, unit=unit)

    if not isinstance(raw, dict):
        fail("top level", f"must be a JSON object, got {type(raw).__name__}")
    _no_unknown(raw, _TOP_KEYS, "top level", fail)
    dcs_raw = raw.get("datacenters")
    if not isinstance(dcs_raw, dict) or not dcs_raw:
        fail("datacenters", "must be a non-empty object {name: {hosts: [...]}}")
    if len(dcs_raw) > MAX_DATACENTERS:
        fail("datacenters", f"{len(dcs_raw)} data centers, more than {MAX_DATACENTERS}")
    n_hosts = sum(len(d["hosts"]) for d in dcs_raw.values() if isinstance(d, dict)
                  and isinstance(d.get("hosts"), list))
    if n_hosts > MAX_HOSTS:
        fail("datacenters", f"{n_hosts} hosts, more than the planner takes ({MAX_HOSTS})")

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
            if "name" not in h:
                fail(f"{hw}.name", "is required (the host name the launcher reaches it by)")
            hname = value(values.host_name, h["name"], f"{hw}.name")
            if hname.lower() in seen_hosts:
                fail(f"{hw}.name", f"host {hname!r} is already listed in data center "
                                   f"{seen_hosts[hname.lower()]!r} (host names ignore case)")
            slots = value(values.integer, h.get("slots"), f"{hw}.slots", lo=1, hi=MAX_SLOTS, unit="GPUs")
            addr = h.get("addr")
            if addr is not None:
                value(values.address, addr, f"{hw}.addr")
            seen_hosts[hname.lower()] = name
            hosts.append(Host(hname, slots, name, addr))
        ifname = d.get("ifname")
        if ifname is not None:
            value(values.ifname, ifname, f"{where}.ifname")
        dcs.append(DataCenter(
            name, tuple(hosts), ifname,
            gpu_flops=number(d, "gpu_tflops", where) * 1e12,
            gpu_memory=number(d, "gpu_memory_gb", where) * 2**30,
            node_bandwidth=number(d, "node_bandwidth_gbps", where) * 1e9 / 8,
            intra_bandwidth=number(d, "intra_bandwidth_gbps", where) * 1e9 / 8,
            intra_latency=number(d, "intra_latency_us", where) * 1e-6))

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
                             rtt=number(w, "rtt_ms", where) * 1e-3,
                             bandwidth=number(w, "bandwidth_gbps", where) * 1e9 / 8,
                             window=number(w, "window_mb", where) * 2**20 if "window_mb" in w else None)
    for a, b in combinations(names, 2):
        if frozenset((a, b)) not in links:
            fail("wan", f"no WAN entry between {a!r} and {b!r}: every pair of data centers needs one "
                        "(rtt_ms, bandwidth_gbps)")
    model = raw.get("model")
    if model is not None:
        if not isinstance(model, dict):
            fail("model", f"must be an object, got {model!r}")
        value(check_model, model, "model")
    timeout = raw.get("timeout_s")
    if timeout is not None:
        timeout = value(values.seconds, timeout, "timeout_s")
    return Topology(tuple(dcs), tuple(links.values()), model, source, timeout)


def _no_unknown(d: dict, allowed: set, where: str, fail) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        fail(where, f"unknown key(s) {unknown}; allowed: {sorted(allowed)}")
