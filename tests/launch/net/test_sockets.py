"""Multi-TCP settings: NCCL's socket split and limits, gloo device lists, TCP sysctl advice."""

import pytest

from launch.net import sockets
from launch.plan.topology import WanLink

LINK = WanLink("east", "west", rtt=0.040, bandwidth=10e9 / 8)   # BDP 50 MB


@pytest.mark.parametrize("n, split", [(1, (1, 1)), (4, (1, 4)), (8, (1, 8)), (16, (2, 8)), (24, (3, 8)),
                                      (64, (8, 8)), (9, (3, 3)), (11, (11, 1)), (13, (13, 1))])
def test_nccl_split_within_limits(n, split):
    threads, socks = sockets.nccl_split(n)
    assert (threads, socks) == split and threads * socks == n
    assert threads <= sockets.NCCL_MAX_THREADS and threads * socks <= sockets.NCCL_MAX_SOCKETS


@pytest.mark.parametrize("n", [0, -1, 65, 128])
def test_nccl_split_refuses_out_of_range(n):
    with pytest.raises(ValueError, match="--wan-connections"):
        sockets.nccl_split(n)


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


def _sysctls(**values):
    table = {"net.ipv4.tcp_rmem": "4096 131072 6291456", "net.ipv4.tcp_wmem": "4096 16384 4194304",
             "net.core.rmem_max": "212992", "net.core.wmem_max": "212992",
             "net.ipv4.tcp_congestion_control": "cubic", "net.ipv4.tcp_slow_start_after_idle": "1"}
    table.update(values)
    return table.get


def test_tcp_advice_names_each_sysctl():
    # 8 connections over 50 MB in flight: 6.25 MB each, a buffer of 12.5 MB at half used.
    lines = sockets.tcp_advice([LINK], 8, read=_sysctls())
    names = [line.split()[0] for line in lines]
    assert names == ["net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max", "net.core.wmem_max",
                     "net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle"]
    assert "sysctl -w net.ipv4.tcp_wmem='4096 16384 12500000'" in lines[1]
    tuned = _sysctls(**{"net.ipv4.tcp_rmem": "4096 131072 268435456",
                        "net.ipv4.tcp_wmem": "4096 16384 268435456",
                        "net.core.rmem_max": "268435456", "net.core.wmem_max": "268435456",
                        "net.ipv4.tcp_congestion_control": "bbr", "net.ipv4.tcp_slow_start_after_idle": "0"})
    assert sockets.tcp_advice([LINK], 8, read=tuned) == []
    assert sockets.tcp_advice([], 8, read=_sysctls()) == []


def test_host_window_is_half_the_smaller_buffer_max():
    assert sockets.host_window(read=_sysctls()) == 0.5 * 4194304
    assert sockets.host_window() > 0            # this machine's sysctls are readable
