"""A stand-in for an SGLang server that speaks its native HTTP API, for the tests and bench/bench_sglang_client.py.

    python tests/sglang_server.py --port 30000 [--model-path embedded] [--dtype auto] [--kv-cache-dtype auto]
        [--quantization Q] [--weight-version default] [--no-compute] [--latency 0.2]
        [--fault-rate 0.1] [--faults all|http429,reset,...] [--fault-mode random|cycle] [--fault-budget N]
        [--hang-s 30] [--startup-delay 2] [--batch-arrays] [--exclude-stop] [--old-api] [--tokenize-skew]
        [--reasoning wrap|drop]

Endpoints as SGLang's python/sglang/srt/entrypoints/http_server.py has them:
    GET  /health, /health_generate     200, or 503 while starting (--startup-delay) or when set unhealthy
    GET  /model_info, /server_info     (and the older /get_model_info, /get_server_info; --old-api: only those):
                                       model_path, dtype, kv_cache_dtype, quantization and weight_version as given
                                       (SGLang's defaults otherwise; no --model-path: the embedded model's folder),
                                       version ``VERSION``
    POST /generate                     GenerateReqInput: exactly one of input_ids / text, single or batch (a list of
                                       lists / of strings), rid (str or list; a str on a batch becomes rid_0, ...),
                                       sampling_params (one dict or one per item; missing fields from the model's
                                       generation_config.json, like --sampling-defaults model). Answers
                                       {text, output_ids, meta_info{id, finish_reason, prompt_tokens,
                                       completion_tokens, cached_tokens, weight_version, e2e_latency}}, a JSON array
                                       for a batch (and for one request with --batch-arrays). Errors as SGLang sends
                                       them: 400 {"error": {"message"}}; 5xx {"object": "error", "message", ...}.
    POST /tokenize, /v1/tokenize       {prompt: str | [str], add_special_tokens} -> {tokens, count, max_model_len}
    POST /detokenize                   {tokens} -> {text}
    POST /abort_request                {rid}
Generation is the embedded engine's: eaglepipe.engines.hf.HFEngine at batch size 1, one request at a time, with
SGLang's finish rules on top (the length limit is checked before the stop ids; the matched stop id stays in
output_ids and is trimmed from text unless no_stop_trim). --no-compute answers made-up ids after --latency only
(the client benchmark). Test-harness endpoints: POST /_test/config (JSON of the knobs below), GET /_test/stats.

A reasoning model (--reasoning; knob "reasoning", null = off), for a --model-path whose tokenizer has <think> and
</think> as special tokens (tests/reasoning_fixtures.py builds one around the embedded weights):
    wrap    every answer is a think block, then the answer the embedded model generates, as token ids:
            "<think>\n" (left out when the prompt already ends with <think>, whitespace after it allowed),
            THOUGHT, "\n</think>\n\n", then the model's ids with the stop id at the end. The block counts against
            max_new_tokens (the model gets what is left) and SGLang's finish rules apply to the whole output.
    drop    the same model with its thinking dropped from the served answers (a broken server or parser): the
            model's answer alone, generated under the whole max_new_tokens.
The model is fed the prompt without a trailing opened <think> and without the ids it has no embedding for (the
markers the test tokenizer adds), so its answer is the one it gives to the plain prompt.

Faults (--fault-rate of /generate requests, kinds from --faults; "cycle" faults exactly every 1/rate-th request):
    http429 http500 http503 http400   an error status with SGLang's error body
    reset                             the connection is dropped without an answer
    hang                              no answer for --hang-s (the client times out)
    malformed                         200 with a body that is not JSON
    truncated                         200 whose body stops short of its Content-Length
    prefix                            output_ids start with the prompt's last 5 ids (sglang #10896, #17240)
    count                             completion_tokens disagrees with output_ids
    abort                             finish_reason {"type": "abort"} with partial output
    finish                            an unknown finish_reason

The double itself is the package sglang_double/ beside this script (its __init__ says which module holds what); this
script runs it and is where the tests and bench import its drivers from.
"""

