"""The one place commweave issues collectives.

Every function takes its process group explicitly (``dist.group.WORLD`` for the world; ``None`` is
refused so that no call silently falls back to the default group), works on gloo and NCCL, and
reports its wire bytes to the open ledgers (:mod:`commweave.ledger`). Point-to-point peers are
*ranks inside the group*, so ring code can compute them in group coordinates.

Tensors are sent as they are: the caller makes them contiguous where layout matters; the functions
here make flat views so gloo accepts N-d buffers (design/traps.md: gloo rejects an N-d input with a
flat output in all-gather).

Every wait is bounded. A collective or point-to-point transfer that does not complete within
:func:`timeout_s` seconds of the wait (``COMMWEAVE_TIMEOUT_S``, default 300, or :func:`set_timeout`)
raises :class:`CommTimeout` naming the operation, the group and, for point-to-point, the peer: a
frozen peer (SIGSTOP, a stuck device) becomes an error instead of a wait for the process group's
timeout (30 minutes by default). A peer that died (connection reset) raises :class:`CommError` at
once. The bound holds whatever timeout the process group was created with, because every operation is
issued asynchronously here and waited on with the bound.
"""

from __future__ import annotations

import inspect
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from commweave import ledger
from commweave import values as value_rules

# The originals, captured once: trace_torch_distributed() patches the public names for foreign code
# (DeepSpeed's MoE, Ulysses) and must not count our own calls twice.
_all_to_all_single = dist.all_to_all_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_reduce = dist.all_reduce
_broadcast = dist.broadcast
_isend = dist.isend
_irecv = dist.irecv
_batch_isend_irecv = dist.batch_isend_irecv

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}

_names: dict[int, tuple[object, str]] = {}

DEFAULT_TIMEOUT_S = 300.0
_TIMEOUT_ENV = "COMMWEAVE_TIMEOUT_S"
_timeout_override: float | None = None


class CommError(RuntimeError):
    """A collective or transfer failed: a peer died or the connection broke."""


class CommTimeout(CommError, TimeoutError):
    """A collective or transfer did not complete within :func:`timeout_s`."""


def check_seconds(value, source: str) -> float:
    """``value`` as a timeout in seconds, or ValueError naming ``source``, the value and the rule: a finite
    number (or plain decimal text) within ``commweave.values.TIMEOUT_RANGE_S``, 1 s .. 1 week (reasons in
    commweave/values.py: under 1 ms torch waits forever, from 1e14 s it overflows).

    Every setting that carries this timeout validates with this, so that all refuse alike: the ``"parm"``
    section's ``timeout_s``, ``--commweave-timeout-s``, ``COMMWEAVE_TIMEOUT_S``, :func:`set_timeout`.
    """
    return value_rules.seconds(value, source, what="the communication timeout", strings=True)


def set_timeout(seconds: float | None) -> None:
    """Set the bound on every wait in this process (``None``: back to ``COMMWEAVE_TIMEOUT_S``).

    Config keys that carry a timeout (the ``"parm"`` section, the launcher) call this once at set-up.
    """
    global _timeout_override
    _timeout_override = None if seconds is None else check_seconds(seconds, "timeout")


def timeout_s() -> float:
    """The bound on every wait, in seconds: :func:`set_timeout`, else ``COMMWEAVE_TIMEOUT_S``, else 300."""
    if _timeout_override is not None:
        return _timeout_override
    env = os.environ.get(_TIMEOUT_ENV)
    return DEFAULT_TIMEOUT_S if env is None else check_seconds(env, _TIMEOUT_ENV)


