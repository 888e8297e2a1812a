"""infer's pre-flight check (``infer.preflight``): before the run generates, the engine answers the first few of its
prompts with their first tokens, and its log-probabilities of those tokens are compared with the target's own, from
one float32 transformers forward over each prompt and answer. An engine that computes another model than transformers
(another checkpoint on the server, a config key read otherwise) is refused in seconds, before the rest is paid for.

``Check`` is InferRun's ``before_generating`` hook: it gets the record and prompt ids of the answers about to be
generated (called only when some are), streams the first ``prompts`` of them with ``tokens`` new tokens and their own
record ids (so their own seeds: the run's first tokens), caches nothing, and compares per token, over the engine's
figures: the mean |engine - transformers| of all of them against ``max_mean_abs_diff``; greedy (temperature 0), also
each first token against transformers' best, where a near-tie within ``max_mean_abs_diff`` nats is forgiven. Either
failing is a UserError naming the records, the engine, the figures at the worst token and the likely causes.

Which runs (``mode``): ``off`` never; ``on`` always, and an engine that returns no figures is refused; ``auto`` when
the target runs in this process (the hf engine) or its weights fit under ``max_weights_gib`` (loading it costs
seconds), and an engine without figures is skipped with a warning. For the hf engine the check reuses the engine's own
model where it is the target in float32 (the same weights: the check then tests its batched, padded, KV-cached
decoding against one plain forward); in another dtype it loads a float32 copy, freed after the check.

The outcome is ``Check.report`` (stages/infer.py puts it in the report's ``run`` part): nothing here decides an
answer, so nothing here is in infer's cache key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from eaglepipe.core.errors import UserError
from eaglepipe.core.runtime import Runtime
from eaglepipe.engines import Failure, Sampling
from eaglepipe.target import compat
from eaglepipe.target import model as target

log = logging.getLogger(__name__)

CAUSES = (
    "another checkpoint, revision or quantization on the server than the target's folder; a config key the engine "
    "reads otherwise than transformers (a tied output head, rope scaling, the norms' eps); figures taken after "
    "temperature or top-k/top-p (vLLM --logprobs-mode processed_*, SGLang without SGLANG_RETURN_ORIGINAL_LOGPROB=1); "
    "an engine in bfloat16 or float16 whose rounding alone exceeds the limit (raise infer.preflight.max_mean_abs_diff)"
)
SKIP = "set infer.preflight.mode: off to skip"


def weights_gib(folder: Path) -> float:
    """The size of the target's safetensors files (those ``compat.weights`` reads), in GiB."""
    files = {file for file, _, _ in compat.weights(folder).values()}
    return sum((Path(folder) / file).stat().st_size for file in files) / 2**30


def not_run(params, engine_name: str, folder: Path) -> str | None:
    """Why ``params`` (config's infer.preflight) leave the check out for this engine and target, or None."""
    if params.mode == "off":
        return "infer.preflight.mode: off"
    if params.mode == "on" or engine_name == "hf":
        return None
    size = weights_gib(folder)
    if size > params.max_weights_gib:
        return f"auto: the target's weights, {size:.2f} GiB, exceed infer.preflight.max_weights_gib"
    return None


@dataclass(frozen=True)
class Answer:
    """One pre-flight answer: its record, prompt and output ids, and the engine's figure of each output id (None
    where it gave none; ``logprobs`` None when it gave no figures at all)."""

    record_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float | None] | None


@dataclass(frozen=True)
class Compared:
    """One answer's figures against the target's: how many tokens had an engine figure, their mean and largest
    |engine - transformers| log-probability (nats), where the largest is (answer position) with both figures there,
    and the answer's first token with the target's best there and how far below it the first token is (nats)."""

    record_id: str
    tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    worst: int
    engine_logprob: float
    target_logprob: float
    first_token: int
    best_token: int
    first_margin: float

    def describe(self) -> str:
        return (
            f"record {self.record_id}: mean |diff| {self.mean_abs_diff:.4f}, most {self.max_abs_diff:.4f} at token "
            f"{self.worst} (engine {self.engine_logprob:.4f}, transformers {self.target_logprob:.4f})"
        )

    def greedy_miss(self) -> str:
        return (
            f"record {self.record_id}: first token {self.first_token}, where transformers' best is {self.best_token}, "
            f"{self.first_margin:.4f} nats better"
        )


