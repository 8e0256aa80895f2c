"""A lower bound on the simulator's iteration time, in O(stages x distinct replicas).

The planner ranks candidates by the simulator itself (:mod:`launch.plan.search`): in increasing order of
this bound, simulating each, until the next bound exceeds the best simulated time. Every candidate
left out is provably no faster, so the choice is the simulator's best of all candidates; the bound
only decides how many need simulating. A closed form that merely *estimates* (the old one was off by
2x on pp=12 tp=2 dp=1, where 1F1B's limit on micro-batches in flight throttles a stage behind a WAN
round trip) cannot give that guarantee.

For one replica (hop_e = latency + A/rate of boundary e's transfer alone on its path — with
blocking sends the A/rate part is added to the sending op instead, which the row waits out; fill_s =
Σ_{e<s}(t_f,e + hop_e) the earliest F(s,0); R_s = Σ_{s'>s}(t_f + t_b) + Σ_{e≥s} 2·hop_e the round
trip from the end of F(s,m) to the start of B(s,m); k_s = warm-up + 1 = the 1F1B in-flight limit),
the last backward of stage s ends no earlier than each of
    fill_s + M·(t_f + t_b)                                          (its own work)
    fill_s + (M−1)·t_f + nB·t_b + t_f + R_s + t_b                   (ops before F(s,M−1), then the
                                                                     round trip; nB = M−1−warm-up)
    fill_s + r·t_f + q·(t_f + R_s + t_b) + t_f + R_s + t_b          (1F1B: F(s, m+k_s) waits for
                                                                     B(s, m); M−1 = q·k_s + r)
and stage s' < s ends after that plus the backward chain down to s'. DeepSpeed's order adds its
receives and a tighter in-flight limit per boundary (:func:`_deepspeed_calls`); a job whose replicas
run in lockstep is bounded as the one replica the engines simulate
(launch.plan.deepspeed_schedule.lockstep). Then a stage's all-reduce
(its intra-DC part, each WAN flow alone). And each WAN direction carries all its bytes at no more
than its bandwidth, starting no earlier than its first possible release and followed by the least
work any of its transfers still leads to.
"""

from __future__ import annotations

from launch.plan.deepspeed_schedule import lockstep
from launch.plan.simulate import ENGINES, Job


def lower_bound(job: Job) -> float:
    if job.schedule in ENGINES:
        job = lockstep(job) or job        # the engines simulate such a job as one replica, exactly
    S, D, M, A = job.stages, job.replicas, job.micro_batches, job.act_bytes
    # DeepSpeed's TrainSchedule and Megatron's non-interleaved schedule run their compute in 1F1B order
    # (warm-up S − s − 1, then F and B alternate: deepspeed_schedule.py, megatron_schedule.py), only
    # later (their blocking calls add waits), so 1F1B's in-flight limits bound them too
    one_f1b = job.schedule in ("1f1b", "deepspeed", "megatron")
    stage_end = [0.0] * S
    wan_bytes: dict[tuple[str, str], float] = {}
    wan_bw: dict[tuple[str, str], float] = {}
    first: dict[tuple[str, str], float] = {}
    tail: dict[tuple[str, str], float] = {}

    def on_wan(key, nbytes, bandwidth, release, after):
        wan_bytes[key] = wan_bytes.get(key, 0.0) + nbytes
        wan_bw[key] = bandwidth
        first[key] = min(first.get(key, release), release)
        tail[key] = min(tail.get(key, after), after)

    columns: dict[tuple, int] = {}      # identical replicas are bounded once
    for d in range(D):
        key = (tuple(job.t_f[s][d] for s in range(S)), tuple(job.t_b[s][d] for s in range(S)),
               tuple(job.routes[e][d] for e in range(S - 1)))
        columns[key] = columns.get(key, 0) + 1
    for (tf0, tb0, routes), copies in columns.items():
        if job.blocking_sends or job.schedule in ENGINES:
            # a row is busy until its send has left: ops last compute + send alone, hops the latency
            send = [r.alone(A) - r.latency for r in routes]
            tf = [tf0[s] + (send[s] if s < S - 1 else 0.0) for s in range(S)]
            tb = [tb0[s] + (send[s - 1] if s > 0 else 0.0) for s in range(S)]
            hop = [r.latency for r in routes]
        else:
            tf, tb, hop = tf0, tb0, [r.alone(A) for r in routes]
        fill, drain = [0.0] * S, [0.0] * S
        for s in range(1, S):
            fill[s] = fill[s - 1] + tf[s - 1] + hop[s - 1]
            drain[s] = drain[s - 1] + hop[s - 1] + tb[s - 1]
        R = [0.0] * S
        for s in range(S - 2, -1, -1):
            R[s] = R[s + 1] + tf[s + 1] + tb[s + 1] + 2 * hop[s]
        E = []
        for s in range(S):
            warm = min(S - s - 1, M) if one_f1b else M
            after_last_f = tf[s] + R[s] + tb[s]
            e = max(fill[s] + M * (tf[s] + tb[s]),
                    fill[s] + (M - 1) * tf[s] + max(0, M - 1 - warm) * tb[s] + after_last_f)
            if one_f1b and warm < M:
                q, r = divmod(M - 1, warm + 1)
                e = max(e, fill[s] + r * tf[s] + q * (tf[s] + R[s] + tb[s]) + after_last_f)
            E.append(e)
        if one_f1b:
            _window_cycles(E, tf, tb, hop, fill, R, M)
        if job.schedule == "deepspeed":
            _deepspeed_calls(E, tf0, tf, tb, send, hop, fill, R, M)
        for s in range(S):
            end = max(E[x] + drain[x] - drain[s] for x in range(s, S))
            stage_end[s] = max(stage_end[s], end)
        for e, r in enumerate(routes):
            if r.wan is None:
                continue
            back = hop[e] + tb[e] + drain[e]           # after B(e+1, m): down to stage 0
            after_f = r.latency + tf[e + 1] + R[e + 1] + tb[e + 1] + back
            after_b = r.latency + tb[e] + drain[e]
            on_wan(r.wan, copies * M * A, r.bandwidth, fill[e] + tf0[e], after_f)
            on_wan(r.wan[::-1], copies * M * A, r.bandwidth,
                   fill[e + 1] + tf[e + 1] + R[e + 1] + tb0[e + 1], after_b)
    best = max(stage_end)
    for s, c in enumerate(job.collectives):
        alone = [c.seconds] + [f.latency + f.nbytes / min(f.bandwidth, f.streams * f.stream_cap)
                               for f in c.flows]
        best = max(best, stage_end[s] + max(alone))
        for f in c.flows:
            on_wan((f.src, f.dst), f.nbytes, f.bandwidth, stage_end[s], f.latency)
    for key, nbytes in wan_bytes.items():
        best = max(best, first[key] + nbytes / wan_bw[key] + tail[key])
    return best


