"""How fast is the SGLang client alone? A benchmark, not a test.

Starts tests/sglang_server.py in --no-compute mode (made-up answers after a fixed --latency per request, so
the server costs next to nothing) and streams --requests prompts through SGLangEngine.stream at --concurrency. A client
that keeps ``concurrency`` requests in flight all the time reaches concurrency / latency requests per second; the bench
prints the ratio it reached (the floor is 0.9 at concurrency 256) and the client's CPU time per request (process CPU of
this process, which runs nothing but the client and its consumer loop). It also prints the latency the client saw per
request, the server's CPU per request and the load average: on a shared machine, time the client and server processes
wait for a core shows up as latency above --latency, and lowers the ratio.

    .venv/bin/python bench/bench_sglang_client.py [--concurrency 256] [--latency 0.5] [--rounds 40]
"""

import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import click

from eaglepipe.core import config
from eaglepipe.engines import Output, Sampling
from eaglepipe.engines.sglang import SGLangEngine
from eaglepipe.target import model as target

ROOT = Path(__file__).resolve().parent.parent

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the SGLang stand-in, a test double
from sglang_server import free_port, start_server, stop_server  # noqa: E402


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Measured:
    """One measured round of ``requests`` through the client: the answers, wall and CPU seconds (the client's, the
    server's) and the most requests the server had in flight at once."""

    requests: int
    outs: list
    wall: float
    cpu: float
    server_cpu: float
    max_inflight: int


def measure(concurrency: int, latency: float, rounds: int, prompt_len: int, max_new_tokens: int) -> Measured:
    """``rounds`` x ``concurrency`` made-up prompts through SGLangEngine.stream against the test server answering
    after ``latency`` seconds, after a warm-up round (the connection pool)."""
    folder = target.resolve("embedded")
    tokenizer = target.load_tokenizer(folder)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="bench-server-")) / "server.log"
    server = start_server(port, log, "--no-compute", "--latency", latency)
    try:
        rng = random.Random(0)
        n = rounds * concurrency
        prompts = [[rng.randrange(1000, 40000) for _ in range(prompt_len)] for _ in range(n)]
        stops = tuple(target.stop_ids(folder, tokenizer))
        sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=stops)
        cfg = {"urls": [url], "concurrency": concurrency, "timeout_s": 60, "health_timeout_s": 60, "retries": 2}
        with SGLangEngine(config.Servers(**cfg), tokenizer) as engine:
            list(engine.stream(prompts[:concurrency], sampling, [f"w{i}" for i in range(concurrency)]))
            server_cpu0, cpu0, t0 = proc_cpu(server.pid), time.process_time(), time.perf_counter()
            outs = [o for _, o in engine.stream(prompts, sampling, [f"r{i}" for i in range(n)])]
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            server_cpu = proc_cpu(server.pid) - server_cpu0
        with urllib.request.urlopen(url + "/_test/stats", timeout=10) as r:
            max_inflight = json.loads(r.read())["max_inflight"]
    finally:
        stop_server(server)
    return Measured(n, outs, wall, cpu, server_cpu, max_inflight)


def figures(m: Measured, concurrency: int, latency: float) -> dict:
    """The bench's JSON line."""
    seen = sorted(o.meta["latency_s"] for o in m.outs if isinstance(o, Output))
    ideal = concurrency / latency
    return {
        "requests": m.requests,
        "ok": sum(isinstance(o, Output) for o in m.outs),
        "concurrency": concurrency,
        "latency_s": latency,
        "wall_s": round(m.wall, 2),
        "requests_per_s": round(m.requests / m.wall, 1),
        "ideal_per_s": round(ideal, 1),
        "ratio": round(m.requests / m.wall / ideal, 3),
        "client_cpu_ms_per_request": round(1000 * m.cpu / m.requests, 3),
        "client_cpu_cores": round(m.cpu / m.wall, 2),
        "request_latency_s": {
            "mean": round(sum(seen) / len(seen), 3),
            "p50": seen[len(seen) // 2],
            "p99": seen[len(seen) * 99 // 100],
        },
        "server_cpu_ms_per_request": round(1000 * m.server_cpu / m.requests, 3),
        "server_max_inflight": m.max_inflight,
        "load_average": os.getloadavg()[0],
        "cpus": os.cpu_count(),
    }


@click.command(help=__doc__)
@click.option("--concurrency", default=256, show_default=True)
@click.option("--latency", default=0.5, show_default=True, help="Seconds the server takes per request.")
@click.option("--rounds", default=40, show_default=True, help="Requests = rounds x concurrency.")
@click.option("--prompt-len", default=512, show_default=True, help="Prompt ids per request.")
@click.option("--max-new-tokens", default=64, show_default=True, help="Answer ids per request.")
@click.option("--floor", default=0.9, show_default=True)
def main(concurrency, latency, rounds, prompt_len, max_new_tokens, floor):
    result = figures(measure(concurrency, latency, rounds, prompt_len, max_new_tokens), concurrency, latency)
    print(json.dumps(result))
    print(
        f"{result['requests_per_s']:.0f} requests/s of an ideal {result['ideal_per_s']:.0f} (concurrency "
        f"{concurrency} / latency {latency}s): ratio {result['ratio']:.3f} "
        f"({'meets' if result['ratio'] >= floor else 'BELOW'} the {floor} floor); "
        f"client CPU {result['client_cpu_ms_per_request']:.3f} ms per request"
    )


if __name__ == "__main__":
    main()
