"""The engines ``infer.engine`` chooses from (``ENGINES``: name -> builder from the ``infer`` params), and ``create``.
Every engine built here gives the raw log-probability of each id it generates (engines/logprobs.py).

A new engine is an entry here, its module, and its name in config.py's ``infer.engine`` (a server engine also gets an
``infer.<name>`` section); tests/core/test_config.py checks both agree.
"""

from __future__ import annotations

from contextlib import closing, nullcontext

from eaglepipe.engines.launch import servers
from eaglepipe.engines.sglang import SGLangEngine
from eaglepipe.engines.vllm import VLLMEngine


def _hf(params, folder, tokenizer, rt):
    """in-process Hugging Face: the target on runtime.device, in infer.dtype (engines/hf.py)."""
    from eaglepipe.engines.hf import HFEngine
    from eaglepipe.target import model as target

    model = target.load_target(folder, params.dtype, rt)
    return nullcontext(HFEngine(model, tokenizer.pad_token_id, params.batch_size, params.batch_tokens))


def _server(engine):
    """The builder of server engine class ``engine`` over ``infer.<infer.engine>`` (completed by ``servers``), which
    keeps every answer's log-probabilities (``scores``, engines/logprobs.py). Its context closes the engine without
    starting it: the engine starts when it generates (or is asked the identity of servers given by url), so a run
    whose answers are all cached starts no server."""

    def build(params, folder, tokenizer, rt):
        from eaglepipe.core import runtime

        section = getattr(params, params.engine)
        built = engine(servers(section, folder, runtime.compute_dtype(params.dtype, rt.device)), tokenizer)
        built.scores = True
        return closing(built)

    return build


ENGINES = {"hf": _hf, "sglang": _server(SGLangEngine), "vllm": _server(VLLMEngine)}


def create(params, folder, tokenizer, rt):
    """The engine ``params.engine`` names (``params``: config.Infer) as a context manager; leaving it, also on
    errors, releases what the engine holds (connections, a server it launched)."""
    return ENGINES[params.engine](params, folder, tokenizer, rt)
