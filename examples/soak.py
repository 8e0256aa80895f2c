"""Soak: a training job (examples/train_moe.py by default) with ranks killed at random and restarted from
its last checkpoint, against an undisturbed run of the same job.

    python -m examples.soak --minutes 30                    # examples/train_moe.py, 4 CPU ranks
    python -m examples.soak --job examples/train_gpt.py --minutes 30 -- <the job's own arguments>

The disturbed run: for ``--minutes`` the job trains and, at a random moment (uniform in ``--kill-after``
seconds after its first step), one rank chosen at random gets SIGKILL. The other ranks must then fail on
their own (a dead peer is an error, not a hang: they are given COMMWEAVE_TIMEOUT_S plus a margin, then
killed and counted as hung). The job is started again and resumes from its last committed checkpoint.
When the window closes the last attempt runs on to its next step and is stopped. The undisturbed run
trains the same job to the same step, and the losses are compared step by step: the job's batches are a
function of the step and the checkpoint holds the RNG states, so the two runs must agree within
``--tolerance`` (relative), and in fact bit for bit.

The job contract (examples/train_moe.py follows it; examples/resume.py does the checkpoint part): it takes
``--steps N --checkpoint-dir D --save-every K``, resumes from D when D holds a committed checkpoint, prints
``step <i> loss <x>`` after each step on rank 0, and runs under the usual torch.distributed variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), which this driver sets for its ``--ranks`` local
processes, as the deepspeed launcher does on one node (so that it can kill one rank and watch the rest).

Prints a table of the attempts, the restarts, the steps lost (trained after the last checkpoint before a
kill, hence trained again), the time from each kill to the last rank's exit, the final losses, and a JSON
line; writes ``soak.json`` and the ranks' logs under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step\s+(\d+)\s+loss\s+([-+0-9.eEnaif]+)\s*$")


@dataclass
class Attempt:
    index: int
    resumed_from: int = 0
    losses: dict[int, float] = field(default_factory=dict)
    killed_rank: int | None = None
    killed_after_s: float | None = None     # since the attempt's first step
    last_step_before_kill: int | None = None
    exit_after_kill_s: dict[int, float] = field(default_factory=dict)
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    hung: list[int] = field(default_factory=list)
    stopped: bool = False
    wall_s: float = 0.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """One start of the job: ``ranks`` processes, their logs, rank 0's step lines."""

    def __init__(self, args, ckpt: Path, logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        cmd = [sys.executable, str(args.job), "--steps", str(args.steps), "--checkpoint-dir", str(ckpt),
               "--save-every", str(args.save_every), *args.job_args]
        self.procs, self.files = [], []
        self.log0 = logs / "rank0.log"
        for r in range(args.ranks):
            env = {**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(args.ranks),
                   "LOCAL_SIZE": str(args.ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "COMMWEAVE_TIMEOUT_S": str(args.timeout_s), "PYTHONPATH": str(ROOT),
                   "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONUNBUFFERED": "1"}
            f = open(logs / f"rank{r}.log", "w")  # noqa: SIM115 (closed in close())
            self.files.append(f)
            self.procs.append(subprocess.Popen(["nice", "-n", str(args.nice), *cmd, f"--local_rank={r}"],
                                               cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT))
        self.port = port

    def steps(self) -> tuple[dict[int, float], int]:
        """Rank 0's losses so far, and the step it resumed from."""
        losses, resumed = {}, 0
        if self.log0.exists():
            for line in self.log0.read_text(errors="replace").splitlines():
                m = STEP.match(line.strip())
                if m:
                    losses[int(m.group(1))] = float(m.group(2))
                elif line.startswith("resumed from step "):
                    resumed = int(line.split()[-1])
        return losses, resumed

    def alive(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if p.poll() is None]

    def kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def close(self) -> None:
        self.kill_all()
        for f in self.files:
            f.close()
        for r in range(len(self.procs)):       # DeepSpeed's CPU all-reduce buffers are never unlinked
            Path(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{self.port}_{r}").unlink(
                missing_ok=True)


def _attempt(args, index: int, ckpt: Path, out: Path, window_end: float | None, until_step: int | None,
             rng) -> Attempt:
    """Run the job once. While ``window_end`` (a monotonic time) is ahead, one rank is killed at a random
    moment; once it has passed, the job is stopped after its next step. ``until_step``: stopped after it."""
    a = Attempt(index)
    job = Job(args, ckpt, out / f"attempt{index}")
    t0 = time.monotonic()
    first_step_at = kill_at = step_at_close = None
    try:
        while job.alive():
            time.sleep(0.2)
            a.losses, a.resumed_from = job.steps()
            now, last = time.monotonic(), max(a.losses, default=None)
            if last is not None and first_step_at is None:
                first_step_at = now
                if window_end is not None and now < window_end:
                    kill_at = now + rng.uniform(*args.kill_after)
            if kill_at is not None and now >= kill_at and now < window_end:
                a.killed_rank = rng.randrange(args.ranks)
                a.killed_after_s, a.last_step_before_kill = now - first_step_at, last
                job.procs[a.killed_rank].send_signal(signal.SIGKILL)
                deadline = now + args.timeout_s + args.grace_s
                while job.alive() and time.monotonic() < deadline:
                    time.sleep(0.05)
                    for r, proc in enumerate(job.procs):
                        if r != a.killed_rank and r not in a.exit_after_kill_s and proc.poll() is not None:
                            a.exit_after_kill_s[r] = time.monotonic() - now
                a.hung = job.alive()
                break
            if window_end is not None and now >= window_end and last is not None:
                if step_at_close is None:
                    step_at_close = last
                elif last > step_at_close:          # a step completed after the window closed
                    a.stopped = True
                    break
            if until_step is not None and last is not None and last >= until_step:
                a.stopped = True
                break
        a.losses, a.resumed_from = job.steps()
    finally:
        a.exit_codes = {r: proc.poll() for r, proc in enumerate(job.procs)}
        job.close()
        a.wall_s = time.monotonic() - t0
    return a


def _run(args, name: str, out: Path, disturbed: bool, until_step: int | None = None) -> list[Attempt]:
    """The disturbed run (kills for ``--minutes``), or the undisturbed one (stopped after ``until_step``)."""
    ckpt = out / name / "checkpoints"
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    rng = random.Random(args.seed)
    window_end = time.monotonic() + 60 * args.minutes if disturbed else None
    attempts: list[Attempt] = []
    while True:
        a = _attempt(args, len(attempts), ckpt, out / name, window_end, until_step, rng)
        attempts.append(a)
        if a.killed_rank is not None:
            what = (f"rank {a.killed_rank} killed {a.killed_after_s:.0f} s after the first step, the others "
                    f"exited within {max(a.exit_after_kill_s.values(), default=float('nan')):.1f} s, "
                    f"hung {a.hung}")
        else:
            what = "stopped" if a.stopped else f"exit codes {a.exit_codes}"
        print(f"  {name} attempt {a.index}: resumed from step {a.resumed_from}, steps "
              f"{min(a.losses, default='-')}..{max(a.losses, default='-')}; {what} ({a.wall_s:.0f} s)",
              flush=True)
        if a.killed_rank is None:
            if not a.stopped:
                raise RuntimeError(f"{name}: the job ended without a kill or a stop (exit codes "
                                   f"{a.exit_codes}); see {out / name / f'attempt{a.index}'}")
            return attempts


def _merged(attempts: list[Attempt]) -> dict[int, float]:
    """The loss of each step from the attempt that last trained it (a resumed attempt retrains steps)."""
    losses: dict[int, float] = {}
    for a in attempts:
        losses.update(a.losses)
    return losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", type=Path, default=ROOT / "examples" / "train_moe.py")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--minutes", type=float, default=30.0, help="how long ranks are killed at random")
    p.add_argument("--steps", type=int, default=1_000_000, help="the job's --steps (it is stopped earlier)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--kill-after", type=float, nargs=2, default=(20.0, 150.0), metavar=("MIN", "MAX"),
                   help="seconds after an attempt's first step at which a rank is killed (uniform)")
    p.add_argument("--timeout-s", type=float, default=30.0, help="COMMWEAVE_TIMEOUT_S of the job")
    p.add_argument("--grace-s", type=float, default=60.0, help="on top of the timeout before 'hung'")
    p.add_argument("--tolerance", type=float, default=1e-3, help="relative, on the final loss")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nice", type=int, default=10)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "soak")
    p.add_argument("job_args", nargs="*", help="after --: the job's own arguments")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.job.resolve() == (ROOT / "examples" / "train_moe.py").resolve() and not args.job_args:
        # configs/parm_cpu.json, with the timeout as the "parm" key and "auto"'s fitted costs kept in one
        # file, so that every start of either run picks the same schedule
        config = json.loads((ROOT / "configs" / "parm_cpu.json").read_text())
        config["parm"].update(timeout_s=args.timeout_s, cost_cache=str(args.out / "cost_cache.json"))
        (args.out / "ds_config.json").write_text(json.dumps(config, indent=1))
        args.job_args = ["--deepspeed_config", str(args.out / "ds_config.json"), "--eval-every", "0",
                         "--hidden", "64", "--ffn", "256", "--layers", "2", "--seq", "32"]

    t0 = time.monotonic()
    print(f"soak: {args.job.name} on {args.ranks} ranks, ranks killed for {args.minutes:g} min", flush=True)
    disturbed = _run(args, "disturbed", args.out, disturbed=True)
    final = max(_merged(disturbed))
    print(f"undisturbed run to step {final}", flush=True)
    reference = _run(args, "undisturbed", args.out, disturbed=False, until_step=final)
    got, want = _merged(disturbed), _merged(reference)
    common = sorted(set(got) & set(want))
    diffs = [abs(got[s] - want[s]) for s in common]
    kills = [a for a in disturbed if a.killed_rank is not None]
    # steps trained after the last checkpoint before a kill: trained again by the next attempt
    lost_after = {a.index: a.last_step_before_kill + 1 - b.resumed_from
                  for a, b in itertools.pairwise(disturbed) if a.killed_rank is not None}
    lost = list(lost_after.values())
    exits = [max(a.exit_after_kill_s.values(), default=float("nan")) for a in kills]
    rel = abs(got[final] - want[final]) / max(abs(want[final]), 1e-12)
    summary = {
        "job": str(args.job.relative_to(ROOT) if args.job.is_relative_to(ROOT) else args.job),
        "ranks": args.ranks, "minutes": args.minutes, "restarts": len(disturbed) - 1, "kills": len(kills),
        "killed_ranks": [a.killed_rank for a in kills], "steps_lost": lost, "steps_lost_total": sum(lost),
        "kill_to_last_exit_s": [round(x, 2) for x in exits],
        "worst_kill_to_last_exit_s": round(max(exits), 2) if exits else None,
        "hung_ranks": sum(len(a.hung) for a in disturbed), "final_step": final,
        "final_loss_disturbed": got[final], "final_loss_undisturbed": want[final], "final_rel_diff": rel,
        "max_abs_diff_all_steps": max(diffs, default=None), "steps_compared": len(common),
        "tolerance_rel": args.tolerance, "within_tolerance": rel <= args.tolerance,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print("\n| attempt | resumed from | last step | killed rank | after s | steps lost | last exit s "
          "| hung |\n|---|---|---|---|---|---|---|---|")
    for a in disturbed:
        print(f"| {a.index} | {a.resumed_from} | {max(a.losses, default='-')} | "
              f"{'-' if a.killed_rank is None else a.killed_rank} | "
              f"{'-' if a.killed_after_s is None else f'{a.killed_after_s:.0f}'} | "
              f"{lost_after.get(a.index, '-')} | "
              f"{max(a.exit_after_kill_s.values(), default=float('nan')):.1f} | {a.hung or '-'} |")
    print(f"\nrestarts {summary['restarts']}, steps lost {summary['steps_lost_total']}, hung ranks "
          f"{summary['hung_ranks']}; final loss at step {final}: disturbed {got[final]:.6f}, undisturbed "
          f"{want[final]:.6f} (relative difference {rel:.2e}, tolerance {args.tolerance:g}); max |diff| over "
          f"{len(common)} steps {summary['max_abs_diff_all_steps']:.2e}")
    (args.out / "soak.json").write_text(json.dumps({"summary": summary,
                                                    "disturbed": [asdict(a) for a in disturbed],
                                                    "undisturbed": [asdict(a) for a in reference]}, indent=1))
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
