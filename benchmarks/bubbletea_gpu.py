"""BubbleTea on one device: a training loop with emulated bubbles, prefill on the low-priority stream.

    python -m benchmarks.bubbletea_gpu --device cuda      # gpu_check.sh's bubbletea step
    python -m benchmarks.bubbletea_gpu --device cpu       # its CPU twin (the dry run): the null stream

Two pipeline stages cannot share one GPU, so the bubble is emulated: each training step is ``--compute``
matmul pairs (``--size`` square, fp32) on the training stream (the greatest priority CUDA gives), then a
bubble of ``--bubble-ms`` in which the training stream sleeps (``torch.cuda._sleep``: one thread block
spinning, the SMs otherwise free, as a rank blocked in a receive), then its synchronisation. The prefill
service (:class:`launch.bubbletea.server.PrefillServer`, runner "stream": a thread of this process, the
least-priority stream) is planned one window per step, the bubble, and opens and closes with it; it
keeps ``--outstanding`` prompts queued.

Arms, interleaved step by step in ABBA order so drift falls on both: *stock* (the server idle: no window
planned) and *on*. Reported: the median step time of each and the slowdown (median of paired on/stock),
prefill tokens/s over the *on* steps' wall time, the device's peak memory (allocated, before and after the
prefill started), the KV caches' cap and peak, and whether every prompt's logits equal the same chunks
run alone on the same device (bit for bit). The last line is JSON ``{"benchmark": "bubbletea_gpu", ...,
"passed"}``; exit status 1 on a failure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import torch

from launch.bubbletea import device as dev
from launch.bubbletea.model import LMConfig
from launch.bubbletea.server import PrefillServer
from launch.bubbletea.timeline import Window

SIZES = {"cuda": dict(size=4096, compute=8, bubble_ms=20.0, steps=60, lm=dict(vocab=32000, hidden=1024,
                                                                          layers=8, heads=16, max_seq=2048),
                      prompt=2048, chunk=256),
         "cpu": dict(size=192, compute=4, bubble_ms=15.0, steps=24, lm=dict(vocab=128, hidden=64, layers=2,
                                                                         heads=4, max_seq=128),
                     prompt=128, chunk=32)}


class Bubble:
    """Emulated waits on the training stream: a sleep kernel on CUDA (calibrated to seconds), a host
    sleep elsewhere (the CPU twin's training thread blocks, as in a receive)."""

    def __init__(self, device: torch.device, stream) -> None:
        self.device, self.stream, self.per_s = device, stream, 0.0
        if device.type == "cuda":
            with dev.on_stream(stream):
                torch.cuda._sleep(1000)                  # load the kernel
                dev.synchronize(stream)
                t0 = time.perf_counter()
                torch.cuda._sleep(50_000_000)
                dev.synchronize(stream)
                self.per_s = 50_000_000 / (time.perf_counter() - t0)

    def __call__(self, seconds: float) -> None:
        if self.device.type == "cuda":
            with dev.on_stream(self.stream):
                torch.cuda._sleep(int(seconds * self.per_s))
                dev.synchronize(self.stream)
        else:
            time.sleep(seconds)


def run(args) -> dict:
    device = dev.as_device(args.device)
    sizes = SIZES["cuda" if device.type == "cuda" else "cpu"]
    size, compute = args.size or sizes["size"], args.compute or sizes["compute"]
    bubble_s, steps = (args.bubble_ms or sizes["bubble_ms"]) / 1e3, args.steps or sizes["steps"]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    train = dev.training_stream(device)
    bubble = Bubble(device, train)
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(size, size, device=device, generator=g) / size ** 0.5
    x = torch.randn(size, size, device=device, generator=g)

    def step(server, planned: bool) -> float:
        t0 = time.perf_counter()
        with dev.on_stream(train):
            y = x
            for _ in range(compute):
                y = torch.tanh(y @ w) @ w.T
            dev.synchronize(train)
        if planned:
            server.plan([Window(None, 0.0, bubble_s, tag=0)])
            server.open(0, time.perf_counter() + bubble_s)
        bubble(bubble_s)
        server.close()
        float(y[0, 0])                                   # the step's result reaches the host
        return time.perf_counter() - t0

    lm = LMConfig(**sizes["lm"])
    prompt, chunk = sizes["prompt"], sizes["chunk"]
    got, ids = [], itertools.count()

    def submit() -> None:
        i = next(ids)
        server.submit(i, _prompt(i, prompt, lm.vocab))

    def done(result) -> None:                            # the hand-off: keep it, queue the next prompt
        got.append(result)
        submit()

    server = PrefillServer(lm, chunk, callback=done, guard=args.guard_ms / 1e3, device=device,
                           runner="stream")
    try:
        for _ in range(3):                               # warm the kernels; training's pool is reserved
            step(server, False)
        peak_training = _peak(device)
        memory = server.measure_memory()
        for _ in range(args.outstanding):
            submit()
        walls = {"stock": [], "on": []}
        for i in range(steps):
            for arm in (("stock", "on") if i % 2 == 0 else ("on", "stock")):
                walls[arm].append(step(server, arm == "on"))
        server.sync()
        tokens = server.stats.tokens
        counters = server.counters()
        server.drain()                 # untimed: finish the queued prompts for the exactness check
    finally:
        server.stop()
    diffs = [_alone_diff(lm, r, chunk, device) for r in got[:3]]
    ratios = [a / b for a, b in zip(walls["on"], walls["stock"], strict=True)]
    summary = {"benchmark": "bubbletea_gpu", "device": str(device), "steps": steps,
               "bubble_ms": bubble_s * 1e3, "step_s_stock": statistics.median(walls["stock"]),
               "step_s_bubbletea": statistics.median(walls["on"]),
               "slowdown": statistics.median(ratios) - 1,
               "prefill_tokens_per_s": tokens / sum(walls["on"]), "prompts": counters["prompts"],
               "chunks": counters["chunks"], "skipped": counters["skipped"], "closed": counters["closed"],
               "peak_memory_training": peak_training, "peak_memory": _peak(device),
               "kv_cap": memory.get("cap"), "kv_peak": server.memory.get("kv_peak"),
               "weights": server.memory.get("weights"), "max_diff_alone": max(diffs, default=None),
               "stream_priority": getattr(server._runner.stream, "priority", None)}
    # bit-equal on a CPU (tests/launch/bubbletea/test_model.py's property); on a GPU another stream may
    # pick other GEMM kernels: fp32 rounding, no more
    tolerance = 0.0 if device.type == "cpu" else 1e-4
    summary["passed"] = bool(diffs) and max(diffs) <= tolerance and counters["chunks"] > 0
    return summary


def _prompt(i: int, tokens: int, vocab: int) -> torch.Tensor:
    return torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(1000 + i))


