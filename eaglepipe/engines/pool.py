"""``ServerPool``: the servers of one server engine (server.py), on its event loop. It checks them, picks the one that
takes the next request, takes one that fails out of rotation and back, and decides what follows a failed attempt.

Before the first request, for every server in ``urls`` (or the launched one):
    /health      waited for (``health_timeout_s``); a launched server that exits is reported with its log's end
    identity     what it serves (the api's ``read``): kept for ``describe()`` and reduced to ``identity`` (what
                 decides the ids: model, weights, dtype, quantization, version; never urls). All servers must agree.
    tokenizer    its ids of ``tokenizer_probes`` (the api's ``tokens``) must be the local tokenizer's, or the run stops
                 naming the probes that differ.

The next request goes to the healthy server with the fewest in flight (``acquire``). A failed attempt is a ``Failed``
of one ``Fault`` kind, and ``after`` is the retry policy, the one place that decides what follows it:
    where       a refused connection or HTTP 503 takes the server out of rotation (the next attempt goes to another);
                back within ``health_timeout_s`` and checked again, it rejoins; back serving something else, or with
                no server left, the run stops (``acquire`` raises a ServerError)
    whether     up to ``retries`` times after the first attempt; a client error (HTTP 4xx other than 408 and 429) once
    how long    retry k after ``backoff_s * 2**(k-1)`` plus up to ``backoff_s`` of jitter, at most ``backoff_max_s``
                (tenacity's ``stop_after_attempt`` and ``wait_exponential_jitter``)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import aiohttp
import orjson
from tenacity import RetryCallState, stop_after_attempt, wait_exponential_jitter

from eaglepipe.core.errors import UserError

if TYPE_CHECKING:
    from eaglepipe.engines.launch import LaunchedServer
    from eaglepipe.engines.server import Api

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}  # the header of every POST to a server
IDLE_S = 2.0  # not reused when idle longer: uvicorn (SGLang, vLLM) closes one idle 5 s, resetting a request sent then


class ServerError(UserError, RuntimeError):
    """The run cannot go on: no server, or a server that disagrees with the local tokenizer or the others."""


class _Unhealthy(ServerError):
    """A server that did not answer /health in time."""


class Fault(Enum):
    """What went wrong with one attempt; the value names it in the stats and the failure reasons."""

    REFUSED = "refused"  # no connection: the server leaves the rotation
    TIMEOUT = "timeout"  # no answer within timeout_s (the request is cancelled on the server)
    CONNECTION = "connection"  # reset, disconnected, a truncated body
    BUSY = "http"  # HTTP 408, 429 or 5xx, named http<status>; a 503 takes the server out of rotation
    CLIENT = "http4xx"  # any other HTTP status but 200: retried once
    MALFORMED = "malformed"  # a body that is not JSON
    CHECK = "check"  # an answer that fails the api's checks (server.BadAnswer) or its figures' (logprobs.BadFigures)


@dataclass
class Server:
    url: str
    up: bool = False
    dead: str | None = None  # why it was given up on
    inflight: int = 0
    sent: int = 0
    model_info: dict = field(default_factory=dict)
    server_info: dict = field(default_factory=dict)
    identity: dict = field(default_factory=dict)
    recovery: asyncio.Task | None = None


class Failed(Exception):
    """One failed attempt: its ``fault``, the ``server`` it went to, why; ``status``: the HTTP status, if any;
    ``cause``: the error behind a refused connection."""

    def __init__(self, fault: Fault, server: Server, why: str, status: int | None = None, cause: str = ""):
        super().__init__(why)
        self.fault, self.server, self.why, self.status, self.cause = fault, server, why, status, cause

    @property
    def kind(self) -> str:
        """Its name in the stats: the fault's, ``http<status>`` for a busy server."""
        return f"http{self.status}" if self.fault is Fault.BUSY else self.fault.value

    @property
    def reason(self) -> str:
        return f"{self.kind}: {self.why}"


def tokenizer_probes(tokenizer) -> list[str]:
    """Strings whose ids must be the same on the server and here: the chat template rendered, every special and
    added token, and plain text with unicode, digits, code and odd whitespace."""
    from eaglepipe.target import chat

    probes = []
    for turns in (
        [{"role": "user", "content": "Hi! What is 2+2?"}],
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2 ünï 中文 🤖"},
        ],
    ):
        try:
            probes.append(chat.render(tokenizer, turns))
        except Exception as e:  # a template that refuses a system turn, say
            log.debug("chat template probe skipped: %s", e)
    special = list(
        dict.fromkeys(
            [
                *tokenizer.all_special_tokens,
                *(t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()),
            ]
        )
    )
    probes += special[:2048]
    if special:
        probes.append("x" + " y".join(special[:64]) + " z")
    probes += [
        "<think>\nreasoning\n</think>\n\nanswer",
        "Hello, world! The year 2024; 3.14159 ≈ π.",
        "def f(x):\n\treturn x ** 2  # tabs, spaces  \n\n",
        "  leading and trailing spaces  ",
        "Ünïcödé 中文 🤖✓",
    ]
    return list(dict.fromkeys(p for p in probes if p))


