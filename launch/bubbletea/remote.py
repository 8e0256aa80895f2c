"""Another rank of the data center as a service of the first rank's endpoint: a proxy over HTTP.

    # on every other rank r of the data center: its own endpoint on the data center's network
    local = Endpoint(config); local.attach(PrefillServer(config, 32, callback=local.deliver), rank=r)
    local.start(my_dc_address, 8100)
    # on the first rank, next to its own server:
    endpoint.attach(RemoteRank(f"http://{address_r}:8100", config, endpoint), rank=r)

:class:`RemoteRank` has what :meth:`Endpoint.attach <launch.bubbletea.endpoint.Endpoint.attach>` needs of a
server (``config``, ``alive``, ``submit``, ``stop``). ``submit`` only queues: a worker thread posts each
prompt to the rank's endpoint (``"wait": false``, under a fresh id, so a re-queued request never collides
with its earlier attempt there), polls the rank for its results every ``poll`` s and hands each one,
KV cache and logits fetched, to ``endpoint.deliver``. The rank counts as dead once it has not answered
for ``timeout`` s (connection refused, a rank being restarted): the first rank's watchdog then re-queues
what it held; a request the rank refused (its own services died) goes back through ``endpoint.lost``.
Inside a data center only: prompts and caches never cross the WAN.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import deque

import torch
from safetensors.torch import load as st_load

from launch.bubbletea.model import KVCache
from launch.bubbletea.server import PrefillResult


class RemoteRank:
    def __init__(self, url: str, config, endpoint, poll: float = 0.05, timeout: float = 5.0) -> None:
        if not url.startswith("http://"):
            raise ValueError(f"url={url!r}: the rank's endpoint, http://HOST:PORT")
        for name, v in (("poll", poll), ("timeout", timeout)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ValueError(f"RemoteRank: {name}={v!r} must be a number of seconds in (0, 1e6)")
        self.url, self.config, self.endpoint = url.rstrip("/"), config, endpoint
        self.poll, self.timeout = poll, timeout
        self._jobs: deque = deque()                     # (id, tokens, submitted) not posted yet
        self._remote: dict[str, tuple[str, float]] = {}  # remote id -> (id, submitted)
        self._last_answer = time.monotonic()
        self._dead = False
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bubbletea-remote", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return not self._dead

    def submit(self, request, tokens: torch.Tensor) -> None:
        if self._dead:
            raise ConnectionError(f"rank at {self.url} has not answered for {self.timeout} s")
        self._jobs.append((request, torch.as_tensor(tokens).tolist(), time.perf_counter()))

    def __len__(self) -> int:
        return len(self._jobs) + len(self._remote)

    def stop(self) -> None:
        self._halt.set()
        self._thread.join(10)

    # -- the worker --------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                status, out = r.status, r.read()
        except urllib.error.HTTPError as e:             # an answer all the same
            status, out = e.code, e.read()
        self._last_answer = time.monotonic()
        return status, out

    def _run(self) -> None:
        while not self._halt.wait(self.poll):
            try:
                self._post()
                self._collect()
            except (OSError, ValueError):               # unreachable (URLError is an OSError), or garbled
                if time.monotonic() - self._last_answer > self.timeout:
                    self._dead = True                   # the first rank's watchdog re-queues its requests
                    return

    def _post(self) -> None:
        while self._jobs:
            request, tokens, submitted = self._jobs[0]
            remote = uuid.uuid4().hex
            status, out = self._call("POST", "/v1/prefill", {"id": remote, "tokens": tokens, "wait": False})
            if status == 503:                           # the rank's queue is full: try again next round
                return
            self._jobs.popleft()
            if status == 202:
                self._remote[remote] = (request, submitted)
            else:
                self.endpoint.lost(request, f"rank at {self.url} answered {status}: {out[:200]!r}")

    def _collect(self) -> None:
        for remote, (request, submitted) in list(self._remote.items()):
            status, out = self._call("GET", f"/v1/requests/{remote}")
            if status == 202:
                continue
            del self._remote[remote]
            if status != 200:
                self.endpoint.lost(request, f"rank at {self.url} answered {status}: {out[:200]!r}")
                continue
            first = json.loads(out)["first_token"]
            status, body = self._call("GET", f"/v1/cache/{remote}")
            if status != 200:
                self.endpoint.lost(request, f"rank at {self.url} lost the cache: {body[:200]!r}")
                continue
            t = st_load(body)
            self._call("DELETE", f"/v1/cache/{remote}")
            cache = KVCache(t["k"], t["v"], t["k"].shape[2])
            self.endpoint.deliver(PrefillResult(request, cache, t["logits"], first, submitted,
                                                time.perf_counter()))
