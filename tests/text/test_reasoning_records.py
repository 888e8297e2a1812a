"""Reasoning split on records derived from ids: each field re-derived, a tampered field named, and a property test
over thousands of random and adversarial token sequences proving that every record can be re-derived from its ids
and never loses its thinking."""

import json
import random

from reasoning_fixtures import ids
from text_helpers import HARMONY, NONE, THINK, parts

from eaglepipe.core.records import Generation, response_from_json, to_json
from eaglepipe.engines import Sampling
from eaglepipe.target import chat
from eaglepipe.text import derive, toolcalls

QUESTION = [{"role": "user", "content": "What is 2+2?"}]


# --- records derived from ids -----------------------------------------------------------------------------------


def record(tok, prompt_ids, output_ids, spec, finish="stop"):
    gen = Generation("r1", "s", prompt_ids, output_ids, finish, {})
    return derive.to_response(gen, tok, spec, Sampling())


def test_prefilled_template_record(tok):
    prompt = chat.prompt_ids(tok, QUESTION)
    assert tok.decode(prompt[-2:], skip_special_tokens=False) == "<think>\n"
    out = ids(tok, "Two plus two is four.\n</think>\n\n4<|im_end|>")
    r = record(tok, prompt, out, THINK)
    assert (r.reasoning, r.content, r.reasoning_closed) == ("Two plus two is four.\n", "\n\n4<|im_end|>", True)
    assert r.output_ids == out and r.text == tok.decode(out, skip_special_tokens=False)
    assert derive.mismatch(r, tok, THINK) is None
    # the same ids read without a reasoning preset: all content, and merge would refuse the record
    assert derive.mismatch(r, tok, NONE) == "reasoning"


def test_truncated_record_is_flagged(tok):
    prompt = chat.prompt_ids(tok, QUESTION)
    out = ids(tok, "Two plus two, carry the")
    r = record(tok, prompt, out, THINK, "length")
    assert (r.reasoning, r.content, r.reasoning_closed) == ("Two plus two, carry the", "", False)


def test_template_without_think_tags_gives_no_reasoning(tok):
    prompt = chat.prompt_ids(tok, QUESTION, None, {"enable_thinking": False})
    r = record(tok, prompt, ids(tok, "4<|im_end|>"), THINK)
    assert (r.reasoning, r.content) == ("", "4<|im_end|>")


