"""A user script for launcher tests: records what the launcher gave this rank, then exits."""

import argparse
import json
import os
from pathlib import Path

import launch.runtime as atlas

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int)
ap.add_argument("--out", required=True)
ap.add_argument("rest", nargs="*")
args = ap.parse_args()
seen = {k: v for k, v in os.environ.items() if k.startswith(("ATLAS_", "NCCL_", "GLOO_"))}
plan = atlas.init()
record = {"env": seen, "rank": os.environ["RANK"], "cross_rank": os.environ.get("CROSS_RANK"),
          "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "rest": args.rest,
          "world": plan.world_size, "dc": plan.dc_of(int(os.environ["RANK"]))}
Path(args.out).mkdir(parents=True, exist_ok=True)
Path(args.out, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
