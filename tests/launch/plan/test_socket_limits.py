"""What the planner knows about sockets: NCCL's socket split and limits, TCP sysctl advice."""

import pytest

from launch.plan import socket_limits
from launch.plan.topology import WanLink

LINK = WanLink("east", "west", rtt=0.040, bandwidth=10e9 / 8)   # BDP 50 MB


@pytest.mark.parametrize("n, split", [(1, (1, 1)), (4, (1, 4)), (8, (1, 8)), (16, (2, 8)), (24, (3, 8)),
                                      (64, (8, 8)), (9, (3, 3)), (11, (11, 1)), (13, (13, 1))])
def test_nccl_split_within_limits(n, split):
    threads, socks = socket_limits.nccl_split(n)
    assert (threads, socks) == split and threads * socks == n
    assert threads <= socket_limits.NCCL_MAX_THREADS and threads * socks <= socket_limits.NCCL_MAX_SOCKETS


@pytest.mark.parametrize("n", [0, -1, 65, 128])
def test_nccl_split_refuses_out_of_range(n):
    with pytest.raises(ValueError, match="--wan-connections"):
        socket_limits.nccl_split(n)


def _sysctls(**values):
    table = {"net.ipv4.tcp_rmem": "4096 131072 6291456", "net.ipv4.tcp_wmem": "4096 16384 4194304",
             "net.core.rmem_max": "212992", "net.core.wmem_max": "212992",
             "net.ipv4.tcp_congestion_control": "cubic", "net.ipv4.tcp_slow_start_after_idle": "1"}
    table.update(values)
    return table.get


def test_tcp_advice_names_each_sysctl():
    # 8 connections over 50 MB in flight: 6.25 MB each, a buffer of 12.5 MB at half used.
    lines = socket_limits.tcp_advice([LINK], 8, read=_sysctls())
    names = [line.split()[0] for line in lines]
    assert names == ["net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem", "net.core.rmem_max", "net.core.wmem_max",
                     "net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle"]
    assert "sysctl -w net.ipv4.tcp_wmem='4096 16384 12500000'" in lines[1]
    tuned = _sysctls(**{"net.ipv4.tcp_rmem": "4096 131072 268435456",
                        "net.ipv4.tcp_wmem": "4096 16384 268435456",
                        "net.core.rmem_max": "268435456", "net.core.wmem_max": "268435456",
                        "net.ipv4.tcp_congestion_control": "bbr", "net.ipv4.tcp_slow_start_after_idle": "0"})
    assert socket_limits.tcp_advice([LINK], 8, read=tuned) == []
    assert socket_limits.tcp_advice([], 8, read=_sysctls()) == []


def test_host_window_is_half_the_smaller_buffer_max():
    assert socket_limits.host_window(read=_sysctls()) == 0.5 * 4194304
    assert socket_limits.host_window() > 0            # this machine's sysctls are readable
