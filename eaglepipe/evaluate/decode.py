"""Decoding loops: plain greedy with a KV cache, and chain speculative decoding with greedy verification.

Speculative loop (one sequence, top-k 1 chain, greedy):
    prefill the target on the prompt -> its first token ``t0`` (not a verification step);
    ``drafter.reset(prompt_ids, aux, t0)``;
    repeat: ``draft = drafter.propose(k)`` (k = num_steps, fewer near max_new_tokens); the target runs once on
    ``[pending] + draft`` with its ``DynamicCache``; the longest prefix of the draft that equals the target's own
    argmax is accepted (n tokens) and the target's next argmax is the bonus token; the cache is cropped to the
    accepted prefix; ``drafter.accept(n, aux of the n + 1 committed positions, bonus)``.
The output equals plain greedy decoding (up to float ties), so a drafter that reads only the tokens so far (the
n-gram one) gets the same counts from ``replay``, which answers each verification from the plain greedy output.

Drafter interface (duck-typed):
    needs_hidden: bool                   the loop computes the target's aux hidden states only if True
    layers: list[int]                    which ones (HF hidden_states indices, eaglepipe/hidden/layout.py), if needed
    reset(prompt_ids, aux, next_token)   aux [len(prompt), n·H]: the target's states at the prompt (or None);
                                         next_token: the target's first token
    propose(k) -> list[int]              up to k draft tokens that follow the last committed token
    accept(n, aux, next_token)           the first n proposed tokens were accepted; aux [n + 1, n·H]: the states at
                                         the previous pending token and the n accepted ones; next_token: the bonus

Acceptance bookkeeping (``Stats``), SGLang's definition: acceptance length = tokens emitted by verification steps /
verification steps (accepted draft tokens plus one per step), over all prompts together. A final step cut short by a
stop token or ``max_new_tokens`` counts the tokens it emitted; a step that proposes nothing (the n-gram drafter
without a match) is still a target forward and counts with length 1.
Per draft position i: ``acceptance_rate[i]`` = steps whose draft tokens 0..i were all accepted / steps that
proposed a token at position i; ``conditional_rate[i]`` = the same over steps that accepted tokens 0..i-1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import zip_longest

import torch
from transformers import DynamicCache

from eaglepipe.drafter.dflash.model import DFlashDraft
from eaglepipe.evaluate.block import BlockDrafter


@dataclass
class Stats:
    """Counts over one or more generations with the same drafter."""

    steps: int = 0  # verification steps (target forwards after the prefill)
    emitted: int = 0  # tokens emitted by verification steps
    tokens: int = 0  # all generated tokens (prefill's first token included)
    seconds: float = 0.0
    proposed: list = field(default_factory=list)  # per draft position: steps that proposed a token there
    accepted: list = field(default_factory=list)  # per draft position: steps that accepted it

    def add_step(self, proposed: int, accepted: int, emitted: int):
        self.steps += 1
        self.emitted += emitted
        self._add([1] * proposed, [int(i < accepted) for i in range(proposed)])

    def merge(self, other: Stats) -> Stats:
        self.steps += other.steps
        self.emitted += other.emitted
        self.tokens += other.tokens
        self.seconds += other.seconds
        self._add(other.proposed, other.accepted)
        return self

    def _add(self, proposed: list, accepted: list):
        """Add per-position counts of equal lengths; the lists grow to the longer."""
        self.proposed = [a + b for a, b in zip_longest(self.proposed, proposed, fillvalue=0)]
        self.accepted = [a + b for a, b in zip_longest(self.accepted, accepted, fillvalue=0)]

    @property
    def acceptance_length(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.accepted, self.proposed)]

    @property
    def conditional_rate(self) -> list[float]:
        reached = [self.proposed[0] if self.proposed else 0] + self.accepted[:-1]
        return [a / r if r else 0.0 for a, r in zip(self.accepted, reached)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def report(self) -> dict:
        return {
            "acceptance_length": round(self.acceptance_length, 4),
            "acceptance_rate_per_position": [round(r, 4) for r in self.acceptance_rate],
            "conditional_acceptance_rate_per_position": [round(r, 4) for r in self.conditional_rate],
            "verification_steps": self.steps,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def first_difference(a: list, b: list) -> int:
    """The first position where two outputs differ (the shorter one's length when one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _aux(hidden_states, layers, device, rows=None) -> torch.Tensor:
    """The states of ``layers`` (sequence 0, its first ``rows`` positions, all for None) concatenated on ``device``."""
    return torch.cat([hidden_states[i][0][:rows].to(device) for i in layers], dim=-1)


def _new_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


@torch.inference_mode()
def greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids, stats: Stats | None = None) -> list[int]:
    """Plain greedy decoding with a KV cache, one token per target forward; stops after a stop id (kept)."""
    stops = set(stop_ids)
    start = time.perf_counter()
    cache = _new_cache(model)
    ids = prompt_ids
    generated = []
    while not generated or (len(generated) < max_new_tokens and generated[-1] not in stops):
        out = model(
            input_ids=torch.tensor([ids], device=model.device), past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        generated.append(int(out.logits[0, -1].argmax()))
        ids = generated[-1:]
    if stats is not None:
        stats.seconds += time.perf_counter() - start
        stats.tokens += len(generated)
    return generated


@torch.inference_mode()
def greedy_check(model, prompt_ids: list[int], output_ids: list[int], max_new_tokens: int, stop_ids) -> int | None:
    """None when ``output_ids`` is the target's plain greedy output for ``prompt_ids`` (each token the argmax given
    those before it, ending after the first stop id or at ``max_new_tokens``), else the first position where it is
    not (as ``first_difference`` counts). One forward over all positions: a near-tie may round otherwise than in
    ``greedy``, so a failed check is settled by decoding."""
    stops = set(stop_ids)
    if not output_ids:
        return 0
    out = model(
        input_ids=torch.tensor([list(prompt_ids) + list(output_ids[:-1])], device=model.device),
        logits_to_keep=len(output_ids),
    )
    argmax = out.logits[0].argmax(-1).tolist()
    for i, (want, got) in enumerate(zip(argmax, output_ids)):
        if want != got or i == max_new_tokens:
            return i
        if got in stops and i < len(output_ids) - 1:  # greedy decoding stops here
            return i + 1
    return None if output_ids[-1] in stops or len(output_ids) == max_new_tokens else len(output_ids)


class _Target:
    """Verification by the target: a forward over the new tokens with its KV cache, the argmax after each."""

    def __init__(self, model, layers):
        self.model = model
        self.layers = layers
        self.cache = _new_cache(model)
        self.cache.activate_past_recording()  # a sliding-window layer keeps what it needs to crop rejected drafts
        self.out = None  # the last forward's output

    def __call__(self, tokens: list[int], at: int, **kw) -> list[int]:
        self.out = self.model(
            input_ids=torch.tensor([tokens], device=self.model.device),
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=self.layers or False,
            **kw,
        )
        return self.out.logits[0].argmax(-1).tolist()

    def aux(self, rows=None):
        return _aux(self.out.hidden_states, self.layers, self.model.device, rows) if self.layers else None

    def crop(self, rejected: int):  # a negative count works in transformers 4.x and 5.x
        self.cache.crop(-rejected)


class _Replay:
    """Verification read off the target's plain greedy output: after ``at`` generated tokens, draft position j is
    answered by ``output[at + j]`` (``None`` past the end). Exact for drafters that read only the tokens so far."""

    def __init__(self, output: list[int]):
        self.output = output

    def __call__(self, tokens: list[int], at: int, **kw) -> list[int]:
        if at == 0:  # the prefill: the first token
            return [self.output[0]]
        return [self.output[at + j] if at + j < len(self.output) else None for j in range(len(tokens))]

    def aux(self, rows=None):
        return None

    def crop(self, rejected: int):
        pass


def _decode(
    verify, drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids, num_steps: int, stats: Stats | None
) -> list[int]:
    """The chain loop of the module docstring over ``verify`` (``_Target`` or ``_Replay``)."""
    stops = set(stop_ids)
    if stats is None:
        stats = Stats()
    start = time.perf_counter()
    pending = verify(list(prompt_ids), 0, logits_to_keep=1)[-1]
    generated = [pending]
    if pending not in stops and max_new_tokens > 1:
        drafter.reset(list(prompt_ids), verify.aux(), pending)
        while True:
            remaining = max_new_tokens - len(generated)
            k = min(num_steps, remaining - 1)
            draft = [int(t) for t in drafter.propose(k)][:k] if k > 0 else []
            target = verify([pending] + draft, len(generated))
            n = 0  # the draft tokens accepted: those the target's argmax agrees with, up to the first it does not
            while n < len(draft) and draft[n] == target[n]:
                n += 1
            new = draft[:n] + [target[n]]
            cut = min([j + 1 for j, t in enumerate(new) if t in stops] + [remaining])  # after a stop, or at the limit
            finished = cut <= len(new)
            new = new[:cut]
            generated.extend(new)
            stats.add_step(len(draft), min(n, len(new)), len(new))
            if finished:
                break
            if n < len(draft):  # drop the rejected draft tokens
                verify.crop(len(draft) - n)
            pending = target[n]
            drafter.accept(n, verify.aux(n + 1), pending)
    stats.seconds += time.perf_counter() - start
    stats.tokens += len(generated)
    return generated


@torch.inference_mode()
def speculative(
    model, drafter, prompt_ids: list[int], max_new_tokens: int, stop_ids, num_steps: int, stats: Stats | None = None
) -> list[int]:
    """Chain speculative decoding with greedy verification (see the module docstring); returns the generated ids."""
    verify = _Target(model, list(drafter.layers) if drafter.needs_hidden else None)
    return _decode(verify, drafter, prompt_ids, max_new_tokens, stop_ids, num_steps, stats)


def replay(
    drafter,
    prompt_ids: list[int],
    output_ids: list[int],
    max_new_tokens: int,
    stop_ids,
    num_steps: int,
    stats: Stats | None = None,
) -> list[int]:
    """The counts ``speculative`` would give with ``drafter`` on a prompt whose plain greedy output is
    ``output_ids``, without running the target; drafters that read no hidden states only. Returns ``output_ids``."""
    if drafter.needs_hidden:
        raise ValueError("replay serves drafters that read no target hidden states")
    return _decode(_Replay(output_ids), drafter, prompt_ids, max_new_tokens, stop_ids, num_steps, stats)


class NgramDrafter:
    """Prompt-lookup drafting: the tokens that followed the most recent earlier occurrence of the last n tokens
    (n from ``max_ngram`` down to ``min_ngram``) in the prompt and the output so far; nothing without a match."""

    needs_hidden = False
    layers = ()

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self.last: list[int] = []

    def reset(self, prompt_ids, aux, next_token):
        self.tokens = list(prompt_ids) + [next_token]
        self.last = []

    def propose(self, k: int) -> list[int]:
        toks = self.tokens
        length = len(toks)
        self.last = []
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = toks[length - n :]
            first = pattern[0]
            for s in range(length - n - 1, -1, -1):
                if toks[s] == first and toks[s : s + n] == pattern:
                    self.last = toks[s + n : s + n + k]
                    return list(self.last)
        return []

    def accept(self, n, aux, next_token):
        self.tokens.extend(self.last[:n])
        self.tokens.append(next_token)


class EagleDrafter:
    """Chain drafting with a trained EAGLE-3 drafter (``Eagle3Draft``), following the alignment documented in
    eaglepipe/drafter/eagle3/model.py: the target's state at position t is paired with the token at t + 1, and the
    drafter's output there predicts the token at t + 2. The drafter's cache always holds exactly the positions built
    from the target's own states (the committed ones); draft steps extend it and are cropped away on the next
    ``accept``. A parallel drafter (``cfg.parallel``) proposes its drafts after the first in one forward over mask
    slots, as vLLM's ``parallel_drafting``."""

    needs_hidden = True

    def __init__(self, model):
        self.model = model
        self.layers = list(model.aux_layers)
        self.cache = None
        self.committed = 0  # drafter positions built from target states (= target tokens in the target's cache)
        self.next = None  # the drafter's first proposal after the last committed token (a target id)
        self.h = None  # its pre-norm output there, fed back for the next chain step
        self.last: list[int] = []

    def _extend(self, tokens: list[int], aux: torch.Tensor):
        m = self.model
        logits, h, self.cache = m(torch.tensor([tokens], device=aux.device), m.project(aux[None]), self.cache)
        self.committed = len(self.cache)
        self.next = int(m.to_target(logits[0, -1].argmax()))
        self.h = h[:, -1:]

    def reset(self, prompt_ids, aux, next_token):
        self.cache = None
        self._extend(list(prompt_ids[1:]) + [next_token], aux)

    def propose(self, k: int) -> list[int]:
        self.last = []
        if k <= 0:
            return []
        m = self.model
        tok = self.next
        h = self.h
        out = [tok]
        if m.cfg.parallel and k > 1:  # one forward over k - 1 mask slots, as vLLM's parallel_drafting
            logits = m.parallel_drafts(k - 1, self.cache)
            out += m.to_target(logits[0].argmax(-1)).tolist()
            self.last = out
            return list(out)
        for _ in range(k - 1):
            logits, h, _ = m(torch.tensor([[tok]], device=h.device), h, self.cache)
            tok = int(m.to_target(logits[0, -1].argmax()))
            out.append(tok)
        self.last = out
        return list(out)

    def accept(self, n, aux, next_token):
        self.cache.crop(self.committed)
        self._extend(self.last[:n] + [next_token], aux)


def drafter_for(model, num_steps: int):
    """The decoder of a trained drafter: block drafting for DFlash (``num_steps`` drafts a block, as served), else
    EAGLE's chain (or parallel) drafting."""
    return BlockDrafter(model, num_steps) if isinstance(model, DFlashDraft) else EagleDrafter(model)
