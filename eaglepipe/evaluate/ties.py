"""The serve check's verdict on a difference (serve.py): where a vLLM output first leaves evaluate's (float32
transformers, greedy), the target's own float32 log-probabilities at that token (one forward over the prompt ids and
evaluate's output before it) tell a numerics tie from another model.

A difference is a tie when vLLM's token and evaluate's are the target's two best there and their log-probabilities are
within ``serve.tie_margin`` nats: another implementation's float32 rounding may take either (an untied tiny DeepseekV3:
-9.8076 and -9.8097, a margin of 0.0021 nats, and vLLM took the second). A tie is reported with its margin and not
failed; any other difference fails, named by its prompt and token. Where the outputs of the run that tells (the plain
one, else the one with the drafter) differ at their first token on most prompts, vLLM computes another model than
transformers for this target (``another_model``).

The target is loaded at the first difference only: where every output agrees, nothing here runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

RUNS = {"plain": "vLLM without the drafter", "eagle": "vLLM with the drafter"}


@dataclass(frozen=True)
class TopTwo:
    """The target's two most likely next tokens and their log-probabilities (float32, nats)."""

    best: int
    second: int
    best_logprob: float
    second_logprob: float

    @property
    def margin(self) -> float:
        return self.best_logprob - self.second_logprob


@torch.inference_mode()
def top_two(model, ids: list[int]) -> TopTwo:
    """The target's two best next tokens after ``ids``: one forward, the float32 log-softmax of the last logits."""
    logits = model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1]
    logprobs, tokens = torch.log_softmax(logits.float(), dim=-1).topk(2)
    return TopTwo(int(tokens[0]), int(tokens[1]), float(logprobs[0]), float(logprobs[1]))


def is_tie(top: TopTwo, engine_token: int, evaluate_token: int, tie_margin: float) -> bool:
    """Whether the engine's and evaluate's tokens are the target's two best, within ``tie_margin`` nats."""
    return {engine_token, evaluate_token} == {top.best, top.second} and top.margin <= tie_margin


class Judge:
    """Judges the serve check's differences (``serve.differences``' entries) with the target: ``load`` returns it
    (float32), called at the first difference only; ``tie_margin`` is serve.tie_margin."""

    def __init__(self, load: Callable[[], torch.nn.Module], tie_margin: float):
        self.load = load
        self.tie_margin = tie_margin
        self.model = None
        self.found: dict[tuple[int, int], TopTwo] = {}  # by (prompt, token): both runs often differ at one place

    def top_two(self, row: dict, token: int) -> TopTwo:
        """The target's two best tokens at output position ``token`` of ``row`` (after evaluate's tokens before it)."""
        key = (row["index"], token)
        if key not in self.found:
            if self.model is None:
                log.info("an output differs from evaluate's: loading the target to judge where it does")
                self.model = self.load()
            self.found[key] = top_two(self.model, list(row["prompt_ids"]) + list(row["output_ids"][:token]))
        return self.found[key]

    def verdict(self, mismatch: dict, row: dict, output: list) -> dict:
        """``mismatch`` (a run's ``output`` against ``row``'s) with what the target says at its first difference:
        the two tokens, the target's two best with their log-probabilities and margin, and ``tie``."""
        token = mismatch["first_difference"]
        engine_token = output[token] if token < len(output) else None
        evaluate_token = row["output_ids"][token] if token < len(row["output_ids"]) else None
        judged = mismatch | {"engine_token": engine_token, "evaluate_token": evaluate_token, "tie": False}
        if engine_token is None or evaluate_token is None:  # one output ends where the other goes on: no tie
            return judged
        top = self.top_two(row, token)
        return judged | {
            "best_token": top.best,
            "second_token": top.second,
            "logprobs": [round(top.best_logprob, 6), round(top.second_logprob, 6)],
            "margin": round(top.margin, 6),
            "tie": is_tie(top, engine_token, evaluate_token, self.tie_margin),
        }

    def __call__(self, rows: list[dict], mismatches: list[dict], outputs: dict[str, list]) -> list[dict]:
        """Every mismatch judged; ``outputs``: each run's outputs (by its name), in the order of ``rows``."""
        position = {row["index"]: i for i, row in enumerate(rows)}
        judged = []
        for mismatch in mismatches:
            i = position[mismatch["prompt"]]
            judged.append(self.verdict(mismatch, rows[i], outputs[mismatch["run"]][i]))
        return judged


def describe(mismatch: dict) -> str:
    """A mismatch in words, naming its prompt and token (and, once judged, the tokens and the target's margin)."""
    where = f"prompt {mismatch['prompt']} ({RUNS.get(mismatch['run'], mismatch['run'])}) at token "
    where += str(mismatch["first_difference"])
    if "tie" not in mismatch:
        return where
    if "margin" not in mismatch:
        ends = f"vLLM {mismatch['engine_token']}, evaluate {mismatch['evaluate_token']}"
        return f"{where}: one output ends where the other goes on ({ends})"
    if mismatch["tie"]:
        verdict = "a near-tie, within serve.tie_margin"
    elif mismatch["engine_token"] == mismatch["second_token"]:
        verdict = "vLLM's is the second best, beyond serve.tie_margin"
    else:
        verdict = "vLLM's is not among the two best"
    return (
        f"{where}: vLLM took {mismatch['engine_token']}, evaluate {mismatch['evaluate_token']}; the target's best "
        f"there is {mismatch['best_token']}, {mismatch['margin']:.4f} nats over its second, "
        f"{mismatch['second_token']} ({verdict})"
    )


def another_model(mismatches: list[dict], prompts: int, run: str) -> str | None:
    """Why ``run``'s outputs differ from evaluate's when they do at their first token, not at a tie, on more than half
    of the ``prompts``: the first token is the target's alone (the prefill, before any draft), so vLLM computes
    another model than transformers; None otherwise."""
    first = [m for m in mismatches if m["run"] == run and m["first_difference"] == 0 and not m.get("tie")]
    if 2 * len(first) <= prompts:
        return None
    return (
        f"the outputs of {RUNS.get(run, run)} differ from evaluate's (transformers, float32) at their first token on "
        f"{len(first)} of {prompts} prompts, where no near-tie explains it: vLLM computes another model than "
        "transformers for this target (a weight it loads otherwise or leaves unloaded, such as a tied output head, "
        "or a config key it reads otherwise: rope scaling, quantization, the chat template's special tokens). "
        "infer's answers, if vLLM generated them (infer.engine: vllm), are that other model's answers, not the "
        "target's as transformers computes it, and the drafter learned from them: not the drafter's fault"
    )
