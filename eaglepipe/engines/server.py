"""What every engine whose target runs on servers does, whatever the server (sglang.py and vllm.py state their
protocols): one client for one or many servers, checked before the first request and watched while it runs.

Before the first request, for every server in ``urls`` (or the one it launched, ``launch``):
    /health      waited for (``health_timeout_s``; servers answer 503 or nothing while they start)
    identity     what the server says it serves (the engine's ``_read_server``): kept for ``describe()`` (the stage
                 writes it to engine.json) and reduced to ``identity()`` (what decides the ids: model, weights, dtype,
                 quantization, server version; never urls or concurrency, so a resumed run against a restarted or an
                 added server reuses the cache). All servers must agree on it.
    tokenizer    probe strings (the chat template rendered, every special and added token, plain text): the
                 server's tokenizer must give the local tokenizer's ids, or the run stops saying which probes differ.

Every request carries token ids and every sampling parameter explicit; at most ``concurrency`` requests are in
flight, each sent to the healthy server with the fewest in flight; every answer is checked (the engine's ``_check``)
before the driver keeps it.

Faults: timeouts, refused/reset connections, HTTP 408/429/5xx, malformed JSON and answers that fail a check are
retried ``retries`` times with exponential backoff and jitter (tenacity), then the prompt is a ``Failure`` with every
attempt's reason. Another 4xx is retried once (with a fresh request id), then it is a failure. A request given up on
(a timeout) or left behind when the run stops early (a gate, Ctrl-C) is cancelled on the server, so the servers do not
go on generating answers nobody will keep. A server that refuses connections or answers 503 is taken out of rotation
and watched: back within ``health_timeout_s`` it is checked again (identity and tokenizer) and rejoins; a server that
comes back serving something else stops the run; when no server is left the run stops (everything finished is already
in the driver's cache).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from ..errors import UserError
from . import Failure, Output, Sampling

_dumps, _loads = orjson.dumps, orjson.loads  # JSON at 256 requests in flight: the client's CPU time matters

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}


class ServerError(UserError, RuntimeError):
    """The run cannot go on: no server, a server that disagrees with the local tokenizer or with the others."""


class BadAnswer(ValueError):
    """An answer that fails a check (retried, then recorded as a failure with this reason)."""


class _Unhealthy(ServerError):
    """A server that did not answer /health in time."""


class _Retry(Exception):
    pass


def check_ids(ids: list, finish: str, sampling: Sampling) -> str:
    """The checks of every engine's answer once its ids and its finish (``stop`` or ``length``) are read: at most
    ``max_new_tokens`` ids, exactly that many on ``length``, no stop id before the end. Returns the record's
    finish_reason: an answer whose last allowed id is a stop id is a ``stop``, as in the embedded engine."""
    stops = set(sampling.stop_token_ids)
    if len(ids) > sampling.max_new_tokens:
        raise BadAnswer(f"{len(ids)} output ids for max_new_tokens={sampling.max_new_tokens}")
    if finish == "length" and len(ids) != sampling.max_new_tokens:
        raise BadAnswer(f"finish_reason length after {len(ids)} of {sampling.max_new_tokens} ids")
    inner = next((n for n, t in enumerate(ids[:-1]) if t in stops), None)
    if inner is not None:
        raise BadAnswer(f"stop id {ids[inner]} at position {inner}, before the end of the output")
    return "stop" if finish == "length" and ids and ids[-1] in stops else finish


class _Permanent(Exception):
    pass


def tokenizer_probes(tokenizer) -> list[str]:
    """Strings whose ids must be the same on the server and here: the chat template rendered (its special tokens in
    place), every special and added token, and plain text with unicode, digits, code and odd whitespace."""
    from .. import chat

    probes = []
    for turns in ([{"role": "user", "content": "Hi! What is 2+2?"}],
                  [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Q1"},
                   {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2 ünï 中文 🤖"}]):
        try:
            probes.append(chat.render(tokenizer, turns))
        except Exception as e:  # a template that refuses a system turn, say
            log.debug("chat template probe skipped: %s", e)
    special = list(dict.fromkeys([*tokenizer.all_special_tokens,
                                  *(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values())]))
    probes += special[:2048]
    if special:
        probes.append("x" + " y".join(special[:64]) + " z")
    probes += ["<think>\nreasoning\n</think>\n\nanswer", "Hello, world! The year 2024; 3.14159 ≈ π.",
               "def f(x):\n\treturn x ** 2  # tabs, spaces  \n\n", "  leading and trailing spaces  ", "Ünïcödé 中文 🤖✓"]
    return list(dict.fromkeys(p for p in probes if p))


@dataclass
class _Server:
    url: str
    up: bool = False
    dead: str | None = None  # why it was given up on
    inflight: int = 0
    sent: int = 0
    model_info: dict = field(default_factory=dict)
    server_info: dict = field(default_factory=dict)
    identity: dict = field(default_factory=dict)
    recovery: asyncio.Task | None = None


class ServerEngine:
    """An engine whose target runs on servers; ``params`` is the engine's section of ``infer`` (config.Servers). Use as
    a context manager (the stage does, through ``infer.create_engine``): entering launches the server if asked, waits
    for health and checks every server; leaving closes the connections and stops a launched server.

    A subclass states the protocol: ``name``/``title``, ``_launcher``, ``_read_server``, ``_server_tokens``,
    ``_sampling``, ``_request``, ``_check``, ``_meta`` and ``_abort_request``."""
    name = title = "server"

    def __init__(self, params, tokenizer):
        self.urls = [u.rstrip("/") for u in params.urls]
        self.concurrency = params.concurrency
        self.timeout_s = params.timeout_s
        self.health_timeout_s = params.health_timeout_s
        self.retries = params.retries
        self.backoff_s = params.backoff_s
        self.backoff_max_s = params.backoff_max_s
        self.launch = params.launch
        self.tokenizer = tokenizer
        self.stats = Counter()
        self._servers: list[_Server] = []
        self._identity: dict | None = None
        self._launched = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: aiohttp.ClientSession | None = None
        self._fatal: ServerError | None = None
        self._changed: asyncio.Event | None = None
        self._probes: list[str] = []
        self._probe_ids: list[list[int]] = []
        self._old_sigterm = None
        self._aborts: set = set()  # /abort_request calls on their way (awaited at close, never cancelled)

    # ---- lifetime -------------------------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self) -> "ServerEngine":
        if self._loop is not None:
            return self
        try:
            if self.launch:
                self._catch_sigterm()
                self._launched = self._launcher()
                self._launched.start()
                self.urls = [self._launched.url]
            self._probes = tokenizer_probes(self.tokenizer)
            self._probe_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in self._probes]
            self._servers = [_Server(u) for u in dict.fromkeys(self.urls)]
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.name}-client", daemon=True)
            self._thread.start()
            self._call(self._connect())
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=30)
            except Exception as e:  # noqa: BLE001 - closing must go on
                log.debug("closing the client: %s", e)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                loop.close()
        if self._launched is not None:
            self._launched.stop()
            self._launched = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def _catch_sigterm(self):
        """A launched server is stopped on SIGTERM too: turn it into SystemExit so ``close`` runs."""
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    def _call(self, coro):
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()
            raise

    async def _shutdown(self):
        pending = [s.recovery for s in self._servers if s.recovery is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, *self._aborts, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # ---- the engine interface --------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What, beyond the local model files, decides the ids (part of the cache fingerprint); never the urls."""
        self.start()
        return dict(self._identity)

    def describe(self) -> dict:
        """What the stage keeps about the servers (engine.json): model_info and server_info of each, as read."""
        return {"engine": self.name, "identity": self._identity,
                "launched": self._launched.describe() if self._launched else None,
                "servers": [{"url": s.url, "model_info": s.model_info, "server_info": s.server_info}
                            for s in self._servers]}

    def stream(self, prompts: list[list[int]], sampling: Sampling, rids: list[str]):
        """Yield (index into prompts, Output | Failure) as answers arrive, ``concurrency`` requests in flight."""
        if not prompts:
            return
        self.start()
        results: queue.Queue = queue.Queue()
        finished = threading.Event()
        end = object()

        async def produce():
            try:
                await self._produce(prompts, sampling, rids, results.put)
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                results.put(e)
            finally:
                results.put(end)
                finished.set()

        fut = asyncio.run_coroutine_threadsafe(produce(), self._loop)
        try:
            while True:
                item = results.get()
                if item is end:
                    break
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        break
                    raise item
                yield item
        finally:
            if not fut.done():  # the consumer stopped early (a gate, Ctrl-C): cancel what is in flight
                fut.cancel()
                finished.wait(timeout=30)
            self._log_stats()

    def _log_stats(self):
        if self.stats:
            log.info("%s client: %s", self.name, ", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())))

    # ---- connecting and checking servers ---------------------------------------------------------------------
    async def _connect(self):
        self._changed = asyncio.Event()
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        deadline = time.monotonic() + self.health_timeout_s
        results = await asyncio.gather(*(self._check_server(s, deadline) for s in self._servers),
                                       return_exceptions=True)
        errors = [f"{s.url}: {r}" for s, r in zip(self._servers, results) if isinstance(r, BaseException)]
        if errors:
            raise ServerError(f"{self.title} server check failed:\n  " + "\n  ".join(errors))
        first = self._servers[0].identity
        differ = [f"{s.url}: {s.identity}" for s in self._servers if s.identity != first]
        if differ:
            raise ServerError(f"the servers serve different models: {self._servers[0].url}: {first}; "
                              + "; ".join(differ))
        self._identity = first
        for s in self._servers:
            s.up = True
        log.info("%s: %d server(s) ready, %s", self.name, len(self._servers), first)

    async def _check_server(self, server: _Server, deadline: float) -> None:
        """Wait for /health, read what the server says it serves (``_read_server``), compare tokenizers."""
        await self._wait_healthy(server, deadline)
        await self._read_server(server)
        await self._compare_tokenizer(server)

    async def _wait_healthy(self, server: _Server, deadline: float) -> None:
        wait, last = 0.25, "no answer yet"
        while True:
            if self._launched is not None and self._launched.exited():
                raise ServerError(f"the launched server exited with code {self._launched.returncode()}; "
                                  f"the end of {self._launched.log_path}:\n{self._launched.tail()}")
            try:
                async with self._session.get(server.url + "/health",
                                             timeout=aiohttp.ClientTimeout(total=max(5.0, min(30.0, self.timeout_s)))
                                             ) as r:
                    await r.read()
                    if r.status == 200:
                        return
                    last = f"/health answered {r.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + wait > deadline:
                raise _Unhealthy(f"not healthy within health_timeout_s={self.health_timeout_s:g}s ({last})")
            await asyncio.sleep(wait)
            wait = min(wait * 1.5, 5.0)

    async def _get_info(self, server: _Server, *paths) -> dict:
        for path in paths:
            async with self._session.get(server.url + path, timeout=aiohttp.ClientTimeout(total=60)) as r:
                raw = await r.read()
                if r.status == 404:
                    continue
                if r.status != 200:
                    raise ServerError(f"GET {path} answered {r.status}: {raw[:200]!r}")
                try:
                    info = _loads(raw)
                except ValueError:
                    raise ServerError(f"GET {path} answered malformed JSON: {raw[:200]!r}") from None
                if not isinstance(info, dict):
                    raise ServerError(f"GET {path} answered a JSON {type(info).__name__}")
                return info
        raise ServerError(f"none of {', '.join(paths)} exists")

    async def _post_json(self, server: _Server, path: str, body, timeout: float = 120):
        """POST ``body`` to a server; its JSON answer, or a ServerError naming the path."""
        async with self._session.post(server.url + path, data=_dumps(body), headers=JSON,
                                      timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            if r.status != 200:
                raise ServerError(f"POST {path} answered {r.status}: {raw[:200]!r}")
        try:
            return _loads(raw)
        except ValueError:
            raise ServerError(f"POST {path} answered malformed JSON: {raw[:200]!r}") from None

    async def _compare_tokenizer(self, server: _Server) -> None:
        tokens = await self._server_tokens(server)
        if not isinstance(tokens, list) or len(tokens) != len(self._probes):
            raise ServerError(f"the server tokenized {len(tokens) if isinstance(tokens, list) else tokens!r} "
                              f"of {len(self._probes)} probes")
        differ = [(p, theirs, ours) for p, theirs, ours in zip(self._probes, tokens, self._probe_ids)
                  if theirs != ours]
        if differ:
            lines = []
            for p, theirs, ours in differ[:8]:
                at = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), min(len(theirs), len(ours)))
                lines.append(f"{p[:60]!r}: from position {at}: server {theirs[at:at + 8]} vs local {ours[at:at + 8]} "
                             f"({len(theirs)} vs {len(ours)} ids)")
            raise ServerError(f"the server's tokenizer disagrees with the local one ({self.tokenizer.name_or_path}) "
                              f"on {len(differ)} of {len(self._probes)} probes:\n    " + "\n    ".join(lines))

    # ---- servers leaving and coming back ---------------------------------------------------------------------
    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()

    def _mark_down(self, server: _Server, why: str) -> None:
        if not server.up:
            return
        server.up = False
        self.stats["server_down"] += 1
        log.warning("%s: %s out of rotation (%s); waiting up to %gs for it to come back", self.name, server.url, why,
                    self.health_timeout_s)
        server.recovery = asyncio.get_running_loop().create_task(self._recover(server))
        self._notify()

    async def _recover(self, server: _Server) -> None:
        before = server.identity
        try:
            await self._check_server(server, time.monotonic() + self.health_timeout_s)
        except _Unhealthy as e:
            server.dead = str(e)
            log.error("%s: giving up on %s: %s", self.name, server.url, e)
        except ServerError as e:
            self._fatal = ServerError(f"{server.url} came back changed: {e}")
        except Exception as e:  # noqa: BLE001
            server.dead = f"{type(e).__name__}: {e}"
        else:
            if server.identity != before:
                self._fatal = ServerError(f"{server.url} came back serving {server.identity}, not {before}: "
                                          "records would mix; stopping (the cache keeps what was generated)")
            else:
                server.up = True
                self.stats["server_back"] += 1
                log.warning("%s: %s is back", self.name, server.url)
        finally:
            server.recovery = None
            self._notify()

    async def _acquire(self) -> _Server:
        while True:
            if self._fatal is not None:
                raise self._fatal
            best = None
            for s in self._servers:
                if s.up and (best is None or (s.inflight, s.sent) < (best.inflight, best.sent)):
                    best = s
            if best is not None:
                return best
            if all(s.dead for s in self._servers):
                raise ServerError(f"no {self.title} server left: "
                                  + "; ".join(f"{s.url}: {s.dead}" for s in self._servers))
            await self._changed.wait()

    # ---- requests --------------------------------------------------------------------------------------------
    async def _produce(self, prompts, sampling: Sampling, rids, put) -> None:
        order = iter(range(len(prompts)))

        async def worker():
            for i in order:
                put((i, await self._one(prompts[i], sampling, rids[i])))

        workers = [asyncio.ensure_future(worker()) for _ in range(min(self.concurrency, len(prompts)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _one(self, prompt_ids: list, sampling: Sampling, record_id: str):
        """One prompt: attempts until an answer passes the checks; a Failure when retries are spent."""
        params = self._sampling(sampling, record_id)
        reasons: list[str] = []
        try:  # the first attempt outside tenacity: it is nearly always the only one, and the client's hot path
            return await self._attempt(prompt_ids, params, sampling, record_id, 1, reasons)
        except _Permanent:
            return self._failed(reasons)
        except _Retry:
            if self.retries == 0:
                return self._failed(reasons)
        # Retry k waits backoff_s * 2**(k-1) plus up to backoff_s of jitter, at most backoff_max_s.
        retrying = AsyncRetrying(stop=stop_after_attempt(self.retries), retry=retry_if_exception_type(_Retry),
                                 wait=wait_exponential_jitter(multiplier=2 * self.backoff_s, max=self.backoff_max_s,
                                                              jitter=self.backoff_s), reraise=True)
        try:
            async for attempt in retrying:
                with attempt:
                    k = attempt.retry_state.attempt_number
                    if k == 1:
                        await asyncio.sleep(min(self.backoff_s + random.uniform(0, self.backoff_s),
                                                self.backoff_max_s))
                    return await self._attempt(prompt_ids, params, sampling, f"{record_id}#{k + 1}", k + 1,
                                               reasons)
        except (_Retry, _Permanent):
            return self._failed(reasons)

    def _failed(self, reasons: list[str]) -> Failure:
        self.stats["failed"] += 1
        return Failure(f"{len(reasons)} attempt(s): " + "; ".join(reasons))

    async def _attempt(self, prompt_ids, params, sampling, rid, n, reasons) -> Output:
        def retry(kind: str, why: str, permanent: bool = False):
            reasons.append(f"{kind}: {why}")
            self.stats[kind] += 1
            return (_Permanent if permanent else _Retry)(why)

        server = await self._acquire()
        server.inflight += 1
        server.sent += 1
        path, body = self._request(prompt_ids, params, rid)
        body = _dumps(body)
        start = time.perf_counter()
        try:
            async with self._session.post(server.url + path, data=body, headers=JSON,
                                          timeout=aiohttp.ClientTimeout(total=self.timeout_s,
                                                                        sock_connect=min(30.0, self.timeout_s))) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            self._mark_down(server, f"cannot connect: {e}")
            raise retry("refused", f"cannot connect to {server.url}") from None
        except asyncio.TimeoutError:
            self._abort(server, rid)
            raise retry("timeout", f"no answer within {self.timeout_s:g}s from {server.url}") from None
        except asyncio.CancelledError:  # the run stops (a gate, Ctrl-C): the server need not finish this one
            self._abort(server, rid)
            raise
        except aiohttp.ClientError as e:  # reset, disconnected, truncated body
            raise retry("connection", f"{type(e).__name__} from {server.url}") from None
        finally:
            server.inflight -= 1
        latency = time.perf_counter() - start
        if status != 200:
            message = f"{status} from {server.url}: {raw[:200].decode('utf-8', 'replace')}"
            if status == 503:
                self._mark_down(server, "HTTP 503")
            if status in (408, 429) or status >= 500:
                raise retry(f"http{status}", message)
            seen = sum(1 for r in reasons if r.startswith("http4xx"))  # 4xx: once more with a fresh rid, then give up
            raise retry("http4xx", message, permanent=seen >= 1)
        try:
            answer = _loads(raw)
        except ValueError:
            raise retry("malformed", f"JSON from {server.url}: {raw[:80]!r}") from None
        try:
            ids, reason, meta = self._check(answer, prompt_ids, sampling, rid)
        except BadAnswer as e:
            raise retry("check", f"{e} ({server.url})") from None
        self.stats["ok"] += 1
        return Output(ids, reason, {"engine": self.name, "server": server.url, "rid": rid, "attempts": n,
                                    **self._meta(meta), "latency_s": round(latency, 4)})

    def _abort(self, server: _Server, rid: str) -> None:
        """Best effort: tell the server to stop working on a request this client gave up on (servers also abort a
        request whose client went away, but only when they next look, and some finish it)."""
        path, body = self._abort_request(rid)

        async def abort():
            try:
                async with self._session.post(server.url + path, data=_dumps(body),
                                              headers=JSON, timeout=aiohttp.ClientTimeout(total=5)) as r:
                    await r.read()
            except Exception:  # noqa: BLE001
                pass

        self.stats["aborted"] += 1
        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


    # ---- the protocol (each engine's module) -----------------------------------------------------------------
    def _launcher(self):
        """The LaunchedServer (engines/launch.py) for ``params.launch``."""
        raise NotImplementedError

    async def _read_server(self, server: _Server) -> None:
        """Read what ``server`` serves into ``model_info``, ``server_info`` and ``identity``; ServerError if it
        cannot serve this run."""
        raise NotImplementedError

    async def _server_tokens(self, server: _Server) -> list:
        """The server's ids for each of ``self._probes`` (no special tokens added)."""
        raise NotImplementedError

    def _sampling(self, sampling: Sampling, record_id: str) -> dict:
        raise NotImplementedError

    def _request(self, prompt_ids: list, params: dict, rid: str) -> tuple[str, dict]:
        """(path, JSON body) of one generation request."""
        raise NotImplementedError

    def _check(self, answer, prompt_ids: list, sampling: Sampling, rid: str) -> tuple[list, str, dict]:
        """(output_ids, finish_reason, meta) of a checked answer, or BadAnswer."""
        raise NotImplementedError

    def _meta(self, meta: dict) -> dict:
        """What of an answer's metadata the record keeps."""
        raise NotImplementedError

    def _abort_request(self, rid: str) -> tuple[str, dict]:
        """(path, JSON body) that cancels request ``rid``."""
        raise NotImplementedError
