"""What the infer tests share: prompts of short questions, the gate settings of their runs, and InferRun.run with
the hf engine over the embedded model, its knobs in one dataclass."""

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


def run(prompt_list, model, tokenizer, folder, cache_dir, knobs: Knobs = Knobs()):
    """InferRun.run with the hf engine over ``model``, in the cache under ``cache_dir`` its fingerprint names."""
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
    ).run(prompt_list)
