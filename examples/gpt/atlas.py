"""The main job's ``--atlas`` rows: the MoE model as a 2-stage pipeline across two emulated data centers,
started by ``deepspeed-atlas`` (``python -m launch``) once with DeepSpeed's own pipeline sends and once
with ATLAS's multi-TCP striping (spatial sharing: temporal sharing did not pay reliably in the
calibration matrix, benchmarks/atlas_calibration.py).

Two network namespaces are the two data centers' hosts (2 ranks each), joined by launch.net.wanemu's WAN:
a user-space delay line for the round trip and a ``tbf`` rate limit; TCP buffers inside the namespaces
are capped so that one connection is window-limited below the link rate, as on a real long fat link
(benchmarks/wan.py measures the link itself). Each node runs under ``timeout``; everything made here
is removed on exit (launch.net.netns.Lab). Needs root; without it :func:`pipeline_rows` says why.

The WAN is configs/atlas_two_dc.json scaled down to this machine: 40 ms RTT, and one TCP connection
carrying 1/25 of the link as Linux's default buffers (2 MiB effective) do on two_dc's 10 Gb/s
(400 Mbit/s here, 128 KiB buffers). Each row carries the calibrated simulator's prediction
(launch.plan.calibrated): the link's rate (32 plain TCP streams, benchmarks.wan.link_rate), what one
transfer costs on it, from ping-pongs by the run's own ranks on its own connections just before its
timed steps (launch.net.pingpong: stock over DeepSpeed's world group, ATLAS over its WAN groups), the
WAN's one-way latency (half the median ``minrtt`` the kernel reports on the run's WAN connections), and
each run's own per-instruction compute times as DeepSpeed's engine timed them. gloo's rendezvous is
receiver-driven (launch.plan.rendezvous): the 4-byte aux-loss tensor each transfer carries after the
activation costs a round trip, and ZeRO-1's step all-reduces over the two stages (the gradient norm of
each of its two parameter groups, MoE and the rest: counted in the run). The launch itself is
launch.net.two_dc's, shared with the calibration matrix.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from examples.gpt.train import Result


@dataclass
class PipelineResult(Result):
    predicted_ms: float = 0.0     # the calibrated simulator's ms per step for this run
    free_wan_ms: float = 0.0      # the same with a free WAN: what the step computes and synchronises

ROOT = Path(__file__).resolve().parents[2]
NODE_TIMEOUT = 900
MICRO_BATCHES = 4
# examples/gpt/pipeline.py's stages pass (activation, running aux loss) and DeepSpeed sends a tuple one
# tensor per call: after the activation, the aux loss, [1] fp32, both ways (it requires grad)
EXTRA_TENSORS = (4.0,)


@dataclass(frozen=True)
class Wan:
    rtt_ms: float = 40.0
    rate_mbit: float = 400.0
    window_kib: int = 128         # TCP buffer cap: one connection ~ 0.7 x window / RTT (~2 MB/s here)
    micro: int = 8                # sequences per micro-batch: [256, 8, 128] fp32 = 1 MiB per transfer
    rate_s: float = 3.0           # how long benchmarks.wan.link_rate's 32 streams time the link's rate

    def describe(self) -> str:
        return f"2 DCs, RTT {self.rtt_ms:g} ms, {self.rate_mbit:g} Mbit/s, TCP buffers {self.window_kib} KiB"

    def model(self, slots: int) -> dict:
        return {"layers": 2, "hidden": 128, "seq": 256, "micro_batch": self.micro, "dtype_bytes": 4,
                "global_batch": self.micro * MICRO_BATCHES * slots, "pp": 2, "tp": 1, "dp": slots}


def _result(name: str, ranks: list[dict], predicted_s: float, free_s: float) -> PipelineResult:
    """One table row: losses of the last stage (every rank reports them), the slowest rank's step time,
    the mean over ranks of the bytes each sent per step, the prediction."""
    res = PipelineResult(name, losses=ranks[0]["losses"], tokens_per_step=ranks[0]["tokens_per_step"],
                         predicted_ms=predicted_s * 1e3, free_wan_ms=free_s * 1e3)
    res.evals = [(len(res.losses), ranks[0]["held_out"])]
    res.step_ms = [max(ms) for ms in zip(*(r["step_ms"] for r in ranks), strict=True)]
    for r in ranks:
        for key, sent in r["sent"].items():
            res.sent_by_group[key] = res.sent_by_group.get(key, 0.0) + sent / len(ranks)
            kind = key.split("@")[0]
            res.sent[kind] = res.sent.get(kind, 0.0) + sent / len(ranks)
    return res


def pipeline_rows(deepspeed_config: str, connections: int = 8, wan: Wan = Wan(),
                  job_args: tuple[str, ...] = ()) -> list[tuple[Result, str]] | str:
    """The two pipeline rows (stock, ATLAS), or the reason they cannot run here."""
    from launch.net import netns
    from launch.net.wanemu import WanLink

    ok, reason = netns.available()
    if not ok:
        return reason
    from benchmarks.wan import link_rate
    from launch.net import two_dc
    from launch.net.pingpong import combine
    from launch.net.sockets import one_way_s
    from launch.plan.calibrated import LinkMode, WanSetting, compute_inputs, pipe_syncs, step_seconds

    args = ["--deepspeed_config", deepspeed_config, "--micro", str(wan.micro),
            "--micro-batches", str(MICRO_BATCHES), *job_args]
    script = ROOT / "examples" / "gpt" / "pipeline.py"
    rows = []
    with WanLink(rtt=wan.rtt_ms / 1e3, rate=wan.rate_mbit * 1e6 / 8) as link, \
            tempfile.TemporaryDirectory(prefix="atlas-rows-") as tmp:
        two_dc.cap_buffers(link, wan.window_kib * 1024)
        # the link's rate (32 plain TCP streams); what one transfer costs, each run measures on its own
        # connections just before its timed steps (ping-pongs, launch.net.pingpong)
        bandwidth = link_rate(link, wan.rate_s)
        topo = two_dc.topology(link, 2, wan.rtt_ms, wan.rate_mbit, wan.window_kib * 1024, wan.model(2))
        # one launch trains both rows, each from the same seeded weights (examples/gpt/pipeline.py --rows)
        ranks = two_dc.launch(link, topo, Path(tmp), script, [*args, "--rows", "stock,atlas"],
                              ["--wan-connections", str(connections), "--atlas-sharing", "spatial"],
                              NODE_TIMEOUT)
        for name, row, conns, what in (
                ("pipeline", "stock", 1, f"DeepSpeed pipeline sends, 1 TCP connection ({wan.describe()})"),
                ("pipeline+ATLAS", "atlas", connections,
                 f"ATLAS: {connections} TCP connections, spatial sharing ({wan.describe()})")):
            runs = [r["rows"][row] for r in ranks]
            compute = compute_inputs([(r["stage"], r["ops"]) for r in runs], 2)
            setting = "stock" if row == "stock" else f"{conns}:spatial"
            act, m = runs[0]["act_bytes"], runs[0]["micro_batches"]
            mode = combine([r["link"]["pingpong_s"] for r in runs if r["link"]["pingpong_s"]], conns)
            modes = {"stock" if row == "stock" else str(conns): mode}
            one_way = one_way_s([c for r in runs for c in r["link"]["tcp"]])
            syncs = pipe_syncs([r["ops"] for r in runs])
            own = LinkMode.from_measured(modes, setting, act)
            predicted = step_seconds(compute, 2, m, act, bandwidth, own, WanSetting.parse(setting),
                                     one_way=one_way, extra_tensors=EXTRA_TENSORS, syncs=syncs)
            free = step_seconds(compute, 2, m, act, 1e18, LinkMode(0.0, 1e18), WanSetting.parse(setting),
                                extra_tensors=EXTRA_TENSORS, syncs=syncs)
            rows.append((_result(name, runs, predicted, free),
                         f"{what}; predicted {predicted * 1e3:.0f} ms/step (a transfer: "
                         f"{mode['alpha_s'] * 1e3:.0f} ms + {mode['Bps'] / 1e6:.1f} MB/s, one way "
                         f"{one_way * 1e3:.1f} ms, {syncs} cross-stage all-reduces per step, measured in "
                         "the run)"))
        lost = {k: v for k, v in link.drops().items() if v and not k.startswith("tcp_retrans")}
    if lost:     # the emulator itself lost packets: the WAN was not what it claims to be
        rows = [(res, f"{what}; WAN emulator drops {lost}") for res, what in rows]
    return rows


def same_losses(rows: list[tuple[Result, str]]) -> bool:
    """ATLAS only moves the same bytes differently: both pipeline runs must give identical losses."""
    (a, _), (b, _) = rows
    return a.losses == b.losses and a.evals == b.evals
