"""The engine's own log-probability of each token it generates (``Scored`` answers), as infer keeps them beside the
ids: what a server is asked for them (``ask``), how its answer is read (``read``), the one rounding every figure gets
(``clean``), and what a launched server needs so that its figures are raw (``prepare_launch``).

Every figure is **raw**: the float32 log-softmax of the model's logits at the generated token, before penalties,
temperature, top-k, top-p and min-p, whatever the sampling; ``None`` where the engine gave none (a NaN or -inf
figure, a missing one). Rounded to 5 decimals. hidden compares them with the states' model (hidden/agreement.py).

vLLM (token-in token-out ``/inference/v1/generate``): ``"logprobs": 0`` in ``sampling_params`` (never
``prompt_logprobs``: it costs a full-vocabulary pass over the prompt and skips the prefix cache) returns
``choices[0].logprobs.content``, one ``{"token_id", "logprob", "rank", "top_logprobs"}`` per generated id in order.
They are raw under vLLM's default ``--logprobs-mode raw_logprobs``: a launched server is refused another mode; one
given by url is taken as it is. ``-9999.0`` stands for -inf, NaN and a figure vLLM lost.

SGLang (``/generate``): the top-level ``return_logprob``, ``logprob_start_len: -1`` (output ids only: a start in the
prompt recomputes its full-vocabulary figures and defeats the radix cache), ``top_logprobs_num: 0`` and
``return_text_in_logprobs: false`` return ``meta_info.output_token_logprobs``, ``[logprob, token_id, null]`` per
completion id (the matched stop id included). They are raw when the whole batch is greedy or when the server runs
with ``SGLANG_RETURN_ORIGINAL_LOGPROB`` true (``LAUNCH_ENV``: a launched server gets it unless the user's environment
sets it), otherwise taken after temperature. -inf and NaN arrive as null; SGLang clamps to float32's least value
(about -3.4e38) where it can: both are no figure.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from eaglepipe.core.errors import UserError
from eaglepipe.engines import Output

log = logging.getLogger(__name__)

DECIMALS = 5  # every figure is rounded to this many decimals
NO_FIGURE = -9999.0  # vLLM's stand-in for -inf, NaN and a lost figure: a figure at or below it is none
RAW_MODE = "raw_logprobs"  # the --logprobs-mode of a vLLM whose figures are raw (its default)
LAUNCH_ENV = {"sglang": {"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"}}  # a launched server's figures raw at any temperature
SGLANG_ASK = {"return_logprob": True, "logprob_start_len": -1, "top_logprobs_num": 0, "return_text_in_logprobs": False}


@dataclass
class Scored(Output):
    """An answer with the engine's raw log-probability of each output id (``None`` where it gave none), or
    ``logprobs`` None when the engine gave no figures at all."""

    logprobs: list | None = None


class BadFigures(ValueError):
    """An answer whose log-probabilities are missing or do not match its ids (retried like a failed check)."""


def clean(figure: float | None) -> float | None:
    """``figure`` rounded to ``DECIMALS``; None for no figure (None, NaN, +-inf, at or below ``NO_FIGURE``)."""
    if figure is None or not math.isfinite(figure) or figure <= NO_FIGURE:
        return None
    return round(float(figure), DECIMALS)


def ask(api_name: str, body: dict) -> dict:
    """The generation request ``body`` of engine ``api_name`` asking also for the figures of the output ids."""
    if api_name == "vllm":
        return {**body, "sampling_params": {**body["sampling_params"], "logprobs": 0}}
    if api_name == "sglang":
        return {**body, **SGLANG_ASK}
    raise ValueError(f"no log-probabilities to ask of engine {api_name!r}")


def read(api_name: str, answer, ids: list) -> list:
    """The figures (``clean``) of the checked output ``ids`` in engine ``api_name``'s ``answer``; BadFigures when they
    are missing, not one per id, for other ids, or not log-probabilities."""
    if api_name == "vllm":
        pairs = _vllm_pairs(answer)
    elif api_name == "sglang":
        pairs = _sglang_pairs(answer)
    else:
        raise ValueError(f"no log-probabilities to read from engine {api_name!r}")
    if len(pairs) != len(ids):
        raise BadFigures(f"{len(pairs)} log-probabilities for {len(ids)} output ids")
    figures = []
    for n, ((figure, token), expected) in enumerate(zip(pairs, ids)):
        if token != expected:
            raise BadFigures(f"the log-probability at position {n} is for id {token!r}, the output id is {expected}")
        if figure is not None and (isinstance(figure, bool) or not isinstance(figure, (int, float))):
            raise BadFigures(f"the log-probability at position {n} is {figure!r}, not a number")
        kept = clean(figure)
        if kept is not None and kept > 0:
            raise BadFigures(f"the log-probability at position {n} is {figure!r}, above 0")
        figures.append(kept)
    return figures


def _vllm_pairs(answer) -> list:
    """(figure, token id) per generated id of a vLLM answer (one choice, already checked)."""
    content = (answer["choices"][0].get("logprobs") or {}).get("content")
    if not isinstance(content, list) or not all(isinstance(entry, dict) for entry in content):
        raise BadFigures("no logprobs.content in the answer (asked with sampling_params.logprobs: 0)")
    return [(entry.get("logprob"), entry.get("token_id")) for entry in content]


def _sglang_pairs(answer) -> list:
    """(figure, token id) per completion id of an SGLang answer (one answer, already checked)."""
    body = answer[0] if isinstance(answer, list) else answer
    entries = body["meta_info"].get("output_token_logprobs")
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) >= 2 for e in entries):
        raise BadFigures("no meta_info.output_token_logprobs in the answer (asked with return_logprob: true)")
    return [(entry[0], entry[1]) for entry in entries]


def prepare_launch(api_name: str, launched) -> None:
    """Make the launched server ``launched`` (launch.LaunchedServer) of engine ``api_name`` give raw figures: a vLLM
    told another ``--logprobs-mode`` is a UserError; an SGLang gets ``LAUNCH_ENV`` where the user's environment does
    not set it."""
    mode = launched.flag("--logprobs-mode") if api_name == "vllm" else None
    if mode not in (None, RAW_MODE):
        raise UserError(
            f"the vLLM launch sets --logprobs-mode {mode}: infer keeps every answer's raw log-probabilities "
            f"(hidden checks them against the states' model), so take it out of the launch's extra_args or set "
            f"it to {RAW_MODE}"
        )
    for name, value in LAUNCH_ENV.get(api_name, {}).items():
        given = os.environ.get(name)
        if given is None:
            launched.env.setdefault(name, value)
        elif given.lower() not in ("1", "true"):
            log.warning(
                "%s=%s in the environment: the launched %s server reports log-probabilities after temperature, "
                "which hidden's check takes for another model when sampling at a temperature other than 1",
                name,
                given,
                api_name,
            )
