"""The HTTP endpoint (loopback only): N requests get N answers equal to the model run alone, a full queue and
bad requests get clear errors, and a killed service loses no request (re-queued to its restart)."""

import asyncio
import json
import os
import signal
import threading
import time

import pytest
import torch

pytest.importorskip("aiohttp")
pytest.importorskip("safetensors")

import aiohttp

from launch.bubbletea.endpoint import Endpoint, cache_tensors, load_cache, parse
from launch.bubbletea.model import CausalLM, LMConfig
from launch.bubbletea.remote import RemoteRank
from launch.bubbletea.server import PrefillServer
from launch.bubbletea.timeline import Window

CFG = LMConfig(vocab=50, hidden=32, layers=1, heads=2, max_seq=64, seed=5)
MODEL = CausalLM(CFG)


def _server(endpoint):
    # nice 0, not SCHED_IDLE: a loaded CI machine would starve the service; the priority is test_server's
    return PrefillServer(CFG, chunk_tokens=8, callback=endpoint.deliver, cost=(0.001, 0.0, 0.0), nice=0,
                         idle=False, cpus=[min(os.sched_getaffinity(0))])


class Bubbles(threading.Thread):
    """The training engine's part: every 20 ms, a 15 ms window on each attached rank's service."""

    def __init__(self, servers: dict) -> None:
        super().__init__(daemon=True)
        self.servers, self.on, self.halt = servers, threading.Event(), threading.Event()
        self.parked = threading.Event()          # set while ``on`` is clear and no window is open
        self.on.set()

    def run(self) -> None:
        tag = 0
        while not self.halt.wait(0.005):
            if not self.on.is_set():
                self.parked.set()
                self.on.wait()
                self.parked.clear()
            for server in list(self.servers.values()):
                tag += 1
                try:
                    server.plan([Window(None, 0.0, 1.0, tag)])
                    server.open(tag, time.perf_counter() + 0.015)
                    time.sleep(0.015)
                    server.close()
                except OSError:            # a killed service: the endpoint's watchdog deals with it
                    pass


@pytest.fixture(scope="module")
def served():
    """One endpoint, one rank's service, the bubbles: (endpoint, {rank: server}, bubbles)."""
    endpoint = Endpoint(CFG, max_queue=32, timeout=60.0, poll=0.05)
    servers = {0: _server(endpoint)}
    endpoint.attach(servers[0], rank=0)
    endpoint.start("127.0.0.1", 0)
    bubbles = Bubbles(servers)
    bubbles.start()
    yield endpoint, servers, bubbles
    bubbles.halt.set()
    bubbles.on.set()
    bubbles.join(10)
    endpoint.stop()
    for server in servers.values():
        server.stop()


def _prompt(n, seed):
    return torch.randint(CFG.vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def _call(session, method, url, **kwargs):
    async with session.request(method, url, **kwargs) as r:
        body = await r.read()
        return r.status, (json.loads(body) if r.content_type == "application/json" else body), r.headers


def _run(coro_fn, *args, **kwargs):
    async def main():
        async with aiohttp.ClientSession() as session:
            return await coro_fn(session, *args, **kwargs)
    return asyncio.run(main())


def test_n_requests_get_n_answers_and_their_caches(served):
    endpoint, _, _ = served
    prompts = {f"q{i}": _prompt(3 + 5 * i, i) for i in range(12)}

    async def go(session):
        posts = [_call(session, "POST", f"{endpoint.url}/v1/prefill", json={"id": rid, "tokens": p})
                 for rid, p in prompts.items()]
        answers = await asyncio.gather(*posts)
        cache = await _call(session, "GET", f"{endpoint.url}/v1/cache/q5")
        deleted = await _call(session, "DELETE", f"{endpoint.url}/v1/cache/q5")
        again = await _call(session, "GET", f"{endpoint.url}/v1/cache/q5")
        polled = await _call(session, "GET", f"{endpoint.url}/v1/requests/q7")
        return answers, cache, deleted, again, polled

    answers, cache, deleted, again, polled = _run(go)
    assert [status for status, _, _ in answers] == [200] * 12
    for (_, body, _), (rid, p) in zip(answers, prompts.items(), strict=True):
        _, logits = MODEL.prefill(torch.tensor(p))
        assert body["id"] == rid and body["state"] == "done" and body["tokens"] == len(p)
        assert body["first_token"] == int(logits.argmax()) and body["rank"] == 0 and body["ttft_s"] > 0
    assert cache[0] == 200
    got, (want, _) = load_cache(cache[1]), MODEL.prefill(torch.tensor(prompts["q5"]))
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v) and got.length == len(prompts["q5"])
    assert deleted[0] == 200 and again[0] == 404 and "no cache for request 'q5'" in again[1]["error"]
    assert polled[0] == 200 and polled[1]["first_token"] == answers[7][1]["first_token"]


