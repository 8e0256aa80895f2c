"""The cost model against every run the WallFacer paper reports, with cluster parameters from public specs:

    python -m benchmarks.paper_check

The runs (wallfacer.md §11): Fig. 7's six panels at each of their two lengths (32 GPUs on three
clusters), the two weak-scaling series of Fig. 10 and the two headline gains. The clusters are spec
profiles (megatron_patches.specs.gpu_profile: A100 / H100 line rates and peaks, 100 Gb/s Ethernet with one
NIC per node, 8 x 400 Gb/s InfiniBand with one per GPU, FlashAttention-2's published efficiency), the
same for every point: nothing is chosen per point, and nothing from the paper goes in.

What is compared: the paper's throughput gain of WallFacer (its best of Star-2 / Star-4, i.e. C > 1,
U = 1) over Ring (C = 1), whole model, and the model's gain for the same layer,
(GEMMs + ring attention) / (GEMMs + the best C > 1), GEMMs = estimate.dense_layer_s (forward, the
recomputed forward of the paper's checkpointing, backward). The paper's per-point values were not
recovered (the figures' bars), only its two maxima: +77.12% for GPT, +114.33% for DiT. So "paper" is
the reported maximum of the model family, and the table's ratio is predicted / that maximum. The band
the README states and the test holds: 1/1.25 <= ... no: the predicted gain must lie in [1, 1.25 x the
paper's maximum] — at least 1 because the paper reports WallFacer ahead of Ring in every figure, at most
1.25 x the maximum because no run of the paper exceeds its maximum (the issue's rule); where the model
falls outside, the row says so and nothing is tuned.

Model dimensions (paper Table 1): GPT 3B and 7B with hidden 4096 (32 heads of 128: the transcribed 12
heads do not divide 4096, and the split does not change ring or WallFacer bytes or FLOPs), causal; DiT
1B hidden 1536, 24 heads, no mask; bf16, batch 1, MHA.
"""

from __future__ import annotations

import argparse
import json

from megatron_patches.choice import plan_s
from megatron_patches.estimate import Cluster, Model, dense_layer_s
from megatron_patches.layout import valid_team_sizes
from megatron_patches.placement import ORDERS
from megatron_patches.specs import gpu_profile

GPT_MAX, DIT_MAX = 1.7712, 2.1433
BAND_HIGH = 1.25

CLUSTERS = {  # name: (gpu, GPUs per node, node network Gb/s, NICs per node, network)
    "A100_40GB_16": ("a100", 16, 100, 1, "ethernet"),
    "A100_40GB_8": ("a100", 8, 100, 1, "ethernet"),
    "A100_40GB_4": ("a100", 4, 100, 1, "ethernet"),
    "H100_80GB_8": ("h100", 8, 3200, 8, "ib"),
}
MODELS = {"GPT 3B": Model(hidden=4096, heads=32), "GPT 7B": Model(hidden=4096, heads=32),
          "DiT 1B": Model(hidden=1536, heads=24, causal=False)}
K = 1024
POINTS = [  # (figure, model, cluster, GPUs, tokens)
    *[("Fig. 7", "DiT 1B", "A100_40GB_8", 32, n * K) for n in (128, 512)],
    *[("Fig. 7", "GPT 3B", "A100_40GB_16", 32, n * K) for n in (64, 128)],
    *[("Fig. 7", "GPT 3B", "A100_40GB_8", 32, n * K) for n in (64, 128)],
    *[("Fig. 7", "GPT 7B", "H100_80GB_8", 32, n * K) for n in (64, 128)],
    *[("Fig. 10a", "DiT 1B", "A100_40GB_4", g, n * K) for g, n in ((8, 128), (16, 256), (32, 512))],
    *[("Fig. 10b", "GPT 7B", "H100_80GB_8", g, n * K) for g, n in ((8, 64), (16, 128), (32, 256), (64, 512))],
]


def cluster(name: str, gpus: int) -> Cluster:
    gpu, per_node, gbits, nics, network = CLUSTERS[name]
    prof = gpu_profile(gpu, per_node, gbits, nics, network)
    return Cluster(gpus, per_node, network=network, nics_per_node=nics, profile=prof)


def gain(cl: Cluster, model: Model) -> dict:
    """Ring's and the best C > 1's seconds (U = 1, the better order), and the layer's throughput gain."""
    import dataclasses

    m = dataclasses.replace(model, seq=model.seq)
    world, topo, nodes, sh = cl.gpus, cl.topology(), cl.nodes(), m.shard(cl.gpus)
    ring = plan_s(world, sh, nodes, topo, 1, 1, "team-major", m.causal)
    star = {c: min(plan_s(world, sh, nodes, topo, 1, c, o, m.causal) for o in ORDERS)
            for c in valid_team_sizes(world) if c > 1}
    best = min(star, key=star.get)
    dense = dense_layer_s(cl, m)
    return {"ring_s": ring, "star_s": star[best], "team_size": best, "dense_s": dense,
            "gain": (dense + ring) / (dense + star[best])}


def table() -> list[dict]:
    import dataclasses

    rows = []
    for fig, model, name, gpus, tokens in POINTS:
        m = dataclasses.replace(MODELS[model], seq=tokens)
        g = gain(cluster(name, gpus), m)
        paper = DIT_MAX if model.startswith("DiT") else GPT_MAX
        rows.append({"point": f"{fig} {model} {name} x{gpus} {tokens // K}K", "paper_max": paper,
                     "predicted": g["gain"], "ratio": g["gain"] / paper, "C": g["team_size"],
                     "in_band": 1.0 <= g["gain"] <= BAND_HIGH * paper})
    for model, paper in (("GPT", GPT_MAX), ("DiT", DIT_MAX)):
        best = max((r for r in rows if model in r["point"]), key=lambda r: r["predicted"])
        rows.append({"point": f"headline {model} (+{100 * (paper - 1):.2f}%): "
                              f"the model's largest {model} gain",
                     "paper_max": paper, "predicted": best["predicted"], "ratio": best["predicted"] / paper,
                     "C": best["C"], "in_band": 1.0 <= best["predicted"] <= BAND_HIGH * paper})
    return rows


def main(argv=None) -> list[dict]:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = table()
    print("PROJECTION (spec profiles, not tuned per point) against the paper's reported maxima; gain = "
          "layer throughput, best WallFacer C > 1 over ring")
    print(f"{'point':<44}{'paper (max)':>12}{'predicted':>10}{'ratio':>7}{'C':>3}  band [1, 1.25 x max]")
    for r in rows:
        print(f"{r['point']:<44}{r['paper_max']:>12.3f}{r['predicted']:>10.3f}{r['ratio']:>7.2f}{r['C']:>3}  "
              f"{'in' if r['in_band'] else 'OUT'}")
    print(json.dumps([{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]))
    return rows


if __name__ == "__main__":
    main()
