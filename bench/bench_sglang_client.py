"""How fast is the SGLang client alone? A benchmark, not a test.

Starts tests/sglang_server.py in --no-compute mode (made-up answers after a fixed --latency per request, so the
server costs next to nothing) and streams --requests prompts through SGLangEngine.stream at --concurrency. A client
that keeps ``concurrency`` requests in flight all the time reaches concurrency / latency requests per second; the
bench prints the ratio it reached (the floor is 0.9 at concurrency 256) and the client's CPU time per request
(process CPU of this process, which runs nothing but the client and its consumer loop). It also prints the latency
the client saw per request, the server's CPU per request and the load average: on a shared machine, time the client
and server processes wait for a core shows up as latency above --latency, and lowers the ratio.

    .venv/bin/python bench/bench_sglang_client.py [--concurrency 256] [--latency 0.5] [--rounds 40]
"""
import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eaglepipe import target  # noqa: E402
from eaglepipe.engines import Output, Sampling  # noqa: E402
from eaglepipe.engines.sglang import SGLangEngine  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_healthy(url: str, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the test server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the test server did not come up")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--latency", type=float, default=0.5, help="seconds the server takes per request")
    ap.add_argument("--rounds", type=int, default=40, help="requests = rounds * concurrency")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt ids per request")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="answer ids per request")
    ap.add_argument("--floor", type=float, default=0.9)
    args = ap.parse_args()

    folder = target.resolve("embedded")
    tokenizer = target.load_tokenizer(folder)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-server-", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sglang_server.py"), "--port", str(port),
                               "--no-compute", "--latency", str(args.latency)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, server)
        rng = random.Random(0)
        n = args.rounds * args.concurrency
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(n)]
        stops = tuple(target.stop_ids(folder, tokenizer))
        sampling = Sampling(max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
        cfg = {"urls": [url], "concurrency": args.concurrency, "timeout_s": 60, "health_timeout_s": 60, "retries": 2}
        with SGLangEngine(cfg, tokenizer) as engine:
            # warm up the connection pool (one round), then measure
            list(engine.stream(prompts[:args.concurrency], sampling, [f"w{i}" for i in range(args.concurrency)]))
            server_cpu0, cpu0, t0 = proc_cpu(server.pid), time.process_time(), time.perf_counter()
            outs = [o for _, o in engine.stream(prompts, sampling, [f"r{i}" for i in range(n)])]
            wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            server_cpu = proc_cpu(server.pid) - server_cpu0
        with urllib.request.urlopen(url + "/_test/stats", timeout=10) as r:
            max_inflight = json.loads(r.read())["max_inflight"]
    finally:
        server.terminate()
        server.wait(timeout=30)
    ok = sum(isinstance(o, Output) for o in outs)
    seen = sorted(o.meta["latency_s"] for o in outs if isinstance(o, Output))
    ideal = args.concurrency / args.latency
    rps = n / wall
    result = {"requests": n, "ok": ok, "concurrency": args.concurrency, "latency_s": args.latency,
              "wall_s": round(wall, 2), "requests_per_s": round(rps, 1), "ideal_per_s": round(ideal, 1),
              "ratio": round(rps / ideal, 3), "client_cpu_ms_per_request": round(1000 * cpu / n, 3),
              "client_cpu_cores": round(cpu / wall, 2),
              "request_latency_s": {"mean": round(sum(seen) / len(seen), 3), "p50": seen[len(seen) // 2],
                                    "p99": seen[len(seen) * 99 // 100]},
              "server_cpu_ms_per_request": round(1000 * server_cpu / n, 3),
              "server_max_inflight": max_inflight, "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    print(json.dumps(result))
    print(f"{rps:.0f} requests/s of an ideal {ideal:.0f} (concurrency {args.concurrency} / latency {args.latency}s): "
          f"ratio {rps / ideal:.3f} ({'meets' if rps / ideal >= args.floor else 'BELOW'} the {args.floor} floor); "
          f"client CPU {1000 * cpu / n:.3f} ms per request")


if __name__ == "__main__":
    main()