class Handle:
    """A pending operation; ``wait()`` completes it within :func:`timeout_s` or raises naming it.

    ``what`` names the operation ("all_to_all", "recv", ...), ``where`` the group and, for
    point-to-point, the peer; ``peers`` (optional, one per work) names the peer of each work of an
    operation built from point-to-point messages, so that its error names the peer that failed.
    """

    __slots__ = ("_finish", "_peers", "_works", "what", "where")

    def __init__(self, works, what: str, where: str, finish=None, peers=None) -> None:
        self._works, self._finish = list(works), finish
        self._peers = list(peers) if peers is not None and len(peers) == len(self._works) else None
        self.what, self.where = what, where

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Complete the operation; a ``timeout`` (as torch's ``Work.wait`` takes) only shortens the bound,
        within the same range (under 1 ms torch would read it as no timeout at all)."""
        try:
            seconds, refused = timeout_s(), None
        except ValueError as e:
            # This rank's bound is refused, but its peers may be in this very operation (an agreement that
            # carries the refusal to them): complete it under the default bound, then raise.
            seconds, refused = DEFAULT_TIMEOUT_S, e
        if timeout is not None:
            seconds = min(seconds, check_seconds(timeout.total_seconds(), "Handle.wait(timeout)"))
        self._wait(seconds)
        if refused is not None:
            raise refused
        return True

    def _wait(self, seconds: float) -> bool:
        for i, w in enumerate(self._works):
            try:
                if isinstance(w, Handle):
                    w._wait(seconds)
                else:
                    w.wait(timedelta(seconds=seconds))
            except CommError:
                raise
            except RuntimeError as e:
                timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
                kind = CommTimeout if timed_out else CommError
                reason = (f"did not complete within {_TIMEOUT_ENV}={seconds:g} s: a peer is frozen, dead, "
                          "or not calling the same operation") if timed_out else f"failed: {e}"
                where = self.where if self._peers is None else f"{self.where} ({self._peers[i]})"
                raise kind(f"commweave: {self.what} on {where} {reason}") from e
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None and all(w.is_completed() for w in self._works)


def _check_group(group) -> None:
    if group is None:
        raise ValueError("group=None: commweave passes process groups explicitly; "
                         "use torch.distributed.group.WORLD for the world group")


def set_group_name(group, name: str) -> None:
    """Name a group for the ledger (groups created by DeepSpeed or Megatron get a readable label)."""
    _check_group(group)
    _names[id(group)] = (group, name)


def group_name(group) -> str:
    """The ledger label of a group: its registered name, "world", or "ranks(0,2,4)"."""
    _check_group(group)
    known = _names.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    if group is dist.group.WORLD:
        return "world"
    return "ranks(" + ",".join(map(str, dist.get_process_group_ranks(group))) + ")"


def new_group(ranks: Sequence[int], name: str | None = None, timeout: timedelta | None = None,
              local_sync: bool = False):
    """``dist.new_group`` with a ledger name. Collective: every rank of the world must call it.

    ``local_sync=True`` (torch's ``use_local_synchronization``): only the members call it, so a
    group can be made lazily inside a subgroup; every member must create overlapping groups in the
    same order.
    """
    group = dist.new_group(ranks=list(ranks), timeout=timeout, use_local_synchronization=local_sync)
    if name is not None and group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        set_group_name(group, name)
    return group


def size(group) -> int:
    _check_group(group)
    return dist.get_world_size(group)


def rank(group) -> int:
    _check_group(group)
    return dist.get_rank(group)


def global_rank(group, group_rank: int) -> int:
    _check_group(group)
    return dist.get_global_rank(group, group_rank)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _flat(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"collective buffers must be contiguous, got shape {tuple(t.shape)} "
                         f"with strides {t.stride()}")
    return t.view(-1)


def all_to_all(output: torch.Tensor, input: torch.Tensor, group,
               output_splits: Sequence[int] | None = None, input_splits: Sequence[int] | None = None,
               async_op: bool = False):
    """``all_to_all_single`` along dim 0 (equal splits unless given, in rows of dim 0)."""
    _check_group(group)
    g, me = size(group), rank(group)
    row_in = _nbytes(input) // max(input.shape[0], 1) if input.dim() else _nbytes(input)
    row_out = _nbytes(output) // max(output.shape[0], 1) if output.dim() else _nbytes(output)
    if input_splits is None:
        if input.shape[0] % g:
            raise ValueError(f"all_to_all: input dim 0 ({input.shape[0]}) must divide by the group "
                             f"size {g} when no splits are given")
        self_in = _nbytes(input) // g
    else:
        self_in = input_splits[me] * row_in
    self_out = _nbytes(output) // g if output_splits is None else output_splits[me] * row_out
    ledger.record("all_to_all", group_name(group), _nbytes(input) - self_in, _nbytes(output) - self_out)
    work = _all_to_all_single(output, input.contiguous(),
                              output_split_sizes=None if output_splits is None else list(output_splits),
                              input_split_sizes=None if input_splits is None else list(input_splits),
                              group=group, async_op=True)
    return _done(Handle([work], "all_to_all", _where(group)), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group, async_op: bool = False):
    """Gather every rank's ``input`` into ``output`` (rank order, concatenated on dim 0)."""
    _check_group(group)
    return _done(_issue_all_gather(output, input, group), async_op)


def _issue_all_gather(output: torch.Tensor, input: torch.Tensor, group) -> Handle:
    g = size(group)
    if output.numel() != g * input.numel():
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"{g} x {input.numel()}")
    n = _nbytes(input) * (g - 1)
    ledger.record("all_gather", group_name(group), n, n)
    if _pairwise(group):
        return _pairwise_all_gather(_flat(output), input.contiguous().view(-1), group)
    work = _all_gather(_flat(output), input.contiguous().view(-1), group=group, async_op=True)
    return Handle([work], "all_gather", _where(group))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group, op: str = "sum",
                   async_op: bool = False):
    """Reduce ``input`` over the group; rank r keeps the r-th of g equal slices (dim 0 order)."""
    _check_group(group)
    g = size(group)
    if input.numel() != g * output.numel():
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"{g} x {output.numel()}")
    n = _nbytes(output) * (g - 1)
    ledger.record("reduce_scatter", group_name(group), n, n)
    if op == "sum" and _pairwise(group):
        return _done(_pairwise_reduce_scatter(_flat(output), input.contiguous().view(-1), group), async_op)
    work = _reduce_scatter(_flat(output), input.contiguous().view(-1), op=_OPS[op], group=group,
                           async_op=True)
    return _done(Handle([work], "reduce_scatter", _where(group)), async_op)


