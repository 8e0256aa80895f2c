"""Pipeline send/recv across the WAN: DeepSpeed's and Megatron's p2p, patched to stripe transfers
over the k-connection WAN groups (:mod:`launch.striping`) and take turns on the link
(:mod:`launch.sharing`). Pairs that stay inside a data center keep the original code path.

Each patch checks its target's signature first (a DeepSpeed or Megatron release that changed the
function is refused, not half-patched) and is undone by :meth:`WanP2P.undo`, which also drains the
token rings. The routing sits *below* ``commweave.comm``'s callers in DeepSpeed and Megatron (their
p2p functions are the only hook the pipeline engines expose); every transfer it makes still goes
through ``commweave.comm`` on the WAN groups.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from commweave import comm
from launch.sharing import TemporalSharing
from launch.striping import WanGroups


@dataclass
class Patch:
    """One replaced module attribute, with the original kept for :meth:`undo`."""

    module: object
    name: str
    replacement: object
    original: object

    @classmethod
    def install(cls, module, name: str, replacement, params: list[str]) -> Patch:
        original = getattr(module, name)
        found = list(inspect.signature(original).parameters)
        if found != params:
            raise RuntimeError(f"cannot patch {module.__name__}.{name}: expected parameters {params}, "
                               f"found {found} (an unsupported DeepSpeed/Megatron version)")
        setattr(module, name, replacement)
        return cls(module, name, replacement, original)

    def undo(self) -> None:
        if getattr(self.module, self.name) is not self.replacement:
            raise RuntimeError(f"{self.module.__name__}.{self.name} was replaced again after ATLAS patched "
                               "it; undo the later patch first")
        setattr(self.module, self.name, self.original)


class _Done:
    """A finished transfer where the caller expects a Work handle (temporal sends complete inline)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class _Works:
    """Several stripes' Work handles behind one ``wait()``, as Megatron's callers expect."""

    works: list

    def wait(self) -> bool:
        comm.wait_all(self.works)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)


@dataclass
class WanP2P:
    wan: WanGroups
    sharing: TemporalSharing | None = None
    patches: list[Patch] = field(default_factory=list)

    def crosses(self, me: int, peer: int) -> bool:
        return self.wan.group(me, peer) is not None

    def post_send(self, tensor: torch.Tensor, me: int, peer: int):
        """Send over the WAN. With temporal sharing the transfer runs to completion while this rank
        holds its token (the next replica may only start once the link is free)."""
        ring = self.sharing.ring(me, peer) if self.sharing is not None else None
        if ring is None:
            return _Works(self.wan.isend(tensor, me, peer))
        ring.acquire()
        comm.wait_all(self.wan.isend(tensor, me, peer))
        ring.release()
        return _Done()

    def post_recv(self, tensor: torch.Tensor, me: int, peer: int):
        return _Works(self.wan.irecv(tensor, me, peer))

    def undo(self) -> None:
        """Restore the original functions (last patch first) and drain the token rings."""
        while self.patches:
            self.patches.pop().undo()
        if self.sharing is not None:
            self.sharing.close()

    # -- DeepSpeed: deepspeed/runtime/pipe/p2p.py send(tensor, dest_stage, async_op) / recv --------
    def patch_deepspeed(self) -> None:
        from deepspeed.runtime.pipe import p2p

        if p2p._grid is None:
            raise RuntimeError("patch_deepspeed: DeepSpeed's pipeline p2p is not initialised; call it "
                               "after deepspeed.initialize() built the PipelineEngine")
        send, recv = p2p.send, p2p.recv

        def atlas_send(tensor, dest_stage, async_op=False):
            me, peer = dist.get_rank(), p2p._grid.stage_to_global(stage_id=dest_stage)
            if async_op or not self.crosses(me, peer):
                return send(tensor, dest_stage, async_op)
            self.post_send(tensor, me, peer).wait()

        def atlas_recv(tensor, src_stage, async_op=False):
            me, peer = dist.get_rank(), p2p._grid.stage_to_global(stage_id=src_stage)
            if async_op or not self.crosses(me, peer):
                return recv(tensor, src_stage, async_op)
            self.post_recv(tensor, me, peer).wait()

        params = ["tensor", "dest_stage", "async_op"]
        self.patches.append(Patch.install(p2p, "send", atlas_send, params))
        self.patches.append(Patch.install(p2p, "recv", atlas_recv, ["tensor", "src_stage", "async_op"]))

    # -- Megatron: megatron/core/pipeline_parallel/p2p_communication.py _p2p_ops, _batched_p2p_ops ---
    def patch_megatron(self) -> None:
        from megatron.core.pipeline_parallel import p2p_communication as mp

        params = ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next",
                  "group", "prev_pipeline_rank", "next_pipeline_rank"]
        p2p_ops, batched = mp._p2p_ops, mp._batched_p2p_ops

        def atlas_p2p_ops(**kw):
            wan = self._take_wan(kw)
            reqs = p2p_ops(**kw)
            reqs.update(self._post(wan))
            return reqs

        def atlas_batched_p2p_ops(**kw):
            wan = self._take_wan(kw)
            return batched(**kw) + list(self._post(wan).values())

        self.patches.append(Patch.install(mp, "_p2p_ops", atlas_p2p_ops, params))
        self.patches.append(Patch.install(mp, "_batched_p2p_ops", atlas_batched_p2p_ops, params))

    def _take_wan(self, kw: dict) -> dict:
        """Move the WAN-crossing tensors out of Megatron's keyword arguments."""
        me, wan = dist.get_rank(), {}
        for name, peer in (("send_prev", kw["prev_pipeline_rank"]), ("recv_prev", kw["prev_pipeline_rank"]),
                           ("send_next", kw["next_pipeline_rank"]), ("recv_next", kw["next_pipeline_rank"])):
            tensor = kw[f"tensor_{name}"]
            if tensor is not None and self.crosses(me, peer):
                wan[name] = (tensor, peer)
                kw[f"tensor_{name}"] = None
        return wan

    def _post(self, wan: dict) -> dict:
        """Receives first: a blocking temporal send must never wait on a peer whose receive for our
        own incoming tensor is not posted yet."""
        me, reqs = dist.get_rank(), {}
        for name in ("recv_prev", "recv_next", "send_next", "send_prev"):
            if name in wan:
                tensor, peer = wan[name]
                post = self.post_recv if name.startswith("recv") else self.post_send
                reqs[name] = post(tensor, me, peer)
        return reqs