def test_mismatch_names_the_tampered_field(tok):
    prompt = chat.prompt_ids(tok, QUESTION)
    r = record(
        tok,
        prompt,
        ids(tok, 'why</think>4<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
        derive.spec_from_params("think", "hermes"),
    )
    spec = derive.spec_from_params("think", "hermes")
    assert r.tool_calls == [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    assert derive.mismatch(r, tok, spec) is None
    for name, value in [
        ("text", "x"),
        ("reasoning", ""),
        ("content", "4"),
        ("reasoning_closed", False),
        ("tool_calls", []),
    ]:
        bad = response_from_json({**to_json(r), name: value})
        assert derive.mismatch(bad, tok, spec) == name
    # merge's spec without a tool-call family does not check tool_calls
    assert derive.mismatch(response_from_json({**to_json(r), "tool_calls": []}), tok, THINK) is None


def test_markup_lists_special_and_added_tokens(tok):
    m = derive.markup(tok)
    assert {"<|im_end|>", "<think>", "<|return|>", "<tool_call>"} <= set(m)
    assert list(m) == sorted(m, key=len, reverse=True)


# --- property test: random and adversarial token sequences ------------------------------------------------------

TEXT, WS, START, END, TOOL, EOT = "text", "ws", "start", "end", "tool", "eot"


class Vocab:
    """Token ids of the test tokenizer, by what they decode to."""

    def __init__(self, tok, rng):
        self.tok = tok
        base = len(tok) - len(tok.get_added_vocab())  # plain vocabulary ids
        self.clean, self.ws = [], []
        for i in rng.sample(range(base), 6000):
            s = tok.decode([i], skip_special_tokens=False)
            if not s or "\ufffd" in s or "<" in s or ">" in s or i in tok.all_special_ids:
                continue
            (self.ws if not s.strip() else self.clean).append(i)
        self.ws += ids(tok, "\n") + ids(tok, " ") + ids(tok, "\n\n")
        self.start, self.end = ids(tok, "<think>"), ids(tok, "</think>")
        # the markers spelled with ordinary tokens, cut at odd places: they decode to the same text
        self.start_split = [ids(tok, "<th") + ids(tok, "ink>"), ids(tok, "<") + ids(tok, "think>")]
        self.end_split = [ids(tok, "</") + ids(tok, "think>"), ids(tok, "</th") + ids(tok, "ink") + ids(tok, ">")]
        self.tool, self.eot = ids(tok, "<tool_call>"), ids(tok, "<|im_end|>")
        self.base = base

    def part(self, rng, kind):
        if kind == TEXT:
            return [rng.choice(self.clean) for _ in range(rng.randint(1, 6))]
        if kind == WS:
            return [rng.choice(self.ws) for _ in range(rng.randint(1, 2))]
        if kind == START:
            return rng.choice([self.start] * 3 + self.start_split)
        if kind == END:
            return rng.choice([self.end] * 3 + self.end_split)
        return {TOOL: self.tool, EOT: self.eot}[kind]


def oracle(plan, prefilled):
    """Blocks, content and closed of a plan of (kind, text) parts: the rules of reasoning.py's docstring, applied to
    the parts that built the ids rather than to the decoded string."""
    kinds = [k for k, _ in plan]
    first = lambda k: kinds.index(k) if k in kinds else len(kinds)  # noqa: E731
    in_block = prefilled or (END in kinds and first(END) < first(START))
    blocks, content, cur, closed = [], [], ([] if in_block else None), True
    for i, (k, t) in enumerate(plan):
        if cur is None:
            if k == START:
                cur = []
            else:
                content.append(t)
        elif k == END:
            blocks.append(cur)
            cur = None
        elif k == TOOL and END not in kinds[i + 1 :]:
            blocks.append(cur)
            cur = None
            content.append(t)
        elif k == START and not "".join(cur).strip():
            continue  # a repeated opening marker at the start of a block
        else:
            cur.append(t)
    if cur is not None:
        blocks.append(cur)
        closed = False
    return ["".join(b) for b in blocks], "".join(content), closed


def random_plan(rng, vocab):
    style = rng.random()
    if style < 0.5:  # shaped like a reasoning model's answer, with adversarial twists
        plan = []
        if rng.random() < 0.5:
            plan.append(START)
        plan += rng.choice([[TEXT], [WS], [], [TEXT, WS, TEXT], [START, TEXT]])  # body (maybe doubled opener)
        if rng.random() < 0.8:
            plan.append(END)
        plan += rng.choice([[TEXT], [WS, TEXT], [TOOL, TEXT], [], [END, TEXT], [START, TEXT, END, TEXT]])
        if rng.random() < 0.7:
            plan.append(EOT)
    else:  # markers at random places
        plan = [rng.choice([TEXT, TEXT, WS, START, END, TOOL, EOT]) for _ in range(rng.randint(0, 8))]
    return [(k, vocab.part(rng, k)) for k in plan]


def check_record(tok, prompt, out, spec):
    r = record(tok, prompt, out, spec)
    again = response_from_json(json.loads(json.dumps(to_json(r))))  # the published record, read back
    assert derive.mismatch(again, tok, spec) is None
    assert again.text == tok.decode(out, skip_special_tokens=False)
    _, part = derive.split_ids(tok, prompt, out, spec)
    assert parts(part) == again.text  # every character is in exactly one segment, in order
    assert {s for k, s in part.segments if k == "marker"} <= {spec.start, spec.end} or spec.kind == "harmony"
    assert part.content == "".join(s for k, s in part.segments if k == "content")
    return again


def test_property_think_blocks_are_never_lost(tok):
    rng = random.Random(1234)
    vocab = Vocab(tok, rng)
    prompts = {
        True: chat.prompt_ids(tok, QUESTION),
        False: chat.prompt_ids(tok, QUESTION, None, {"prefill_think": False}),
    }
    off = chat.prompt_ids(tok, QUESTION, None, {"enable_thinking": False})
    checked = with_reasoning = 0
    for case in range(3000):
        prefilled = rng.random() < 0.5
        plan = random_plan(rng, vocab)
        if rng.random() < 0.15:  # cut short at a random token (finish_reason length)
            flat = [(k, i) for k, p in plan for i in p]
            cut = rng.randint(0, len(flat))
            out = [i for _, i in flat[:cut]]
            plan = None  # a cut can turn a marker spelled with ordinary tokens into plain text: invariants only
        elif rng.random() < 0.1:  # junk: arbitrary ids of the whole vocabulary, specials and byte pieces included
            out = [rng.randrange(len(tok)) for _ in range(rng.randint(0, 12))]
            plan = None
        else:
            out = [i for _, p in plan for i in p]
        prompt = prompts[prefilled] if plan is not None or rng.random() < 0.7 else off
        r = check_record(tok, prompt, out, THINK)
        if plan is None:
            continue
        texts = [(k, tok.decode(p, skip_special_tokens=False)) for k, p in plan]
        blocks, content, closed = oracle(texts, prefilled)
        assert (r.reasoning, r.content, r.reasoning_closed) == ("\n".join(b for b in blocks if b), content, closed), (
            case,
            texts,
            prefilled,
        )
        if any(b.strip() for b in blocks):  # the ids hold a non-empty think block: reasoning is non-empty
            assert r.reasoning.strip()
            with_reasoning += 1
        # prompt + output decode to the prompt's text followed by the record's text
        assert (
            tok.decode(prompt + out, skip_special_tokens=False)
            == tok.decode(prompt, skip_special_tokens=False) + r.text
        )
        checked += 1
    assert checked > 2000 and with_reasoning > 500


def test_property_harmony_channels(tok):
    rng = random.Random(99)
    vocab = Vocab(tok, rng)
    prompt = chat.prompt_ids(tok, QUESTION, None, {"harmony": True})
    word = lambda: tok.decode(vocab.part(rng, TEXT), skip_special_tokens=False)  # noqa: E731
    for _ in range(600):
        msgs = []
        for _ in range(rng.randint(0, 3)):
            msgs.append(rng.choice(["analysis", "analysis", "final", "commentary", "call"]))
        text, bodies = "", []
        for n, m in enumerate(msgs):
            head = "" if n == 0 else "<|start|>assistant"
            body = rng.choice([word(), word(), "", " \n"])
            if m == "call":
                text += f'{head}<|channel|>commentary to=functions.f <|constrain|>json<|message|>{{"a": 1}}<|call|>'
            else:
                text += f"{head}<|channel|>{m}<|message|>{body}" + ("<|end|>" if m != "final" else "<|return|>")
                if m == "analysis":
                    bodies.append(body)
        out = ids(tok, text)
        if rng.random() < 0.2:
            out = out[: rng.randint(0, len(out))]
            bodies = None
        r = check_record(tok, prompt, out, HARMONY)
        if bodies is not None:
            assert r.reasoning == "\n".join(b for b in bodies if b)
            assert r.reasoning_closed
            assert len(r.tool_calls) == msgs.count("call") and not toolcalls.count_errors(r.tool_calls)
