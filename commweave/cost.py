"""The alpha-beta cost model shared by Parm's selector, WallFacer's placement and ATLAS's planner.

One operation on n bytes costs t(n) = α + β·n (FSMoE §6.2: "linear models with intercept terms",
fitted by least squares on micro-benchmarks). Collectives on g ranks are built from one link's α and β
with the ring/pairwise step counts, on the same wire-byte conventions as the ledger
(commweave/ledger.py), so that a prediction and a ledger reading talk about the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """t(n) = alpha + beta·n: alpha in seconds, beta in seconds per byte (or per unit of work)."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ValueError(f"alpha and beta must be >= 0, got alpha={self.alpha}, beta={self.beta}")

    def __call__(self, n: float) -> float:
        return self.alpha + self.beta * n

    @classmethod
    def from_link(cls, latency_s: float, bandwidth_bytes_per_s: float) -> AlphaBeta:
        if bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s, got {bandwidth_bytes_per_s}")
        return cls(latency_s, 1.0 / bandwidth_bytes_per_s)


@dataclass(frozen=True, slots=True)
class Fit:
    model: AlphaBeta
    r2: float


def fit(sizes: Sequence[float], times: Sequence[float]) -> Fit:
    """Least-squares α, β from (size, time) samples; both clamped at 0 (a negative intercept is noise)."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit needs >= 2 paired samples, got {len(sizes)} sizes and {len(times)} times")
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(times) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    if sxx == 0:
        raise ValueError("fit needs at least two distinct sizes")
    beta = max(sum((x - mx) * (y - my) for x, y in zip(sizes, times, strict=True)) / sxx, 0.0)
    alpha = max(my - beta * mx, 0.0)
    model = AlphaBeta(alpha, beta)
    ss_tot = sum((y - my) ** 2 for y in times)
    ss_res = sum((y - model(x)) ** 2 for x, y in zip(sizes, times, strict=True))
    return Fit(model, 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0)


# Collective times from one link's alpha-beta; n is the bytes named in each docstring, g the group size.
# Ring / pairwise algorithms: g−1 steps, each paying α.

def all_to_all(link: AlphaBeta, n: float, g: int) -> float:
    """n = one rank's input buffer; (g−1)/g of it crosses the link."""
    return 0.0 if g <= 1 else (g - 1) * link.alpha + link.beta * n * (g - 1) / g


def all_gather(link: AlphaBeta, n_out: float, g: int) -> float:
    """n_out = the gathered buffer (g × one rank's input)."""
    return 0.0 if g <= 1 else (g - 1) * link.alpha + link.beta * n_out * (g - 1) / g


def reduce_scatter(link: AlphaBeta, n_in: float, g: int) -> float:
    """n_in = one rank's full input (g × its output)."""
    return 0.0 if g <= 1 else (g - 1) * link.alpha + link.beta * n_in * (g - 1) / g


def all_reduce(link: AlphaBeta, n: float, g: int) -> float:
    """Ring all-reduce = reduce-scatter + all-gather."""
    return 0.0 if g <= 1 else 2 * (g - 1) * link.alpha + link.beta * 2 * n * (g - 1) / g


def p2p(link: AlphaBeta, n: float) -> float:
    return link(n)


def exchange(intra: AlphaBeta, nic: AlphaBeta, pairs: Sequence[tuple[int, int]], node: Sequence[int],
             n: float, flow: AlphaBeta | None = None) -> float:
    """Time of a set of simultaneous point-to-point messages of n bytes on a two-level network.

    ``pairs`` are (source, destination) ranks, ``node[r]`` the node of rank r. A message inside a
    node pays ``intra`` (a per-rank link, e.g. NVLink). Messages between nodes share their nodes'
    NICs: ``nic`` is one node's network link (all its NICs together), divided among the flows that
    leave the source node or enter the destination node, whichever is more; ``flow`` caps one
    message at what a single rank's NIC carries (with one NIC per GPU, a lone flow does not get
    the whole node's bandwidth). The exchange ends with its slowest message.
    """
    out_flows: dict[int, int] = {}
    in_flows: dict[int, int] = {}
    for s, d in pairs:
        if node[s] != node[d]:
            out_flows[node[s]] = out_flows.get(node[s], 0) + 1
            in_flows[node[d]] = in_flows.get(node[d], 0) + 1
    worst = 0.0
    for s, d in pairs:
        if s == d:
            continue
        if node[s] == node[d]:
            worst = max(worst, intra(n))
        else:
            share = max(out_flows[node[s]], in_flows[node[d]])
            beta = max(nic.beta * share, flow.beta if flow is not None else 0.0)
            worst = max(worst, nic.alpha + beta * n)
    return worst
