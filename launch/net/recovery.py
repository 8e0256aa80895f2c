"""A broken WAN connection, reported and repaired: what :meth:`launch.net.striping.Transfer.wait` does when
a stripe fails.

gloo gives each device of a group one TCP connection per rank pair; when one breaks (a reset, a
closed peer) or stalls (no progress within ``COMMWEAVE_TIMEOUT_S``: gloo then closes it), that device
of the group is dead for good, and the other devices still work. A transfer that lost some of its
stripes while others arrived (so the peer is alive and the path works) is sent again on fresh
connections, agreed by both ranks of the pair; one that lost every stripe (a dead or frozen peer, the
whole path down, or a transfer small enough to go whole on one connection) is an error at once,
naming the transfer, the stripe, its connection and the peer:

1. report: a ``RuntimeWarning`` and an entry in ``WanGroups.events`` naming the transfer (pipeline
   coordinates), the stripe, its TCP connection (local and remote address and port) and the peer.
   gloo (torch 2.13) reports a connection reset only for an operation that has not started moving
   data; a reset or a stall in the middle of a stripe shows as no progress within the timeout;
2. agree: both ranks write, under a key of the broken group in the job's store (the c10d store, a
   connection of its own), how many transfers each way they completed, and read the other's (within
   the timeout: a peer that does not come is dead, frozen, or saw nothing fail, and this rank raises);
3. re-open: both ranks create a new group for the pair (``new_group`` over the two ranks only), with
   the same k devices, and drop the broken one;
4. resend: the sender sends again what the receiver lacks (its last completed send, whose stripes it
   keeps until the next one completes: gloo completes a send when the bytes are in the socket buffer,
   before they arrive), and both re-post the transfers still in flight, in their order;
5. at most ``ATLAS_WAN_RETRIES`` (default 2) times per transfer; then a ``CommError`` naming the stripe,
   its connection, the peer and the attempts.

What it cannot repair: a failure one rank never sees (the sender's data was in its socket buffer when
the link broke and it sends nothing more on the pair) makes the other rank's store wait time out, an
error within the timeout, not a retry. Recovery is gloo-only (see :mod:`launch.net.striping`).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from datetime import timedelta

import torch.distributed as dist

from commweave import comm

RETRIES_ENV, DEFAULT_RETRIES = "ATLAS_WAN_RETRIES", 2


def retries() -> int:
    """How many times one transfer is sent again after a broken connection (``ATLAS_WAN_RETRIES``)."""
    text = os.environ.get(RETRIES_ENV, str(DEFAULT_RETRIES))
    if not text.isdigit():
        raise ValueError(f"{RETRIES_ENV}={text!r}: must be an integer >= 0")
    return int(text)


def recover(wan, pair, failing, failed: dict[int, Exception]) -> None:
    """Repair ``pair`` after ``failing`` lost the stripes ``failed``; returns once ``failing`` completed."""
    limit = retries()
    me = dist.get_rank()
    peer = pair.ranks[1] if pair.ranks[0] == me else pair.ranks[0]
    while True:
        failing.attempts += 1
        hopeless = len(failed) == len(failing.views)
        _report(wan, pair, failing, failed, limit, hopeless)
        if hopeless or dist.get_backend() != "gloo" or failing.attempts > limit:
            i, e = next(iter(sorted(failed.items())))
            if hopeless:
                why = "(no stripe arrived: the peer is dead or frozen, or the whole path is down)"
            elif dist.get_backend() != "gloo":
                why = f"(no repair on {dist.get_backend()})"
            else:
                why = f"after {limit} retr{'y' if limit == 1 else 'ies'}"
            raise type(e)(f"ATLAS WAN: {failing.what} failed {why}: stripe {i} of {len(failing.views)} on "
                          f"{pair.connection(i)} (group {pair.name}, peer rank {peer}): {e}") from e
        theirs = _exchange(pair, me, peer, failing.what,
                           {"sent": pair.done.get(me, 0), "received": pair.done.get(peer, 0)})
        old = pair.group
        wan.open_pair(pair.ranks, local=True)
        dist.destroy_process_group(old)
        delivered = theirs["received"]           # this rank's sends the peer completed
        resend = None
        if delivered < pair.done.get(me, 0):
            if delivered != pair.last_index or pair.last_sent is None:
                raise comm.CommError(f"ATLAS WAN: {pair.name}: peer rank {peer} completed {delivered} of "
                                     f"this rank's {pair.done.get(me, 0)} sends; only the last one is kept "
                                     "for a resend")
            # the failing transfer's own class (launch.net.striping.Transfer, which calls this module)
            resend = type(failing)(wan, pair, "send", pair.last_sent, me, peer, f"resend of {failing.what}",
                                   resend_of=pair.last_index)
        for t in list(pair.inflight):
            if t.kind == "send" and t.index < delivered:
                t.finish()                       # arrived before the connection broke
            else:
                t.post()
        failed = {}
        if resend is not None:
            failed = resend.wait_stripes()
        if not failed and not failing.done:
            failed = failing.wait_stripes()
        if not failed:
            if not failing.done:
                failing.finish()
            return


def _report(wan, pair, failing, failed: dict[int, Exception], limit: int, hopeless: bool) -> None:
    k = len(failing.views)
    stalled = all(isinstance(e, comm.CommTimeout) for e in failed.values())
    for i, e in sorted(failed.items()):
        wan.events.append({"transfer": failing.what, "pair": pair.name, "stripe": i, "stripes": k,
                           "connection": pair.connection(i),
                           "kind": "timeout" if isinstance(e, comm.CommTimeout) else "error",
                           "attempt": failing.attempts, "error": str(e), "time": time.monotonic()})
    stripes = ", ".join(f"{i} ({pair.connection(i)})" for i in sorted(failed))
    action = (f"re-opening the pair's connections and sending again (retry {failing.attempts} of {limit})"
              if failing.attempts <= limit and not hopeless else "giving up")
    how = "made no progress within COMMWEAVE_TIMEOUT_S (stalled or reset)" if stalled else "broke"
    warnings.warn(f"ATLAS WAN: {failing.what}: stripe(s) {stripes} of {k} {how} (group {pair.name}): "
                  f"{next(iter(failed.values()))}; {action}", RuntimeWarning, stacklevel=3)


def _exchange(pair, me: int, peer: int, what: str, mine: dict) -> dict:
    """Both ranks of the pair publish their counts under the broken group's name; returns the peer's."""
    store = dist.distributed_c10d._get_default_store()
    tag = f"atlas-wan/{dist.distributed_c10d._get_process_group_name(pair.group)}"
    store.set(f"{tag}/{me}", json.dumps(mine))
    seconds = comm.timeout_s()
    try:
        store.wait([f"{tag}/{peer}"], timedelta(seconds=seconds))
        return json.loads(store.get(f"{tag}/{peer}"))
    except (RuntimeError, dist.DistStoreError) as e:
        raise comm.CommTimeout(f"ATLAS WAN: {what}: peer rank {peer} did not join the repair of the "
                               f"broken connection of {pair.name} within COMMWEAVE_TIMEOUT_S={seconds:g} s: "
                               f"it is dead, frozen, or saw its side of the transfer complete ({e})") from e