@pytest.mark.parametrize("body, status, reason", [
    (b"{not json", 400, "the body is not JSON: Expecting property name"),
    (b"[1, 2]", 400, 'the body must be a JSON object {"tokens": [...]}, got list'),
    (b"{}", 400, "missing field 'tokens': the prompt's token ids, a list of integers"),
    (b'{"tokens": [1], "prompt": "hi"}', 400, "unknown field 'prompt': the fields are id, tokens, wait"),
    (b'{"tokens": [1], "tokens": [2]}', 400, "field 'tokens' is given twice"),
    (b'{"tokens": "1 2 3"}', 400, "tokens must be a list of integers, got str"),
    (b'{"tokens": [1, 2.5]}', 400, "tokens[1] = 2.5: token ids are integers"),
    (b'{"tokens": [1, true]}', 400, "tokens[1] = true: token ids are integers"),
    (b'{"tokens": [1, "2"]}', 400, 'tokens[1] = "2": token ids are integers'),
    (b'{"tokens": [3, 50]}', 400, r"tokens[1] = 50: token ids lie in [0, 50)"),
    (b'{"tokens": [-1]}', 400, r"tokens[0] = -1: token ids lie in [0, 50)"),
    (b'{"tokens": []}', 400, "tokens: 0 tokens; the model takes 1..64"),
    (json.dumps({"tokens": [1] * 65}).encode(), 400, "tokens: 65 tokens; the model takes 1..64"),
    (b'{"tokens": [1], "id": "a/b"}', 400, 'id="a/b": 1..128 characters of A-Z a-z 0-9 . _ -'),
    (b'{"tokens": [1], "wait": 1}', 400, "wait=1: true or false"),
    (b'{"tokens": [' + b"1, " * 40_000 + b'1]}', 413, "more than a prompt of 64 tokens (the model's max_seq"),
])
def test_bad_requests_get_the_reason(served, body, status, reason):
    endpoint, _, _ = served
    got, answer, _ = _run(_call, "POST", f"{endpoint.url}/v1/prefill", data=body,
                          headers={"Content-Type": "application/json"})
    assert got == status and reason in answer["error"]


def test_an_id_in_use_and_unknown_ones(served):
    endpoint, _, _ = served

    async def go(session):
        url = f"{endpoint.url}/v1/prefill"
        first = await _call(session, "POST", url, json={"id": "dup", "tokens": [1, 2]})
        second = await _call(session, "POST", url, json={"id": "dup", "tokens": [1]})
        unknown = await _call(session, "GET", f"{endpoint.url}/v1/requests/nobody")
        return first, second, unknown

    first, second, unknown = _run(go)
    assert first[0] == 200 and second[0] == 409 and second[1]["error"] == "id 'dup' is already in use"
    assert unknown[0] == 404 and unknown[1]["error"] == "no request 'nobody'"


def test_a_full_queue_says_so_and_waiting_requests_are_refused_with_a_reason():
    """No service attached: requests wait for one, fill the queue, and are refused after orphan_timeout."""
    endpoint = Endpoint(CFG, max_queue=2, orphan_timeout=0.5, poll=0.05)
    endpoint.start()
    try:
        async def go(session):
            url = f"{endpoint.url}/v1/prefill"
            queued = [await _call(session, "POST", url, json={"id": f"w{i}", "tokens": [1], "wait": False})
                      for i in range(2)]
            full = await _call(session, "POST", url, json={"tokens": [1]})
            health = await _call(session, "GET", f"{endpoint.url}/v1/health")
            await asyncio.sleep(1.0)
            refused = await _call(session, "GET", f"{endpoint.url}/v1/requests/w0")
            return queued, full, health, refused

        queued, full, health, refused = _run(go)
    finally:
        endpoint.stop()
    assert [(s, b["state"]) for s, b, _ in queued] == [(202, "waiting")] * 2
    assert full[0] == 503 and full[2]["Retry-After"] == "1"
    assert full[1]["error"] == ("queue full: 2 requests wait for prefill (Endpoint(max_queue=2)); "
                                "retry later")
    assert health[1]["queued"] == 2 and health[1]["waiting"] == 2 and health[1]["full"] == 1
    assert refused[0] == 503 and refused[1]["error"] == (
        "request 'w0' refused: no prefill service was attached for 0.5 s (Endpoint(orphan_timeout=0.5))")


