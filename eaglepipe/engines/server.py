"""``ServerEngine``: an engine whose target runs on servers (protocols: sglang.py, vllm.py; servers: pool.py).

Requests carry token ids and every sampling parameter explicit, at most ``concurrency`` in flight; every answer is
checked (``_check``) before it is kept.

Timeouts, refused/reset connections, HTTP 408/429/5xx, malformed JSON and failed checks are retried ``retries`` times
with exponential backoff and jitter, then the prompt is a ``Failure`` with every attempt's reason. Another 4xx is
retried once (fresh request id). A request given up on (timeout) or left behind when the run stops early (a gate,
Ctrl-C) is cancelled on the server. A refused connection or HTTP 503 takes the server out of rotation (pool.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time

import aiohttp
import orjson
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from eaglepipe.core.config import CACHE
from eaglepipe.engines import Failure, Output, Sampling
from eaglepipe.engines.pool import JSON, ServerError, ServerPool, _Server

__all__ = ["BadAnswer", "ServerEngine", "ServerError", "_Server", "check_ids"]

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


class _Retry(Exception):
    pass


class _Permanent(Exception):
    pass


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


class ServerEngine(ServerPool):
    """A context manager: entering launches the server if asked and checks every server; leaving closes the
    connections and stops a launched server.

    A subclass gives what ServerPool asks and
        ``_sampling(sampling, record_id)``           the request's sampling params (dict)
        ``_request(prompt_ids, params, rid)``        (path, JSON body) of one generation request
        ``_check(answer, prompt_ids, sampling, rid)``  (output_ids, finish_reason, meta) of an answer, or BadAnswer
        ``_meta(meta)``                              what of that meta the record keeps
        ``_abort_request(rid)``                      (path, JSON body) that cancels request ``rid``
    """

    def __init__(self, params, tokenizer):
        super().__init__(params, tokenizer)
        self.concurrency = params.concurrency
        self.retries = params.retries
        self.backoff_s = params.backoff_s
        self.backoff_max_s = params.backoff_max_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._aborts: set = set()  # /abort_request calls on their way (awaited at close, never cancelled)

    # ---- lifetime -------------------------------------------------------------------------------------------
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self) -> ServerEngine:
        if self._loop is not None:
            return self
        try:
            self._open()
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name=f"{self.name}-client", daemon=True)
            self._thread.start()
            fut = asyncio.run_coroutine_threadsafe(self._connect(), self._loop)
            try:
                fut.result()
            except BaseException:
                fut.cancel()
                raise
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._disconnect(self._aborts), loop).result(timeout=30)
            except Exception as e:  # noqa: BLE001 - closing must go on
                log.debug("closing the client: %s", e)
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                loop.close()
        self._release()

    # ---- the engine interface --------------------------------------------------------------------------------
    def identity(self) -> dict:
        """What, beyond the local model files, decides the ids (part of the cache fingerprint); never the urls."""
        self.start()
        return portable(self._identity)

    def describe(self) -> dict:
        """What the stage keeps about the servers (engine.json)."""
        return portable(
            {
                "engine": self.name,
                "identity": self._identity,
                "launched": self._launched.describe() if self._launched else None,
                "servers": [
                    {"url": s.url, "model_info": s.model_info, "server_info": s.server_info} for s in self._servers
                ],
            }
        )

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

    async def _one(self, prompt_ids: list, sampling: Sampling, record_id: str):
        """One prompt: attempts until an answer passes the checks; a Failure when retries are spent."""
        params = self._sampling(sampling, record_id)
        reasons: list[str] = []
        try:  # the first attempt outside tenacity (the hot path)
            return await self._attempt(prompt_ids, params, sampling, record_id, 1, reasons)
        except _Permanent:
            return self._failed(reasons)
        except _Retry:
            if self.retries == 0:
                return self._failed(reasons)
        # Retry k waits backoff_s * 2**(k-1) plus up to backoff_s of jitter, at most backoff_max_s.
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.retries),
            retry=retry_if_exception_type(_Retry),
            wait=wait_exponential_jitter(multiplier=2 * self.backoff_s, max=self.backoff_max_s, jitter=self.backoff_s),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    k = attempt.retry_state.attempt_number
                    if k == 1:
                        await asyncio.sleep(min(self.backoff_s + random.uniform(0, self.backoff_s), self.backoff_max_s))
                    return await self._attempt(prompt_ids, params, sampling, f"{record_id}#{k + 1}", k + 1, reasons)
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
        body = orjson.dumps(body)
        start = time.perf_counter()
        try:
            async with self._session.post(
                server.url + path,
                data=body,
                headers=JSON,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(30.0, self.timeout_s)),
            ) as r:
                status, raw = r.status, await r.read()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            self._mark_down(server, f"cannot connect: {e}")
            raise retry("refused", f"cannot connect to {server.url}") from None
        except TimeoutError:
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
            answer = orjson.loads(raw)
        except ValueError:
            raise retry("malformed", f"JSON from {server.url}: {raw[:80]!r}") from None
        try:
            ids, reason, meta = self._check(answer, prompt_ids, sampling, rid)
        except BadAnswer as e:
            raise retry("check", f"{e} ({server.url})") from None
        self.stats["ok"] += 1
        return Output(
            ids,
            reason,
            {
                "engine": self.name,
                "server": server.url,
                "rid": rid,
                "attempts": n,
                **self._meta(meta),
                "latency_s": round(latency, 4),
            },
        )

    def _abort(self, server: _Server, rid: str) -> None:
        """Best effort: ask the server to cancel request ``rid``, which this client gave up on."""
        path, body = self._abort_request(rid)

        async def abort():
            try:
                async with self._session.post(
                    server.url + path, data=orjson.dumps(body), headers=JSON, timeout=aiohttp.ClientTimeout(total=5)
                ) as r:
                    await r.read()
            except Exception:  # noqa: BLE001
                pass

        self.stats["aborted"] += 1
        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)
