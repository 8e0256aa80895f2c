"""Launching an ATLAS job and joining it on every rank.

    runner.py    ``deepspeed-atlas`` / ``python -m launch``: checks -> plan -> hostfile + env -> DeepSpeed
    launchers.py each DeepSpeed --launcher carried safely (pdsh, openmpi, slurm, mpich, impi) or refused
    dryrun.py    ``deepspeed-atlas --dry-run``: per node, the command, environment and hostfile
    runtime.py   what a training script calls on every rank (rank/local rank from every launcher)
"""
