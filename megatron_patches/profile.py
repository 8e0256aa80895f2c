"""A cluster's cost profile: every constant WallFacer's cost model (placement.estimate) uses, from one of
two sources and nothing else:

- ``measured``: microbenchmarks a user runs on their own ranks (``python -m megatron_patches.estimate
  --calibrate --out PROFILE.json``, calibrate.py): point-to-point α/β inside a node (and across nodes
  where the job has several), all-gather / reduce-scatter / all-to-all α and efficiency per group size,
  the attention kernel's throughput per block size (forward, backward, full and causal blocks), the
  overlap of a hop with a block's compute (at most 1; below 0 in a CPU-clock profile: the extra CPU the
  hop costs beside the block), and a GEMM's throughput;
- ``spec``: public specifications (specs.py: line rates, peak FLOP/s, the FlashAttention-2 paper's
  reported efficiency range), with every derivation written where it is made.

Nothing in a profile is fitted to a result the model is then checked against (the paper's gains, the
attention benchmark's rows). The JSON file (``FORMAT``) is what ``--wallfacer-profile`` /
``COMMWEAVE_WALLFACER_PROFILE`` name for ``auto``::

    {"format": "commweave-wallfacer-profile/2", "source": "measured", "description": "...",
     "ranks_per_node": 8,
     "intra": {"alpha_us": 61.0, "gbytes": 1.9},          # one rank's message inside a node
     "inter": null | {"alpha_us": ..., "gbytes": ...},   # one rank's message between nodes (its NIC)
     "node_gbytes": null | 400.0,                       # a node's whole network (all NICs together)
     "collectives": {"all_gather": {"2": {"alpha_us": .., "efficiency": ..}, "4": ...}, "reduce_scatter":
                     ..., "all_to_all": ...},            # on the intra link, every group running at once
     "attention": {"fwd": {"8": [[work, tflops], ...], "1": ...}, "fwd_causal": ..., "bwd": ...,
                   "bwd_causal": ...},                  # per curve: b·h heads per call -> points
     "overlap": 0.7, "gemm_tflops": 0.02,
     "host": {"8 1 2 team-major": 0.012, ...},           # host.py: seconds per plan "P U C order"
     "memory": {"gbytes": 4.1, "rows": 16, "row_bytes": {"8 1 2 team-major": 260000, ...},
                "trace_bytes": 2048},                    # memory.py: traffic per row, copy bandwidth
     "calls": {"bwd 1024 512 4 64": 0.061, ...},          # seconds of exact block calls (optional)
     "provenance": {...}}

A collective on g ranks moving n bytes per rank on a link of β s/byte costs α_g + β·n·(g−1)/g / e_g: e_g = 1
is the ring/pairwise algorithm at the link's rate (cost.py), e_g < 1 what the measurement found less.
Attention throughput is per call: a call of ``scores`` score entries (rows × keys; n(n+1)/2 causal) over
b·h heads does 4·scores·b·h·d FLOPs forward (QKᵀ and PV) and 10·… backward (FlashAttention-2's five
matmuls), and takes FLOPs / throughput(work), work = scores·b·h (the call's score entries over all its
heads: what a kernel's fixed costs are spread over, so a call of 8 heads on 512 x 256 keys runs as fast as
one of 2 heads on 724², measured), the throughput interpolated log-log between measured sizes (held at the
ends). Each curve is measured at one or more head counts (a causal call's tiling waste depends on its
rows, so 1 head x 4096² and 8 heads x 1024² differ at equal work): a call is priced on the curve of the
measured head count nearest its own (in log, the larger on a tie). Format 2 (this one) keys the curves
by heads and work; format 1 keyed them by scores of one head.

Host work (host.py): the seconds a plan's forward + backward spends besides its kernels and bytes, measured
on the code path at 16 rows per rank less the model's price of that tiny problem, keyed "P U C order"
(choice.plan_s adds it). Optional: a profile without it (the spec model, or one calibrated with
``--host-rows 0``) prices no host work, and Profile.host_s says 0 for a plan it does not hold.
Exact calls, optional the same way: the seconds of each block call (curve, rows, keys, b·h heads, head
dim) that the plans of one problem make (choice.call_shapes), measured as the curves are; a call priced
from the profile takes its measured seconds where it has them (a plan's calls are rectangles, 512 x 1024
at 8 heads or 1024 x 512 at 4, which the square blocks of the curves only bracket), else the curve.
Memory traffic (memory.py), optional the same way: per plan the bytes per row per rank its code moves
outside the kernel blocks (traced), the rows host.py's run already holds, the b·h·d·elt of the trace,
and the copy bandwidth measured in the profile's clock; Profile.memory_s prices it.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import asdict, dataclass, field

from commweave import values

FORMAT = "commweave-wallfacer-profile/2"
ENV = "COMMWEAVE_WALLFACER_PROFILE"
SOURCES = ("measured", "spec")
KINDS = ("all_gather", "reduce_scatter", "all_to_all")
CURVES = ("fwd", "fwd_causal", "bwd", "bwd_causal")
FWD_FLOPS, BWD_FLOPS = 4, 10  # per score entry, per (b·h·d): 2 matmuls forward, 5 backward (FA-2)


def _number(value, name: str, low: float, strict: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low):
        rule = f"> {low:g}" if strict else f">= {low:g}"
        raise ValueError(f"profile {name}={value!r} must be a finite number {rule}")
    return float(value)


@dataclass(frozen=True)
class Link:
    """t(n) = alpha_s + n / (gbytes·10⁹) for one message of n bytes."""

    alpha_s: float
    gbytes: float

    def __post_init__(self) -> None:
        _number(self.alpha_s, "alpha", 0.0)
        _number(self.gbytes, "gbytes", 0.0, strict=True)

    @property
    def beta(self) -> float:
        return 1.0 / (self.gbytes * 1e9)


@dataclass(frozen=True)
class Collective:
    alpha_s: float
    efficiency: float

    def __post_init__(self) -> None:
        _number(self.alpha_s, "collective alpha", 0.0)
        if _number(self.efficiency, "collective efficiency", 0.0, strict=True) > 4:
            raise ValueError(f"profile collective efficiency={self.efficiency} must be <= 4 (a measurement "
                             f"error: no collective beats its link fourfold)")


@dataclass(frozen=True)
class Curve:
    """Effective TFLOP/s of one kernel call against its work (score entries x b·h), sorted by work."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("profile attention curve needs at least one [work, tflops] point")
        for n, t in self.points:
            _number(n, "attention work", 0.0, strict=True)
            _number(t, "attention tflops", 0.0, strict=True)
        if [n for n, _ in self.points] != sorted({n for n, _ in self.points}):
            raise ValueError(f"profile attention curve sizes {[n for n, _ in self.points]} must increase")

    def tflops(self, work: float) -> float:
        pts = self.points
        if work <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(pts):
            if work <= n1:
                w = math.log(work / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
        return pts[-1][1]


@dataclass(frozen=True)
class Kernel:
    """One kind of call (forward or backward, full or causal): a Curve per measured b·h head count."""

    curves: dict  # int heads -> Curve

    def __post_init__(self) -> None:
        if not self.curves or any(type(h) is not int or h < 1 for h in self.curves):
            raise ValueError(f"profile attention head counts {list(self.curves)} must be integers >= 1")

    def tflops(self, heads: int, work: float) -> float:
        near = min(self.curves, key=lambda h: (abs(math.log(h / heads)), -h))
        return self.curves[near].tflops(work)


@dataclass(frozen=True)
class Profile:
    source: str
    description: str
    ranks_per_node: int
    intra: Link
    collectives: dict
    attention: dict
    overlap: float
    gemm_tflops: float
    inter: Link | None = None
    node_gbytes: float | None = None
    provenance: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)  # host.plan_key -> seconds
    memory: dict = field(default_factory=dict)  # {"gbytes", "rows", "trace_bytes", "row_bytes": {key: B}}
    calls: dict = field(default_factory=dict)  # call_key -> seconds of that exact block call

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"profile source={self.source!r} is not one of {SOURCES}")
        if not isinstance(self.ranks_per_node, int) or isinstance(self.ranks_per_node, bool) \
                or self.ranks_per_node < 1:
            raise ValueError(f"profile ranks_per_node={self.ranks_per_node!r} must be an integer >= 1")
        if set(self.attention) != set(CURVES):
            raise ValueError(f"profile attention has curves {sorted(self.attention)}, needs {list(CURVES)}")
        if not set(self.collectives) <= set(KINDS):
            raise ValueError(f"profile collectives {sorted(self.collectives)} must be among {KINDS}")
        for kind, table in self.collectives.items():
            if not table or any(not isinstance(g, int) or g < 2 for g in table):
                raise ValueError(f"profile collectives.{kind} group sizes {list(table)} "
                                 f"must be integers >= 2")
        ov = self.overlap   # below 0 only in the CPU clock: contention (calibrate.py)
        if isinstance(ov, bool) or not isinstance(ov, (int, float)) or not math.isfinite(ov) or ov > 1:
            raise ValueError(f"profile overlap={ov!r} must be a finite number <= 1")
        if ov < 0 and self.provenance.get("clock") != "cpu":
            raise ValueError(f"profile overlap={ov} is below 0, which only a CPU-clock profile may be "
                             f"(provenance clock={self.provenance.get('clock')!r}): in the wall clock a hop "
                             f"beside a block hides at least nothing")
        _number(self.gemm_tflops, "gemm_tflops", 0.0, strict=True)
        if (self.inter is None) != (self.node_gbytes is None):
            raise ValueError("profile inter and node_gbytes go together: both null (one node) or both given")
        if self.node_gbytes is not None:
            _number(self.node_gbytes, "node_gbytes", 0.0, strict=True)
        for key, t in self.host.items():
            if not isinstance(key, str) or len(key.split()) != 4:
                raise ValueError(f"profile host key {key!r} must be 'P U C order'")
            _number(t, f"host[{key!r}]", 0.0)
        for key, t in self.calls.items():
            why = call_key_error(key) if isinstance(key, str) else "is not a string"
            if why:
                raise ValueError(f"profile calls key {key!r} {why}: it must be 'curve rows keys heads "
                                 f"head_dim' (a curve of {list(CURVES)}, four integers > 0; causal: "
                                 f"rows = keys)")
            _number(t, f"calls[{key!r}]", 0.0, strict=True)
        if self.memory:
            if set(self.memory) != {"gbytes", "rows", "trace_bytes", "row_bytes"} \
                    or not isinstance(self.memory["row_bytes"], dict):
                raise ValueError(f"profile memory={self.memory!r} must be {{gbytes, rows, trace_bytes, "
                                 f"row_bytes: {{'P U C order': bytes}}}}")
            for name in ("gbytes", "trace_bytes"):
                _number(self.memory[name], f"memory.{name}", 0.0, strict=True)
            _number(self.memory["rows"], "memory.rows", 0.0)
            for key, n in self.memory["row_bytes"].items():
                if not isinstance(key, str) or len(key.split()) != 4:
                    raise ValueError(f"profile memory.row_bytes key {key!r} must be 'P U C order'")
                _number(n, f"memory.row_bytes[{key!r}]", 0.0)

    def host_s(self, world: int, u: int, c: int, order: str) -> float:
        """Host seconds of one forward + backward of the plan (host.py), 0 where not measured."""
        return self.host.get(f"{world} {u} {c} {order}", 0.0)

    def memory_s(self, world: int, u: int, c: int, order: str, rows: int, row_bytes: float) -> float:
        """Seconds of the plan's memory traffic outside its kernels (memory.py) at ``rows`` rows per rank of
        ``row_bytes`` = b·h·d·elt each: the traced bytes per row scaled from the trace's row size, for the
        rows above those host_s holds, at the measured copy bandwidth; 0 where not measured."""
        m = self.memory
        per_row = m.get("row_bytes", {}).get(f"{world} {u} {c} {order}")
        if per_row is None:
            return 0.0
        return per_row * max(rows - m["rows"], 0) * row_bytes / m["trace_bytes"] / (m["gbytes"] * 1e9)

    def call_seconds(self, name: str, rows: int, keys: int, heads: int, d: int) -> float | None:
        """The measured seconds of exactly this block call (calls), None where it was not measured."""
        return self.calls.get(call_key(name, rows, keys, heads, d))

    def collective(self, kind: str, g: int) -> Collective:
        """The measured (α, efficiency) of ``kind`` on g ranks; an unmeasured g takes the nearest measured
        size's efficiency and α scaled by its step count (g−1)/(g'−1); none measured: the ring algorithm
        at the link's rate (α per step, efficiency 1)."""
        table = self.collectives.get(kind)
        if not table:
            return Collective((g - 1) * self.intra.alpha_s, 1.0)
        if g in table:
            return table[g]
        near = min(table, key=lambda m: (abs(math.log(m / g)), m))
        return Collective(table[near].alpha_s * (g - 1) / (near - 1), table[near].efficiency)

    def to_json(self) -> dict:
        out = {"format": FORMAT, **asdict(self)}
        for name in ("intra", "inter"):
            link = getattr(self, name)
            out[name] = None if link is None else {"alpha_us": link.alpha_s * 1e6, "gbytes": link.gbytes}
        out["collectives"] = {k: {str(g): {"alpha_us": c.alpha_s * 1e6, "efficiency": c.efficiency}
                                  for g, c in sorted(t.items())} for k, t in self.collectives.items()}
        out["attention"] = {k: {str(h): [list(p) for p in c.points]
                                for h, c in sorted(self.attention[k].curves.items())} for k in CURVES}
        return out


