"""The p2p patches: DeepSpeed's pipeline engine trains to the single-process losses with its WAN
sends striped and taking turns; Megatron's p2p ops deliver the same tensors over the WAN groups;
intra-DC pairs keep the original path; undo restores the originals."""

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from commweave.ledger import recording
from examples import atlas_pipeline as example
from launch.run.runtime import enable_deepspeed, enable_megatron
from tests.launch.plans import two_dc_plan

LO = {"GLOO_SOCKET_IFNAME": "lo"}
STEPS = 3


def _deepspeed_training(sharing):
    from deepspeed.runtime.pipe import p2p

    plan = two_dc_plan(pp=2, dp=2, connections=2, sharing=sharing or "temporal",
                       layers=len(example.layer_factories()))
    originals = (p2p.send, p2p.recv)
    with recording() as led:
        losses = example.train(STEPS, plan, enable_deepspeed if sharing else None)
    restored = (p2p.send, p2p.recv) == originals
    me = dist.get_rank()
    wan = f"atlas-wan({me % 2},{me % 2 + 2})"
    stage = plan.coord(me)[0]
    tokens = led.calls("send", f"atlas-token(stage{stage},tp0,{'fwd' if stage == 0 else 'bwd'})")
    return losses, led.sent("send", wan), restored, plan.dp * plan.micro_batches, tokens


