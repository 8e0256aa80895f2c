"""Pipeline send/recv across the WAN: DeepSpeed's and Megatron's p2p, patched to stripe transfers
over the k-connection WAN groups (:mod:`launch.net.striping`) and take turns on the link
(:mod:`launch.net.sharing`). Pairs that stay inside a data center keep the original code path.

Each patch set checks every target's signature before it installs any (a DeepSpeed or Megatron
release that changed a function is refused, not half-patched). :meth:`WanP2P.undo` is idempotent and
always completes: it switches the routing off first (every replacement then passes straight through to
the original), restores every attribute it still owns (one replaced again by someone else stays,
passing through, with a warning), then collects the token rings once. The routing sits *below*
``commweave.comm``'s callers in DeepSpeed and Megatron (their
p2p functions are the only hook the pipeline engines expose); every transfer it makes still goes
through ``commweave.comm`` on the WAN groups.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from launch.net.sharing import TemporalSharing
from launch.net.striping import WanGroups
from launch.plan.plan import Plan

DEEPSPEED_PARAMS = {"send": ["tensor", "dest_stage", "async_op"], "recv": ["tensor", "src_stage", "async_op"]}
MEGATRON_PARAMS = ["tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "group",
                   "prev_pipeline_rank", "next_pipeline_rank"]


@dataclass
class Patch:
    """One replaced module attribute, with the original kept for :meth:`undo`."""

    module: object
    name: str
    replacement: object
    original: object

    @staticmethod
    def check(module, name: str, params: list[str]) -> None:
        found = list(inspect.signature(getattr(module, name)).parameters)
        if found != params:
            raise RuntimeError(f"cannot patch {module.__name__}.{name}: expected parameters {params}, "
                               f"found {found} (an unsupported DeepSpeed/Megatron version)")

    @classmethod
    def install(cls, module, name: str, replacement, params: list[str]) -> Patch:
        cls.check(module, name, params)
        original = getattr(module, name)
        setattr(module, name, replacement)
        return cls(module, name, replacement, original)

    def undo(self) -> bool:
        """Restore the original; False (and nothing changed) where a later patch replaced ours."""
        if getattr(self.module, self.name) is not self.replacement:
            return False
        setattr(self.module, self.name, self.original)
        return True


class _Done:
    """A finished transfer where the caller expects a Work handle (temporal sends complete inline)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@dataclass
class WanP2P:
    wan: WanGroups
    sharing: TemporalSharing | None = None
    patches: list[Patch] = field(default_factory=list)
    active: bool = True
    plan: Plan | None = None

    def crosses(self, me: int, peer: int) -> bool:
        return self.active and self.wan.group(me, peer) is not None

    def post_send(self, tensor: torch.Tensor, me: int, peer: int):
        """Send over the WAN. With temporal sharing the transfer runs to completion while this rank
        holds its token (the next replica may only start once the link is free)."""
        ring = self.sharing.ring(me, peer) if self.sharing is not None else None
        what = self._what("send", me, peer)
        if ring is None:
            return self.wan.isend(tensor, me, peer, what)
        ring.acquire()
        self.wan.isend(tensor, me, peer, what).wait()
        ring.release()
        return _Done()

    def post_recv(self, tensor: torch.Tensor, me: int, peer: int):
        return self.wan.irecv(tensor, me, peer, self._what("recv", me, peer))

    def _what(self, kind: str, me: int, peer: int) -> str:
        """The transfer in pipeline terms, for errors and reports."""
        plan = self.plan
        if plan is None:
            return f"WAN {kind} between rank {me} and rank {peer}"
        (s, d, _), (sp, _, _) = plan.coord(me), plan.coord(peer)
        way = "to" if kind == "send" else "from"
        return f"WAN {kind} of stage {s} replica {d} (rank {me}) {way} stage {sp} (rank {peer})"

    def undo(self) -> None:
        """Switch the routing off, restore every patch (last first), collect the token rings. A second
        call does nothing; a ring that fails to close still leaves every patch restored."""
        if not self.active:
            return
        self.active = False
        kept = []
        while self.patches:
            patch = self.patches.pop()
            if not patch.undo():
                kept.append(f"{patch.module.__name__}.{patch.name}")
        if kept:
            warnings.warn(f"ATLAS undo: {', '.join(kept)} replaced again after ATLAS patched it; left in "
                          "place (ATLAS's routing inside it is off)", RuntimeWarning, stacklevel=2)
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

        self._install(p2p, [("send", atlas_send, DEEPSPEED_PARAMS["send"]),
                            ("recv", atlas_recv, DEEPSPEED_PARAMS["recv"])])

    def _install(self, module, patches: list) -> None:
        """Check every signature, then install all (never half of a set)."""
        for name, _, params in patches:
            Patch.check(module, name, params)
        for name, fn, params in patches:
            self.patches.append(Patch.install(module, name, fn, params))

    # -- Megatron: megatron/core/pipeline_parallel/p2p_communication.py _p2p_ops, _batched_p2p_ops ---
    def patch_megatron(self) -> None:
        from megatron.core.pipeline_parallel import p2p_communication as mp

        p2p_ops, batched = mp._p2p_ops, mp._batched_p2p_ops

        def atlas_p2p_ops(**kw):
            wan = self._take_wan(kw)
            reqs = p2p_ops(**kw)
            reqs.update(self._post(wan))
            return reqs

        def atlas_batched_p2p_ops(**kw):
            wan = self._take_wan(kw)
            return batched(**kw) + list(self._post(wan).values())

        self._install(mp, [("_p2p_ops", atlas_p2p_ops, MEGATRON_PARAMS),
                           ("_batched_p2p_ops", atlas_batched_p2p_ops, MEGATRON_PARAMS)])

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
