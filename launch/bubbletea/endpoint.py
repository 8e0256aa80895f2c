"""Requests from outside: an HTTP endpoint in front of a data center's prefill services (aiohttp).

    endpoint = Endpoint(config, max_queue=64)                  # on the data center's first rank
    server = PrefillServer(config, chunk_tokens=32, callback=endpoint.deliver)
    endpoint.attach(server, rank=0)                             # after a restart: attach the new one
    url = endpoint.start("127.0.0.1", 8000)                     # a thread with its own event loop
    bt = enable(engine, server)                                 # training as usual; prefill in its bubbles
    ...
    endpoint.stop()

The API (JSON in and out; every error is ``{"error": reason}`` with the status below):

- ``POST /v1/prefill`` ``{"tokens": [int, ...], "id": "optional", "wait": true}``: queues the prompt to
  the attached service with the fewest requests outstanding and, with ``wait``, answers once it is
  prefilled: ``{"id", "state": "done", "first_token", "tokens", "rank", "ttft_s", "cache": "/v1/cache/ID"}``
  (``ttft_s`` from arrival here to the result). ``"wait": false`` answers 202 at once. 400: a body
  that is not a JSON object, a missing, unknown or repeated field, token ids that are not integers in
  ``[0, vocab)``, a prompt outside ``1..max_seq``; 409: an id already in use; 413: a body larger than
  ``max_seq`` tokens can need; 503 (with ``Retry-After``): the queue holds ``max_queue`` requests;
  504: not prefilled within ``timeout`` (it stays queued: poll it).
- ``GET /v1/requests/ID``: 200 as above when done, 202 ``{"state": "queued" | "waiting"}``, 503 with
  the reason for a refused request, 404 for an unknown one.
- ``GET /v1/cache/ID``: the KV cache as safetensors (``k``, ``v``: float32 ``[L, H, T, Dh]``, and the last
  prompt token's ``logits`` [V];
  :func:`load_cache` reads it, :func:`launch.bubbletea.hf.to_dynamic_cache` makes it a DynamicCache);
  ``DELETE`` frees it. The ``keep`` most recent caches are kept.
- ``GET /v1/health``: queue depth, limits, per rank: alive, outstanding, served.

A request is never lost when a rank's service stops: a watchdog (every ``poll`` s) sees the process
gone, and the requests it held go to another attached service, or wait for one to be attached (a
restarted rank); a request refused after all (``attempts`` services stopped while holding it, or no
service for ``orphan_timeout`` s) says why. A result that arrives twice (a service that finished a
request just before it was declared dead) is kept once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch
from aiohttp import web
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from launch.bubbletea.model import KVCache
from launch.bubbletea.server import PrefillResult

_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
FIELDS = ("id", "tokens", "wait")


@dataclass
class _Request:
    id: str
    tokens: torch.Tensor
    arrived: float
    done: asyncio.Event
    state: str = "new"                 # -> waiting (for a service) <-> queued (on a rank) -> done | refused
    rank: int | None = None
    attempts: int = 0                  # services that stopped while holding it
    waiting_since: float = 0.0
    reason: str = ""
    result: dict = field(default_factory=dict)


class BadRequest(ValueError):
    pass


def parse(body: bytes, vocab: int, max_seq: int) -> tuple[str | None, torch.Tensor, bool]:
    """A POST /v1/prefill body -> (id or None, tokens, wait); BadRequest names the field and the rule."""
    def no_repeats(pairs):
        keys = [k for k, _ in pairs]
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:                   # json keeps the last of repeated keys silently
            raise BadRequest(f"field {repeated[0]!r} is given twice")
        return dict(pairs)
    try:
        data = json.loads(body, object_pairs_hook=no_repeats)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest(f'the body must be a JSON object {{"tokens": [...]}}, got {type(data).__name__}')
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}: the fields are {', '.join(FIELDS)}")
    if "tokens" not in data:
        raise BadRequest("missing field 'tokens': the prompt's token ids, a list of integers")
    tokens = data["tokens"]
    if not isinstance(tokens, list):
        raise BadRequest(f"tokens must be a list of integers, got {type(tokens).__name__}")
    if not 1 <= len(tokens) <= max_seq:
        raise BadRequest(f"tokens: {len(tokens)} tokens; the model takes 1..{max_seq}")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"tokens[{i}] = {json.dumps(t)}: token ids are integers")
        if not 0 <= t < vocab:
            raise BadRequest(f"tokens[{i}] = {t}: token ids lie in [0, {vocab})")
    rid = data.get("id")
    if rid is not None and (not isinstance(rid, str) or not _ID.fullmatch(rid)):
        raise BadRequest(f"id={json.dumps(rid)}: 1..128 characters of A-Z a-z 0-9 . _ -")
    wait = data.get("wait", True)
    if not isinstance(wait, bool):
        raise BadRequest(f"wait={json.dumps(wait)}: true or false")
    return rid, torch.tensor(tokens, dtype=torch.long), wait


def cache_tensors(cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The filled k, v [L, H, T, Dh] of a KVCache or of a transformers DynamicCache (batch 1), float32."""
    if isinstance(cache, KVCache):
        n = cache.length
        return cache.k[:, :, :n].float().contiguous(), cache.v[:, :, :n].float().contiguous()
    return (torch.stack([layer.keys[0] for layer in cache.layers]).float(),
            torch.stack([layer.values[0] for layer in cache.layers]).float())