def _alone_diff(lm: LMConfig, result, chunk: int, device) -> float:
    """Max |difference| of the logits from the same prompt's chunks run alone on the device's default
    stream (0.0: bit-equal)."""
    i = result.request
    _, logits = lm.build(device).prefill(_prompt(i, result.cache.length, lm.vocab).to(device), chunk)
    return float((logits - result.logits).abs().max())


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bubbletea_gpu",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", type=int, default=None)
    ap.add_argument("--compute", type=int, default=None, help="matmul pairs per training step")
    ap.add_argument("--bubble-ms", type=float, default=None)
    ap.add_argument("--steps", type=int, default=None, help="paired steps")
    ap.add_argument("--guard-ms", type=float, default=1.0)
    ap.add_argument("--outstanding", type=int, default=4)
    args = ap.parse_args(argv)
    s = run(args)
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f} MiB"      # noqa: E731
    print(f"BubbleTea on one {s['device']}: {s['steps']} paired steps, emulated bubble "
          f"{s['bubble_ms']:g} ms, prefill stream priority {s['stream_priority']}")
    print("| | step (median) | slowdown | prefill tokens/s | prompts | chunks (skipped, closed) "
          "| peak memory |")
    print("|---|---|---|---|---|---|---|")
    print(f"| stock | {s['step_s_stock'] * 1e3:.2f} ms | - | - | - | - "
          f"| {mib(s['peak_memory_training'])} |")
    print(f"| BubbleTea | {s['step_s_bubbletea'] * 1e3:.2f} ms | {100 * s['slowdown']:+.2f}% | "
          f"{s['prefill_tokens_per_s']:,.0f} | {s['prompts']} | {s['chunks']} ({s['skipped']}, "
          f"{s['closed']}) | {mib(s['peak_memory'])} |")
    print(f"KV cap {mib(s['kv_cap'])}, KV peak {mib(s['kv_peak'])}, weights {mib(s['weights'])}; "
          f"max |logits - the chunks run alone| {s['max_diff_alone']}")
    print(json.dumps(s))
    return 0 if s["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
