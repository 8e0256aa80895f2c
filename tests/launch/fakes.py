"""Stand-ins for pdsh, ssh, srun and mpirun (OpenMPI and Hydra dialects) that record their argv and
then do what the real tool would do with it, on this machine, in a sandbox directory:

- ``pdsh -S -f N -w H1,H2 CMD...``: joins CMD with spaces (as pdsh does) and runs it through ``sh -c``
  once per host, in a clean environment as a fresh ssh session has, ``%n`` replaced by the host's index;
- ``ssh [-o OPT | -oOPT | -p PORT]... HOST CMD...``: an ``-oProxyCommand=X`` option runs X through the
  shell, as OpenSSH does; CMD runs through ``sh -c``;
- ``srun -n N --nodelist H1,H2 --ntasks-per-node P --export=ALL[,K=V...] PROG...``: splits --export at
  commas as Slurm does, starts the tasks block-wise with SLURM_PROCID/LOCALID/NODEID/NTASKS and
  SLURMD_NODENAME; the program is started directly (no shell), as srun does;
- ``mpirun`` (OpenMPI: ``-hostfile H -x K=V``; Hydra, mpich/impi: ``-ppn P -genv K V -hosts H1,H2``,
  ``-env K V`` per MPMD segment separated by ``:``): starts the ranks block-wise with OMPI_COMM_WORLD_*
  or PMI_RANK/PMI_SIZE/MPI_LOCALRANKID, directly (no shell);
- ``sinfo``, ``ompi_info``: present (DeepSpeed checks for them) and do nothing.

Every call appends ``{"tool": name, "argv": [...]}`` to ``calls.jsonl`` in the bin folder; a test
that expects nothing to run asserts the file does not exist (and its marker file neither)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

_COMMON = r'''
import json, os, shlex, subprocess, sys
LOG, SANDBOX = {log!r}, {sandbox!r}
with open(LOG, "a") as f:
    f.write(json.dumps({{"tool": {tool!r}, "argv": sys.argv[1:]}}) + "\n")
os.makedirs(SANDBOX, exist_ok=True)

def wait_all(procs):
    rc = 0
    for p in procs:
        rc = p.wait() or rc
    sys.exit(rc)
'''

_PDSH = r'''
args = sys.argv[1:]
hosts = None
while args:
    if args[0] == "-S": args = args[1:]
    elif args[0] == "-f": args = args[2:]
    elif args[0] == "-w": hosts, args = args[1].split(","), args[2:]
    else: break
cmd = " ".join(args)
clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
wait_all([subprocess.Popen(["sh", "-c", cmd.replace("%n", str(i))], env=clean, cwd=SANDBOX)
          for i, _ in enumerate(hosts)])
'''

_SSH = r'''
args = sys.argv[1:]
while args and args[0].startswith("-"):
    opt = args[0]
    if opt in ("-o", "-p"):
        value, args = args[1], args[2:]
    else:
        value, args = opt[2:], args[1:]
    if opt.startswith("-o") and value.lower().startswith("proxycommand="):
        subprocess.run(["sh", "-c", value.split("=", 1)[1]], cwd=SANDBOX)
host, cmd = args[0], " ".join(args[1:])
sys.exit(subprocess.run(["sh", "-c", cmd], cwd=SANDBOX).returncode)
'''

_SRUN = r'''
args, opts = sys.argv[1:], {}
while args and args[0].startswith("-"):
    if args[0].startswith("--export="):
        opts["export"], args = args[0].split("=", 1)[1], args[1:]
    else:
        opts[args[0]], args = args[1], args[2:]
env = dict(os.environ)
for item in opts.get("export", "ALL").split(","):      # Slurm splits the list at every comma
    if item == "ALL":
        continue
    key, _, value = item.partition("=")
    env[key] = value
hosts, n = opts["--nodelist"].split(","), int(opts["-n"])
per = int(opts["--ntasks-per-node"])
procs = []
for rank in range(n):
    node, local = divmod(rank, per)
    e = {**env, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
         "SLURM_NTASKS": str(n), "SLURMD_NODENAME": hosts[node]}
    procs.append(subprocess.Popen(args, env=e, cwd=SANDBOX))
wait_all(procs)
'''

_MPIRUN = r'''
args = sys.argv[1:]
genv, hosts, n, ppn, slots = {}, None, None, None, None
openmpi = "-hostfile" in args
while args and args[0].startswith("-"):
    opt = args[0]
    if opt == "-x":                                          # OpenMPI: -x K=V
        key, _, value = args[1].partition("="); genv[key] = value; args = args[2:]
    elif opt == "-genv":                                     # Hydra: -genv K V
        genv[args[1]] = args[2]; args = args[3:]
    elif opt == "--mca":
        args = args[3:]
    elif opt == "-hostfile":
        lines = [line.split() for line in open(args[1]) if line.strip()]
        hosts, slots = [w[0] for w in lines], [int(w[1].split("=")[1]) for w in lines]
        args = args[2:]
    elif opt == "-hosts":
        hosts = args[1].split(","); args = args[2:]
    elif opt in ("-n", "-np"):
        n = int(args[1]); args = args[2:]
        if not openmpi and hosts is not None:
            break                                            # impi: per-rank MPMD segments follow
    elif opt == "-ppn":
        ppn = int(args[1]); args = args[2:]
    else:
        args = args[2:]
segments = []
if openmpi or n is not None and hosts is not None and "-env" not in args:
    segments = [({}, args)] * n
else:                                                        # -env K V ... PROG : -n 1 -env ... PROG
    part = []
    for word in args + [":"]:
        if word != ":":
            part.append(word)
            continue
        words, env = part, {}
        if words[:1] == ["-n"]:
            words = words[2:]
        while words[:1] == ["-env"]:
            env[words[1]] = words[2]; words = words[3:]
        segments.append((env, words))
        part = []
n, per = len(segments), ppn or slots[0]
procs = []
for rank, (env, prog) in enumerate(segments):
    node, local = divmod(rank, per)
    e = {**os.environ, **genv, **env}
    if openmpi:
        e.update(OMPI_COMM_WORLD_RANK=str(rank), OMPI_COMM_WORLD_LOCAL_RANK=str(local),
                 OMPI_COMM_WORLD_SIZE=str(n), OMPI_COMM_WORLD_LOCAL_SIZE=str(per))
    else:
        e.update(PMI_RANK=str(rank), PMI_SIZE=str(n), MPI_LOCALRANKID=str(local))
    procs.append(subprocess.Popen(prog, env=e, cwd=SANDBOX))
wait_all(procs)
'''

_NOTHING = "\nsys.exit(0)\n"

TOOLS = {"pdsh": _PDSH, "ssh": _SSH, "srun": _SRUN, "mpirun": _MPIRUN, "sinfo": _NOTHING,
         "ompi_info": _NOTHING}


def install(folder: Path) -> Path:
    """Write the fakes into ``folder/bin`` (returned); the sandbox is ``folder/sandbox``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    log, sandbox = str(bin_dir / "calls.jsonl"), str(folder / "sandbox")
    for tool, body in TOOLS.items():
        path = bin_dir / tool
        path.write_text(f"#!{sys.executable}\n" + _COMMON.format(log=log, sandbox=sandbox, tool=tool) + body)
        path.chmod(0o755)
    return bin_dir


def calls(bin_dir: Path) -> list[dict]:
    path = bin_dir / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
