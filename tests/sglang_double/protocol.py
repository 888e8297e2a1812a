"""What the SGLang double speaks: the fault kinds, the sampling params SGLang takes, the test knobs (KNOBS, and CLEAN
that resets them all), the version it reports, SGLang's error bodies, rid rules and sampling defaults."""

import json
import os
from pathlib import Path

import orjson
from aiohttp import web

dumps, loads = orjson.dumps, orjson.loads  # the benchmark wants the server cheap

FAULTS = (
    "http429",
    "http500",
    "http503",
    "reset",
    "hang",
    "malformed",
    "truncated",
    "prefix",
    "count",
    "abort",
    "finish",
)
EXTRA_FAULTS = ("http400",)
PRE_FAULTS = {"http429", "http500", "http503", "http400", "reset", "hang", "malformed", "truncated"}
SAMPLING_KEYS = {
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
}
KNOBS = {
    "latency": 0.0,
    "fault_rate": 0.0,
    "faults": list(FAULTS),
    "fault_mode": "random",
    "fault_budget": None,
    "hang_s": 30.0,
    "batch_arrays": False,
    "exclude_stop": False,
    "old_api": False,
    "tokenize_skew": False,
    "unhealthy": False,
    "seed": 0,
    "fail_rids": [],
    "fake_stop_after": None,
    "reasoning": None,
    "logprob_offset": 0.0,
}
CLEAN = {**KNOBS, "reset_stats": True}  # POST /_test/config with CLEAN: every knob as at start, the stats from zero
TAIL = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
KEEPALIVE_S = 5.0  # SGLang's uvicorn closes a connection idle this long (http_server.py, timeout_keep_alive)
REASONING_MODES = (None, "wrap", "drop")
THOUGHT = "Let me think."  # the reasoning text of --reasoning wrap (short: it counts against max_new_tokens)
VERSION = "0.0.0+eaglepipe-test-server"  # the version /server_info reports
# GenerateReqInput's log-probability fields (top level, not sampling params) and SGLang's defaults for them
LOGPROB_FIELDS = {
    "return_logprob": False,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "return_text_in_logprobs": False,
}
ORIGINAL_LOGPROB = "SGLANG_RETURN_ORIGINAL_LOGPROB"  # set true, figures are taken before temperature (sampler.py)


class RequestError(Exception):
    """A request SGLang would refuse with 400 and {"error": {"message": ...}}."""


def sglang_error(status: int, message: str) -> web.Response:
    if status == 400:
        body = {"error": {"message": message}}
    else:
        body = {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
    return web.json_response(body, status=status)


def new_stats() -> dict:
    """What GET /stats counts, from zero (at start and on ``reset_stats``)."""
    return {
        "generate_requests": 0,
        "answers": 0,
        "faults": {},
        "aborts": 0,
        "aborted_rids": [],
        "rids": [],
        "max_inflight": 0,
        "connections": [],
    }


def request_ids(rid, single: bool, n: int) -> list:
    """The rids of a request's ``n`` items, as SGLang derives them from its ``rid`` (None: random ones)."""
    if single:
        rids = [rid if rid is not None else os.urandom(16).hex()]
    elif rid is None:
        rids = [os.urandom(16).hex() for _ in range(n)]
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)]
    elif isinstance(rid, list) and len(rid) == n:
        rids = rid
    else:
        raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
    if len(set(rids)) != len(rids):
        raise RequestError(f"Duplicate request IDs in the batch: {rids}")
    return rids


def logprob_fields(body: dict, single: bool, inputs: list) -> list[dict]:
    """Each request's LOGPROB_FIELDS, as GenerateReqInput normalises them (one value for all, or a list with one per
    request of a batch; SGLang's default where none is given) and checked as SGLang does."""
    n = len(inputs)
    columns = {}
    for name, default in LOGPROB_FIELDS.items():
        value = body.get(name)
        if isinstance(value, list):
            if single or len(value) != n:
                raise RequestError(f"{name} should be one value, or a list with one per request of a batch")
            columns[name] = [default if v is None else v for v in value]
        else:
            columns[name] = [default if value is None else value] * n
    fields = [{name: column[i] for name, column in columns.items()} for i in range(n)]
    for item, ids in zip(fields, inputs):
        start, top = item["logprob_start_len"], item["top_logprobs_num"]
        if type(start) is not int or start < -1:
            raise RequestError(f"logprob_start_len should be -1 or a position in the prompt, got {start!r}")
        if start > len(ids):
            raise RequestError(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={len(ids)}. Please use a smaller logprob_start_len."
            )
        if type(top) is not int or top < 0:
            raise RequestError(f"top_logprobs_num should be a non-negative integer, got {top!r}")
    return fields


def original_logprob() -> bool:
    """Whether the environment sets ORIGINAL_LOGPROB true (SGLang's get_bool_env_var)."""
    return os.environ.get(ORIGINAL_LOGPROB, "false").lower() in ("true", "1")


def sampling_defaults(folder: Path) -> dict:
    """The sampling params a request leaves out, as SGLang's ``--sampling-defaults model`` fills them: the model's
    generation_config.json over SGLang's own."""
    gen_config = folder / "generation_config.json"
    defaults = json.loads(gen_config.read_text()) if gen_config.exists() else {}
    return {
        "max_new_tokens": 128,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        **{
            k: defaults[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if defaults.get(k) is not None
        },
    }
