"""SGLang engine (``infer.engine: sglang``): token ids to SGLang's native ``POST /generate`` (ids in, ids out).

Identity from /model_info and /server_info (else /get_model_info, /get_server_info): model path, weight version,
dtype, quantization, KV cache dtype, version. A launched server's is predicted before it starts: its arguments (SGLang's
defaults where they give none) and the ``sglang`` installed where the launcher runs. /tokenize takes all probes in one
request; /abort_request cancels.

Requests: ``input_ids``, every sampling parameter explicit, ``stop_token_ids`` = infer's, ``skip_special_tokens:
false``, ``rid`` = the record id (a retry sends ``<id>#<attempt>``).

Answers (``check_answer``): a known ``finish_reason`` (an abort is retried); ``meta_info.id`` and ``prompt_tokens``
match what was sent; ``output_ids`` do not start with the prompt's last ids (sglang #10896, #17240);
``len(output_ids) == completion_tokens``; no stop id before the end; a stop on an id outside infer's stop ids is
refused. The matched stop id ends ``output_ids``, as in the hf engine (put back when a server leaves it out but counts
it); an answer whose last allowed id is a stop id is a ``stop`` (SGLang says ``length``).
"""

from __future__ import annotations

import sys

from eaglepipe.engines import Sampling, seed_for
from eaglepipe.engines.launch import LaunchedServer
from eaglepipe.engines.pool import Server, ServerError, ServerPool
from eaglepipe.engines.server import BadAnswer, ServerEngine, check_ids

# SGLang's INIT_INCREMENTAL_DETOKENIZATION_OFFSET: the number of prompt ids the #10896/#17240 bug puts in front.
PROMPT_TAIL = 5
FINISH_TYPES = ("stop", "length", "abort")
IDENTITY_KEYS = ("dtype", "quantization", "kv_cache_dtype")
# What SGLang's ServerArgs default to where a launch gives no --weight-version, --dtype, ...: a launched server's
# identity holds them (``SGLang.predicted``).
DEFAULTS = {"weight_version": "default", "dtype": "auto", "quantization": None, "kv_cache_dtype": "auto"}
KEPT_META = ("prompt_tokens", "completion_tokens", "cached_tokens", "weight_version")  # of meta_info, in the record


