"""``ServerEngine``: an engine whose target runs on servers. It is the client of one ``Api`` (what the engine states of
its servers' protocol: sglang.py, vllm.py) over a ``ServerPool`` (pool.py: the servers, failover, the retry policy),
with a server it launches through launch.py.

Requests carry token ids and every sampling parameter explicit, at most ``concurrency`` in flight; every answer is
checked (the api's ``check``) before it is kept. A failed attempt (timeout, refused or reset connection, an HTTP error,
malformed JSON, a failed check) goes to the pool's ``after``, which says whether and when the prompt is tried again
(with a fresh request id); when it gives up, the prompt is a ``Failure`` with every attempt's reason. A request given
up on (timeout) or left behind when the run stops early (a gate, Ctrl-C) is cancelled on the server.

An engine built to ``scores`` (infer's: table.py) also asks every server for the raw log-probability of each
generated id and keeps them in its answers (logprobs.py: what is asked and read, and a launched server made to give
them raw); hidden's vLLM states source and the serve check ask for none.

Nothing starts before it is needed: ``identity`` of a launched server is predicted from its launch arguments and the
engine version installed where its launcher runs (checked against what the server reports once it runs), so a run
whose answers are all cached starts no server; servers given by url are asked (they run already).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Protocol

import aiohttp
import orjson

from eaglepipe.core.config import CACHE
from eaglepipe.engines import Failure, Output, Sampling, logprobs
from eaglepipe.engines.launch import LaunchedServer
from eaglepipe.engines.logprobs import Scored
from eaglepipe.engines.pool import JSON, Failed, Fault, Server, ServerError, ServerPool

log = logging.getLogger(__name__)


def portable(value):
    """``value`` (JSON) with the cache folder's path written ``<cache>`` (it differs between clones)."""
    if isinstance(value, str):
        return value.replace(str(CACHE), "<cache>")
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    return [portable(v) for v in value] if isinstance(value, list) else value


class BadAnswer(ValueError):
    """An answer that fails a check (retried, then recorded as a failure with this reason)."""


def check_ids(ids: list, finish: str, sampling: Sampling) -> str:
    """Check an answer's ``ids`` and ``finish`` (``stop`` or ``length``): at most ``max_new_tokens`` ids, exactly that
    many on ``length``, no stop id before the end; else BadAnswer. Returns the record's finish_reason (``stop`` when
    the last allowed id is a stop id, as in the hf engine)."""
    stops = set(sampling.stop_token_ids)
    if len(ids) > sampling.max_new_tokens:
        raise BadAnswer(f"{len(ids)} output ids for max_new_tokens={sampling.max_new_tokens}")
    if finish == "length" and len(ids) != sampling.max_new_tokens:
        raise BadAnswer(f"finish_reason length after {len(ids)} of {sampling.max_new_tokens} ids")
    inner = next((n for n, t in enumerate(ids[:-1]) if t in stops), None)
    if inner is not None:
        raise BadAnswer(f"stop id {ids[inner]} at position {inner}, before the end of the output")
    return "stop" if finish == "length" and ids and ids[-1] in stops else finish


class Api(Protocol):
    """What a server engine states of its servers' protocol; the client (``ServerEngine``) does the rest."""

    name: str  # infer.engine's name for it
    title: str  # its name in messages
    package: str  # the module whose installed version a launched server runs ...
    version_key: str  # ... and the identity's key for that version

    def launcher(self, cfg) -> LaunchedServer:
        """The server ``cfg`` (config.Launch) describes, not started."""

    def predicted(self, launched: LaunchedServer, version: str) -> dict:
        """The identity ``launched`` will report, from its arguments and the installed ``version``."""

    async def read(self, pool: ServerPool, server: Server) -> None:
        """Fill ``server``'s model_info, server_info and identity; a ServerError if it cannot serve this run."""

    async def tokens(self, pool: ServerPool, server: Server, probes: list[str]) -> list:
        """The server's ids of each of ``probes``, no special tokens added."""

    def request(self, prompt_ids: list, sampling: Sampling, record_id: str, rid: str) -> tuple[str, dict]:
        """(path, JSON body) of one generation request; ``rid``: this attempt's request id."""

    def check(self, answer, prompt_ids: list, sampling: Sampling, rid: str) -> tuple[list, str, dict]:
        """(output_ids, finish_reason, the meta the record keeps) of an answer, or BadAnswer."""

    def abort(self, rid: str) -> tuple[str, dict]:
        """(path, JSON body) that cancels request ``rid``."""


