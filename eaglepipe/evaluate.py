"""The evaluate run: plain greedy, EAGLE-3 speculative and prompt-lookup (n-gram) speculative decoding on the held-out
prompts, interleaved prompt by prompt in each process (so the speeds are measured under the same conditions), with a
losslessness check against plain greedy for every prompt. See speculative.py for the loops and the definitions.

Under torchrun (runtime.py) rank r of W decodes prompts r, r + W, ..; the counts of every prompt are gathered and
added up in prompt order, so every figure but the speeds is the same at any number of processes of the same thread
count (``evaluate.threads``; the speeds are tokens over the seconds every process spent)."""
from __future__ import annotations

import logging
from collections import defaultdict
from pathlib import Path

import torch

from . import chat, draft, runtime, speculative
from .records import read_jsonl

log = logging.getLogger(__name__)

METHODS = ("plain", "eagle", "ngram")


def load_prompts(path, tokenizer, template_kwargs: dict | None = None) -> list[dict]:
    """[{"index", "category", "ids"}] from a JSONL file of OpenAI ``messages`` (optional ``tools``, ``category``)."""
    prompts = []
    for n, obj in read_jsonl(path):
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{path}:{n}: field 'messages' should be a non-empty list")
        ids = chat.prompt_ids(tokenizer, messages, obj.get("tools"), template_kwargs)
        prompts.append({"index": len(prompts), "category": str(obj.get("category", "all")), "ids": ids})
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def position_rows(rates: dict[str, list[float]]) -> list[dict]:
    """Plot rows ``{position, method, acceptance_rate}`` (positions from 1) from each method's acceptance rate per
    draft position."""
    return [{"position": i + 1, "method": method, "acceptance_rate": r}
            for method, per_position in rates.items() for i, r in enumerate(per_position)]


def decoded_record(p: dict, output_ids: list, eagle: speculative.Stats, layers: list) -> dict:
    """One line of the decoded file (``data/decoded``, read by the serve check, serve.py): the prompt's ids, the
    plain greedy output ids and the EAGLE run's counts (verification steps, tokens they emitted, per draft position
    the steps that proposed and that accepted a token) with the target layers the drafter read (HF indices)."""
    return {"index": p["index"], "category": p["category"], "prompt_ids": p["ids"], "output_ids": output_ids,
            "eagle": {"steps": eagle.steps, "emitted": eagle.emitted, "proposed": eagle.proposed,
                      "accepted": eagle.accepted, "layers": list(layers)}}


