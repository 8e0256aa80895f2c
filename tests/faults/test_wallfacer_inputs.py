"""wallfacer_attention's hostile and careless inputs (issue 22): flags only as bools, integers that cannot
overflow the agreement, packed batches and positions that do not fit — on 4 ranks, every case refused with
the same ValueError on every rank (also where one rank alone got the bad value), naming the argument, the
value and the rule, with nothing but the agreement's all-gathers before it; a healthy call afterwards.

Before: ``causal="false"`` (or "no", "0") computed causal attention; ``team_size=2**63`` on one rank
overflowed that rank's int64 metadata and left the other three waiting in the all-gather until the timeout.
"""

import pytest
import torch
import torch.distributed as dist

from commweave import comm, ledger

WORLD = 4
BIG = 2 ** 63

CASES = {  # name: (bad rank or None for every rank, arguments, expected text)
    "causal 'false', every rank": (None, {"causal": "false"}, "causal='false' must be a bool (True or "
                                   "False); strings and numbers are refused, not read as truth values"),
    "causal 'no', rank 2": (2, {"causal": "no"}, "wallfacer_attention: rank 2: causal='no' must be a bool"),
    "causal '0', rank 1": (1, {"causal": "0"}, "wallfacer_attention: rank 1: causal='0' must be a bool"),
    "causal 1, rank 3": (3, {"causal": 1}, "wallfacer_attention: rank 3: causal=1 must be a bool"),
    "causal None, every rank": (None, {"causal": None}, "causal=None must be a bool"),
    "deterministic 'yes', rank 0": (0, {"deterministic": "yes"}, "wallfacer_attention: rank 0: "
                                    "deterministic='yes' must be a bool"),
    "check 'no', rank 2": (2, {"check": "no"}, "wallfacer_attention: rank 2: check='no' must be a bool"),
    "team_size 2**63, rank 1": (1, {"team_size": BIG}, f"wallfacer_attention: rank 1: team_size C={BIG} is "
                                "invalid for P=4 ranks: C² must divide P (valid: 1, 2)"),
    "team_size -2**63-1, rank 0": (0, {"team_size": -BIG - 1}, f"wallfacer_attention: rank 0: team_size "
                                   f"C={-BIG - 1} is invalid for P=4 ranks"),
    "team_size 2**63, every rank": (None, {"team_size": BIG}, f"team_size C={BIG} is invalid for P=4 ranks"),
    "team_size 2**31, rank 3": (3, {"team_size": 2 ** 31}, "wallfacer_attention: rank 3: team_size "
                                "C=2147483648 is invalid for P=4 ranks"),
    "ulysses_size 2**63, rank 3": (3, {"ulysses_size": BIG}, f"wallfacer_attention: rank 3: "
                                   f"ulysses_size={BIG} must be an int in 1 … P = 4"),
    "ulysses_size True, rank 1": (1, {"ulysses_size": True}, "wallfacer_attention: rank 1: ulysses_size=True "
                                  "must be an int in 1 … P = 4"),
    "cu_seqlens floats, rank 2": (2, {"packed": "float"}, "wallfacer_attention: rank 2: packed_seq_params: "
                                  "cu_seqlens_q must be a 1-d integer tensor, got 1-d torch.float32"),
    "cu_seqlens_kv differs, rank 0": (0, {"packed": "kv"}, "wallfacer_attention: rank 0: packed_seq_params: "
                                      "cu_seqlens_kv (and cu_seqlens_kv_padded) must equal cu_seqlens_q"),
    "qkv_format sbhd, every rank": (None, {"packed": "sbhd"}, "packed_seq_params: qkv_format='sbhd': packed "
                                    "sequences come as 'thd'"),
    "contiguous positions, zigzag layout, every rank": (None, {"positions": "contiguous"}, "on this rank are "
                                                        "not the zigzag layout's"),
    "contiguous positions, zigzag layout, rank 1": (1, {"positions": "contiguous"}, [
        "wallfacer_attention: rank 1: positions [4, 5, 6, 7]", "the batch is in the contiguous layout; pass "
                                                               "layout='contiguous'"]),
    "positions float, rank 3": (3, {"positions": "float"}, "wallfacer_attention: rank 3: positions must be "
                                "an integer tensor [s_local] or [b, s_local], got a 1-d float32 tensor"),
}


def _params(kind):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, 6, 16], dtype=torch.int32)
    if kind == "float":
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.float(), cu_seqlens_kv=cu.float())
    if kind == "kv":
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=torch.tensor([0, 8, 16]))
    return PackedSeqParams(qkv_format=kind, cu_seqlens_q=cu, cu_seqlens_kv=cu)


def _positions(kind, rank):
    if kind == "float":
        return torch.arange(4.0)
    return torch.arange(rank * 4, rank * 4 + 4).expand(2, 4)  # contiguous: [4r, 4r + 4)


def _outcome(fn):
    """(exception type, its text, the kinds of communication before it)."""
    with ledger.recording() as led:
        try:
            fn()
            kind, text = "no error", ""
        except Exception as e:  # the test compares the type
            kind, text = type(e).__name__, str(e)
    return kind, text, sorted({key.split("@")[0] for key, v in led.as_dict().items() if v["calls"]})


def _cases():
    from megatron_patches import wallfacer_attention

    me, out = dist.get_rank(), {}
    comm.set_timeout(60)  # a rank left waiting would fail the case with a timeout, not hang the test
    try:
        for name, (bad, change, _) in CASES.items():
            kw = {"team_size": 2, **(change if bad in (None, me) else {})}
            torch.manual_seed(me)
            q, k, v = torch.randn(4, 2, 4, 8), torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)
            if "packed" in kw:
                kw["packed_seq_params"] = _params(kw.pop("packed"))
                q, k, v = q[:, :1], k[:, :1], v[:, :1]
            if "positions" in kw:
                kw["positions"] = _positions(kw["positions"], me)
            out[name] = _outcome(lambda q=q, k=k, v=v, kw=kw: wallfacer_attention(q, k, v, dist.group.WORLD,
                                                                                 **kw))
        q, k, v = torch.randn(4, 2, 4, 8), torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)
        zigzag = torch.tensor([me * 2, me * 2 + 1, 15 - me * 2 - 1, 15 - me * 2])  # chunks r, 2P−1−r
        out["healthy"] = tuple(wallfacer_attention(q, k, v, dist.group.WORLD, 2, causal=False,
                                                   positions=zigzag).shape) == (4, 2, 4, 8)
    finally:
        comm.set_timeout(None)
    return out


@pytest.mark.world_size(WORLD)
def test_wallfacer_inputs_refused_on_every_rank_before_any_attention_traffic(world):
    results = world.run(_cases)
    bad = []
    for name, (_, _, want) in CASES.items():
        outcomes = [r[name] for r in results]
        kinds, texts, traffic = zip(*outcomes, strict=True)
        wants = [want] if isinstance(want, str) else want
        if set(kinds) != {"ValueError"} or len(set(texts)) != 1 or not all(w in texts[0] for w in wants):
            bad.append(f"{name}: {outcomes}")
        elif not set().union(*map(set, traffic)) <= {"all_gather"}:
            bad.append(f"{name}: communication before the error: {traffic}")
    assert not bad, "\n".join(bad)
    assert all(r["healthy"] for r in results)


def test_case_count():
    """The corpus of this file by class (issue 22's faults table): every case is refused clearly."""
    assert len(CASES) == 19