class ServerEngine:
    """The engine over ``api``'s servers; ``params``: its ``infer`` section (config.Servers). A context manager:
    entering starts it (``start``: launches the server if asked, checks every server), leaving closes the connections
    and stops a launched server. ``stream``, and ``identity`` of servers given by url, start it when needed;
    ``close`` of one never started stops nothing (table.create hands the stages such an engine). ``scores``: every
    answer also carries the engine's raw log-probability of each id (a ``Scored``; logprobs.py)."""

    def __init__(self, api: Api, params, tokenizer, scores: bool = False):
        self.api, self.name, self.title = api, api.name, api.title
        self.scores = scores
        self.launch = params.launch
        self.concurrency = params.concurrency
        self.timeout_s = params.timeout_s
        self.pool = ServerPool(params, tokenizer, api)
        self.stats = self.pool.stats
        self.launched: LaunchedServer | None = None  # the server ``launch`` describes, once identity or start built it
        self._identity: dict | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._aborts: set = set()  # cancellations on their way (awaited at close, never cancelled)

    # ---- lifetime -------------------------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    def _launcher(self) -> LaunchedServer:
        """The server ``launch`` describes (``launched``), built once; one that scores, made to give raw figures."""
        if self.launched is None:
            self.launched = self.api.launcher(self.launch)
            if self.scores:
                logprobs.prepare_launch(self.name, self.launched)
        return self.launched

    def start(self) -> ServerEngine:
        """Launch the server if asked, then wait for every server and check it (pool.py) on the client's event loop;
        a launched one must report the identity its launch predicts."""
        if self._loop is not None:
            return self
        try:
            if self.launch is not None:
                self._launcher().start()
            self.pool.open(self.launched)
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.name}-client", daemon=True)
            self._thread.start()
            connected = asyncio.run_coroutine_threadsafe(self.pool.connect(), self._loop)
            try:
                connected.result()
            except BaseException:
                connected.cancel()
                raise
            self._identity = self._agreed(self.pool.identity)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self.pool.disconnect(self._aborts), loop).result(timeout=30)
            except Exception as e:  # noqa: BLE001 - closing must go on
                log.debug("closing the client: %s", e)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                loop.close()
        if self.launched is not None:
            self.launched.stop()

    # ---- what the servers are ----------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What, beyond the local model files, decides the ids (part of the cache fingerprint); never the urls. A
        launched server's comes from its launch (``_predicted``) without starting it; servers given by url are
        asked."""
        if self._identity is None and self.launch is not None:
            self._identity = self._predicted()
            if self._identity is None:
                log.info("%s: no %s installed where the launcher runs: starting it to ask", self.name, self.api.package)
        if self._identity is None:
            self.start()
        return portable(self._identity)

    def _predicted(self, reported: dict | None = None) -> dict | None:
        """The identity the launch arguments give with the engine version installed where the launcher runs (or, when
        that cannot be read, the version the started server ``reported``); None without a version."""
        version = self._launcher().installed(self.api.package)
        if version is None and reported is not None:
            version = reported.get(self.api.version_key)
        return None if version is None else self.api.predicted(self._launcher(), version)

    def _agreed(self, reported: dict) -> dict:
        """The run's identity once the servers answered with ``reported``: theirs, for servers given by url; for a
        launched one, what its launch predicts, where what it reports must agree (a ServerError naming both)."""
        if self.launch is None:
            return reported
        expected = self._identity or self._predicted(reported) or reported
        differ = sorted(
            k for k, v in expected.items() if v is not None and reported.get(k) is not None and reported[k] != v
        )
        if differ:
            raise ServerError(
                f"the launched {self.title} server reports {reported}, but its launch arguments and the "
                f"installed {self.api.package} say {expected} (they differ in {', '.join(differ)})"
            )
        return expected

    def describe(self) -> dict:
        """What the stage keeps about the servers (engine.json); ``servers`` is empty when none was started."""
        return portable(
            {
                "engine": self.name,
                "identity": self._identity,
                "launched": self.launched.describe() if self.launched else None,
                "servers": [
                    {"url": s.url, "model_info": s.model_info, "server_info": s.server_info} for s in self.pool.servers
                ],
            }
        )

    # ---- the engine interface --------------------------------------------------------------------------------
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
            if self.stats:
                log.info("%s client: %s", self.name, ", ".join(f"{k}={v}" for k, v in sorted(self.stats.items())))

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

    async def _one(self, prompt_ids: list, sampling: Sampling, record_id: str) -> Output | Failure:
        """One prompt: attempts until an answer passes the checks, as long as the pool's policy (``after``) says; a
        Failure with every attempt's reason when it gives up."""
        failures: list[Failed] = []
        while True:
            try:
                return await self._attempt(prompt_ids, sampling, record_id, len(failures) + 1)
            except Failed as failure:
                failures.append(failure)
            wait = self.pool.after(failures)
            if wait is None:
                self.stats["failed"] += 1
                return Failure(f"{len(failures)} attempt(s): " + "; ".join(f.reason for f in failures))
            await asyncio.sleep(wait)

    async def _attempt(self, prompt_ids: list, sampling: Sampling, record_id: str, n: int) -> Output:
        """Attempt ``n`` at a prompt (request id ``<record id>#<n>`` from the second on) on the server the pool picks;
        its checked Output (Scored, with the figures checked against the ids, when the engine scores), or Failed."""
        rid = record_id if n == 1 else f"{record_id}#{n}"
        server = await self.pool.acquire()
        path, body = self.api.request(prompt_ids, sampling, record_id, rid)
        if self.scores:
            body = logprobs.ask(self.name, body)
        start = time.perf_counter()
        status, raw = await self._post(server, path, orjson.dumps(body), rid)
        latency = time.perf_counter() - start
        answer = self._answer(server, status, raw)
        try:
            ids, reason, meta = self.api.check(answer, prompt_ids, sampling, rid)
            figures = logprobs.read(self.name, answer, ids) if self.scores else None
        except (BadAnswer, logprobs.BadFigures) as e:
            raise Failed(Fault.CHECK, server, f"{e} ({server.url})") from None
        self.stats["ok"] += 1
        head = {"engine": self.name, "server": server.url, "rid": rid, "attempts": n}
        meta = {**head, **meta, "latency_s": round(latency, 4)}
        return Scored(ids, reason, meta, figures) if self.scores else Output(ids, reason, meta)

    async def _post(self, server: Server, path: str, body: bytes, rid: str) -> tuple[int, bytes]:
        """(HTTP status, body) of one request; Failed when no answer came (a timeout cancels ``rid`` on the server,
        as does the run stopping)."""
        server.inflight += 1
        server.sent += 1
        try:
            async with self.pool.session.post(
                server.url + path,
                data=body,
                headers=JSON,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(30.0, self.timeout_s)),
            ) as r:
                return r.status, await r.read()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            raise Failed(Fault.REFUSED, server, f"cannot connect to {server.url}", cause=str(e)) from None
        except TimeoutError:
            self._abort(server, rid)
            raise Failed(Fault.TIMEOUT, server, f"no answer within {self.timeout_s:g}s from {server.url}") from None
        except asyncio.CancelledError:  # the run stops (a gate, Ctrl-C): the server need not finish this one
            self._abort(server, rid)
            raise
        except aiohttp.ClientError as e:  # reset, disconnected, truncated body
            raise Failed(Fault.CONNECTION, server, f"{type(e).__name__} from {server.url}") from None
        finally:
            server.inflight -= 1

    @staticmethod
    def _answer(server: Server, status: int, raw: bytes):
        """The JSON of an HTTP 200 answer; else Failed."""
        if status != 200:
            message = f"{status} from {server.url}: {raw[:200].decode('utf-8', 'replace')}"
            busy = status in (408, 429) or status >= 500
            raise Failed(Fault.BUSY if busy else Fault.CLIENT, server, message, status)
        try:
            return orjson.loads(raw)
        except ValueError:
            raise Failed(Fault.MALFORMED, server, f"JSON from {server.url}: {raw[:80]!r}") from None

    def _abort(self, server: Server, rid: str) -> None:
        """Best effort: ask the server to cancel request ``rid``, which this client gave up on."""
        path, body = self.api.abort(rid)

        async def abort():
            try:
                async with self.pool.session.post(
                    server.url + path, data=orjson.dumps(body), headers=JSON, timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    await r.read()
            except Exception:  # noqa: BLE001
                pass

        self.stats["aborted"] += 1
        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
