"""What runs where: topology + model -> the ATLAS plan, simulated against the baselines.

    topology.py      the topology file (DCs, hosts, slots, GPU speed, WAN rtt/bandwidth), validated
                     field by field
    estimate.py      a layout's costs -> the simulator's job; simulate.py the discrete-event iteration
                     simulator (fluid.py: a WAN direction shared per TCP connection, spatial or temporal)
    bound.py         a proven lower bound on the simulator; search.py ranks candidates by the simulator
    placement.py     Algorithm 1 placement + search -> pp/tp/dp, stage-to-DC map, sharing, connections,
                     DC-ordered hostfile
    plan.py          the plan itself (what the launcher exports to every rank and net/ reads)
    socket_limits.py what the planner knows about sockets: NCCL's limits, the default window, NCCL's
                     buffer memory, this host's TCP sysctls checked against a plan
    baselines.py     DP across the WAN, stock DeepSpeed/Megatron rank order, Varuna-like, same simulator
    timeline.py      one iteration's ops: idle windows, a PNG (matplotlib), a Chrome trace
    __main__.py      ``python -m launch.plan``: the plan against the baselines, the JSON line
"""
