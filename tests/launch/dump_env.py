"""A user script for launcher tests: records what the launcher gave this rank, then exits."""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import launch.run.runtime as atlas

ap = argparse.ArgumentParser()
ap.add_argument("--local_rank", type=int)
ap.add_argument("--out", required=True)
ap.add_argument("rest", nargs="*")
args = ap.parse_args()
seen = {k: v for k, v in os.environ.items() if k.startswith(("ATLAS_", "NCCL_", "GLOO_", "COMMWEAVE_"))}
plan = atlas.init()
rank = os.environ["RANK"]
record = {"env": seen, "rank": rank, "local_rank": os.environ.get("LOCAL_RANK"),
          "world_size": os.environ.get("WORLD_SIZE"), "cross_rank": os.environ.get("CROSS_RANK"),
          "master": [os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")],
          "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "rest": args.rest,
          "world": plan.world_size, "dc": plan.dc_of(int(rank)), "host": plan.host_of(int(rank))[0].name}
Path(args.out).mkdir(parents=True, exist_ok=True)
Path(args.out, f"rank{rank}.json").write_text(json.dumps(record))