def load_cache(data: bytes) -> KVCache:
    """The body of ``GET /v1/cache/ID`` as a KVCache."""
    t = st_load(data)
    return KVCache(t["k"], t["v"], t["k"].shape[2])


class Endpoint:
    def __init__(self, config, max_queue: int = 64, timeout: float = 60.0, keep: int = 256,
                 attempts: int = 3, orphan_timeout: float = 600.0, poll: float = 0.1) -> None:
        """``config``: the model every attached service runs (LMConfig or HFConfig); ``max_queue``:
        requests not yet prefilled; ``timeout``: how long a waiting POST waits; ``keep``: caches kept;
        ``orphan_timeout``: how long a request waits for a service (a rank's restart: a process start, a
        model load, the training job's own recovery, minutes)."""
        for name, v in (("max_queue", max_queue), ("keep", keep), ("attempts", attempts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Endpoint: {name}={v!r} must be an integer >= 1")
        for name, v in (("timeout", timeout), ("orphan_timeout", orphan_timeout), ("poll", poll)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ValueError(f"Endpoint: {name}={v!r} must be a number of seconds in (0, 1e6)")
        self.config, self.max_queue, self.timeout, self.keep = config, max_queue, timeout, keep
        self.attempts, self.orphan_timeout, self.poll = attempts, orphan_timeout, poll
        self.counters = {"served": 0, "requeued": 0, "refused": 0, "full": 0, "bad": 0}
        self._lock = threading.Lock()
        self._servers: dict[int, object] = {}
        self._served: dict[int, int] = {}
        self._live: dict[str, _Request] = {}           # not yet done or refused
        self._waiting: deque[_Request] = deque()       # for a service
        self._finished: OrderedDict[str, _Request] = OrderedDict()
        self._caches: OrderedDict[str, tuple] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.url: str | None = None
        self._limit = 4096 + 24 * config.max_seq        # body bytes: digits, separators, spaces, other fields

    # -- ranks ------------------------------------------------------------------------------------
    def attach(self, server, rank: int) -> None:
        """Serve from ``server`` (a PrefillServer whose callback is :meth:`deliver`) as ``rank``; a rank
        attached before is replaced, and the requests its old server held go to the new one."""
        if server.config != self.config:
            raise ValueError(f"attach(rank={rank}): the server runs {server.config}, the endpoint serves "
                             f"{self.config}")
        with self._lock:
            old = self._servers.pop(rank, None)
            if old is not None:
                self._lost(rank, "was replaced")
            self._servers[rank] = server
            self._served.setdefault(rank, 0)
            while self._waiting and self._dispatch(self._waiting[0]):
                self._waiting.popleft()

    def _dispatch(self, req: _Request) -> bool:
        """Queue a request on the live service with the fewest outstanding (lock held); False if none."""
        load = {r: 0 for r, s in self._servers.items() if s.alive}
        for q in self._live.values():
            if q.state == "queued" and q.rank in load:
                load[q.rank] += 1
        for rank in sorted(load, key=lambda r: (load[r], r)):
            try:
                self._servers[rank].submit(req.id, req.tokens)
            except OSError:                  # its process just died: the watchdog will see it
                continue
            req.state, req.rank = "queued", rank
            return True
        if req.state != "waiting":               # the orphan clock starts when it starts waiting
            req.state, req.rank, req.waiting_since = "waiting", None, time.monotonic()
        return False

    def _lost(self, rank: int, why: str) -> None:
        """Rank's service is gone (lock held): re-queue what it held, or refuse with the reason."""
        for req in [q for q in self._live.values() if q.state == "queued" and q.rank == rank]:
            self._requeue(req, f"rank {rank}'s service {why}")

    def _requeue(self, req: _Request, why: str) -> None:
        req.attempts += 1
        self.counters["requeued"] += 1
        if req.attempts >= self.attempts:
            self._refuse(req, f"the prefill services holding it stopped {req.attempts} times "
                              f"(last: {why}; Endpoint(attempts={self.attempts}))")
        elif not self._dispatch(req):
            self._waiting.append(req)

    def lost(self, request: str, why: str) -> None:
        """A service cannot deliver ``request`` after all (a remote rank refused it): re-queue it."""
        with self._lock:
            req = self._live.get(request)
            if req is not None and req.state == "queued":
                self._requeue(req, why)

    def _refuse(self, req: _Request, reason: str) -> None:
        req.state, req.reason = "refused", reason
        self.counters["refused"] += 1
        self._finish(req)

    def _finish(self, req: _Request) -> None:
        self._live.pop(req.id, None)
        self._finished[req.id] = req
        while len(self._finished) > self.keep + self.max_queue:
            old, _ = self._finished.popitem(last=False)
            self._caches.pop(old, None)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(req.done.set)

    def deliver(self, result: PrefillResult) -> None:
        """The services' callback (their collector threads): store the cache, answer the request."""
        k, v = cache_tensors(result.cache)
        with self._lock:
            req = self._live.get(result.request)
            if req is None or req.state != "queued":          # refused meanwhile, or a second result
                return
            req.state = "done"
            req.result = {"id": req.id, "state": "done", "first_token": result.first_token,
                          "tokens": req.tokens.numel(), "rank": req.rank,
                          "ttft_s": round(time.monotonic() - req.arrived, 6), "cache": f"/v1/cache/{req.id}"}
            self.counters["served"] += 1
            self._served[req.rank] = self._served.get(req.rank, 0) + 1
            self._caches[req.id] = (k, v, result.logits.float(), result.first_token)
            while len(self._caches) > self.keep:
                self._caches.popitem(last=False)
            self._finish(req)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll)
            dead = []
            with self._lock:
                for rank, server in list(self._servers.items()):
                    if not server.alive:
                        del self._servers[rank]
                        self._lost(rank, "stopped")
                        dead.append(server)
                now = time.monotonic()
                while self._waiting and self._dispatch(self._waiting[0]):
                    self._waiting.popleft()
                for req in [q for q in self._waiting if now - q.waiting_since > self.orphan_timeout]:
                    self._waiting.remove(req)
                    self._refuse(req, f"no prefill service was attached for {self.orphan_timeout} s "
                                      f"(Endpoint(orphan_timeout={self.orphan_timeout}))")
            for server in dead:                    # collect the dead process and its threads
                await asyncio.get_running_loop().run_in_executor(None, server.stop)

    # -- HTTP ---------------------------------------------------------------------------------------
    async def _prefill(self, request: web.Request) -> web.Response:
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is larger than {self._limit} bytes, more than a prompt of "
                               f"{self.config.max_seq} tokens (the model's max_seq) needs")
        try:
            rid, tokens, wait = parse(body, self.config.vocab, self.config.max_seq)
        except BadRequest as e:
            self.counters["bad"] += 1
            return _error(400, str(e))
        with self._lock:
            rid = rid or uuid.uuid4().hex
            if rid in self._live or rid in self._finished:
                return _error(409, f"id {rid!r} is already in use")
            if len(self._live) >= self.max_queue:
                self.counters["full"] += 1
                return _error(503, f"queue full: {len(self._live)} requests wait for prefill "
                                   f"(Endpoint(max_queue={self.max_queue})); retry later",
                              {"Retry-After": "1"})
            req = _Request(rid, tokens, time.monotonic(), asyncio.Event())
            self._live[rid] = req
            if not self._dispatch(req):
                self._waiting.append(req)
        if not wait:
            return web.json_response({"id": rid, "state": req.state}, status=202)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(req.done.wait(), self.timeout)
        if not req.done.is_set():
            return _error(504, f"request {rid!r} not prefilled within {self.timeout} s "
                               f"(Endpoint(timeout=...)); it stays {req.state}: GET /v1/requests/{rid}")
        return self._answer(req)

    def _answer(self, req: _Request) -> web.Response:
        if req.state == "done":
            return web.json_response(req.result)
        if req.state == "refused":
            return _error(503, f"request {req.id!r} refused: {req.reason}")
        return web.json_response({"id": req.id, "state": req.state}, status=202)

    async def _status(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        with self._lock:
            req = self._live.get(rid) or self._finished.get(rid)
        return _error(404, f"no request {rid!r}") if req is None else self._answer(req)

    async def _cache(self, request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        with self._lock:
            entry = self._caches.pop(rid, None) if request.method == "DELETE" else self._caches.get(rid)
        if entry is None:
            return _error(404, f"no cache for request {rid!r}: unknown, not prefilled yet, deleted, or "
                               f"older than the {self.keep} kept (Endpoint(keep=...))")
        if request.method == "DELETE":
            return web.json_response({"id": rid, "deleted": True})
        k, v, logits, first = entry
        data = st_save({"k": k, "v": v, "logits": logits},
                       metadata={"first_token": str(first), "layout": "k, v: [L, H, T, Dh]; logits: [V]"})
        return web.Response(body=data, content_type="application/octet-stream")

    async def _health(self, request: web.Request) -> web.Response:
        with self._lock:
            ranks = {r: {"alive": s.alive, "outstanding": 0, "served": self._served.get(r, 0)}
                     for r, s in self._servers.items()}
            for q in self._live.values():
                if q.state == "queued" and q.rank in ranks:
                    ranks[q.rank]["outstanding"] += 1
            return web.json_response({"queued": len(self._live), "waiting": len(self._waiting),
                                      "max_queue": self.max_queue, "ranks": ranks, **self.counters})

    # -- life -------------------------------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (port 0: any free one) from a thread of this process; returns the base URL."""
        if self._thread is not None:
            raise RuntimeError("the endpoint is already started")
        ready: list = []
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(host, port, ready, started),
                                        name="bubbletea-endpoint", daemon=True)
        self._thread.start()
        started.wait()
        if isinstance(ready[0], BaseException):
            self._thread = None
            raise ready[0]
        self.url = ready[0]
        return self.url

    def _serve(self, host, port, ready, started) -> None:
        loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=self._limit)
        app.add_routes([web.post("/v1/prefill", self._prefill), web.get("/v1/requests/{id}", self._status),
                        web.get("/v1/cache/{id}", self._cache), web.delete("/v1/cache/{id}", self._cache),
                        web.get("/v1/health", self._health)])
        runner = web.AppRunner(app, access_log=None)
        try:
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, host, port).start())
        except BaseException as e:
            ready.append(e)
            started.set()
            return
        self._loop = loop
        bound = runner.addresses[0]
        ready.append(f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}")
        watcher = loop.create_task(self._watch())
        started.set()
        loop.run_forever()
        with self._lock:             # no result may schedule on a closed loop (it would fail the service)
            self._loop = None
        watcher.cancel()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def stop(self) -> None:
        """Stop serving (the attached servers are the caller's: ``server.stop()``)."""
        if self._thread is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._thread = None


def _error(status: int, reason: str, headers: dict | None = None) -> web.Response:
    return web.json_response({"error": reason}, status=status, headers=headers)