def _window_cycles(E: list[float], tf, tb, hop, fill, R, M: int) -> None:
    """1F1B's in-flight limits across a window of stages s..s+j (raises E in place).

    Stage s runs F(s, i + k_s) right after B(s, i) (k_s = S − s) and stage s+j runs B(s+j, i + j + 1)
    right after F(s+j, i + k_s) (its warm-up is k_s − j − 1). So
        B(s+j, i) -> back to B(s, i) -> F(s, i + k_s) -> forward to F(s+j, i + k_s) -> B(s+j, i+j+1)
    is a cycle: j + 1 micro-batches per round trip over the window, which costs
        Σ_{x=s..s+j} (t_f + t_b) + 2·Σ_{e=s..s+j−1} hop_e.
    With a WAN hop inside, that round trip is what 1F1B's in-flight limit stalls on (the old closed
    form's 2x miss on pp=12 tp=2 dp=1). Valid while F(s, i + k_s) exists: i ≤ M − 1 − k_s.
    """
    S = len(E)
    work, hops = [0.0], [0.0]
    for x in range(S):
        work.append(work[-1] + tf[x] + tb[x])
    for h in hop:
        hops.append(hops[-1] + h)
    for s in range(S - 1):
        k = S - s
        if k > M - 1:
            continue
        for j in range(1, S - s):
            cycle = work[s + j + 1] - work[s] + 2 * (hops[s + j] - hops[s])
            q = (M - 1 - k) // (j + 1) + 1
            t = s + j
            first_b = fill[t] + tf[t] + R[t] + tb[t]
            E[t] = max(E[t], first_b + q * cycle + (M - 1 - q * (j + 1)) * tb[t])


def _deepspeed_calls(E: list[float], tf0, tf, tb, send, hop, fill, R, M: int) -> None:
    """What DeepSpeed's one-call-at-a-time order adds (raises E in place).

    Every call blocks the rank until it is done, receives included: a receive lasts at least its
    transfer and latency (send_e + hop_e), so after F(s, 0) stage s spends at least
        M·(t_f,s + t_b,s) + (M − 1)·(send_{s−1} + hop_{s−1}) + M·(send_s + hop_s)
    (its compute and sends, then the activations after the first and every gradient it receives).
    And its backward step receives gradient m and only then sends activation m + w (w = S − s − 1,
    train_schedule), so activation m + w leaves stage s no earlier than one round trip after
    activation m did: its transfer (send_s), and R_s from its arrival to gradient m's:
        T(m + w) >= T(m) + send_s + R_s,   T(r) >= fill_s + (r + 1)·t_f,s   (r < w)
    and B(s, M−1) ends no earlier than T(M−1) + send_s + R_s + t_b,s. With 2 stages (w = 1) that is
    every micro-batch paying a transfer, the last stage's forward and backward and a transfer back."""
    S = len(E)
    for s in range(S):
        recv_act = send[s - 1] + hop[s - 1] if s > 0 else 0.0
        recv_grad = send[s] + hop[s] if s < S - 1 else 0.0
        E[s] = max(E[s], fill[s] + M * (tf[s] + tb[s]) + (M - 1) * recv_act + M * recv_grad)
        if s < S - 1:
            w = S - s - 1
            q, r = divmod(M - 1, w)
            E[s] = max(E[s], fill[s] + (r + 1) * tf0[s] + (q + 1) * (send[s] + R[s]) + tb[s])
