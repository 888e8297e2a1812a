"""Regression: a reasoning model's thinking silently lost from the training data (../shared/seed).

The real infer run (real cache, real gates, params.yaml's gate settings) is driven by a scripted engine that serves a
reasoning model's answers as token ids of the test tokenizer (reasoning_fixtures.py), so these tests run offline:
1. the seed's run replayed: every record keeps non-empty reasoning, and merge accepts every record;
2. the same run with the reasoning dropped from the served answers fails its gate within the warm-up, keeps what it
   generated in the cache and publishes nothing; merge refuses a published record whose reasoning was blanked;
3. the prefilled-opening-tag template, an output with no closing tag, gpt-oss harmony channels;
and every turn of a reasoning model under a template that drops the history's reasoning.
4 (the real stage on the embedded model) and 1 and 2 end to end over HTTP are in test_regression_reasoning_e2e.py.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT
from reasoning_fixtures import (
    ScriptedEngine,
    harmony_model,
    question_of,
    reasoning_dropped,
    reasoning_model,
    think_answer,
)
from text_helpers import GATES

from eaglepipe.core import config
from eaglepipe.core.records import Prompt, RecordError, content_id, write_json, write_jsonl
from eaglepipe.dataset import merge
from eaglepipe.engines import Sampling
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import GateBreach, Gates
from eaglepipe.infer.run import InferRun, Plan
from eaglepipe.target import model as target
from eaglepipe.text import derive
from eaglepipe.tools import inspect

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    }
]
MERGE = config.Merge(shard_tokens=100000)


def prompts(n, tools_every=4, source="glaive"):
    out = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: what is {i} times {i + 1}?"}]
        tools = TOOLS if tools_every and i % tools_every == 0 else None
        out.append(Prompt(content_id(messages, tools), source, messages, tools))
    return out


def run(ps, engine, tok, folder, cache_dir, spec, template_kwargs=None, max_new_tokens=256):
    sampling = Sampling(max_new_tokens=max_new_tokens, stop_token_ids=tuple(target.stop_ids(folder, tok)))
    gates = Gates(GATES, spec.expects_reasoning, derive.markup(tok))
    return InferRun(engine, tok, sampling, spec, gates, Cache(Path(cache_dir)), Plan(template_kwargs or {})).run(ps)


def test_1_seed_run_replayed_every_record_keeps_its_reasoning(tok, folder, tmp_path):
    ps = prompts(40)
    spec = derive.spec_from_params("think", "hermes")
    engine = ScriptedEngine(tok, reasoning_model)
    responses, rep = run(ps, engine, tok, folder, tmp_path / "cache", spec)
    assert len(responses) == 40 and engine.served == 40
    think = tok.convert_tokens_to_ids("</think>")
    for p, r in zip(ps, responses):
        thought, _ = think_answer(p.messages[-1]["content"], p.tools)
        assert think in r.output_ids  # the thinking is in the ids ...
        assert r.reasoning.strip() == thought  # ... and in the readable field
        assert r.reasoning_closed and r.content.endswith("<|im_end|>") and "</think>" not in r.content
        if p.tools:
            assert r.tool_calls == [
                {"type": "function", "function": {"name": "search", "arguments": {"query": p.messages[-1]["content"]}}}
            ]
            assert "<tool_call>" in r.content
    assert rep["with_reasoning"] == 40 and rep["unclosed_reasoning"] == 0
    assert rep["gates"]["min_reasoning"] == 1.0
    assert rep["tool_calls"] == {"records": 10, "calls": 10, "parse_failures": 0}
    # published, then merged: merge re-validates every record against its ids and accepts them all
    write_jsonl(tmp_path / "responses.jsonl", responses)
    stats = merge.run(
        tmp_path / "responses.jsonl",
        tmp_path / "seq",
        tok,
        derive.spec_from_params("think"),
        target.end_of_turn_id(folder, tok),
        MERGE,
    )
    assert stats["train"]["samples"] + stats["valid"]["samples"] == 40
    # what a user checks by eye: the inspection command, run as `make inspect` runs it
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["target"].update({"model": str(folder), "reasoning": "think", "tool_calls": "hermes"})
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    write_json(tmp_path / "infer.json", rep)
    proc = subprocess.run(
        [
            sys.executable,
            "stages/inspect_run.py",
            "--responses",
            str(tmp_path / "responses.jsonl"),
            "--params",
            str(tmp_path / "params.yaml"),
            "--report",
            str(tmp_path / "infer.json"),
            "--n",
            "40",
            "--seed",
            "3",
            "--source",
            "glaive",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "with reasoning 40 (100.0%)" in out and "(source glaive): 40 records; showing 40" in out
    assert out.count("-- reasoning (closed) --") == 40 and out.count("-- content --") == 40
    assert out.count("re-derived from ids: ok") == 40 and out.count('  1. search({"query": ') == 10
    assert out.count("-- prompt (its prompt_ids decoded) --") == 40
    assert all(f"<|im_start|>user\n{p.messages[-1]['content']}<|im_end|>" in out for p in ps)  # the question asked


@pytest.mark.parametrize("template", [{}, {"prefill_think": False}], ids=["prefilled", "model-opens-tag"])
def test_2_reasoning_dropped_fails_its_gate_within_the_warmup(tok, folder, tmp_path, template):
    ps = prompts(64)
    engine = ScriptedEngine(tok, reasoning_dropped, "reasoning dropped")
    cache = tmp_path / "cache"
    with pytest.raises(GateBreach) as e:
        run(ps, engine, tok, folder, cache, derive.spec_from_params("think"), template)
    warmup = GATES.warmup
    msg = str(e.value)
    assert f"gate min_reasoning breached: observed 0.000 < {GATES.min_reasoning} after {warmup} records" in msg
    assert ", ".join(p.id for p in ps[:5]) in msg  # a few record ids to look at
    assert engine.served == warmup  # stopped at the first check: the rest was never asked for
    done, _ = Cache(cache).load()  # what was generated stays on disk for inspection
    assert list(done) == [p.id for p in ps[:warmup]]
    assert not (tmp_path / "responses.jsonl").exists()
    # the stopped run's records can be inspected where they are
    shown = inspect.render(cache / "generations.jsonl", 2, 0, tok, derive.spec_from_params("think"))
    assert f"generations.jsonl: {warmup} records; showing 2" in shown
    assert shown.count("NEVER CLOSED although the model stopped" if not template else "-- reasoning (none) --") == 2
    # resuming the broken run stops again at its first new record, before spending more compute
    engine2 = ScriptedEngine(tok, reasoning_dropped, "reasoning dropped")
    with pytest.raises(GateBreach, match=f"after {warmup + 1} records"):
        run(ps, engine2, tok, folder, cache, derive.spec_from_params("think"), template)
    assert engine2.served == 1


def test_2b_merge_refuses_a_published_record_whose_reasoning_was_blanked(tok, folder, tmp_path):
    spec = derive.spec_from_params("think")
    responses, _ = run(prompts(3, 0), ScriptedEngine(tok, reasoning_model), tok, folder, tmp_path / "c", spec)
    responses[1].reasoning = ""  # the seed's record: thinking in the ids, nothing in the field
    write_jsonl(tmp_path / "r.jsonl", responses)
    with pytest.raises(RecordError, match=r"r\.jsonl:2: field 'reasoning'.*inconsistent"):
        merge.run(tmp_path / "r.jsonl", tmp_path / "seq", tok, spec, target.end_of_turn_id(folder, tok), MERGE)


def test_3_prefilled_template_only_the_closing_tag_is_generated(tok, folder, tmp_path):
    ps = prompts(20, 0)
    spec = derive.spec_from_params("think")
    responses, _ = run(ps, ScriptedEngine(tok, reasoning_model), tok, folder, tmp_path, spec)
    open_id, close_id = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    for r in responses:
        assert r.prompt_ids[-2] == open_id and open_id not in r.output_ids and close_id in r.output_ids
        assert r.reasoning.startswith("The user asks:")


def test_3_output_without_closing_tag_is_reasoning_flagged_unclosed(tok, folder, tmp_path):
    def sometimes_cut(prompt_text):
        text, finish = reasoning_model(prompt_text)
        return (text, "length") if "Question 3:" in prompt_text else (text, finish)

    ps = prompts(20, 0)
    responses, rep = run(
        ps,
        ScriptedEngine(tok, sometimes_cut),
        tok,
        folder,
        tmp_path,
        derive.spec_from_params("think"),
        max_new_tokens=6,
    )
    cut = [r for r in responses if r.finish_reason == "length"]
    assert len(cut) == 1 and len(cut[0].output_ids) == 6
    assert cut[0].reasoning and cut[0].content == "" and not cut[0].reasoning_closed
    assert cut[0].reasoning == cut[0].text  # reasoning holds it all
    assert rep["unclosed_reasoning"] == 1 and rep["finish_reason"] == {"stop": 19, "length": 1}


def test_3_gpt_oss_harmony_channels(tok, folder, tmp_path):
    ps = prompts(24)
    spec = derive.spec_from_params("harmony", "harmony")
    responses, rep = run(ps, ScriptedEngine(tok, harmony_model), tok, folder, tmp_path, spec, {"harmony": True})
    assert tok.decode(responses[0].prompt_ids).endswith("<|start|>assistant")
    for p, r in zip(ps, responses):
        assert r.reasoning.startswith("User asks: Question") and r.reasoning_closed
        assert "<|channel|>analysis" not in r.content
        if p.tools:
            assert r.tool_calls == [
                {"type": "function", "function": {"name": "search", "arguments": {"query": p.messages[-1]["content"]}}}
            ]
            assert r.content.endswith("<|call|>") and "to=functions.search" in r.content
        else:
            assert r.content == f"Answer: {p.messages[-1]['content']}" and r.tool_calls == []
    assert rep["with_reasoning"] == 24 and rep["tool_calls"]["parse_failures"] == 0
    # the same output read with the think preset has no reasoning: the gate would stop such a misconfigured run
    with pytest.raises(GateBreach, match="min_reasoning"):
        run(
            ps,
            ScriptedEngine(tok, harmony_model),
            tok,
            folder,
            tmp_path / "other",
            derive.spec_from_params("think"),
            {"harmony": True},
        )


# -------------------------------------------------------------------------------- every turn of a reasoning model
def chat_of(*users):
    """A conversation of these user turns, a dataset answer between each two."""
    messages = []
    for i, user in enumerate(users):
        messages += ([{"role": "assistant", "content": f"dataset answer {i}"}] if i else []) + [
            {"role": "user", "content": user}
        ]
    return messages


def test_every_turn_of_a_reasoning_model_under_a_template_that_drops_history_reasoning(tok, folder, tmp_path):
    """infer.turns: all with a thinking model whose template (Qwen3's way) renders an earlier answer's content only:
    each later turn's prompt holds the earlier answers without their reasoning, so merge keeps every turn a sequence
    of its own, each trained in the context it was generated in. A turn that calls a tool, or is aborted, ends its
    conversation there (nothing in the dataset answers the target's own call), counted."""

    def script(text):
        question = question_of(text)
        if question.startswith("abort"):
            return "cut off", "abort"
        return reasoning_model(text)

    ps = [
        Prompt(content_id(m, t), "chat", m, t)
        for m, t in [
            (chat_of("What is 2 + 2?", "And 3 + 3?", "And 4 + 4?"), None),
            (chat_of("Look up the capital of Peru.", "And of Chile?"), TOOLS),
            (chat_of("abort this one", "never asked"), None),
        ]
    ]
    spec = derive.spec_from_params("think", "hermes")
    sampling = Sampling(max_new_tokens=256, stop_token_ids=tuple(target.stop_ids(folder, tok)))
    gates = Gates(config.Gates(warmup=100, every=100, max_truncated=1.0, max_empty=1.0), True, derive.markup(tok))
    responses, report = InferRun(
        ScriptedEngine(tok, script), tok, sampling, spec, gates, Cache(tmp_path / "cache"), Plan({}, turns="all")
    ).run(ps)
    assert [r.id for r in responses] == [
        f"{ps[0].id}@1",
        f"{ps[0].id}@2",
        f"{ps[0].id}@3",
        f"{ps[1].id}@1",
        f"{ps[2].id}@1",
    ]
    assert report["turns"] == {"mode": "all", "answered": {1: 3, 2: 1, 3: 1}, "unanswered": 2, "ended_at_tool_call": 1}
    first, second = responses[0], responses[1]
    assert first.reasoning and first.content.strip() == "Here is my answer to: What is 2 + 2?<|im_end|>"
    history = tok.decode(second.prompt_ids, skip_special_tokens=False)
    assert "Here is my answer to: What is 2 + 2?" in history and first.reasoning not in history  # dropped
    assert "dataset answer" not in history
    write_jsonl(tmp_path / "responses.jsonl", [r for r in responses if r.finish_reason != "abort"])
    stats = merge.run(
        tmp_path / "responses.jsonl", tmp_path / "seq", tok, spec, target.end_of_turn_id(folder, tok), MERGE
    )
    assert stats["turns"] == {"joined": 0, "apart": 2}
    assert stats["train"]["samples"] + stats["valid"]["samples"] == 4
