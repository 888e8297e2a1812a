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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import orjson
from aiohttp import web

from eaglepipe.target import model as target

dumps, loads = orjson.dumps, orjson.loads  # the benchmark wants the server cheap

log = logging.getLogger("sglang_server")

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
}
TAIL = 5  # SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET
KEEPALIVE_S = 5.0  # SGLang's uvicorn closes a connection idle this long (http_server.py, timeout_keep_alive)
REASONING_MODES = (None, "wrap", "drop")
THOUGHT = "Let me think."  # the reasoning text of --reasoning wrap (short: it counts against max_new_tokens)
VERSION = "0.0.0+eaglepipe-test-server"  # the version /server_info reports


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


class FakeSGLang:
    def __init__(self, args):
        self.args = args
        self.knobs = dict(KNOBS)
        self.knobs.update({k: getattr(args, k) for k in KNOBS if getattr(args, k, None) is not None})
        if isinstance(self.knobs["faults"], str):
            self.knobs["faults"] = self.parse_faults(self.knobs["faults"])
        self.rng = random.Random(self.knobs["seed"])
        self.folder = target.resolve(args.model_path or "embedded")
        self.model_path = args.model_path or str(self.folder)  # as given, like SGLang's
        self.tokenizer = target.load_tokenizer(self.folder)
        self.eos = set(target.stop_ids(self.folder, self.tokenizer))
        self.vocab_size = len(self.tokenizer)
        self.special = set(self.tokenizer.all_special_ids)
        self.defaults = sampling_defaults(self.folder)
        self.engine = None
        if not args.no_compute:
            import torch

            from eaglepipe.engines.hf import HFEngine

            torch.set_num_threads(1)
            self.engine = HFEngine(target.load_model(self.folder), self.tokenizer.pad_token_id, batch_size=1)
        self.compute_pool = ThreadPoolExecutor(1, thread_name_prefix="generate")  # one request at a time
        self.ready_at = time.monotonic() + args.startup_delay
        self.started = time.time()
        self.inflight: set[str] = set()
        self.aborted: set[str] = set()
        self.requests = self.injected = 0
        self.stats = new_stats()
        self.handling = 0
        config = json.loads((self.folder / "config.json").read_text())
        self.model_type, self.architectures = config.get("model_type"), config.get("architectures")
        self.random_seed = args.seed
        self.embeddings = int(config.get("vocab_size") or self.vocab_size)  # ids the model can read
        vocab = self.tokenizer.get_vocab()
        self.think_ids = (vocab.get("<think>"), vocab.get("</think>"))
        self.check_reasoning(self.knobs["reasoning"])

    @staticmethod
    def parse_faults(text: str) -> list[str]:
        kinds = list(FAULTS) if text in ("all", "") else [k.strip() for k in text.split(",") if k.strip()]
        unknown = set(kinds) - set(FAULTS) - set(EXTRA_FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS + EXTRA_FAULTS}")
        return kinds

    def check_reasoning(self, mode) -> None:
        if mode not in REASONING_MODES:
            raise ValueError(f"reasoning={mode!r}: expected one of {REASONING_MODES}")
        if mode == "wrap" and None in self.think_ids:
            raise ValueError(f"reasoning='wrap' needs <think> and </think> tokens; {self.folder} has none")

    def think_open(self, ids: list) -> int | None:
        """Where the prompt's trailing opened <think> is (whitespace after it allowed), or None."""
        open_id = self.think_ids[0]
        if open_id is None:
            return None
        k = len(ids)
        while k and ids[k - 1] != open_id and not self.tokenizer.decode(ids[k - 1 : k]).strip():
            k -= 1
        return k - 1 if k and ids[k - 1] == open_id else None

    def reasoning_parts(self, ids: list) -> tuple[list, list]:
        """--reasoning: (ids served before the model's answer, the model's input)."""
        opened = self.think_open(ids)
        model_ids = [t for t in (ids if opened is None else ids[:opened]) if t < self.embeddings]
        if self.knobs["reasoning"] != "wrap":
            return [], model_ids
        block = ("" if opened is not None else "<think>\n") + THOUGHT + "\n</think>\n\n"
        return self.tokenizer.encode(block, add_special_tokens=False), model_ids

    # ---- info ---------------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        return time.monotonic() >= self.ready_at and not self.knobs["unhealthy"]

    async def health(self, request):
        return web.Response(status=200 if self.ready() else 503)

    def model_info_body(self):
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.args.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.model_type,
            "architectures": self.architectures,
        }

    def server_info_body(self):
        a = self.args
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "tokenizer_mode": "auto",
            "skip_tokenizer_init": False,
            "load_format": "auto",
            "trust_remote_code": False,
            "dtype": a.dtype,
            "kv_cache_dtype": a.kv_cache_dtype,
            "quantization": a.quantization,
            "context_length": None,
            "device": "cpu",
            "served_model_name": self.model_path,
            "chat_template": None,
            "reasoning_parser": None,
            "tool_call_parser": None,
            "sampling_defaults": "model",
            "is_embedding": False,
            "host": a.host,
            "port": a.port,
            "tp_size": a.tp,
            "dp_size": a.dp,
            "random_seed": self.random_seed,
            "weight_version": a.weight_version,
            "extra_args": a.extra,
            "max_total_num_tokens": 65536,
            "max_req_input_len": 8192,
            "internal_states": [
                {
                    "last_gen_throughput": round(self.rng.random() * 100, 2),
                    "uptime_s": round(time.time() - self.started, 1),
                }
            ],
            "version": VERSION,
            "no_compute": a.no_compute,
        }

    async def model_info(self, request):
        if self.knobs["old_api"] and not request.path.startswith("/get_"):
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.model_info_body())

    async def server_info(self, request):
        if self.knobs["old_api"] and not request.path.startswith("/get_"):
            return web.json_response({"detail": "Not Found"}, status=404)
        return web.json_response(self.server_info_body())

    async def tokenize(self, request):
        body = await request.json()
        prompt, add = body.get("prompt"), body.get("add_special_tokens", True)
        single = isinstance(prompt, str)
        if not single and not (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
            return sglang_error(400, f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
        tokens = [self.tokenizer.encode(p, add_special_tokens=add) for p in ([prompt] if single else prompt)]
        if self.knobs["tokenize_skew"]:  # a server whose tokenizer maps special tokens elsewhere
            tokens = [[t + 1 if t in self.special else t for t in ids] for ids in tokens]
        return web.json_response(
            {
                "tokens": tokens[0] if single else tokens,
                "count": len(tokens[0]) if single else [len(t) for t in tokens],
                "max_model_len": getattr(self.tokenizer, "model_max_length", -1),
            }
        )

    async def detokenize(self, request):
        body = await request.json()
        toks = body.get("tokens") or []
        skip = body.get("skip_special_tokens", True)
        if toks and isinstance(toks[0], list):
            return web.json_response({"text": [self.tokenizer.decode(t, skip_special_tokens=skip) for t in toks]})
        return web.json_response({"text": self.tokenizer.decode(toks, skip_special_tokens=skip)})

    async def abort_request(self, request):
        body = await request.json()
        self.stats["aborts"] += 1
        if body.get("abort_all"):
            self.aborted |= self.inflight
        elif body.get("rid") in self.inflight:
            self.aborted.add(body["rid"])
            self.stats["aborted_rids"].append(body["rid"])
        return web.Response(status=200)

    # ---- test harness ---------------------------------------------------------------------------------------------
    async def set_config(self, request):
        body = await request.json()
        if body.pop("reset_stats", False):
            self.stats = new_stats()
        unknown = set(body) - set(KNOBS)
        if unknown:
            return web.json_response({"error": f"unknown knobs {sorted(unknown)}"}, status=400)
        if "reasoning" in body:
            try:
                self.check_reasoning(body["reasoning"])
            except ValueError as e:
                return web.json_response({"error": str(e)}, status=400)
        if isinstance(body.get("faults"), str):
            body["faults"] = self.parse_faults(body["faults"])
        self.knobs.update(body)
        self.requests = self.injected = 0  # fault_mode cycle and fault_budget count from here
        if "seed" in body:
            self.rng = random.Random(body["seed"])
        return web.json_response(self.knobs)

    async def get_stats(self, request):
        return web.json_response({**self.stats, "knobs": self.knobs, "inflight": sorted(self.inflight)})

    # ---- /generate ------------------------------------------------------------------------------------------------
    def pick_fault(self) -> str | None:
        k = self.knobs
        n = self.requests
        self.requests += 1
        if (
            not k["fault_rate"]
            or not k["faults"]
            or (k["fault_budget"] is not None and self.injected >= k["fault_budget"])
        ):
            return None
        if k["fault_mode"] == "cycle":
            if int((n + 1) * k["fault_rate"]) <= int(n * k["fault_rate"]):
                return None
            kind = k["faults"][self.injected % len(k["faults"])]
        elif self.rng.random() >= k["fault_rate"]:
            return None
        else:
            kind = self.rng.choice(k["faults"])
        self.injected += 1
        return kind

    def parse_items(self, body) -> tuple[bool, list[dict]]:
        """GenerateReqInput, normalised as SGLang does: (is_single, [{input_ids, sampling_params, rid}])."""
        single, inputs = self.parse_inputs(body)
        n = len(inputs)
        rids = request_ids(body.get("rid"), single, n)
        sps = body.get("sampling_params") or {}
        sps = [sps] * n if isinstance(sps, dict) else sps
        if not isinstance(sps, list) or len(sps) != n:
            raise RequestError("sampling_params should be a dict or one dict per request")
        return single, [
            {"input_ids": list(i), "sampling_params": self.sampling(sp), "rid": r}
            for i, sp, r in zip(inputs, sps, rids)
        ]

    def parse_inputs(self, body) -> tuple[bool, list[list[int]]]:
        """(is_single, the prompts' token ids) of a GenerateReqInput: its text tokenized, or its input_ids checked."""
        if not isinstance(body, dict):
            raise RequestError("the request body should be a JSON object")
        given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
        if len(given) != 1:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if given[0] == "input_embeds":
            raise RequestError("input_embeds are not supported by the test server")
        if body.get("stream"):
            raise RequestError("stream is not supported by the test server")
        if given[0] == "text":
            texts = body["text"]
            single = isinstance(texts, str)
            inputs = [self.tokenizer.encode(t) for t in ([texts] if single else texts)]
        else:
            ids = body["input_ids"]
            if not isinstance(ids, list) or not ids:
                raise RequestError("input_ids should be a non-empty list")
            single = not isinstance(ids[0], list)
            inputs = [ids] if single else ids
        for ids in inputs:
            if not ids or not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= self.vocab_size:
                raise RequestError("input_ids should hold valid token ids (and not be empty)")
        return single, inputs

    def sampling(self, sp: dict) -> dict:
        unknown = set(sp) - SAMPLING_KEYS
        if unknown:
            raise RequestError(f"unknown sampling params {sorted(unknown)}")
        sp = {k: v for k, v in sp.items() if v is not None}
        p = {
            **self.defaults,
            "stop_token_ids": [],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "no_stop_trim": False,
            "spaces_between_special_tokens": True,
            **sp,
        }
        if not p["temperature"] >= 0.0:
            raise RequestError(f"temperature must be non-negative, got {p['temperature']}.")
        if not 0.0 < p["top_p"] <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {p['top_p']}.")
        if not 0.0 <= p["min_p"] <= 1.0:
            raise RequestError(f"min_p must be in [0, 1], got {p['min_p']}.")
        if p["top_k"] < 1 and p["top_k"] != -1:
            raise RequestError(f"top_k must be -1 (disable) or at least 1, got {p['top_k']}.")
        if p["max_new_tokens"] < 0:
            raise RequestError(f"max_new_tokens must be at least 0, got {p['max_new_tokens']}.")
        for k in ("repetition_penalty",):
            if p.get(k, 1.0) != 1.0:
                raise RequestError(f"{k} != 1 is not supported by the test server")
        for k in ("frequency_penalty", "presence_penalty", "min_new_tokens"):
            if p.get(k, 0) != 0:
                raise RequestError(f"{k} != 0 is not supported by the test server")
        if p.get("stop") or p.get("stop_regex") or p.get("regex") or p.get("json_schema") or p.get("ebnf"):
            raise RequestError("stop strings and grammars are not supported by the test server")
        return p

    def compute(self, item: dict) -> dict:
        """One request, as SGLang would answer it (runs in the single compute thread)."""
        ids, sp, rid = item["input_ids"], item["sampling_params"], item["rid"]
        start = time.perf_counter()
        stops = set() if sp["ignore_eos"] else set(sp["stop_token_ids"]) | self.eos
        limit = sp["max_new_tokens"]
        block, model_ids = self.reasoning_parts(ids) if self.knobs["reasoning"] else ([], ids)
        budget = max(limit - len(block), 0)  # a think block counts against max_new_tokens
        gen = block + self.generated(model_ids, sp, stops, budget, rid)
        # SGLang's Req.check_finished: the length limit first, then the stop ids; the matched id stays in output_ids.
        if len(gen) >= limit:
            gen, finish = gen[:limit], {"type": "length", "length": limit}
        elif gen and gen[-1] in stops:
            finish = {"type": "stop", "matched": gen[-1]}
        else:
            finish = {"type": "length", "length": limit}
        text_ids = gen[:-1] if finish["type"] == "stop" and not sp["no_stop_trim"] else gen
        text = self.tokenizer.decode(text_ids, skip_special_tokens=sp["skip_special_tokens"]) if self.engine else ""
        out_ids = gen[:-1] if finish["type"] == "stop" and self.knobs["exclude_stop"] else gen
        return {
            "text": text,
            "output_ids": out_ids,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": len(ids),
                "weight_version": self.args.weight_version,
                "completion_tokens": len(gen),
                "cached_tokens": 0,
                "e2e_latency": round(time.perf_counter() - start, 6),
            },
        }

    def generated(self, model_ids: list, sp: dict, stops: set, budget: int, rid: str) -> list:
        """At most ``budget`` ids the model answers ``model_ids`` with under sampling params ``sp``."""
        from eaglepipe.engines import Sampling

        if budget == 0:
            return []
        if self.engine is None:  # --no-compute: ids made up from the prompt, never a stop id unless asked
            h = zlib.crc32(repr(model_ids).encode())
            gen = [1000 + (h + 7919 * k) % 20000 for k in range(budget)]
            after = self.knobs["fake_stop_after"]
            if after and sp["stop_token_ids"] and after <= budget:
                gen = gen[: after - 1] + [min(sp["stop_token_ids"])]
            return gen
        top_k = sp["top_k"] if sp["top_k"] > 0 else -1
        sampling = Sampling(
            temperature=sp["temperature"],
            top_p=sp["top_p"],
            top_k=top_k,
            min_p=sp["min_p"],
            max_new_tokens=budget,
            seed=int(sp.get("sampling_seed") or 0),
            stop_token_ids=tuple(sorted(stops)),
        )
        return next(self.engine.stream([model_ids], sampling, [rid]))[1].output_ids

    def corrupt(self, kind: str, answer: dict, prompt: list) -> dict:
        ids, meta = answer["output_ids"], answer["meta_info"]
        if kind == "prefix":
            answer["output_ids"] = prompt[-TAIL:] + ids
        elif kind == "count":
            meta["completion_tokens"] += 1
        elif kind == "abort":
            answer["output_ids"] = ids[: len(ids) // 2]
            meta["finish_reason"] = {"type": "abort", "message": "Abort in fault injection.", "status_code": 500}
        elif kind == "finish":
            meta["finish_reason"] = {"type": "weird"}
        return answer

    async def generate(self, request: web.Request):
        self.stats["generate_requests"] += 1
        port = request.transport.get_extra_info("peername")[1]  # the client's end of the connection
        if port not in self.stats["connections"]:
            self.stats["connections"].append(port)
        self.handling += 1
        self.stats["max_inflight"] = max(self.stats["max_inflight"], self.handling)
        try:
            return await self.generate_one(request)
        finally:
            self.handling -= 1

    async def generate_one(self, request: web.Request):
        raw = await request.read()
        try:
            body = loads(raw)
        except ValueError as e:
            return sglang_error(400, f"malformed JSON: {e}")
        if not self.ready():
            return sglang_error(503, "The server is starting.")
        try:
            single, items = self.parse_items(body)
        except RequestError as e:
            return sglang_error(400, str(e))
        dup = [it["rid"] for it in items if it["rid"] in self.inflight]
        if dup:
            return sglang_error(400, f"Duplicate request ID(s) still in flight: {dup}")
        fault = self.pick_fault()
        if any(it["rid"].split("#")[0] in self.knobs["fail_rids"] for it in items):
            fault = "http500"  # these records always fail (a permanent fault)
        if fault:
            self.stats["faults"][fault] = self.stats["faults"].get(fault, 0) + 1
            log.info("fault %s for %s", fault, [it["rid"] for it in items])
        rids = [it["rid"] for it in items]
        self.stats["rids"].extend(rids)
        self.inflight.update(rids)
        try:
            if fault in PRE_FAULTS:
                return await self.pre_fault(fault, request)
            if self.knobs["latency"]:
                await asyncio.sleep(self.knobs["latency"])
            loop = asyncio.get_running_loop()
            answers = []
            for it in items:
                if self.engine is None:
                    answers.append(self.compute(it))
                else:
                    answers.append(await loop.run_in_executor(self.compute_pool, self.compute, it))
            for it, a in zip(items, answers):
                if it["rid"] in self.aborted:
                    self.aborted.discard(it["rid"])
                    a["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort request.", "status_code": 400}
            if fault:
                answers[0] = self.corrupt(fault, answers[0], items[0]["input_ids"])
            self.stats["answers"] += len(answers)
            out = answers[0] if single and not self.knobs["batch_arrays"] else answers
            return web.Response(body=dumps(out), content_type="application/json")
        finally:
            self.inflight.difference_update(rids)
            self.aborted.difference_update(rids)

    async def pre_fault(self, fault: str, request: web.Request):
        if fault.startswith("http"):
            status = int(fault[4:])
            return sglang_error(
                status,
                {
                    429: "Too many requests.",
                    500: "Internal server error (injected).",
                    503: "Service unavailable (injected).",
                    400: "Invalid request (injected).",
                }[status],
            )
        if fault == "reset":
            request.transport.abort()
            raise asyncio.CancelledError  # nothing more to send on this connection
        if fault == "hang":
            await asyncio.sleep(self.knobs["hang_s"])
            return sglang_error(500, "hung (injected)")
        if fault == "malformed":
            return web.Response(body=b'{"text": "oops", "output_ids": [1, 2,', content_type="application/json")
        if fault == "truncated":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            resp.content_length = 4096
            await resp.prepare(request)
            await resp.write(b'{"text": "partial", "output_ids": [1, 2, 3')
            request.transport.close()
            raise asyncio.CancelledError
        raise AssertionError(fault)


def make_app(server: FakeSGLang) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, server.health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, server.model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server.server_info)
    app.router.add_route("POST", "/generate", server.generate)
    app.router.add_route("PUT", "/generate", server.generate)
    for path in ("/tokenize", "/v1/tokenize"):
        app.router.add_post(path, server.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.router.add_post(path, server.detokenize)
    app.router.add_post("/abort_request", server.abort_request)
    app.router.add_post("/_test/config", server.set_config)
    app.router.add_get("/_test/stats", server.get_stats)
    return app


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


# ---- driving the server from another process (the tests and bench/bench_sglang_client.py) -------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, log: Path, *args) -> subprocess.Popen:
    """This server on a loopback port; returns once /health answers 200."""
    with open(log, "ab") as out:  # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, __file__, "--port", str(port), *map(str, args)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
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


def stats(url: str) -> dict:
    """What the server has seen since its start or the last reset."""
    with urllib.request.urlopen(url + "/_test/stats", timeout=10) as r:
        return loads(r.read())


CLEAN = {
    "latency": 0.0,
    "fault_rate": 0.0,
    "faults": "all",
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
    "reset_stats": True,
}


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