class ServerPool:
    """The servers of one engine; ``params``: its ``infer`` section (config.Servers); ``api``: what the engine states
    of its servers' protocol (server.Api). Called in order: ``open``, ``connect`` (on the event loop),
    ``acquire``/``after`` per attempt, ``disconnect``."""

    def __init__(self, params, tokenizer, api: Api):
        self.api, self.title, self.name = api, api.title, api.name
        self.urls = [u.rstrip("/") for u in params.urls]
        self.timeout_s = params.timeout_s
        self.health_timeout_s = params.health_timeout_s
        self.tokenizer = tokenizer
        self.stats = Counter()
        self.servers: list[Server] = []
        self.identity: dict | None = None  # what every server reports
        self.session: aiohttp.ClientSession | None = None
        self.probes: list[str] = []
        self.probe_ids: list[list[int]] = []
        self._stop = stop_after_attempt(params.retries + 1)
        self._wait = wait_exponential_jitter(
            multiplier=params.backoff_s, max=params.backoff_max_s, jitter=params.backoff_s
        )
        self._launched: LaunchedServer | None = None
        self._fatal: ServerError | None = None
        self._changed: asyncio.Event | None = None

    # ---- lifetime -------------------------------------------------------------------------------------------
    def open(self, launched: LaunchedServer | None = None) -> None:
        """Tokenize the probes; list the servers: ``urls``, or the ``launched`` one (started)."""
        self._launched = launched
        if launched is not None:
            self.urls = [launched.url]
        self.probes = tokenizer_probes(self.tokenizer)
        self.probe_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in self.probes]
        self.servers = [Server(u) for u in dict.fromkeys(self.urls)]

    async def disconnect(self, tasks) -> None:
        """Cancel the recoveries, wait for them and ``tasks`` (requests still on their way), close the session."""
        pending = [s.recovery for s in self.servers if s.recovery is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, *tasks, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    # ---- connecting and checking servers ---------------------------------------------------------------------
    async def connect(self) -> None:
        self._changed = asyncio.Event()
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_S))
        deadline = time.monotonic() + self.health_timeout_s
        results = await asyncio.gather(*(self._check_server(s, deadline) for s in self.servers), return_exceptions=True)
        errors = [f"{s.url}: {r}" for s, r in zip(self.servers, results) if isinstance(r, BaseException)]
        if errors:
            raise ServerError(f"{self.title} server check failed:\n  " + "\n  ".join(errors))
        first = self.servers[0].identity
        differ = [f"{s.url}: {s.identity}" for s in self.servers if s.identity != first]
        if differ:
            raise ServerError(
                f"the servers serve different models: {self.servers[0].url}: {first}; " + "; ".join(differ)
            )
        self.identity = first
        for s in self.servers:
            s.up = True
        log.info("%s: %d server(s) ready, %s", self.name, len(self.servers), first)

    async def _check_server(self, server: Server, deadline: float) -> None:
        """Wait for /health, read what the server says it serves (the api's ``read``), compare tokenizers."""
        await self._wait_healthy(server, deadline)
        await self.api.read(self, server)
        await self._compare_tokenizer(server)

    async def _wait_healthy(self, server: Server, deadline: float) -> None:
        wait, last = 0.25, "no answer yet"
        while True:
            if self._launched is not None and self._launched.returncode() is not None:
                raise ServerError(
                    f"the launched server exited with code {self._launched.returncode()}; "
                    f"the end of {self._launched.log_path}:\n{self._launched.tail()}"
                )
            try:
                async with self.session.get(
                    server.url + "/health", timeout=aiohttp.ClientTimeout(total=max(5.0, min(30.0, self.timeout_s)))
                ) as r:
                    await r.read()
                    if r.status == 200:
                        return
                    last = f"/health answered {r.status}"
            except (TimeoutError, aiohttp.ClientError) as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() + wait > deadline:
                raise _Unhealthy(f"not healthy within health_timeout_s={self.health_timeout_s:g}s ({last})")
            await asyncio.sleep(wait)
            wait = min(wait * 1.5, 5.0)

    async def get_info(self, server: Server, *paths) -> dict:
        """The JSON object of the first of ``paths`` the server has (a 404 tries the next); else a ServerError."""
        for path in paths:
            async with self.session.get(server.url + path, timeout=aiohttp.ClientTimeout(total=60)) as r:
                raw = await r.read()
                if r.status == 404:
                    continue
                if r.status != 200:
                    raise ServerError(f"GET {path} answered {r.status}: {raw[:200]!r}")
                try:
                    info = orjson.loads(raw)
                except ValueError:
                    raise ServerError(f"GET {path} answered malformed JSON: {raw[:200]!r}") from None
                if not isinstance(info, dict):
                    raise ServerError(f"GET {path} answered a JSON {type(info).__name__}")
                return info
        raise ServerError(f"none of {', '.join(paths)} exists")

    async def post_json(self, server: Server, path: str, body, timeout: float = 120):
        """POST ``body`` to a server; its JSON answer, or a ServerError naming the path."""
        async with self.session.post(
            server.url + path, data=orjson.dumps(body), headers=JSON, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            raw = await r.read()
            if r.status != 200:
                raise ServerError(f"POST {path} answered {r.status}: {raw[:200]!r}")
        try:
            return orjson.loads(raw)
        except ValueError:
            raise ServerError(f"POST {path} answered malformed JSON: {raw[:200]!r}") from None

    async def _compare_tokenizer(self, server: Server) -> None:
        tokens = await self.api.tokens(self, server, self.probes)
        if not isinstance(tokens, list) or len(tokens) != len(self.probes):
            raise ServerError(
                f"the server tokenized {len(tokens) if isinstance(tokens, list) else tokens!r} "
                f"of {len(self.probes)} probes"
            )
        differ = [(p, theirs, ours) for p, theirs, ours in zip(self.probes, tokens, self.probe_ids) if theirs != ours]
        if differ:
            lines = []
            for p, theirs, ours in differ[:8]:
                at = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), min(len(theirs), len(ours)))
                lines.append(
                    f"{p[:60]!r}: from position {at}: server {theirs[at : at + 8]} vs local {ours[at : at + 8]} "
                    f"({len(theirs)} vs {len(ours)} ids)"
                )
            raise ServerError(
                f"the server's tokenizer disagrees with the local one ({self.tokenizer.name_or_path}) "
                f"on {len(differ)} of {len(self.probes)} probes:\n    " + "\n    ".join(lines)
            )

    # ---- the retry policy ------------------------------------------------------------------------------------
    def after(self, failures: list[Failed]) -> float | None:
        """What follows the failed attempt ``failures[-1]`` (the earlier ones: the same prompt's before it): counted,
        its server out of rotation where it refused or answered 503; the seconds to wait before the next attempt
        (``acquire`` picks its server), or None to give up."""
        failure = failures[-1]
        self.stats[failure.kind] += 1
        if failure.fault is Fault.REFUSED:
            self._mark_down(failure.server, f"cannot connect: {failure.cause}")
        elif failure.status == 503:
            self._mark_down(failure.server, "HTTP 503")
        attempt = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
        attempt.attempt_number = len(failures)
        client_errors = sum(f.fault is Fault.CLIENT for f in failures)
        if self._stop(attempt) or (failure.fault is Fault.CLIENT and client_errors > 1):
            return None
        return self._wait(attempt)

    # ---- servers leaving and coming back ---------------------------------------------------------------------
    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()

    def _mark_down(self, server: Server, why: str) -> None:
        """Take ``server`` out of rotation and watch for it to come back (``_recover``)."""
        if not server.up:
            return
        server.up = False
        self.stats["server_down"] += 1
        log.warning(
            "%s: %s out of rotation (%s); waiting up to %gs for it to come back",
            self.name,
            server.url,
            why,
            self.health_timeout_s,
        )
        server.recovery = asyncio.get_running_loop().create_task(self._recover(server))
        self._notify()

    async def _recover(self, server: Server) -> None:
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
                self._fatal = ServerError(
                    f"{server.url} came back serving {server.identity}, not {before}: "
                    "records would mix; stopping (the cache keeps what was generated)"
                )
            else:
                server.up = True
                self.stats["server_back"] += 1
                log.warning("%s: %s is back", self.name, server.url)
        finally:
            server.recovery = None
            self._notify()

    async def acquire(self) -> Server:
        """The healthy server with the fewest in flight (then the fewest sent), waiting while none is up; a
        ServerError when the run cannot go on."""
        while True:
            if self._fatal is not None:
                raise self._fatal
            best = min((s for s in self.servers if s.up), key=lambda s: (s.inflight, s.sent), default=None)
            if best is not None:
                return best
            if all(s.dead for s in self.servers):
                raise ServerError(
                    f"no {self.title} server left: " + "; ".join(f"{s.url}: {s.dead}" for s in self.servers)
                )
            await self._changed.wait()
