"""Bytes over the WAN: ATLAS's multi-TCP pipeline transfers and temporal sharing (atlas.md §1.3, §2).

    sockets.py   multi-TCP settings (NCCL socket knobs, gloo devices, Megatron's per-group NCCL config),
                 the TCP connections a process holds
    striping.py  k-connection gloo WAN groups, transfers striped by tag, each stripe's connection known
    recovery.py  a broken or stalled WAN connection: reported, re-opened by both ranks, sent again
    sharing.py   temporal WAN sharing: token rings (one group per ring and direction) over the DP senders
    wan_p2p.py   DeepSpeed's and Megatron's pipeline p2p patched onto the two above (with undo)
    netns.py, wanemu.py  one-machine clusters and an emulated WAN with cut/stall faults (tests, benchmarks)
"""