def call_key(name: str, rows: int, keys: int, heads: int, d: int) -> str:
    """The key of one exact block call in Profile.calls: the curve, its query rows and keys (a causal
    call is a diagonal block: rows = keys), b·h heads and the head dim."""
    return f"{name} {rows} {keys} {heads} {d}"


def call_key_error(key: str) -> str:
    """'' for a well-formed call_key, else what is wrong with it."""
    parts = key.split()
    if len(parts) != 5 or parts[0] not in CURVES or not all(x.isdigit() and int(x) > 0 for x in parts[1:]):
        return "is not a curve and four integers > 0"
    if parts[0].endswith("causal") and parts[1] != parts[2]:
        return "is a causal call off the diagonal (rows != keys)"
    return ""


def _link(raw, name: str) -> Link | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"alpha_us", "gbytes"}:
        raise ValueError(f"profile {name}={raw!r} must be {{'alpha_us': ..., 'gbytes': ...}}")
    return Link(_number(raw["alpha_us"], f"{name}.alpha_us", 0.0) * 1e-6, raw["gbytes"])


def from_json(raw: dict, source: str = "<profile>") -> Profile:
    """A Profile from its JSON object; ValueError naming the file, the field and the rule."""
    try:
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            again = " (an older profile: measure it again with --calibrate)" \
                if isinstance(got, str) and got.startswith(FORMAT[:-1]) else ""
            raise ValueError(f"format={got!r} must be {FORMAT!r}{again}")
        known = {"format", "source", "description", "ranks_per_node", "intra", "inter", "node_gbytes",
                 "collectives", "attention", "overlap", "gemm_tflops", "provenance", "host", "memory",
                 "calls"}
        if set(raw) - known:
            raise ValueError(f"unknown fields {sorted(set(raw) - known)}")
        colls = {}
        for kind, table in (raw.get("collectives") or {}).items():
            if not isinstance(table, dict):
                raise ValueError(f"collectives.{kind} must map group sizes to {{alpha_us, efficiency}}")
            colls[kind] = {}
            for g, c in table.items():
                if not (isinstance(g, str) and g.isdigit()) or not isinstance(c, dict) \
                        or set(c) != {"alpha_us", "efficiency"}:
                    raise ValueError(f"collectives.{kind}.{g}={c!r} must be {{alpha_us, efficiency}} under "
                                     f"an integer group size")
                colls[kind][int(g)] = Collective(_number(c["alpha_us"], f"{kind}.alpha_us", 0) * 1e-6,
                                                 c["efficiency"])
        att = raw.get("attention")
        if not isinstance(att, dict):
            raise ValueError(f"attention={att!r} must map {list(CURVES)} to {{heads: [[work, tflops], ...]}}")
        curves = {}
        for k, per_heads in att.items():
            if not isinstance(per_heads, dict) or not all(h.isdigit() for h in per_heads):
                raise ValueError(f"attention.{k} must map integer head counts to [[work, tflops], ...]")
            table = {}
            for h, pts in per_heads.items():
                if not isinstance(pts, list) or any(not isinstance(p, list) or len(p) != 2 for p in pts):
                    raise ValueError(f"attention.{k}.{h} must be a list of [work, tflops] pairs")
                table[int(h)] = Curve(tuple((p[0], p[1]) for p in pts))
            curves[k] = Kernel(table)
        host = raw.get("host") or {}
        if not isinstance(host, dict):
            raise ValueError(f"host={host!r} must map 'P U C order' to seconds")
        calls = raw.get("calls") or {}
        if not isinstance(calls, dict):
            raise ValueError(f"calls={calls!r} must map 'curve rows keys heads head_dim' to seconds")
        missing = [k for k in ("source", "ranks_per_node", "intra", "overlap", "gemm_tflops") if k not in raw]
        if missing:
            raise ValueError(f"missing fields {missing}")
        return Profile(raw["source"], str(raw.get("description", "")), raw["ranks_per_node"],
                       _link(raw["intra"], "intra"), colls, curves, raw["overlap"], raw["gemm_tflops"],
                       _link(raw.get("inter"), "inter"), raw.get("node_gbytes"), raw.get("provenance") or {},
                       host, raw.get("memory") or {}, calls)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def load(path: str) -> Profile:
    """The profile in the JSON file ``path`` (commweave.values.load_json: a regular file of bounded size and
    depth, UTF-8, no duplicate keys, no NaN or Infinity); ValueError naming the file and the rule."""
    try:
        raw = values.load_json(path, "wallfacer profile", top=dict)
    except ValueError as e:
        raise ValueError(f"wallfacer profile {path!r}: {getattr(e, 'rule', e)}") from None
    return from_json(raw, path)


def save(profile: Profile, path: str) -> None:
    with open(path, "w") as f:
        json.dump(profile.to_json(), f, indent=1)
        f.write("\n")


def profile_path(given: str | None = None) -> str | None:
    """The profile ``auto`` reads: the given path (``--wallfacer-profile``), else
    $COMMWEAVE_WALLFACER_PROFILE, else None (no profile: the spec model from the cluster arguments, which
    auto says it uses)."""
    return given or os.environ.get(ENV) or None
