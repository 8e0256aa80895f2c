"""Where each figure the planner takes comes from: measured, stated by the topology file, or assumed.

The plan is only as good as its inputs, and one of them decides most WAN figures: the TCP window one
connection gets, which caps it at window/RTT (the calibration's old 9x miss was a 2 MiB window assumed
where the nodes' buffers gave 256 KiB). Every system in the comparison (ATLAS and each baseline) runs
on the same nodes and so gets the same window per connection. For each WAN link it is, in order:

- **measured**: ``--link A:B=FILE`` names the JSON ``python -m benchmarks.wan --json FILE`` wrote on that
  link; its ``window_mb`` is one stock connection's rate x the minimum RTT, what a connection really
  carries with the nodes' rmem/wmem limits (benchmarks/wan.py);
- **stated**: the topology's ``window_mb`` for the link (launched calibration runs write the one their
  namespaces give: min(effective rmem/wmem limit, stock rate x RTT));
- **assumed**: Linux's default buffer limits x the kernel's overhead fraction
  (launch.plan.socket_limits.DEFAULT_WINDOW, 2 MiB), never this machine's sysctls.

RTT, bandwidth, GPU speed and memory are stated by the topology file (its defaults where a key is
absent); compute times are modelled from FLOPs (launch.plan.estimate); the schedule is the engine's
own call order (launch.plan.deepspeed_schedule, checked against real runs by benchmarks.atlas_calibration).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from commweave import values
from launch.plan.socket_limits import DEFAULT_WINDOW
from launch.plan.topology import Topology


@dataclass(frozen=True, slots=True)
class Window:
    a: str
    b: str
    bytes: float
    source: str          # "measured" | "stated" | "assumed"
    where: str           # the file or rule it came from


Measured = dict[frozenset[str], str]     # link {a, b} -> the file its window was measured in


def apply_links(topo: Topology, specs: list[str] | None, name: str = "--link") -> tuple[Topology, Measured]:
    """``topo`` with the window of every link named in ``specs`` ("A:B=FILE", FILE from
    ``python -m benchmarks.wan --json``) taken from the measurement, and which links those are."""
    measured: Measured = {}
    for spec in specs or ():
        pair, sep, path = spec.partition("=")
        a, sep2, b = pair.partition(":")
        if not (sep and sep2 and a and b and path):
            values.refuse(name, spec, "use A:B=FILE (two data centers of the topology and the JSON "
                                      "`python -m benchmarks.wan --json FILE` wrote on their link)")
        topo.link(a, b)           # both known and linked, else a ValueError naming them
        raw = values.load_json(path, f"{name} {spec}", top=dict)
        if "window_mb" not in raw:
            values.refuse(f"{name} {spec}", path, "has no window_mb (write it with python -m benchmarks.wan "
                                                  "--json FILE)")
        window = values.number(raw["window_mb"], f"{path}: window_mb", lo=1e-3, hi=4096.0, unit="MiB") * 2**20
        wan = tuple(replace(w, window=window) if {w.a, w.b} == {a, b} else w for w in topo.wan)
        topo = replace(topo, wan=wan)
        measured[frozenset((a, b))] = path
    return topo, measured


def windows(topo: Topology, measured: Measured, window: float = DEFAULT_WINDOW) -> list[Window]:
    """Each WAN link's per-connection window and where it comes from."""
    out = []
    for w in topo.wan:
        path = measured.get(frozenset((w.a, w.b)))
        if path is not None:
            out.append(Window(w.a, w.b, w.window, "measured", f"{path} (python -m benchmarks.wan)"))
        elif w.window is not None:
            out.append(Window(w.a, w.b, w.window, "stated", f"{topo.source}: window_mb"))
        else:
            out.append(Window(w.a, w.b, window, "assumed", "Linux's default buffers (no window_mb; "
                                                           "python -m benchmarks.wan --json measures it)"))
    return out


def render(topo: Topology, measured: Measured, window: float = DEFAULT_WINDOW) -> list[str]:
    """The inputs block of ``python -m launch.plan``."""
    lines = ["inputs (measured / stated by the topology file / assumed; the same for ATLAS and every "
             "baseline)"]
    for w in windows(topo, measured, window):
        link = topo.link(w.a, w.b)
        share = min(1.0, w.bytes / link.rtt / link.bandwidth)
        lines.append(f"  WAN {w.a}<->{w.b}: RTT {link.rtt * 1e3:g} ms and {link.bandwidth * 8 / 1e9:g} Gb/s "
                     f"stated; TCP window {w.bytes / 2**20:.3g} MiB per connection {w.source}: {w.where}; "
                     f"one connection carries {100 * share:.3g}% of the link")
    lines.append(f"  GPUs (gpu_tflops, gpu_memory_gb) and networks inside the DCs stated by {topo.source}; "
                 "compute times modelled from FLOPs; the schedule is each engine's own call order")
    return lines
