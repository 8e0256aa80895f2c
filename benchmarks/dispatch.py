"""Fused MoE dispatch+combine against DeepSpeed's sparse path, megatron-core's permute and a plain copy.

    python -m benchmarks.dispatch                      # CPU, S=16384 M=1024 E=16 k=2 cf=1.25, fp32+bf16
    python -m benchmarks.dispatch --device cuda        # the same on a GPU

Each method runs forward+backward of dispatch, then combine of the dispatched buffer (the expert is the
identity, so combine's input gradient flows back into dispatch), with gradients for x and the gates,
side by side in one process, interleaved repeat by repeat so load changes hit all methods alike:

    ours        ds_plugins.dispatch.dispatch / combine (the fused kernels; backend() is printed)
    deepspeed   deepspeed.moe.sharded_moe._route_slots + _sparse_encode / _sparse_decode, autograd
    megatron    megatron.core.transformer.moe.moe_utils.permute / unpermute, drop_and_pad=True with the
                same capacity (routing map padded to C tokens per expert as pad_to_capacity does), unfused
    copy        dst.copy_(src) over half the bytes below: it reads and writes that many, the memory limit

Routes come from DeepSpeed's top2gating (topkgating for k > 2) with sparse_routes, C = ceil(k·cf·S/E).

Bytes that must move, counted for the fused op (rows of M elements, L = live routes, S_r = tokens
with at least one live route; any implementation has to read each input row it needs once and write
each output row once):

    dispatch forward    read S_r token rows            write E·C slot rows (empty slots are zeros)
    combine forward     read L routed rows             write S rows
    combine backward    read S rows of dy, L routed rows of expert_output (for the gate gradients)
                                                       write E·C rows of d expert_output
    dispatch backward   read L routed rows of dX       write S rows of dx

plus the int32 indices and locations and the fp32 gates (read once per op) and the gate gradients.
GB/s in the table is these bytes over each method's median time; "% copy" compares that with the copy.

CPU runs give every method the memory a GPU caching allocator gives: the benchmark re-executes itself
with GLIBC_TUNABLES that keep glibc from returning freed blocks to the kernel, and with torch's
THP_MEM_ALLOC_ENABLE=1, which backs large buffers with 2 MB pages (``--system-allocator`` turns both
off). Otherwise every fresh 100+ MB buffer costs a page fault per 4 KB page (on the VMs seen here,
clone() ran at 5 GB/s against copy_'s 25 GB/s), every random row a TLB miss, and all methods would be
timing the kernel's page handling. The last line is one JSON object with the ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass

import torch

_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=68719476736"


@dataclass
class Case:
    x: torch.Tensor  # [S, M]
    dy: torch.Tensor  # [S, M], the gradient fed to combine's output
    indices: torch.Tensor  # [k, S] int32
    locations: torch.Tensor  # [k, S] int32
    gates: torch.Tensor  # [k, S] fp32
    num_experts: int
    capacity: int

    @property
    def live(self) -> int:
        return int((self.indices >= 0).sum())

    def must_move_bytes(self) -> int:
        k, tokens = self.indices.shape
        slots, d_model, size = self.num_experts * self.capacity, self.x.shape[1], self.x.element_size()
        routed_tokens = int((self.indices >= 0).any(0).sum())
        rows = (routed_tokens + slots  # dispatch forward
                + self.live + tokens  # combine forward
                + tokens + self.live + slots  # combine backward
                + self.live + tokens)  # dispatch backward
        route_bytes = 4 * k * tokens * (4 * 2  # int32 indices and locations, read by each of 4 kernels
                                        + 2 + 1)  # fp32 gates read twice, their gradient written once
        return rows * d_model * size + route_bytes


def make_case(tokens: int, d_model: int, experts: int, k: int, capacity_factor: float, dtype: torch.dtype,
              device: str, seed: int = 0) -> Case:
    from deepspeed.moe.sharded_moe import top2gating, topkgating

    torch.manual_seed(seed)
    logits = torch.randn(tokens, experts)
    if k == 2:
        routes = top2gating(logits, capacity_factor, 1, sparse_routes=True)
    else:
        routes = topkgating(logits, k, capacity_factor, 1, sparse_routes=True)
    _, capacity, _, indices, locations, gates, _ = routes
    x = torch.randn(tokens, d_model, dtype=dtype, device=device)
    dy = torch.randn(tokens, d_model, dtype=dtype, device=device)
    return Case(x, dy, indices.to(device), locations.to(device), gates.float().to(device), experts,
                int(capacity))


def _ours(case: Case):
    from ds_plugins.dispatch import combine, dispatch

    x, gates = case.x.detach().requires_grad_(True), case.gates.detach().requires_grad_(True)

    def step():
        x.grad = gates.grad = None
        y = combine(dispatch(x, case.indices, case.locations, case.num_experts, case.capacity), case.indices,
                    case.locations, gates)
        y.backward(case.dy)
        return y, x.grad

    return step


def _deepspeed(case: Case):
    from deepspeed.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    x, gates = case.x.detach().requires_grad_(True), case.gates.detach().requires_grad_(True)
    tokens, d_model = x.shape

    def step():
        x.grad = gates.grad = None
        slots = _route_slots(case.indices, case.locations, case.num_experts, case.capacity)
        dispatched = _sparse_encode(x, slots, case.num_experts, case.capacity)
        y = _sparse_decode(dispatched.view(-1, d_model), slots, gates, tokens)
        y.backward(case.dy)
        return y, x.grad

    return step


def _megatron(case: Case):
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping, permute, unpermute

    tokens = case.x.shape[0]
    k = case.indices.shape[0]
    live = case.indices >= 0
    token_of = torch.arange(tokens, device=case.x.device).expand_as(case.indices)
    routing_map = torch.zeros(tokens, case.num_experts, dtype=torch.bool, device=case.x.device)
    routing_map[token_of[live], case.indices[live].long()] = True
    probs = torch.zeros(tokens, case.num_experts, device=case.x.device)
    probs[token_of[live], case.indices[live].long()] = case.gates[live]
    # pad_to_capacity: every expert gets exactly C tokens, the padding ones with probability 0.
    capacity_factor = case.capacity * case.num_experts / (tokens * k)
    probs, routing_map = apply_router_token_dropping(probs, routing_map, k, capacity_factor, "probs",
                                                     pad_to_capacity=True)
    if int(routing_map.sum()) != case.num_experts * case.capacity:
        raise RuntimeError("megatron's capacity differs from DeepSpeed's for this shape")
    x, probs = case.x.detach().requires_grad_(True), probs.detach().requires_grad_(True)
    slots = case.num_experts * case.capacity

    def step():
        x.grad = probs.grad = None
        permuted, _, sorted_indices = permute(x, routing_map, num_out_tokens=slots, drop_and_pad=True)
        y = unpermute(permuted, sorted_indices, x.shape, probs=probs, routing_map=routing_map,
                      drop_and_pad=True)
        y.backward(case.dy)
        return y, x.grad

    return step


def _copy(case: Case):
    numel = case.must_move_bytes() // 2 // case.x.element_size()
    src = torch.randn(numel, device=case.x.device).to(case.x.dtype)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# Each maker returns a step: forward+backward, returning (y, dx) (the copy returns its output).
METHODS = {"ours": _ours, "deepspeed": _deepspeed, "megatron": _megatron, "copy": _copy}


def _clock(device: str):
    if device == "cuda":
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
    else:
        def timed(fn):
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
    return timed


def _isa() -> str:
    from ds_plugins import dispatch

    return f"CPU kernels {dispatch._C.CPU_ISA}, " if dispatch._C is not None else ""


def run(args) -> dict:
    from tqdm import tqdm

    from ds_plugins.dispatch import backend

    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    methods = {name: METHODS[name] for name in METHODS if name in args.methods.split(",")}
    timed = _clock(args.device)
    load_before = os.getloadavg()
    results = {}
    with tqdm(total=len(dtypes) * len(methods) * (args.warmup + args.repeats), desc="dispatch bench",
              disable=args.no_progress, file=sys.stderr) as bar:
        for dtype in dtypes:
            case = make_case(args.tokens, args.model, args.experts, args.k, args.capacity_factor, dtype,
                             args.device)
            steps = {name: make(case) for name, make in methods.items()}
            times = {name: [] for name in steps}
            for i in range(args.warmup + args.repeats):
                for name, step in steps.items():
                    seconds = timed(step)
                    if i >= args.warmup:
                        times[name].append(seconds)
                    bar.update()
            medians = {name: statistics.median(t) for name, t in times.items()}
            results[str(dtype).removeprefix("torch.")] = (case, medians)
            del steps, case
    load_after = os.getloadavg()

    allocator = "system" if "GLIBC_TUNABLES" not in os.environ else (
        f"reuse{'+thp' if os.environ.get('THP_MEM_ALLOC_ENABLE') == '1' else ''}")
    print(f"\ndispatch+combine forward+backward on {args.device} (backend {backend(args.device)!r}, "
          f"{_isa()}{torch.get_num_threads()} threads, {allocator} allocator): S={args.tokens} "
          f"M={args.model} E={args.experts} k={args.k} cf={args.capacity_factor}; median of {args.repeats}; "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    ratios = {}
    for dtype, (case, medians) in results.items():
        moved = case.must_move_bytes()
        copy_bw = moved / medians["copy"]
        print(f"\n{dtype}: C={case.capacity}, {case.live} live routes of {case.indices.numel()}, "
              f"{moved / 1e6:.1f} MB must move")
        print(f"{'method':<10} {'ms':>9} {'GB/s':>8} {'% copy':>7} {'ours x':>7}")
        for name, seconds in medians.items():
            print(f"{name:<10} {seconds * 1e3:9.2f} {moved / seconds / 1e9:8.2f} "
                  f"{100 * moved / seconds / copy_bw:7.1f} {seconds / medians['ours']:7.2f}")
        ratio_names = {"deepspeed": "vs_deepspeed", "megatron": "vs_megatron", "copy": "copy_fraction"}
        ratios[dtype] = {key: round(medians[name] / medians["ours"], 3)
                         for name, key in ratio_names.items() if name in medians}
        ratios[dtype]["ours_ms"] = round(medians["ours"] * 1e3, 3)
    shape = {"S": args.tokens, "M": args.model, "E": args.experts, "k": args.k, "cf": args.capacity_factor}
    summary = {"benchmark": "dispatch", "device": args.device, "backend": backend(args.device),
               "threads": torch.get_num_threads(), "allocator": allocator, "shape": shape,
               "load": [round(load_before[0], 2), round(load_after[0], 2)], "ratios": ratios}
    print(json.dumps(summary))
    return summary


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=16384, help="S")
    p.add_argument("--model", type=int, default=1024, help="M, the hidden size")
    p.add_argument("--experts", type=int, default=16, help="E")
    p.add_argument("--k", type=int, default=2, help="routes per token")
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated subset of ours,deepspeed,megatron,copy (ours and copy always run)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 15 CPU, 50 CUDA)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--system-allocator", action="store_true",
                   help="CPU: keep glibc's default of returning large blocks to the kernel")
    return p


def main(argv: list[str] | None = None) -> dict | None:
    args = _parser().parse_args(argv)
    args.methods = ",".join(sorted({*args.methods.split(","), "ours", "copy"}))
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        sys.exit(f"--methods: unknown {sorted(unknown)}; choose from {','.join(METHODS)}")
    if args.repeats is None:
        args.repeats = 50 if args.device == "cuda" else 15
    if (args.device == "cpu" and not args.system_allocator and "GLIBC_TUNABLES" not in os.environ
            and platform.libc_ver()[0] == "glibc" and argv is None):
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.dispatch", *sys.argv[1:]],
                  {"THP_MEM_ALLOC_ENABLE": "1", **os.environ, "GLIBC_TUNABLES": _TUNABLES})
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible")
    if args.k < 2 or math.ceil(args.tokens * args.k * args.capacity_factor / args.experts) < 1:
        sys.exit("--k must be >= 2 (DeepSpeed's top2gating/topkgating make the routes)")
    return run(args)


if __name__ == "__main__":
    main()