def run(prompts: list[dict], model, drafter_model, stop_ids, params, rt: runtime.Runtime = runtime.Runtime()) -> dict:
    """Decode every prompt three ways (this rank's share of them); return the metrics of all of them, on every rank
    (``lossless`` False lists the mismatches). ``positions`` holds the acceptance rate per draft position of
    ``eagle`` and ``ngram`` as plot rows (``position_rows``), and ``decoded`` one ``decoded_record`` per prompt, each
    for its own file: every other key is a metric."""
    num_steps, max_new = params.num_steps, params.max_new_tokens
    eagle = speculative.EagleDrafter(drafter_model)
    lookup = speculative.NgramDrafter(params.ngram.max, params.ngram.min)
    layers = model.config.get_text_config().num_hidden_layers
    if any(not 0 <= i < layers for i in eagle.layers):
        raise ValueError(f"the drafter reads hidden states {eagle.layers}, the target has {layers} layers")

    def decode(method, ids, stats, limit=max_new):
        if method == "plain":
            return speculative.greedy(model, ids, limit, stop_ids, stats)
        return speculative.speculative(model, eagle if method == "eagle" else lookup, ids, limit, stop_ids,
                                       num_steps, stats)

    mine = prompts[rt.rank::rt.world]
    for method in METHODS if mine else ():  # warm-up (first-call allocations, lazy hooks), not counted
        decode(method, mine[0]["ids"], speculative.Stats(), min(8, max_new))
    done = []  # per prompt of this rank: (prompt, plain output, stats per method, mismatches)
    for p in mine:
        outputs, stats = {}, {}
        order = METHODS[p["index"] % 3:] + METHODS[:p["index"] % 3]  # rotate: no method always runs first
        for method in order:
            stats[method] = speculative.Stats()
            outputs[method] = decode(method, p["ids"], stats[method])
        wrong = [{"prompt": p["index"], "method": method,
                  "first_difference": first_difference(outputs[method], outputs["plain"])}
                 for method in ("eagle", "ngram") if outputs[method] != outputs["plain"]]
        done.append((p, outputs["plain"], stats, wrong))
        log.info("prompt %d/%d (%s): %d tokens; acceptance length eagle %.3f, n-gram %.3f", p["index"] + 1,
                 len(prompts), p["category"], len(outputs["plain"]), stats["eagle"].acceptance_length,
                 stats["ngram"].acceptance_length)
    totals = {m: speculative.Stats() for m in METHODS}
    per_cat = defaultdict(lambda: {m: speculative.Stats() for m in METHODS})
    mismatches, decoded = [], []
    for p, plain_ids, stats, wrong in sorted((d for part in rt.gather(done) for d in part),
                                             key=lambda d: d[0]["index"]):
        for method in METHODS:
            totals[method].merge(stats[method])
            per_cat[p["category"]][method].merge(stats[method])
        decoded.append(decoded_record(p, plain_ids, stats["eagle"], eagle.layers))
        mismatches += wrong
    plain, spec, base = totals["plain"], totals["eagle"], totals["ngram"]
    return {
        "prompts": len(prompts), "num_steps": num_steps, "max_new_tokens": max_new,
        "lossless": not mismatches, "mismatches": mismatches,
        "acceptance_length": round(spec.acceptance_length, 4),
        "acceptance_rate_per_position": [round(r, 4) for r in spec.acceptance_rate],
        "conditional_acceptance_rate_per_position": [round(r, 4) for r in spec.conditional_rate],
        "verification_steps": spec.steps,
        "tokens": plain.tokens,
        "baseline_acceptance_length": round(base.acceptance_length, 4),
        "baseline_acceptance_rate_per_position": [round(r, 4) for r in base.acceptance_rate],
        "beats_baseline": spec.acceptance_length > base.acceptance_length,
        "per_category": {cat: {"prompts": sum(1 for p in prompts if p["category"] == cat),
                               "acceptance_length": round(s["eagle"].acceptance_length, 4),
                               "baseline_acceptance_length": round(s["ngram"].acceptance_length, 4)}
                         for cat, s in sorted(per_cat.items())},
        "run": {"threads": torch.get_num_threads(), "processes": rt.world, "seconds": {m: round(totals[m].seconds, 2) for m in METHODS},
                "plain_tokens_per_s": round(plain.tokens_per_s, 2),
                "speculative_tokens_per_s": round(spec.tokens_per_s, 2),
                "baseline_tokens_per_s": round(base.tokens_per_s, 2),
                "speedup": round(spec.tokens_per_s / plain.tokens_per_s, 4) if plain.tokens_per_s else None,
                "baseline_speedup": round(base.tokens_per_s / plain.tokens_per_s, 4) if plain.tokens_per_s else None,
                "per_category_speedup": {cat: round(s["eagle"].tokens_per_s / s["plain"].tokens_per_s, 4)
                                         if s["plain"].tokens_per_s else None for cat, s in sorted(per_cat.items())}},
        "positions": position_rows({m: [round(r, 4) for r in totals[m].acceptance_rate] for m in ("eagle", "ngram")}),
        "decoded": decoded,
    }


def load_drafter(folder, model):
    """The trained drafter on the target's device, given its input embedding (the drafter does not store one)."""
    return draft.load(Path(folder), model.get_input_embeddings().weight).to(model.device)