@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("sharing", [None, "spatial", "temporal"])
def test_deepspeed_pipeline_trains_to_the_reference(world, sharing):
    results = world.run(_deepspeed_training, sharing)
    micro_batches = results[0][3]
    ref = example.reference_losses(STEPS, micro_batches)
    act = example.MICRO_BATCH * example.HIDDEN * 4
    untrained = example.reference_losses(STEPS, micro_batches, lr=0.0)
    assert abs(ref[-1] - untrained[-1]) > 1e-3       # the optimizer steps matter to the losses
    for losses, wan_bytes, restored, _, tokens in results:
        assert losses == pytest.approx(ref, rel=1e-5, abs=1e-7)
        assert restored
        assert (tokens > 0) == (sharing == "temporal")   # replicas pass the WAN token only when taking turns
        if sharing is None:
            assert wan_bytes == 0
        else:
            # stage 0 sends every micro-batch's activation over its WAN group, stage 1 its gradient
            assert wan_bytes >= STEPS * (micro_batches // 2) * act


def _megatron_ops(batched, sharing):
    from megatron.core.pipeline_parallel import p2p_communication as mp

    plan = two_dc_plan(pp=4, tp=1, dp=1, connections=3, sharing=sharing)   # stages a, a, b, b
    me = dist.get_rank()
    group = comm.new_group(range(4), name="pp")
    originals = (mp._p2p_ops, mp._batched_p2p_ops)
    handle = enable_megatron(plan)
    prev, nxt = (me - 1) % 4, (me + 1) % 4
    n = (1 << 20) + 5          # large enough to be striped
    got = {}
    with recording() as led:
        for step in range(2):
            send = torch.full((n,), float(10 * me + step))
            recv_prev = torch.empty(n) if me > 0 else None
            recv_next = torch.empty(n) if me < 3 else None
            op = mp._batched_p2p_ops if batched else mp._p2p_ops
            reqs = op(tensor_send_prev=send if me > 0 else None, tensor_recv_prev=recv_prev,
                      tensor_send_next=send if me < 3 else None, tensor_recv_next=recv_next,
                      group=group, prev_pipeline_rank=prev, next_pipeline_rank=nxt)
            for r in reqs if isinstance(reqs, list) else reqs.values():
                r.wait()
            got[step] = (recv_prev[0].item() if me > 0 else None, recv_next[0].item() if me < 3 else None,
                         all(bool((t == t[0]).all()) for t in (recv_prev, recv_next) if t is not None))
    handle.undo()
    return got, led.sent("send", "atlas-wan(1,2)"), led.calls("send", "atlas-wan(1,2)"), \
        (mp._p2p_ops, mp._batched_p2p_ops) == originals


@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("batched, sharing", [(False, "temporal"), (True, "spatial")])
def test_megatron_p2p_routes_only_the_wan_pair(world, batched, sharing):
    results = world.run(_megatron_ops, batched, sharing)
    n = (1 << 20) + 5
    for me, (got, wan_bytes, wan_calls, restored) in enumerate(results):
        assert restored
        for step, (from_prev, from_next, uniform) in got.items():
            assert uniform
            assert from_prev == (None if me == 0 else 10 * (me - 1) + step)
            assert from_next == (None if me == 3 else 10 * (me + 1) + step)
        # only ranks 1 (stage 1, DC a) and 2 (stage 2, DC b) cross: 2 steps x 3 stripes each
        assert (wan_bytes, wan_calls) == ((2 * 4 * n, 6) if me in (1, 2) else (0, 0))


def _signature_check():
    from deepspeed.runtime.pipe import p2p

    from launch.net.wan_p2p import Patch

    def wrong(tensor, dest):
        return None

    with pytest.raises(RuntimeError, match="expected parameters"):
        Patch.install(p2p, "send", wrong, ["tensor", "dest"])
    return p2p.send.__name__


@pytest.mark.world_size(4, env=LO)
def test_patch_refuses_a_changed_signature(world):
    assert world.run(_signature_check) == ["send"] * 4


def _wrong_topology():
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from deepspeed.runtime.pipe.topology import ProcessTopology

    plan = two_dc_plan(pp=2, dp=2, connections=2)
    deepspeed.init_distributed(dist_backend="gloo")
    data_outer = ProcessTopology(axes=["data", "pipe"], dims=[2, 2])   # ranks 0, 1 = one pipeline
    model = PipelineModule([LayerSpec(torch.nn.Linear, 4, 4) for _ in range(2)], topology=data_outer,
                           loss_fn=torch.nn.MSELoss())
    deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         config={"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1})
    with pytest.raises(ValueError, match=r"topology=launch\.run\.runtime\.pipe_topology"):
        enable_deepspeed(plan)
    return True


@pytest.mark.world_size(4, env=LO)
def test_deepspeed_topology_must_follow_the_plan(world):
    assert world.run(_wrong_topology) == [True] * 4


def _undo_is_idempotent_and_complete():
    import os
    import warnings

    from megatron.core.pipeline_parallel import p2p_communication as mp

    os.environ["COMMWEAVE_TIMEOUT_S"] = "20"    # a receive nobody answers would fail the call, not hang it
    try:
        plan = two_dc_plan(pp=2, dp=2, connections=2)         # temporal: a token ring per stage
        originals = (mp._p2p_ops, mp._batched_p2p_ops)
        me = dist.get_rank()
        stage, d, _ = plan.coord(me)
        peer = plan.rank(1 - stage, d)
        handle = enable_megatron(plan)
        x = torch.full((8,), float(me))
        for _ in range(2):                                     # tokens move; replica 0 collects the last
            (handle.post_send(x, me, peer) if stage == 0 else handle.post_recv(x, me, peer)).wait()

        def later(**kw):                                       # someone else patched after ATLAS
            return atlas(**kw)

        atlas, mp._p2p_ops = mp._p2p_ops, later
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle.undo()
        handle.undo()                                          # posts nothing: the barrier is not delayed
        dist.barrier()
        kept = mp._p2p_ops is later and not handle.crosses(me, peer)   # left in place, passing through
        restored = mp._batched_p2p_ops is originals[1]
        mp._p2p_ops = originals[0]

        second = enable_megatron(plan)                         # a ring that fails to close...
        def broken():
            raise comm.CommTimeout("token lost")
        second.sharing.close = broken
        with pytest.raises(comm.CommTimeout, match="token lost"):
            second.undo()
        after_failure = (mp._p2p_ops, mp._batched_p2p_ops) == originals    # ...still restores both
        second.undo()                                          # and the second undo does nothing
        dist.barrier()
    finally:
        del os.environ["COMMWEAVE_TIMEOUT_S"]
    return kept, restored, after_failure, [str(w.message) for w in caught]


@pytest.mark.world_size(4, env=LO)
def test_undo_twice_after_a_later_patch_and_after_a_failure(world):
    for kept, restored, after_failure, warned in world.run(_undo_is_idempotent_and_complete):
        assert kept and restored and after_failure
        assert any("p2p_communication._p2p_ops replaced again after ATLAS patched it" in w for w in warned)


def _one_rank_cannot_set_up(var, value, bad_rank):
    import os

    plan = two_dc_plan(pp=2, dp=2, connections=2)
    groups = len(dist.distributed_c10d._world.pg_map)
    saved = os.environ.get(var)
    if dist.get_rank() == bad_rank:
        os.environ[var] = value
    try:
        with pytest.raises(ValueError) as e:
            enable_megatron(plan)
    finally:
        if saved is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = saved
    return str(e.value), len(dist.distributed_c10d._world.pg_map) - groups


@pytest.mark.world_size(4, env=LO)
@pytest.mark.parametrize("var, value, bad_rank, everywhere, there", [
    ("ATLAS_SHARING", "fair", 2, "rank(s) [2] could not set up", "ATLAS_SHARING='fair'"),
    ("COMMWEAVE_TIMEOUT_S", "-1", 1, "rank(s) [1] could not set up", "COMMWEAVE_TIMEOUT_S='-1'"),
    ("ATLAS_WAN_RETRIES", "many", 0, "rank(s) [0] could not set up", "ATLAS_WAN_RETRIES='many'"),
    ("ATLAS_WAN_CONNS", "3", 3, "disagree on the connections per WAN pair (ATLAS_WAN_CONNS) "
                                "(rank 0: 2, rank 1: 2, rank 2: 2, rank 3: 3)",
     "disagree on the connections"),
])
def test_a_bad_setting_on_one_rank_stops_every_rank_before_any_group(world, var, value, bad_rank, everywhere,
                                                                     there):
    """The rank with the bad value names it (the variable, the value, the rule); every other rank names
    that rank; no rank created a group (one all-gather, then everyone stops)."""
    for rank, (message, new_groups) in enumerate(world.run(_one_rank_cannot_set_up, var, value, bad_rank)):
        assert (there if rank == bad_rank else everywhere) in message and new_groups == 0, message
