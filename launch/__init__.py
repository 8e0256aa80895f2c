"""ATLAS: training one model across data centers with DeepSpeed and Megatron (arXiv 2411.14458).

    topology.py  the topology file (DCs, hosts, slots, WAN rtt/bandwidth), validated
    estimate.py  the planner's cost model; simulate.py its discrete-event iteration simulator
    plan.py      Algorithm 1 placement + search -> pp/tp/dp, stage-to-DC map, DC-ordered hostfile
    sockets.py   multi-TCP settings (NCCL socket knobs, gloo devices) and TCP sysctl advice
    striping.py  k-connection gloo WAN groups, transfers striped by tag
    sharing.py   temporal WAN sharing: token rings over the DP senders of a boundary
    wan_p2p.py   DeepSpeed's and Megatron's pipeline p2p patched onto the two above (with undo)
    runtime.py   what a training script calls on every rank
    runner.py    ``deepspeed-atlas`` / ``python -m launch``: plan -> hostfile + env -> DeepSpeed's runner
    netns.py, wanemu.py  one-machine clusters and an emulated WAN (tests and benchmarks)
"""
