"""ATLAS: training one model across data centers with DeepSpeed and Megatron (arXiv 2411.14458).

Four wings, imports pointing one way only: run -> bubbletea -> net -> plan -> commweave (never back up,
no circle; tests/test_imports.py checks it):

    plan/       what runs where: the topology, the cost model and simulator, the search, the placement,
                the baselines, the timeline; ``python -m launch.plan TOPOLOGY`` (plan/__main__.py)
    net/        bytes over the WAN: the socket settings, striped k-connection transfers, their recovery,
                temporal sharing, the pipeline p2p patches, and a one-machine WAN emulator
    bubbletea/  prefill inference in the pipeline bubbles (in the simulator and in a DeepSpeed engine)
    run/        launching and the rank side: ``deepspeed-atlas`` / ``python -m launch``, the launchers,
                the dry run, and what a training script calls on every rank
"""
