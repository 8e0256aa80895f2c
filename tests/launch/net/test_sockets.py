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


SS = """ESTAB 0      0               10.201.0.1:38729          10.201.0.2:40916
\t skmem:(r0,rb262144,t0,tb262144,f0,w0,o0,bl0,d0) bbr wscale:10,10 rto:244 rtt:41.2/0.5 mss:8948 \
cwnd:34 bytes_acked:9437185 bytes_received:12 minrtt:40.05 rcv_space:89480 snd_wnd:183296
ESTAB 0      0               127.0.0.1:44566          127.0.0.1:43805
\t skmem:(r0,rb131072,t0,tb4194304,f0,w0,o0,bl0,d0) cubic wscale:10,10 rtt:0.004/0.002 cwnd:11 snd_wnd:65536
"""


def test_tcp_info_reads_windows_and_buffers():
    (far,) = sockets.tcp_info({"10.201.0.2"}, SS)
    assert far["snd_wnd"] == 183296 and far["rb"] == 262144 and far["tb"] == 262144
    assert far["cwnd"] == 34 and far["minrtt"] == 40.05 and far["bytes_acked"] == 9437185
    assert far["cc"] == "bbr" and far["peer"] == "10.201.0.2" and far["local"] == "10.201.0.1:38729"
    assert "rtt" not in far            # "rtt:41.2/0.5" is smoothed/variance, not one number
    assert [c["cc"] for c in sockets.tcp_info(None, SS)] == ["bbr", "cubic"]


def test_one_way_is_half_the_median_minrtt():
    (far,) = sockets.tcp_info({"10.201.0.2"}, SS)
    assert sockets.one_way_s([far]) == pytest.approx(40.05 / 2e3)
    # median of 40, 41, 80 ms (one queued sample) and a connection without the field
    conns = [{"minrtt": 41.0}, {"minrtt": 80.0}, {"minrtt": 40.0}, {"cwnd": 10}]
    assert sockets.one_way_s(conns) == pytest.approx(0.0205)
    assert sockets.one_way_s(conns[:2]) == pytest.approx((41.0 + 80.0) / 4e3)
    with pytest.raises(ValueError, match="no connection reports a minrtt"):
        sockets.one_way_s([{"cwnd": 10}])
