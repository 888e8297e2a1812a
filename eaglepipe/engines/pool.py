"""``ServerPool``: the servers of a server engine (server.py builds on it), their checks, which takes the next
request, and a server the run launched (launch.py).

Before the first request, for every server in ``urls`` (or the launched one):
    /health      waited for (``health_timeout_s``)
    identity     what it serves (``_read_server``): kept for ``describe()`` and reduced to ``identity()`` (what
                 decides the ids: model, weights, dtype, quantization, version; never urls). All servers must agree.
    tokenizer    its ids of ``tokenizer_probes`` (``_server_tokens``) must be the local tokenizer's, or the run stops
                 naming the probes that differ.

The next request goes to the healthy server with the fewest in flight (``_acquire``). A server that refuses
connections or answers 503 leaves the rotation (``_mark_down``); back within ``health_timeout_s`` and checked again,
it rejoins; back serving something else, or with no server left, the run stops. A launched server is stopped on
``_release``, also on SIGTERM. Everything async runs on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson

from eaglepipe.core.errors import UserError

log = logging.getLogger(__name__)

JSON = {"Content-Type": "application/json"}  # the header of every POST to a server
IDLE_S = 2.0  # not reused when idle longer: uvicorn (SGLang, vLLM) closes one idle 5 s, resetting a request sent then


class ServerError(UserError, RuntimeError):
    """The run cannot go on: no server, or a server that disagrees with the local tokenizer or the others."""


class _Unhealthy(ServerError):
    """A server that did not answer /health in time."""


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


class ServerPool:
    """The servers of one engine; ``params``: its ``infer`` section (config.Servers). Called in order: ``_open``,
    ``_connect`` (on the event loop), ``_acquire``/``_mark_down`` per request, ``_disconnect``, ``_release``.

    A subclass gives ``name``, ``title`` and
        ``_launcher()``                 the LaunchedServer (launch.py) for ``params.launch``
        ``async _read_server(server)``  fill its ``model_info``, ``server_info``, ``identity``; ServerError if it
                                        cannot serve this run
        ``async _server_tokens(server)``  its ids for each of ``self._probes`` (no special tokens added)
    """

    name = title = "server"

    def __init__(self, params, tokenizer):
        self.urls = [u.rstrip("/") for u in params.urls]
        self.timeout_s = params.timeout_s
        self.health_timeout_s = params.health_timeout_s
        self.launch = params.launch
        self.tokenizer = tokenizer
        self.stats = Counter()
        self._servers: list[_Server] = []
        self._identity: dict | None = None
        self._launched = None
        self._session: aiohttp.ClientSession | None = None
        self._fatal: ServerError | None = None
        self._changed: asyncio.Event | None = None
        self._probes: list[str] = []
        self._probe_ids: list[list[int]] = []
        self._old_sigterm = None

    # ---- lifetime -------------------------------------------------------------------------------------------
    def _open(self) -> None:
        """Launch the server if asked (``urls`` becomes its url; in the main thread a default SIGTERM becomes a
        SystemExit); tokenize the probes; list the servers."""
        if self.launch:
            if (
                threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
            ):  # SystemExit: the engine's close stops it
                self._old_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
            self._launched = self._launcher()
            self._launched.start()
            self.urls = [self._launched.url]
        self._probes = tokenizer_probes(self.tokenizer)
        self._probe_ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in self._probes]
        self._servers = [_Server(u) for u in dict.fromkeys(self.urls)]

    def _release(self) -> None:
        """Stop a launched server and give SIGTERM its handler back; nothing when there is nothing to release."""
        if self._launched is not None:
            self._launched.stop()
            self._launched = None
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    async def _disconnect(self, tasks) -> None:
        """Cancel the recoveries, wait for them and ``tasks`` (requests still on their way), close the session."""
        pending = [s.recovery for s in self._servers if s.recovery is not None]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, *tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    # ---- connecting and checking servers ---------------------------------------------------------------------
    async def _connect(self):
        self._changed = asyncio.Event()
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=IDLE_S))
        deadline = time.monotonic() + self.health_timeout_s
        results = await asyncio.gather(
            *(self._check_server(s, deadline) for s in self._servers), return_exceptions=True
        )
        errors = [f"{s.url}: {r}" for s, r in zip(self._servers, results) if isinstance(r, BaseException)]
        if errors:
            raise ServerError(f"{self.title} server check failed:\n  " + "\n  ".join(errors))
        first = self._servers[0].identity
        differ = [f"{s.url}: {s.identity}" for s in self._servers if s.identity != first]
        if differ:
            raise ServerError(
                f"the servers serve different models: {self._servers[0].url}: {first}; " + "; ".join(differ)
            )
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
            if self._launched is not None and self._launched.returncode() is not None:
                raise ServerError(
                    f"the launched server exited with code {self._launched.returncode()}; "
                    f"the end of {self._launched.log_path}:\n{self._launched.tail()}"
                )
            try:
                async with self._session.get(
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

    async def _get_info(self, server: _Server, *paths) -> dict:
        """The JSON object of the first of ``paths`` the server has (a 404 tries the next); else a ServerError."""
        for path in paths:
            async with self._session.get(server.url + path, timeout=aiohttp.ClientTimeout(total=60)) as r:
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

    async def _post_json(self, server: _Server, path: str, body, timeout: float = 120):
        """POST ``body`` to a server; its JSON answer, or a ServerError naming the path."""
        async with self._session.post(
            server.url + path, data=orjson.dumps(body), headers=JSON, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as r:
            raw = await r.read()
            if r.status != 200:
                raise ServerError(f"POST {path} answered {r.status}: {raw[:200]!r}")
        try:
            return orjson.loads(raw)
        except ValueError:
            raise ServerError(f"POST {path} answered malformed JSON: {raw[:200]!r}") from None

    async def _compare_tokenizer(self, server: _Server) -> None:
        tokens = await self._server_tokens(server)
        if not isinstance(tokens, list) or len(tokens) != len(self._probes):
            raise ServerError(
                f"the server tokenized {len(tokens) if isinstance(tokens, list) else tokens!r} "
                f"of {len(self._probes)} probes"
            )
        differ = [(p, theirs, ours) for p, theirs, ours in zip(self._probes, tokens, self._probe_ids) if theirs != ours]
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
                f"on {len(differ)} of {len(self._probes)} probes:\n    " + "\n    ".join(lines)
            )

    # ---- servers leaving and coming back ---------------------------------------------------------------------
    def _notify(self):
        self._changed.set()
        self._changed = asyncio.Event()

    def _mark_down(self, server: _Server, why: str) -> None:
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

    async def _acquire(self) -> _Server:
        """The healthy server with the fewest in flight (then the fewest sent), waiting while none is up; a
        ServerError when the run cannot go on."""
        while True:
            if self._fatal is not None:
                raise self._fatal
            best = min((s for s in self._servers if s.up), key=lambda s: (s.inflight, s.sent), default=None)
            if best is not None:
                return best
            if all(s.dead for s in self._servers):
                raise ServerError(
                    f"no {self.title} server left: " + "; ".join(f"{s.url}: {s.dead}" for s in self._servers)
                )
            await self._changed.wait()
