"""A rank killed (SIGKILL) or frozen (SIGSTOP) in the middle of a pipeline send of the ATLAS path:
every other rank fails within COMMWEAVE_TIMEOUT_S with an error naming the operation and the peer,
never a hang, although the process group was created with a 10-minute timeout.

Four ranks (pp = 2 stages in two data centers, dp = 2 replicas taking turns on the WAN, 2 TCP
connections per pair) run forward and backward pipeline transfers through ATLAS's WAN path (striped
sends, temporal-sharing tokens). Rank 1 (stage 0, replica 1) posts its third activation send and then
signals itself. The ranks are separate processes so that a frozen one can stay frozen while the others
report; the test prints the time from the fault to the last rank's error.
"""

import json
import multiprocessing as mp
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import pytest

from commweave.world import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 8.0          # COMMWEAVE_TIMEOUT_S for the job
FAULT_RANK, FAULT_AT = 1, 5      # the rank that dies or freezes, at its n-th WAN send (step 2, micro-batch 1)
SLACK_S = 4.0            # scheduling noise on a busy 2-core machine, on top of the timeout


def _rank(rank: int, port: int, sig: int, out: str) -> None:
    os.environ.update(GLOO_SOCKET_IFNAME="lo", COMMWEAVE_TIMEOUT_S=str(TIMEOUT_S), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from launch.net.sharing import TemporalSharing
    from launch.net.striping import open_wan_groups
    from launch.net.wan_p2p import WanP2P
    from tests.launch.plans import two_dc_plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4,
                            timeout=timedelta(minutes=10))
    plan = two_dc_plan(pp=2, dp=2, connections=2)
    atlas = WanP2P(open_wan_groups(plan, 2, stripe_min_bytes=1 << 16), TemporalSharing(plan), plan=plan)
    stage, d, _ = plan.coord(rank)
    peer = plan.rank(1 - stage, d)
    sends = 0
    if rank == FAULT_RANK:
        isend = atlas.wan.isend

        def faulty(tensor, me, to, what=""):
            nonlocal sends
            sends += 1
            transfer = isend(tensor, me, to, what)          # posted: the stripes are on their way
            if sends == FAULT_AT:
                Path(out, "fault").write_text(str(time.time()))
                os.kill(os.getpid(), sig)
            return transfer

        atlas.wan.isend = faulty
    dist.barrier()
    try:
        for step in range(100):
            for m in range(2):
                x = torch.full((1 << 20,), float(1000 * step + 10 * m + d))       # 4 MiB: two stripes
                if stage == 0:
                    atlas.post_send(x, rank, peer).wait()
                else:
                    atlas.post_recv(x, rank, peer).wait()
            for m in range(2):
                g = torch.full((1 << 20,), float(-m))
                if stage == 1:
                    atlas.post_send(g, rank, peer).wait()
                else:
                    atlas.post_recv(g, rank, peer).wait()
        report = {"finished": True}
    except Exception as e:          # every error is the result
        report = {"error": f"{type(e).__name__}: {e}", "t": time.time()}
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    os._exit(0)          # leave at once, as a failed job's rank does: its connections close


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_a_dead_or_frozen_rank_in_a_pipeline_send_fails_every_other_rank(tmp_path, sig):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, int(sig), str(tmp_path)), daemon=True)
             for r in range(4)]
    for p in procs:
        p.start()
    others = [r for r in range(4) if r != FAULT_RANK]
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and not all((tmp_path / f"rank{r}.json").exists() for r in others):
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()            # the frozen rank (SIGKILL ends a stopped process too)
            p.join()
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in others
               if (tmp_path / f"rank{r}.json").exists()}
    assert sorted(reports) == others, f"ranks {sorted(set(others) - set(reports))} hung"
    fault = float((tmp_path / "fault").read_text())
    delays = {r: rep["t"] - fault for r, rep in reports.items()}
    print(f"\n{sig.name} of rank {FAULT_RANK} in a WAN pipeline send, COMMWEAVE_TIMEOUT_S={TIMEOUT_S:g}:")
    for r, rep in reports.items():
        print(f"  rank {r}: error after {delays[r]:.2f} s: {rep['error'][:160]}")
    print(f"  time from the fault to the last rank's error: {max(delays.values()):.2f} s")
    for r, rep in reports.items():
        assert "error" in rep, f"rank {r} finished although rank {FAULT_RANK} died"
        assert " rank " in rep["error"] and any(op in rep["error"] for op in ("send", "recv", "token")), rep
        assert delays[r] <= TIMEOUT_S + SLACK_S, (r, delays[r], rep["error"])
