"""ATLAS: training one model across data centers with DeepSpeed and Megatron (arXiv 2411.14458).

    topology.py  the topology file (DCs, hosts, slots, GPU speed, WAN rtt/bandwidth), validated field by field
    estimate.py  a layout's costs -> the simulator's job; simulate.py the discrete-event iteration
                 simulator (fluid.py: a WAN direction shared per TCP connection, spatial or temporal)
    bound.py     a proven lower bound on the simulator; search.py ranks candidates by the simulator
    plan.py      Algorithm 1 placement + search -> pp/tp/dp, stage-to-DC map, sharing, connections,
                 DC-ordered hostfile
    baselines.py DP across the WAN, stock DeepSpeed/Megatron rank order, Varuna-like, same simulator
    report.py    ``python -m launch.plan``: the plan against the baselines, the JSON line
    timeline.py  one iteration's ops: idle windows, a PNG (matplotlib), a Chrome trace
    sockets.py   multi-TCP settings (NCCL socket knobs, gloo devices), NCCL buffer memory, TCP sysctl advice
    striping.py  k-connection gloo WAN groups, transfers striped by tag, each stripe's connection known
    recovery.py  a broken or stalled WAN connection: reported, re-opened by both ranks, sent again
    sharing.py   temporal WAN sharing: token rings (one group per ring and direction) over the DP senders
    wan_p2p.py   DeepSpeed's and Megatron's pipeline p2p patched onto the two above (with undo)
    runtime.py   what a training script calls on every rank (rank/local rank from every launcher)
    runner.py    ``deepspeed-atlas`` / ``python -m launch``: checks -> plan -> hostfile + env -> DeepSpeed
    launchers.py each DeepSpeed --launcher carried safely (pdsh, openmpi, slurm, mpich, impi) or refused
    dryrun.py    ``deepspeed-atlas --dry-run``: per node, the command, environment and hostfile
    netns.py, wanemu.py  one-machine clusters and an emulated WAN with cut/stall faults (tests, benchmarks)
"""
