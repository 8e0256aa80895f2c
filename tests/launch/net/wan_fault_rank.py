"""One rank of tests/launch/net/test_wan_faults.py, run inside a network namespace: a WAN pair of two
ranks, 4 TCP connections (gloo devices) over the emulated WAN, and one transfer per case while the
emulator cuts or stalls the connection of one stripe (rank 0 names it by its ports, from the group's
own record of its connections). Writes what each rank saw to --out."""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch
import torch.distributed as dist

from commweave import comm
from launch.net.striping import open_wan_groups
from launch.net.wanemu import add_rule
from tests.launch.plans import two_dc_plan

# case -> (emulator rule, the stripe whose connection it breaks, ATLAS_WAN_RETRIES)
CASES = {"cut": ("cut", 1, "2"), "stall": ("stall", 2, "2"), "exhaust": ("cut", 3, "0")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--master", required=True)
    ap.add_argument("--ifname", required=True)
    ap.add_argument("--rules", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--elements", type=int, default=8 << 20)
    args = ap.parse_args()
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=10))
    plan = two_dc_plan(pp=2, dp=1, connections=4)
    wan = open_wan_groups(plan, 4, ifname=args.ifname)
    pair = wan.pairs[frozenset((0, 1))]
    report = []
    for n, (case, (action, stripe, retries)) in enumerate(CASES.items()):
        os.environ["ATLAS_WAN_RETRIES"] = retries
        sent = torch.randint(-2**31, 2**31 - 1, (args.elements,), dtype=torch.int32,
                             generator=torch.Generator().manual_seed(n))      # every bit pattern counts
        connection = pair.connection(stripe)
        if rank == 0:
            ports = [int(end.rsplit(":", 1)[1]) for end in connection.split("->")]
            add_rule(Path(args.rules), action, ports, after_bytes=1 << 20)
            time.sleep(0.3)                                   # the forwarders re-read the rules at 20 Hz
        dist.barrier()                                        # the world group's own connection
        seen, start, outcome, equal = len(wan.events), time.monotonic(), "delivered", None
        try:
            if rank == 0:
                wan.isend(sent, 0, 1, f"case {case}: stage 0 -> stage 1").wait()
            else:
                got = torch.empty_like(sent)
                wan.irecv(got, 1, 0, f"case {case}: stage 1 <- stage 0").wait()
                equal = torch.equal(got, sent)
        except comm.CommError as e:
            outcome = f"error: {e}"
        report.append({"case": case, "stripe": stripe, "connection": connection, "outcome": outcome,
                       "equal": equal, "seconds": time.monotonic() - start, "generation": pair.generation,
                       "events": wan.events[seen:]})
        dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)        # the last case leaves a broken pair behind: no orderly group teardown


if __name__ == "__main__":
    main()
