"""What the infer tests share: prompts of short questions, the gate settings of their runs, InferRun.run with the hf
engine over the embedded model, its knobs in one dataclass, and records compared across batches (their figures
within a tolerance)."""

import json
from dataclasses import dataclass
from pathlib import Path

import e2e

from eaglepipe.core import config
from eaglepipe.core.records import Prompt, content_id
from eaglepipe.engines import Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.run import InferRun, Plan, fingerprint
from eaglepipe.target import model as target
from eaglepipe.text import derive

QUESTIONS = [*e2e.QUESTIONS, "Spell 'cat' backwards.", "What is the opposite of hot?"]
NONE = derive.spec_from_params("none")
GATES = {"warmup": 4, "every": 4, "min_reasoning": 0.9, "max_truncated": 1.0, "max_empty": 0.5}


# The hf engine's figures of one answer in another batch differ in their last decimals (measured up to 2e-5 nats on
# the embedded target, float32, batch 1 against 6): records compare exactly but for them, and them within this.
FIGURES_TOLERANCE = 1e-4


def same_but_figures(records: list[dict], reference: list[dict]) -> None:
    """``records`` (JSON objects) are ``reference``'s byte for byte but for the log-probabilities, which are within
    FIGURES_TOLERANCE of theirs, id for id."""
    assert without_figures(records) == without_figures(reference)
    for record, ref in zip(records, reference):
        figures = list(zip(record["logprobs"], ref["logprobs"], strict=True))
        assert max(abs(a - b) for a, b in figures) < FIGURES_TOLERANCE, record["id"]


def without_figures(records: list[dict]) -> list[str]:
    """Each record (a JSON object) as JSON text, its log-probabilities left out."""
    return [json.dumps({k: v for k, v in r.items() if k != "logprobs"}) for r in records]


def prompts(questions, source="t"):
    out = []
    for q in questions:
        messages = [{"role": "user", "content": q}]
        out.append(Prompt(content_id(messages, None), source, messages))
    return out


@dataclass(frozen=True)
class Knobs:
    """What a test's infer run varies: the sampling, the hf engine's batch size, infer.samples and infer.turns."""

    max_new_tokens: int = 12
    batch_size: int = 4
    samples: int = 1
    temperature: float = 0.0
    turns: str = "last"


def run(prompt_list, model, tokenizer, folder, cache_dir, knobs: Knobs = Knobs(), before_generating=None):
    """InferRun.run with the hf engine over ``model``, in the cache under ``cache_dir`` its fingerprint names, with the
    hook ``before_generating``."""
    engine = HFEngine(model, tokenizer.pad_token_id, knobs.batch_size)
    sampling = Sampling(
        temperature=knobs.temperature,
        max_new_tokens=knobs.max_new_tokens,
        stop_token_ids=tuple(target.stop_ids(folder, tokenizer)),
    )
    spec = derive.spec_from_params("none")
    fp = fingerprint(
        target.fingerprint(folder), "hf", engine.identity(), sampling, {}, spec if knobs.turns == "all" else None
    )
    return InferRun(
        engine,
        tokenizer,
        sampling,
        spec,
        Gates(config.Gates(**GATES), False),
        Cache(Path(cache_dir) / fp),
        Plan({}, samples=knobs.samples, turns=knobs.turns),
        before_generating,
    ).run(prompt_list)
