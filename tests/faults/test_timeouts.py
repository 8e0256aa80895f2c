"""Timeouts that mean what they say (issue 22, item 4): one range, 1 s .. 1 week, for every setting.

Before: COMMWEAVE_TIMEOUT_S (and ``"parm".timeout_s``, ``--commweave-timeout-s``) below 1 ms rounded to
torch's "no timeout" (an all-reduce waited 15 s for a peer 15 s late), 1e14 and above were accepted and
raised OverflowError at the first wait, and ranks could run with different bounds. Now every setting goes
through ``comm.check_seconds`` (commweave.values.seconds), a refused value raises at the first wait (once
the operation has completed under the default bound: the peers may be in it), and every agreement
compares the ranks' timeouts, so a rank with another value, or one whose value
is refused, makes every rank raise the same error at set-up. The multi-rank cases run on 4 ranks (one
world for the module).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from commweave import comm
from tests.faults import corpus

pytestmark = pytest.mark.fault("refused", kind="timeouts")

RULE = "the communication timeout must be a finite number of seconds in [1, 604800]"
BAD = ["0.0005", "1e-4", "0.999", "0", "-3", "1e14", "1e400", "inf", "nan", "604801", "", "5 s", "1_0"]


@pytest.mark.parametrize("value", BAD)
def test_the_variable(monkeypatch, value):
    monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", value)
    corpus.refused(comm.timeout_s, f"COMMWEAVE_TIMEOUT_S={value!r}", RULE)


@pytest.mark.parametrize("value", [1e-4, 0.5, 1e14, float("inf"), True, "abc", [5]])
def test_the_parm_section(value):
    from ds_plugins.config import ParmConfig

    corpus.refused(lambda: ParmConfig.from_dict({"timeout_s": value}), f"parm timeout_s={value!r}", RULE)


@pytest.mark.parametrize("value", ["0.0005", "1e14", "0.5"])
def test_the_megatron_argument(value):
    from megatron_patches.args import WallFacerConfig, add_wallfacer_args
    from tests.faults.test_bad_input import BASE, _megatron_parser

    parser = add_wallfacer_args(_megatron_parser())
    corpus.refused(lambda: WallFacerConfig.from_args(parser.parse_args(f"{BASE} --commweave-timeout-s {value}"
                                                                       .split())),
                   f"--commweave-timeout-s={value!r}", RULE, error=Exception)


@pytest.mark.parametrize("value", [1e-4, 1e14, 0.5])
def test_set_timeout_and_a_worlds_bounds(value):
    from commweave.world import World

    corpus.refused(lambda: comm.set_timeout(value), f"timeout={value!r}", RULE)
    corpus.refused(lambda: World(2, timeout=value), f"World.timeout={value!r}", "seconds in [1, 604800]")


@pytest.mark.fault("harmless", kind="timeouts")
def test_the_ends_of_the_range_are_accepted(monkeypatch):
    for value in ("1", "604800", "2.5e2"):
        monkeypatch.setenv("COMMWEAVE_TIMEOUT_S", value)
        assert comm.timeout_s() == float(value)


def _handle_wait_refuses_a_tiny_bound() -> str:
    x = torch.ones(2)
    handle = comm.all_reduce(x, dist.group.WORLD, async_op=True)
    try:
        handle.wait(timedelta(microseconds=1))      # torch would read 1 us as "no timeout"
    except ValueError as e:
        handle.wait()
        return str(e)
    return ""


def _refused_at_the_wait() -> tuple[str, float]:
    os.environ["COMMWEAVE_TIMEOUT_S"] = "1e14"
    x = torch.ones(2)
    try:
        comm.all_reduce(x, dist.group.WORLD)
    except ValueError as e:
        return str(e), float(x[0])
    finally:
        del os.environ["COMMWEAVE_TIMEOUT_S"]
    return "", float(x[0])


def _initialize(parm: dict, env: dict) -> str:
    import ds_plugins
    from tests.ds_plugins.deepspeed_oracle import use_layout
    from tests.faults.test_bad_input import S, _net

    lay = use_layout(2, 2)
    net = _net(None)
    os.environ.update(env)
    config = {"train_micro_batch_size_per_gpu": S, "parm": {"enabled": True, "schedule": "s1", **parm},
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
    try:
        with comm.trace_torch_distributed():
            ds_plugins.initialize(model=net, model_parameters=net.parameters(), mpu=lay.mpu, config=config)
    except ValueError as e:
        return str(e)
    finally:
        comm.set_timeout(None)
        for key in env:
            del os.environ[key]
    return ""


def _disagreeing_ranks() -> dict[str, str]:
    me, out = dist.get_rank(), {}
    out["parm timeout_s 7 on rank 2"] = _initialize({"timeout_s": 7} if me == 2 else {}, {})
    out["COMMWEAVE_TIMEOUT_S 0.0005 on rank 1"] = _initialize({}, {"COMMWEAVE_TIMEOUT_S": "0.0005"}
                                                              if me == 1 else {})
    comm.set_timeout(5 if me == 3 else 300)
    try:
        comm.check_agree(dist.group.WORLD, "wallfacer_attention", rows=8)   # a per-call agreement
        out["set_timeout 5 on rank 3, a values-only agreement"] = ""
    except ValueError as e:
        out["set_timeout 5 on rank 3, a values-only agreement"] = str(e)
    finally:
        comm.set_timeout(None)
    out["Handle.wait(1 us)"] = _handle_wait_refuses_a_tiny_bound()
    out["COMMWEAVE_TIMEOUT_S 1e14 at an all-reduce"], out["sum"] = _refused_at_the_wait()
    return out


@pytest.fixture(scope="module")
def disagreeing(world_pool):
    return world_pool.get(4).run(_disagreeing_ranks)


AGREED = {  # case -> what every rank's error says
    "parm timeout_s 7 on rank 2": ['ds_plugins.initialize: the "parm" section: the ranks of group world must '
                                   "agree on the communication timeout (s)", "rank 0=300.0, rank 1=300.0, "
                                   "rank 2=7.0, rank 3=300.0"],
    "COMMWEAVE_TIMEOUT_S 0.0005 on rank 1": ["rank 1: COMMWEAVE_TIMEOUT_S='0.0005': " + RULE],
    "set_timeout 5 on rank 3, a values-only agreement": ["wallfacer_attention: the ranks of group world must "
                                                         "agree on the communication timeout (s)",
                                                         "rank 3=5.0"],
    "Handle.wait(1 us)": ["Handle.wait(timeout)=1e-06: " + RULE],
    "COMMWEAVE_TIMEOUT_S 1e14 at an all-reduce": ["COMMWEAVE_TIMEOUT_S='1e14': " + RULE],
}


@pytest.mark.parametrize("case", list(AGREED))
def test_every_rank_gets_the_same_error(disagreeing, case):
    corpus.says([r[case] for r in disagreeing], *AGREED[case])
    if case.endswith("at an all-reduce"):   # the operation completed on every rank, then the refusal
        assert all(r["sum"] == 4.0 for r in disagreeing)
