"""The SGLang double's server: its state (model folder, tokenizer, engine, knobs, stats), the reasoning model it
plays, its info, tokenizer and abort endpoints, the test harness, and the aiohttp app routing every endpoint
(/generate is generate.py's)."""

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from eaglepipe.target import model as target
from sglang_double.generate import GenerateEndpoint
from sglang_double.protocol import (
    EXTRA_FAULTS,
    FAULTS,
    KNOBS,
    REASONING_MODES,
    THOUGHT,
    VERSION,
    new_stats,
    original_logprob,
    sampling_defaults,
    sglang_error,
)


class FakeSGLang(GenerateEndpoint):
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
        self.original_logprob = original_logprob()  # read once at start, as SGLang's sampler does
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
