"""Multi-TCP settings: NCCL's socket knobs (checked against its limits), gloo device lists, Megatron's
per-group NCCL config."""

import pytest

from launch.net import sockets
from launch.plan.topology import WanLink

LINK = WanLink("east", "west", rtt=0.040, bandwidth=10e9 / 8)   # BDP 50 MB


@pytest.mark.parametrize("env, message", [
    ({"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "16"}, "16 x 8 = 128: must be <= 64"),
    ({"NCCL_SOCKET_NTHREADS": "17"}, "NCCL_SOCKET_NTHREADS=17: must be in 1..16"),
    ({"NCCL_NSOCKS_PERTHREAD": "many"}, "must be an integer"),
])
def test_user_nccl_knobs_are_checked(env, message):
    with pytest.raises(ValueError, match=message):
        sockets.nccl_env(8, [LINK], env)


def test_nccl_env_defaults_and_user_values():
    env = sockets.nccl_env(16, [LINK], {})
    assert env == {"NCCL_SOCKET_NTHREADS": "2", "NCCL_NSOCKS_PERTHREAD": "8", "NCCL_BUFFSIZE": str(64 << 20)}
    kept = sockets.nccl_env(16, [LINK], {"NCCL_SOCKET_NTHREADS": "4", "NCCL_BUFFSIZE": "8388608"})
    assert kept["NCCL_SOCKET_NTHREADS"] == "4" and kept["NCCL_BUFFSIZE"] == "8388608"
    # the user's 4 threads with our 8 sockets per thread is 32 <= 64: accepted
    with pytest.raises(ValueError, match="must be <= 64"):
        sockets.nccl_env(16, [LINK], {"NCCL_SOCKET_NTHREADS": "16"})   # 16 x 8 = 128


def test_gloo_ifname_and_megatron_config():
    assert sockets.gloo_ifname("wan0", 3) == "wan0,wan0,wan0"
    with pytest.raises(ValueError, match="one name"):
        sockets.gloo_ifname("a,b", 2)
    assert sockets.megatron_nccl_config(False) == ""
    # every group spanning stages (pp, mp = tp x pp, the embedding groups, tp_ep_pp) on NCCL's socket
    # transport; the groups inside a stage (DP/TP/CP/EP) untouched
    assert sockets.megatron_nccl_config(True) == "".join(
        f"{g}:\n  net_name: socket\n" for g in ("pp", "mp", "embd", "pos_embd", "tp_ep_pp"))
