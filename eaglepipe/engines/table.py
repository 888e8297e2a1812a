"""The table of engines ``infer.engine`` chooses from (``ENGINES``: a name and the function that builds the engine
from the ``infer`` params), and ``create``. A new engine is one entry here plus its module, and its name among
``infer.engine``'s values in config.py (with, for a server engine, its ``infer.<name>`` section);
tests/test_config.py checks that the two name the same engines. Only the infer stage imports this table, so no other
stage's code includes the engines'.
"""
from __future__ import annotations

from .launch import servers


def _hf(params, folder, tokenizer, rt):
    """in-process Hugging Face: the target on runtime.device, in infer.dtype (engines/hf.py)."""
    from contextlib import nullcontext

    from .. import runtime
    from .hf import HFEngine

    model = runtime.load_target(folder, params.dtype, rt)
    return nullcontext(HFEngine(model, tokenizer.pad_token_id, params.batch_size, params.batch_tokens))


def _sglang(params, folder, tokenizer, rt):
    """SGLang servers' native /generate, token ids in and out (engines/sglang.py)."""
    from .. import runtime
    from .sglang import SGLangEngine

    return SGLangEngine(servers(params.sglang, folder, runtime.compute_dtype(params.dtype, rt.device)), tokenizer)


def _vllm(params, folder, tokenizer, rt):
    """vLLM servers' token-in token-out /inference/v1/generate (engines/vllm.py)."""
    from .. import runtime
    from .vllm import VLLMEngine

    return VLLMEngine(servers(params.vllm, folder, runtime.compute_dtype(params.dtype, rt.device)), tokenizer)


ENGINES = {"hf": _hf, "sglang": _sglang, "vllm": _vllm}


def create(params, folder, tokenizer, rt):
    """The engine ``params.engine`` names (``params``: the ``infer`` section, config.Infer), as a context manager:
    ``with create(...) as engine:``. Leaving it releases what the engine holds (connections, a server it launched),
    also on errors. A launched server is started as ``servers`` says."""
    return ENGINES[params.engine](params, folder, tokenizer, rt)