@torch.inference_mode()
def target_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The target's float32 log-softmax before each output token ([len(output_ids), vocab]): one forward over the
    prompt and the answer, the logits kept at the answer's positions only."""
    ids = torch.tensor([prompt_ids + output_ids[:-1]], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=len(output_ids)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def compare(answer: Answer, target_rows: torch.Tensor) -> Compared | None:
    """``answer``'s engine figures against ``target_rows`` (``target_logprobs`` of its ids), over the tokens that have
    one; None when none has."""
    chosen = target_rows.gather(1, torch.tensor(answer.output_ids)[:, None])[:, 0]
    figures = answer.logprobs
    positions = [t for t, figure in enumerate(figures) if figure is not None]
    if not positions:
        return None
    diffs = [abs(figures[t] - float(chosen[t])) for t in positions]
    worst = positions[max(range(len(diffs)), key=diffs.__getitem__)]
    best = int(target_rows[0].argmax())
    return Compared(
        answer.record_id,
        len(positions),
        sum(diffs) / len(diffs),
        max(diffs),
        worst,
        figures[worst],
        float(chosen[worst]),
        answer.output_ids[0],
        best,
        float(target_rows[0, best] - chosen[0]),
    )


@dataclass
class Check:
    """The pre-flight of one run: ``engine`` (``name``, ``stream``) generating with ``sampling``, checked against the
    target in ``folder`` loaded onto ``rt``; ``params``: config's infer.preflight. Call it with the record and prompt
    ids about to be generated; ``report`` says what it found."""

    engine: object
    sampling: Sampling
    folder: Path
    rt: Runtime
    params: object
    report: dict = field(init=False)

    def __post_init__(self):
        self.report = {"mode": self.params.mode, "verdict": "not run: nothing to generate"}

    @property
    def tokens(self) -> int:
        """New tokens per answer: ``params.tokens``, within the run's own ``max_new_tokens``."""
        return min(self.params.tokens, self.sampling.max_new_tokens)

    def __call__(self, record_ids: list[str], prompts: list[list[int]]) -> None:
        why = not_run(self.params, self.engine.name, self.folder)
        if why:
            log.info("pre-flight left out: %s", why)
            self.report["verdict"] = f"left out: {why}"
            return
        answers = self.answers(record_ids[: self.params.prompts], prompts[: self.params.prompts])
        compared = self.compared(answers)
        if compared:
            self.judge(compared)
            return
        why = f"the {self.engine.name} engine " + (
            "returned no log-probabilities" if answers else "gave no answer (its failures are above)"
        )
        if self.params.mode == "on":
            raise UserError(f"infer.preflight (mode: on): {why} to compare with transformers'; {SKIP}")
        log.warning("pre-flight left out: %s", why)
        self.report["verdict"] = f"left out: {why}"

    def answers(self, record_ids: list[str], prompts: list[list[int]]) -> list[Answer]:
        """The engine's answers to ``prompts`` with ``tokens`` new tokens, under their own ``record_ids``; failures
        and empty answers are logged or left out (the run meets them again)."""
        short = replace(self.sampling, max_new_tokens=self.tokens)
        found = []
        for i, out in self.engine.stream(prompts, short, record_ids):
            if isinstance(out, Failure):
                log.warning("pre-flight: record %s failed: %s", record_ids[i], out.reason)
                continue
            if out.output_ids:
                found.append(Answer(record_ids[i], prompts[i], out.output_ids, getattr(out, "logprobs", None)))
        return found

    def compared(self, answers: list[Answer]) -> list[Compared]:
        """Every answer with engine figures against the target's (loaded only when some answer has figures)."""
        scored = [a for a in answers if a.logprobs is not None]
        if not scored:
            return []
        model = self.model()
        vocabulary = model.get_input_embeddings().num_embeddings
        found = []
        for answer in scored:
            past = [i for i in answer.prompt_ids + answer.output_ids if i >= vocabulary]
            if past:
                raise UserError(
                    f"infer.preflight: the {self.engine.name} engine answered record {answer.record_id} with token "
                    f"id {past[0]}, past the {vocabulary} embeddings of the target that transformers loads from "
                    f"{self.folder}: it serves another model. Likely causes: {CAUSES}; {SKIP}"
                )
            one = compare(answer, target_logprobs(model, answer.prompt_ids, answer.output_ids))
            if one is not None:
                found.append(one)
        del model
        if self.rt.device.type == "cuda":
            torch.cuda.empty_cache()  # a float32 copy made for the check leaves the device to the run
        return found

    def model(self):
        """The target in float32 on ``rt``: the hf engine's own model where it is that, else a copy loaded now."""
        own = getattr(self.engine, "model", None)
        if (
            own is not None
            and own.dtype == torch.float32
            and Path(own.name_or_path).resolve() == Path(self.folder).resolve()
        ):
            return own
        log.info("pre-flight: loading the target in float32 to check the %s engine against", self.engine.name)
        return target.load_target(self.folder, "float32", self.rt)

    def judge(self, compared: list[Compared]) -> None:
        """Refuse the engine when the mean difference over every compared token exceeds ``max_mean_abs_diff``, or
        (greedy) a first token is not transformers' best beyond it; else log and report the figures."""
        limit = self.params.max_mean_abs_diff
        tokens = sum(c.tokens for c in compared)
        mean = sum(c.mean_abs_diff * c.tokens for c in compared) / tokens
        most = max(c.max_abs_diff for c in compared)
        greedy = self.sampling.temperature <= 0
        misses = [c for c in compared if greedy and c.first_token != c.best_token and c.first_margin > limit]
        self.report.update(
            prompts=len(compared), tokens=tokens, mean_abs_diff=round(mean, 5), max_abs_diff=round(most, 5)
        )
        if mean <= limit and not misses:
            self.report["verdict"] = "passed"
            log.info(
                "pre-flight passed: %s vs transformers (float32) over %d answers, %d tokens: mean |diff| %.5f, "
                "most %.5f nats (infer.preflight.max_mean_abs_diff %s)",
                self.engine.name,
                len(compared),
                tokens,
                mean,
                most,
                limit,
            )
            return
        raise UserError(self.refusal(compared, mean, misses))

    def refusal(self, compared: list[Compared], mean: float, misses: list[Compared]) -> str:
        """The refusal's message: the engine, the figures per record (worst first), the greedy misses, the causes."""
        worst_first = sorted(compared, key=lambda c: -c.mean_abs_diff)
        figures = "; ".join(c.describe() for c in worst_first)
        greedy = f"; greedy, a first token transformers would not take: {'; '.join(m.greedy_miss() for m in misses)}"
        return (
            f"infer.preflight: the {self.engine.name} engine does not compute the target that transformers loads from "
            f"{self.folder}: over the first {self.tokens} tokens of records "
            f"{', '.join(c.record_id for c in compared)}, its log-probabilities differ from transformers' (float32) by "
            f"{mean:.4f} nats on average (infer.preflight.max_mean_abs_diff {self.params.max_mean_abs_diff}): "
            f"{figures}{greedy if misses else ''}. Likely causes: {CAUSES}; {SKIP}"
        )