def test_another_rank_serves_through_the_first_ranks_endpoint(served):
    """The first rank's endpoint has no service of its own; rank 1's endpoint (the module's) serves."""
    rank1, _, _ = served
    first = Endpoint(CFG, poll=0.05, orphan_timeout=1.0)
    first.attach(RemoteRank(rank1.url, CFG, first, poll=0.02), rank=1)
    first.start()
    prompts = {f"m{i}": _prompt(4 + 9 * i, 50 + i) for i in range(4)}
    try:
        async def go(session):
            url = f"{first.url}/v1/prefill"
            answers = await asyncio.gather(*(_call(session, "POST", url, json={"id": rid, "tokens": p})
                                             for rid, p in prompts.items()))
            return answers, await _call(session, "GET", f"{first.url}/v1/cache/m3")

        answers, cache = _run(go)
    finally:
        first.stop()
    for (status, body, _), p in zip(answers, prompts.values(), strict=True):
        assert (status, body["rank"]) == (200, 1)
        assert body["first_token"] == int(MODEL.prefill(torch.tensor(p))[1].argmax())
    got, (want, _) = load_cache(cache[1]), MODEL.prefill(torch.tensor(prompts["m3"]))
    assert torch.equal(got.k, want.k) and torch.equal(got.v, want.v)


def test_an_unreachable_rank_is_declared_dead_and_its_requests_refused_with_a_reason():
    endpoint = Endpoint(CFG, poll=0.05, orphan_timeout=0.5)
    endpoint.attach(RemoteRank("http://127.0.0.1:1", CFG, endpoint, poll=0.02, timeout=0.2), rank=1)
    endpoint.start()
    try:
        status, body, _ = _run(_call, "POST", f"{endpoint.url}/v1/prefill", json={"id": "u", "tokens": [1]})
    finally:
        endpoint.stop()
    assert status == 503 and body["error"] == (
        "request 'u' refused: no prefill service was attached for 0.5 s (Endpoint(orphan_timeout=0.5))")
    assert endpoint.counters["requeued"] == 1


def test_a_killed_service_loses_no_request(served):
    """Requests queued in a rank's service when it is killed go to the rank's restarted service."""
    endpoint, servers, bubbles = served
    bubbles.on.clear()                                   # no windows: the requests stay in the service
    assert bubbles.parked.wait(10)
    prompts = {f"k{i}": _prompt(10 + i, 100 + i) for i in range(6)}

    async def submit(session):
        return [await _call(session, "POST", f"{endpoint.url}/v1/prefill",
                            json={"id": rid, "tokens": p, "wait": False}) for rid, p in prompts.items()]

    assert [(s, b["state"]) for s, b, _ in _run(submit)] == [(202, "queued")] * 6
    requeued = endpoint.counters["requeued"]
    os.kill(servers[0]._proc.pid, signal.SIGKILL)        # the rank dies
    deadline = time.monotonic() + 10
    while endpoint.counters["requeued"] < requeued + 6 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert endpoint.counters["requeued"] == requeued + 6

    async def health_and_poll(session):
        return (await _call(session, "GET", f"{endpoint.url}/v1/health"),
                await _call(session, "GET", f"{endpoint.url}/v1/requests/k0"))

    (_, health, _), (status, body, _) = _run(health_and_poll)
    assert health["ranks"] == {} and health["waiting"] == 6 and (status, body["state"]) == (202, "waiting")
    servers[0] = _server(endpoint)                       # the rank restarts
    endpoint.attach(servers[0], rank=0)
    bubbles.on.set()

    async def collect(session):
        out, deadline = {}, time.monotonic() + 120
        while len(out) < len(prompts) and time.monotonic() < deadline:
            for rid in prompts.keys() - out.keys():
                status, body, _ = await _call(session, "GET", f"{endpoint.url}/v1/requests/{rid}")
                assert status in (200, 202), body
                if status == 200:
                    out[rid] = body
            await asyncio.sleep(0.05)
        return out

    answers = _run(collect)
    assert sorted(answers) == sorted(prompts)
    for rid, p in prompts.items():
        assert answers[rid]["first_token"] == int(MODEL.prefill(torch.tensor(p))[1].argmax())


def test_parse_and_cache_tensors_directly():
    rid, tokens, wait = parse(b'{"tokens": [4, 5], "id": "x.1", "wait": false}', 50, 64)
    assert (rid, tokens.tolist(), wait) == ("x.1", [4, 5], False)
    cache, _ = MODEL.prefill(torch.tensor([1, 2, 3]))
    k, v = cache_tensors(cache)
    assert torch.equal(k, cache.k) and torch.equal(v, cache.v)      # a DynamicCache's: test_hf.py