def sampling_params(s: Sampling, record_id: str) -> dict:
    """Every sampling parameter /generate takes that changes ids, explicit, plus the text flags."""
    sp = {
        "max_new_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "min_new_tokens": 0,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    if s.temperature > 0:
        sp["sampling_seed"] = seed_for(s.seed, record_id)
    return sp


def check_answer(body, prompt_ids: list, sampling: Sampling, rid: str | None = None) -> tuple[list, str, dict]:
    """(output_ids, finish_reason, meta_info) of one /generate answer in the records' terms, or BadAnswer."""
    ids, meta = _answer_parts(body)
    finish, kind = _finish(meta)
    count = _completion_tokens(meta, prompt_ids, rid)
    tail = min(PROMPT_TAIL, len(prompt_ids))
    if tail >= 2 and ids[:tail] == prompt_ids[-tail:]:
        raise BadAnswer(f"output_ids start with the prompt's last {tail} ids (sglang #10896/#17240)")
    if kind == "stop":
        ids = _with_matched(ids, finish.get("matched"), count, set(sampling.stop_token_ids))
    if len(ids) != count:
        raise BadAnswer(f"len(output_ids)={len(ids)} != completion_tokens={count}")
    return ids, check_ids(ids, kind, sampling), meta


def _answer_parts(body) -> tuple[list, dict]:
    """(output_ids, meta_info) of one answer's JSON, each of the right type."""
    if isinstance(body, list):  # a batch-shaped answer to one request
        if len(body) != 1:
            raise BadAnswer(f"{len(body)} answers for one request")
        body = body[0]
    if not isinstance(body, dict):
        raise BadAnswer(f"answer is a JSON {type(body).__name__}, not an object")
    if "error" in body:
        raise BadAnswer(f"error in answer: {str(body['error'])[:200]}")
    ids, meta = body.get("output_ids"), body.get("meta_info")
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise BadAnswer("output_ids missing or not a list of token ids")
    if not isinstance(meta, dict):
        raise BadAnswer("meta_info missing")
    return ids, meta


def _finish(meta: dict) -> tuple[dict, str]:
    """(finish_reason, its type) of an answer that ended as stop or length (an abort is retried)."""
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in FINISH_TYPES:
        raise BadAnswer(f"unknown finish_reason {finish!r}")
    if kind == "abort":
        raise BadAnswer(f"aborted by the server: {str(finish.get('message'))[:200]}")
    return finish, kind


def _completion_tokens(meta: dict, prompt_ids: list, rid: str | None) -> int:
    """meta_info's completion_tokens, once its id and prompt_tokens (where given) match what was sent."""
    if rid is not None and meta.get("id") not in (None, rid):
        raise BadAnswer(f"answer is for rid {meta.get('id')!r}, not {rid!r}")
    if meta.get("prompt_tokens") not in (None, len(prompt_ids)):
        raise BadAnswer(f"prompt_tokens={meta.get('prompt_tokens')} but {len(prompt_ids)} ids were sent")
    count = meta.get("completion_tokens")
    if type(count) is not int:
        raise BadAnswer("meta_info.completion_tokens missing")
    return count


def _with_matched(ids: list, matched, count: int, stops: set) -> list:
    """A stop answer's ids ending with the ``matched`` stop id, put back where the server left it out but counted
    it."""
    if type(matched) is not int:
        raise BadAnswer(f"stopped on {matched!r}, not on a stop id (no stop strings are sent)")
    if matched not in stops:
        raise BadAnswer(f"stopped on id {matched}, which is not one of infer's stop ids {sorted(stops)}")
    if not ids or ids[-1] != matched:
        if len(ids) + 1 != count:
            raise BadAnswer(
                f"finish_reason stop on id {matched} but output_ids end with "
                f"{ids[-1] if ids else None} and completion_tokens={count}"
            )
        ids = ids + [matched]  # a server that leaves the matched id out of output_ids (but counts it)
    return ids


class SGLang:
    """SGLang's native API, as ServerEngine's ``api`` (server.Api)."""

    name, title, package, version_key = "sglang", "SGLang", "sglang", "sglang_version"

    def launcher(self, cfg) -> LaunchedServer:
        return LaunchedServer(
            cfg,
            self.name,
            [sys.executable, "-m", "sglang.launch_server"],
            ["--model-path", cfg.model_path, "--tp", str(cfg.tp), "--dp", str(cfg.dp)],
        )

    def predicted(self, launched: LaunchedServer, version: str) -> dict:
        """What ``read`` will find: the launch's arguments, SGLang's defaults where they give none."""
        given = {k: launched.flag("--" + k.replace("_", "-")) for k in ("weight_version", *IDENTITY_KEYS)}
        return {
            "model_path": launched.flag("--model-path"),
            **{k: DEFAULTS[k] if v is None else v for k, v in given.items()},
            "sglang_version": version,
        }

    async def read(self, pool: ServerPool, server: Server) -> None:
        model_info = await pool.get_info(server, "/model_info", "/get_model_info")
        server_info = await pool.get_info(server, "/server_info", "/get_server_info")
        if model_info.get("is_generation") is False:
            raise ServerError(f"{server.url} serves a model that does not generate (is_generation false)")
        if server_info.get("skip_tokenizer_init"):
            raise ServerError(
                f"{server.url} runs with --skip-tokenizer-init: its tokenizer cannot be compared with "
                "the local one; start it without that flag"
            )
        server_info.pop("internal_states", None)  # load and memory figures of the moment, not the server's setup
        server.model_info, server.server_info = model_info, server_info
        server.identity = {
            "model_path": model_info.get("model_path", server_info.get("model_path")),
            "weight_version": model_info.get("weight_version", server_info.get("weight_version")),
            **{k: server_info.get(k) for k in IDENTITY_KEYS},
            "sglang_version": server_info.get("version"),
        }

    async def tokens(self, pool: ServerPool, server: Server, probes: list[str]) -> list:
        answer = await pool.post_json(server, "/tokenize", {"prompt": probes, "add_special_tokens": False})
        if not isinstance(answer, dict) or "tokens" not in answer:
            raise ServerError(
                f"POST /tokenize answered {str(answer)[:200]} (the tokenizer check needs an SGLang with /tokenize)"
            )
        return answer["tokens"]

    def request(self, prompt_ids: list, sampling: Sampling, record_id: str, rid: str) -> tuple[str, dict]:
        params = sampling_params(sampling, record_id)
        return "/generate", {"input_ids": prompt_ids, "sampling_params": params, "rid": rid, "stream": False}

    def check(self, answer, prompt_ids: list, sampling: Sampling, rid: str) -> tuple[list, str, dict]:
        ids, finish, meta = check_answer(answer, prompt_ids, sampling, rid)
        return ids, finish, {k: meta.get(k) for k in KEPT_META}

    def abort(self, rid: str) -> tuple[str, dict]:
        return "/abort_request", {"rid": rid}


class SGLangEngine(ServerEngine):
    """The engine for ``infer.engine: sglang``; ``params`` is ``infer.sglang`` (config.Servers)."""

    def __init__(self, params, tokenizer):
        super().__init__(SGLang(), params, tokenizer)