import argparse
import logging

from aiohttp import web
from sglang_double.control import configure, distribution, free_port, start_server, stats, stop_server
from sglang_double.protocol import CLEAN, FAULTS, KEEPALIVE_S, THOUGHT, VERSION
from sglang_double.server import FakeSGLang, make_app

__all__ = [  # what the tests and bench/bench_sglang_client.py import from here
    "CLEAN",
    "THOUGHT",
    "VERSION",
    "configure",
    "distribution",
    "free_port",
    "start_server",
    "stats",
    "stop_server",
]

log = logging.getLogger("sglang_server")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sglang_options(ap)
    knob_options(ap)
    args, extra = ap.parse_known_args(argv)
    args.extra = extra  # SGLang flags the launcher passes through (recorded in /server_info)
    return args


def sglang_options(ap: argparse.ArgumentParser) -> None:
    """The options SGLang's launch_server has that the double reads or reports."""
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument(
        "--model-path",
        "--model",
        dest="model_path",
        help="'embedded' (the default), a Hugging Face model folder or a .gguf file (eaglepipe.target.model.resolve)",
    )
    ap.add_argument("--tp", "--tp-size", dest="tp", type=int, default=1, help="recorded in /server_info only")
    ap.add_argument("--dp", "--dp-size", dest="dp", type=int, default=1, help="recorded in /server_info only")
    for flag, default in (("--dtype", "auto"), ("--kv-cache-dtype", "auto"), ("--weight-version", "default")):
        ap.add_argument(flag, default=default, help="reported in /server_info only (the model computes in float32)")
    ap.add_argument("--quantization", help="reported in /server_info only")


def knob_options(ap: argparse.ArgumentParser) -> None:
    """The double's own knobs (also settable later: POST /_test/config)."""
    ap.add_argument("--no-compute", action="store_true", help="answer made-up ids without running the model")
    ap.add_argument("--latency", type=float, help="seconds added to every /generate answer")
    ap.add_argument("--fault-rate", dest="fault_rate", type=float, help="share of /generate requests that fault")
    ap.add_argument("--faults", help=f"comma-separated kinds, or 'all' ({','.join(FAULTS)}; also http400)")
    ap.add_argument("--fault-mode", dest="fault_mode", choices=("random", "cycle"))
    ap.add_argument("--fault-budget", dest="fault_budget", type=int, help="inject at most this many faults")
    ap.add_argument("--hang-s", dest="hang_s", type=float)
    ap.add_argument(
        "--startup-delay",
        dest="startup_delay",
        type=float,
        default=0.0,
        help="answer 503 on /health and /generate for this long after starting",
    )
    ap.add_argument("--batch-arrays", dest="batch_arrays", action="store_const", const=True)
    flags = (
        ("--exclude-stop", "leave the matched stop id out of output_ids (but count it)"),
        ("--old-api", "only the old /get_model_info and /get_server_info"),
        ("--tokenize-skew", "/tokenize maps special tokens to other ids (a mismatched tokenizer)"),
    )
    for flag, why in flags:
        ap.add_argument(flag, dest=flag[2:].replace("-", "_"), action="store_const", const=True, help=why)
    ap.add_argument(
        "--reasoning",
        choices=("wrap", "drop"),
        help="serve a reasoning model: 'wrap' puts a think block before the model's answer (needs "
        "<think> and </think> in the tokenizer), 'drop' serves the answer without it (thinking "
        "lost); see the module docstring",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fake-stop-after",
        dest="fake_stop_after",
        type=int,
        help="--no-compute: answers end with a stop id after this many ids",
    )


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = FakeSGLang(args)
    log.info(
        "serving %s on %s:%d (%s)",
        server.folder,
        args.host,
        args.port,
        "no compute" if args.no_compute else "HFEngine, batch size 1",
    )
    web.run_app(
        make_app(server),
        host=args.host,
        port=args.port,
        access_log=None,
        print=None,
        shutdown_timeout=0.5,
        keepalive_timeout=KEEPALIVE_S,
    )


if __name__ == "__main__":
    main()
