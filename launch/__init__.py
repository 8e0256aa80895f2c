"""ATLAS: training one model across data centers with DeepSpeed and Megatron (arXiv 2411.14458).

    topology.py  the topology file (DCs, hosts, slots, GPU speed, WAN rtt/bandwidth), validated
    estimate.py  a layout's costs -> the simulator's job; simulate.py the discrete-event iteration
                 simulator (fluid.py: a WAN direction shared per TCP connection, spatial or temporal)
    bound.py     a proven lower bound on the simulator; search.py ranks candidates by the simulator
    plan.py      Algorithm 1 placement + search -> pp/tp/dp, stage-to-DC map, sharing, connections,
                 DC-ordered hostfile
    baselines.py DP across the WAN, stock DeepSpeed/Megatron rank order, Varuna-like, same simulator
    report.py    ``python -m launch.plan``: the plan against the baselines, the JSON line
    timeline.py  one iteration's ops: idle windows, a PNG (matplotlib), a Chrome trace
    sockets.py   multi-TCP settings (NCCL socket knobs, gloo devices) and TCP sysctl advice
    striping.py  k-connection gloo WAN groups, transfers striped by tag
    sharing.py   temporal WAN sharing: token rings over the DP senders of a boundary
    wan_p2p.py   DeepSpeed's and Megatron's pipeline p2p patched onto the two above (with undo)
    runtime.py   what a training script calls on every rank
    runner.py    ``deepspeed-atlas`` / ``python -m launch``: plan -> hostfile + env -> DeepSpeed's runner
    netns.py, wanemu.py  one-machine clusters and an emulated WAN (tests and benchmarks)
"""
