"""Cost profiles from public specifications, for clusters one cannot calibrate (the paper's, a what-if).

Every number below is a vendor's line rate or peak, a protocol's framing overhead, or a kernel's
efficiency as its authors published it; none is chosen to reproduce a WallFacer result. Where a spec
leaves a value open the choice is the idealisation, written down, and the README's validation table
says what that costs.

GPUs (NVIDIA data sheets; dense bf16 without sparsity; NVLink per direction = half the quoted
bidirectional total):

    A100 SXM4       312 TFLOP/s    NVLink 3: 12 links x 25 GB/s = 300 GB/s
    H100 SXM5       989 TFLOP/s    NVLink 4: 18 links x 25 GB/s = 450 GB/s

Links: the line rate times the payload share of a frame, and nothing else (first principles: ring
and pairwise algorithms are bandwidth-optimal, so a collective's efficiency is 1 and its α is one
per ring step; a hop on its own stream overlaps the block fully, overlap = 1):

    InfiniBand      payload share 1 (4 KiB MTU, ~1% headers: below the precision of anything here)
    Ethernet, TCP   1448 / 1538 = 0.941 at MTU 1500 (Ethernet's 38 bytes of preamble, header, FCS and
                    inter-frame gap, IPv4 20, TCP 20 + 12 of timestamps); one flow may fill the NIC
    one TCP flow    at most 42 Gb/s of payload: one core's receive-side copy caps a Linux TCP flow at
                    ~42 Gb/s even with TSO/GRO, jumbo frames and aRFS on (Cai et al., "Understanding
                    Host Network Stack Overheads", SIGCOMM 2021, https://www.cs.cornell.edu/~ragarwal/
                    pubs/network-stack.pdf: "a single core is no longer able to process packets at line
                    rate" at 100 Gb/s). NCCL's socket transport opens NCCL_SOCKET_NTHREADS x
                    NCCL_NSOCKS_PERTHREAD = 1 x 1 sockets per connection by default (NCCL's environment
                    variable docs; cloud presets differ) and 2 channels per network peer for send/recv
                    ("2 p2p channels per peer" in NCCL's INFO log, NVIDIA/nccl#1189; NCCL_NCHANNELS_PER_
                    NET_PEER "typically 2", a maintainer in NVIDIA/nccl#1424): one rank's message to a
                    rank on another node rides 2 flows, at most 84 Gb/s, below 100 GbE's 94 Gb/s payload
    latency α       3 µs NVLink, 10 µs InfiniBand, 25 µs TCP: the order of NCCL's small-message
                    latencies; at the paper's message sizes (MBs) α is under 1% of any step

Attention kernel (the paper runs FlashAttention, App. A.3): FlashAttention-2 (Dao, arXiv 2307.08691)
reports 50-73% of the A100's peak, rising with the sequence length; this takes 50% for its shortest
and 73% for its longest benchmark, log-log in between, forward and backward alike, causal as full (the
paper gives the range, not a curve per mask). Its benchmark (§4.1) holds 16K tokens per call (batch x
sequence length), hidden 2048, head dim 128 (16 heads): a 512-token sequence is a call of work
32 x 16 x 512² = 2^27 score entries (profile.py's axis: scores x b·h), a 16K one 16 x 16384² = 2^32. On
H100 FlashAttention-2 reaches 335 TFLOP/s at its best (the same paper's H100 figure): 34% of peak, the
short end scaled alike (0.34 x 50/73).

GEMMs (the layer's other work, for the throughput gains of whole layers): 75% of peak, the middle of
the 70-80% that NVIDIA's published cuBLAS bf16 figures show for large GEMMs on A100 and H100.
"""

from __future__ import annotations

from megatron_patches.profile import CURVES, Curve, Kernel, Link, Profile

GPUS = {  # name: (dense bf16 TFLOP/s, NVLink GB/s per direction, attention kernel)
    "a100": (312.0, 300.0, "fa2-a100"),
    "h100": (989.0, 450.0, "fa2-h100"),
}
KERNEL_WORK = (2.0 ** 27, 2.0 ** 32)  # FlashAttention-2's shortest and longest benchmark calls (docstring)
KERNEL_HEADS = 16  # its 16 heads of 128
KERNELS = {  # FlashAttention-2's share of peak at those two calls (module docstring)
    "fa2-a100": (0.50, 0.73),
    "fa2-h100": (0.34 * 0.50 / 0.73, 0.34),
}
PAYLOAD = {"ib": 1.0, "ethernet": 1448 / 1538}
TCP_FLOW_GBYTES = 42 / 8  # one TCP flow's payload ceiling, GB/s (module docstring)
NCCL_FLOWS_PER_PEER = 2  # NCCL send/recv channels per network peer x 1 socket each (module docstring)
GEMM_EFFICIENCY = 0.75


def spec_profile(ranks_per_node: int, intra_gbytes: float, node_gbytes: float,
                 rank_nic_gbytes: float | None = None, intra_us: float = 3.0, nic_us: float = 10.0,
                 tflops: float = 989.0, network: str = "ib", kernel: str = "fa2-a100") -> Profile:
    """A spec profile: GB/s line rates (one GPU's intra-node link one way, a node's network, one GPU's NIC,
    default the node's), latencies in µs, peak dense TFLOP/s, ``network`` "ib" or "ethernet" (payload
    share), ``kernel`` one of KERNELS (its efficiency range times ``tflops``)."""
    if network not in PAYLOAD:
        raise ValueError(f"network={network!r} is not one of {sorted(PAYLOAD)}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is not one of {sorted(KERNELS)}")
    if not (isinstance(ranks_per_node, int) and ranks_per_node >= 1) or not tflops > 0:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be an integer >= 1 and tflops={tflops} > 0")
    pay = PAYLOAD[network]
    rank_nic = (node_gbytes if rank_nic_gbytes is None else rank_nic_gbytes) * pay
    if network == "ethernet":  # one rank's message: NCCL's flows to that peer, each below line rate
        rank_nic = min(rank_nic, NCCL_FLOWS_PER_PEER * TCP_FLOW_GBYTES)
    low, high = KERNELS[kernel]
    curve = Curve(((KERNEL_WORK[0], low * tflops), (KERNEL_WORK[1], high * tflops)))
    return Profile(
        "spec", f"public specs: {ranks_per_node}/node, {intra_gbytes:g} GB/s intra, {node_gbytes:g} GB/s "
                f"{network} per node, {tflops:g} TFLOP/s, {kernel}",
        ranks_per_node, Link(intra_us * 1e-6, intra_gbytes), {},
        dict.fromkeys(CURVES, Kernel({KERNEL_HEADS: curve})),
        overlap=1.0, gemm_tflops=GEMM_EFFICIENCY * tflops, inter=Link(nic_us * 1e-6, rank_nic),
        node_gbytes=node_gbytes * pay, provenance={"specs": __name__})


def gpu_profile(gpu: str, ranks_per_node: int, node_gbits: float, nics_per_node: int,
                network: str) -> Profile:
    """The spec profile of one of GPUS with a node network of ``node_gbits`` Gb/s over ``nics_per_node``."""
    tflops, nvlink, kernel = GPUS[gpu]
    node = node_gbits / 8
    return spec_profile(ranks_per_node, nvlink, node, node / nics_per_node, 3.0,
                        10.0 if network == "ib" else 25.0, tflops, network, kernel)