def _where(group, peer: int | None = None) -> str:
    """"group pair" or "group ranks(0,1) with peer rank 3" (the peer as a global rank)."""
    label = f"group {group_name(group)}"
    return label if peer is None else f"{label} with peer rank {global_rank(group, peer)}"


def _done(work: Handle, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def _pairwise(group) -> bool:
    """gloo's all-gather and reduce-scatter run about 3x slower than the same exchange as point-to-point
    messages (measured here: 21 MB on 2 ranks, 100 ms vs 35 ms), so on gloo they are built from send/recv,
    as Parm's own SAA kernel builds its all-gather (parm.md §2.6). The ledger records them as collectives.
    """
    return dist.get_backend(group) == "gloo" and size(group) > 1


def _exchange(group, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> tuple[list, list]:
    """Post the pairwise messages; returns the works and, for each, its peer ("send to peer rank 3")."""
    ops, peers = [], []
    for step in range(1, size(group)):  # step s: send to rank+s, receive from rank-s
        me = rank(group)
        to, frm = (me + step) % size(group), (me - step) % size(group)
        ops.append(dist.P2POp(_isend, sends[to], global_rank(group, to), group))
        ops.append(dist.P2POp(_irecv, recvs[frm], global_rank(group, frm), group))
        peers += [f"send to peer rank {global_rank(group, to)}",
                  f"recv from peer rank {global_rank(group, frm)}"]
    return _batch_isend_irecv(ops), peers


def _pairwise_all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> Handle:
    g, me = size(group), rank(group)
    blocks = out.view(g, -1)
    blocks[me].copy_(inp)
    works, peers = _exchange(group, dict.fromkeys(range(g), inp), {q: blocks[q] for q in range(g)})
    return Handle(works, "all_gather", _where(group), peers=peers)


def _pairwise_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group) -> Handle:
    g, me = size(group), rank(group)
    blocks = inp.view(g, -1)
    received = inp.new_empty((g, out.numel()))

    def finish() -> None:
        received[me] = blocks[me]
        torch.sum(received, dim=0, out=out)  # the g partial sums, added in rank order

    works, peers = _exchange(group, {q: blocks[q] for q in range(g)}, {q: received[q] for q in range(g)})
    return Handle(works, "reduce_scatter", _where(group), finish, peers)


def all_reduce(tensor: torch.Tensor, group, op: str = "sum", async_op: bool = False):
    _check_group(group)
    g = size(group)
    n = 2 * _nbytes(tensor) * (g - 1) // g
    ledger.record("all_reduce", group_name(group), n, n)
    work = _all_reduce(tensor, op=_OPS[op], group=group, async_op=True)
    return _done(Handle([work], "all_reduce", _where(group)), async_op)


def broadcast(tensor: torch.Tensor, src: int, group, async_op: bool = False):
    """Broadcast from ``src``, a rank inside ``group``."""
    _check_group(group)
    g, me = size(group), rank(group)
    sent = _nbytes(tensor) * (g - 1) if me == src else 0
    ledger.record("broadcast", group_name(group), sent, 0 if me == src else _nbytes(tensor))
    work = _broadcast(tensor, src=global_rank(group, src), group=group, async_op=True)
    return _done(Handle([work], "broadcast", _where(group, src)), async_op)


def isend(tensor: torch.Tensor, peer: int, group, tag: int = 0):
    """Asynchronous send to ``peer``, a rank inside ``group``; returns the Work handle."""
    _check_group(group)
    ledger.record("send", group_name(group), _nbytes(tensor), 0)
    return Handle([_isend(tensor, dst=global_rank(group, peer), group=group, tag=tag)], "send",
                  _where(group, peer))


def irecv(tensor: torch.Tensor, peer: int, group, tag: int = 0):
    """Asynchronous receive from ``peer``, a rank inside ``group``; returns the Work handle."""
    _check_group(group)
    ledger.record("recv", group_name(group), 0, _nbytes(tensor))
    return Handle([_irecv(tensor, src=global_rank(group, peer), group=group, tag=tag)], "recv",
                  _where(group, peer))


def send(tensor: torch.Tensor, peer: int, group, tag: int = 0) -> None:
    isend(tensor, peer, group, tag).wait()


def recv(tensor: torch.Tensor, peer: int, group, tag: int = 0) -> None:
    irecv(tensor, peer, group, tag).wait()


@dataclass(frozen=True, slots=True)
class P2P:
    """One half of a batched exchange: ``op`` is "send" or "recv", ``peer`` a rank inside ``group``."""

    op: str
    tensor: torch.Tensor
    peer: int
    group: object
    tag: int = 0


def batch_p2p(ops: Sequence[P2P]) -> list:
    """Post a set of sends and receives together (NCCL groups them; gloo posts them in order).

    Returns one :class:`Handle` per op; wait on all of them before reading the received buffers.
    """
    if not ops:
        return []
    p2p, handles = [], []
    for o in ops:
        _check_group(o.group)
        if o.op not in ("send", "recv"):
            raise ValueError(f"P2P.op must be 'send' or 'recv', got {o.op!r}")
        n = _nbytes(o.tensor)
        ledger.record(o.op, group_name(o.group), n if o.op == "send" else 0, n if o.op == "recv" else 0)
        p2p.append(dist.P2POp(_isend if o.op == "send" else _irecv, o.tensor,
                              global_rank(o.group, o.peer), o.group, o.tag))
        handles.append((o.op, _where(o.group, o.peer)))
    works = _batch_isend_irecv(p2p)
    if len(works) != len(handles):  # NCCL returns one work for the whole batch
        return [Handle(works, "batched send/recv", "; ".join(w for _, w in handles))]
    return [Handle([w], op, where) for w, (op, where) in zip(works, handles, strict=True)]


def wait_all(works) -> None:
    """Wait on each handle (ours, or a foreign ``Work``) within :func:`timeout_s`."""
    for w in works:
        if w is not None:
            (w if isinstance(w, Handle) else Handle([w], "operation", "a foreign work handle")).wait()


_MESSAGE_BYTES = 512


def disagreement(group, what: str, error: str | None = None, *, relay: bool = False,
                 **values: int) -> str | None:
    """What every rank of ``group`` must raise, the same text on every rank: a rank's refusal of its input,
    or ``values`` (integers, or floats compared bit for bit) that differ between ranks; None when all is
    well. Collective, never raises.

    ``error`` is this rank's own verdict on its arguments (None when they are fine). A rank that raised
    on its own would leave the others waiting in their next collective, so a rank that refuses its input
    passes the message here instead, and every rank gets "rank 2: <message>" (the first refusing rank; the
    message alone when every rank refused alike, or with ``relay``: a message that an earlier round over
    another group produced, passed on verbatim). Refusals come first, then the values are compared, this
    process's communication timeout among them (:func:`_with_timeout`). One all-gather of
    ``len(values) + 66`` int64 per rank (messages are cut at 512 bytes).
    """
    return _disagreement(group, what, error, relay, _MESSAGE_BYTES, values)


_TIMEOUT_VALUE = "the communication timeout (s)"


def _with_timeout(error: str | None, checked: dict) -> tuple[str | None, dict]:
    """Every agreement also compares this process's :func:`timeout_s`: ranks that bound their waits
    differently would time out at different moments (one waits 3 s for a peer that gives up after 300),
    so a different value (``set_timeout``, the ``"parm"`` section, ``--commweave-timeout-s`` or
    ``COMMWEAVE_TIMEOUT_S`` on one rank) raises on every rank at set-up instead. A value this rank refuses
    is its refusal (sent as NaN where no message can travel)."""
    try:
        bound = timeout_s()
    except ValueError as e:
        bound, error = float("nan"), error or str(e)
    return error, {**checked, _TIMEOUT_VALUE: bound}


def _agreement_bound() -> float:
    """The bound on the agreement's own all-gather: this process's timeout, or the default where this
    process's value is refused (the agreement is how every rank learns of the refusal)."""
    try:
        return timeout_s()
    except ValueError:
        return DEFAULT_TIMEOUT_S


def _disagreement(group, what: str, error: str | None, relay: bool, width: int, values: dict) -> str | None:
    """:func:`disagreement` with messages of up to ``width`` bytes (0: no refusals, the values only)."""
    error, values = _with_timeout(error, values)
    names = list(values)
    floats = {n for n in names if isinstance(values[n], float)}   # sent as their bits, shown as numbers
    ints = [struct.unpack("<q", struct.pack("<d", values[n]))[0] if n in floats else int(values[n])
            for n in names]
    text = (error or "").encode()[:width]
    words = torch.frombuffer(bytearray(text.ljust(width, b"\0")), dtype=torch.int64) if width else \
        torch.empty(0, dtype=torch.int64)
    mine = torch.cat([torch.tensor([*ints, len(text) if error else -1], dtype=torch.int64), words])
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    every = torch.empty(size(group), mine.numel(), dtype=torch.int64, device=device)
    _issue_all_gather(every, mine.to(every.device), group)._wait(_agreement_bound())
    every = every.cpu()
    n = len(names)
    messages = [None if int(row[n]) < 0 else
                row[n + 1:].numpy().tobytes()[:int(row[n])].decode(errors="replace") for row in every]
    refused = [r for r, m in enumerate(messages) if m is not None]
    if refused:
        first = messages[refused[0]]
        if relay or (len(refused) == len(messages) and all(m == first for m in messages)):
            return first
        others = f" (and {len(refused) - 1} other rank(s))" if len(refused) > 1 else ""
        return f"rank {global_rank(group, refused[0])}{others}: {first}"
    bad = [name for i, name in enumerate(names) if (every[:, i] != every[0, i]).any()]
    if not bad:
        return None
    def shown(r: int, i: int):
        v = int(every[r, i])
        return struct.unpack("<d", struct.pack("<q", v))[0] if names[i] in floats else v

    table = "; ".join(f"{name}: " + ", ".join(f"rank {global_rank(group, r)}={shown(r, i)}"
                                               for r in range(size(group)))
                      for i, name in enumerate(names) if name in bad)
    return f"{what}: the ranks of {_where(group)} must agree on {', '.join(bad)}, got {table}"


def agree(group, what: str, error: str | None = None, **values: int) -> None:
    """Raise :func:`disagreement`'s message as a ValueError on every rank of ``group``, if there is one."""
    message = disagreement(group, what, error, **values)
    if message is not None:
        raise ValueError(message)


def check_agree(group, what: str, **values: int) -> None:
    """Raise on every rank of ``group`` unless every rank passed the same integer ``values``.

    Sizes that a later collective depends on (shapes, team sizes, schedule ids) are checked here first,
    so a disagreement is a ``ValueError`` naming each value per rank instead of a hang or a mismatched
    transfer (:func:`agree` without a refusal); the communication timeout is compared too. One all-gather
    of ``len(values) + 2`` int64 per rank.
    """
    message = _disagreement(group, what, None, False, 0, values)
    if message is not None:
        raise ValueError(message)


@contextmanager
def trace_torch_distributed() -> Iterator[None]:
    """Count collectives that foreign code (DeepSpeed's MoE, Ulysses) issues via ``torch.distributed``.

    Patches the public ``torch.distributed`` functions for the duration of the block and restores them
    afterwards. Code that cached a function object before the block (DeepSpeed's backend caches its
    all-gather function at init) is not seen; call sites that look the name up at call time are.
    """

    def wrap(fn, kind):
        def recorded(*args, **kwargs):
            bound = _bind(fn, args, kwargs)
            group = bound.get("group") or dist.group.WORLD
            if kind == "all_to_all":
                t_in, t_out = bound["input"], bound["output"]
                s_in, s_out = bound.get("input_split_sizes"), bound.get("output_split_sizes")
                me, g = dist.get_rank(group), dist.get_world_size(group)
                row_in = _nbytes(t_in) // max(t_in.shape[0], 1)
                row_out = _nbytes(t_out) // max(t_out.shape[0], 1)
                self_in = _nbytes(t_in) // g if not s_in else s_in[me] * row_in
                self_out = _nbytes(t_out) // g if not s_out else s_out[me] * row_out
                ledger.record(kind, group_name(group), _nbytes(t_in) - self_in, _nbytes(t_out) - self_out)
            elif kind == "all_gather":
                n = _nbytes(bound.get("input_tensor", bound.get("tensor"))) * (dist.get_world_size(group) - 1)
                ledger.record(kind, group_name(group), n, n)
            elif kind == "reduce_scatter":
                n = _nbytes(bound["output"]) * (dist.get_world_size(group) - 1)
                ledger.record(kind, group_name(group), n, n)
            elif kind == "all_reduce":
                g = dist.get_world_size(group)
                n = 2 * _nbytes(bound["tensor"]) * (g - 1) // g
                ledger.record(kind, group_name(group), n, n)
            elif kind in ("send", "recv"):
                n = _nbytes(bound["tensor"])
                ledger.record(kind, group_name(group), n if kind == "send" else 0, n if kind == "recv" else 0)
            return fn(*args, **kwargs)

        return recorded

    table = {"all_to_all_single": "all_to_all", "all_gather_into_tensor": "all_gather",
             "all_gather_single": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "reduce_scatter_single": "reduce_scatter", "all_reduce": "all_reduce",
             "send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
    saved = {name: getattr(dist, name) for name in table if hasattr(dist, name)}
    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(fn, table[name]))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _bind(fn, args, kwargs) -> dict:
    return dict(inspect.signature(fn).bind(*args, **kwargs).arguments)
