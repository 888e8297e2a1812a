"""Driving the SGLang double from another process (the tests and bench/bench_sglang_client.py): a free port, the
server started on it and stopped, its knobs set and its stats read over HTTP, and a launcher's view of an installed
SGLang."""

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from sglang_double.protocol import dumps, loads

SCRIPT = Path(__file__).resolve().parent.parent / "sglang_server.py"  # what start_server runs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log: Path, *args, env: dict | None = None) -> subprocess.Popen:
    """The double (tests/sglang_server.py) on a loopback port, ``env`` added to its environment; returns once /health
    answers 200."""
    with open(log, "ab") as out:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), "--port", str(port), *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
    wait_healthy(f"http://127.0.0.1:{port}", proc, log)
    return proc


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"test server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"test server not healthy in {timeout}s:\n{log.read_text()[-3000:]}")


def configure(url: str, **knobs) -> dict:
    """Set the server's test knobs (faults, latency, ...; CLEAN resets them all)."""
    req = urllib.request.Request(
        url + "/_test/config", data=dumps(knobs), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return loads(r.read())


def post(url: str, path: str, body) -> tuple[int, object]:
    """(HTTP status, JSON answer) of POST ``path`` with the JSON ``body``: a request as any client sends it."""
    req = urllib.request.Request(
        url + path, data=dumps(body), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, loads(e.read())


def stats(url: str) -> dict:
    """What the server has seen since its start or the last reset."""
    with urllib.request.urlopen(url + "/_test/stats", timeout=10) as r:
        return loads(r.read())


def distribution(site: Path, name: str, version: str, module: str | None = None) -> Path:
    """``site``, holding the package metadata of distribution ``name`` ``version`` (that installs ``module``, when
    given) and nothing else: on a launcher's PYTHONPATH, what its Python says is installed (a launched server's
    version, launch.LaunchedServer.installed). ``distribution(site, "sglang", VERSION)`` makes this double's launch
    one of "the installed SGLang"."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if module is not None:
        (info / "top_level.txt").write_text(module + "\n")
    return site


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
