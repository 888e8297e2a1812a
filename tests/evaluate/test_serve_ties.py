"""The serve check's verdict on a difference (eaglepipe/evaluate/ties.py through serve.compare), with the real embedded
target and no server: an engine output that takes the target's second-best token where its two best are closest is a
numerics tie within serve.tie_margin (reported, passed) and a failure below it, named by prompt and token; one that
takes the second-best where the target is sure fails; a plain run that differs at the first token on every prompt is
another model; where every output agrees the target is never loaded."""

import json
from pathlib import Path

import pytest
import torch

from eaglepipe.core import config
from eaglepipe.evaluate import serve, ties
from eaglepipe.evaluate.decode import greedy
from eaglepipe.target import chat
from eaglepipe.target import model as target

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24
HELDOUT = (7, 0, 1)  # line 7's greedy output has a near-tie at token 9: 0.0054 nats between the target's two best
LAYERS = [2, 15, 27]


@pytest.fixture(scope="module")
def decoded(target_folder, tokenizer, model):
    """Three held-out prompts (HELDOUT) with evaluate's plain greedy outputs (float32 transformers) and, per output
    position, the target's margin between its two best tokens (one forward over the whole output)."""
    stops = target.stop_ids(target_folder, tokenizer)
    lines = (ROOT / "data/eval/heldout.jsonl").read_text().splitlines()
    rows, margins = [], []
    for index in HELDOUT:
        conversation = json.loads(lines[index])
        prompt_ids = chat.prompt_ids(tokenizer, conversation["messages"], conversation.get("tools"), {})
        output_ids = greedy(model, prompt_ids, NEW_TOKENS, stops)
        rows.append(record(index, prompt_ids, output_ids))
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids + output_ids[:-1]])
            logits = model(input_ids=ids, logits_to_keep=len(output_ids)).logits[0]
        top = torch.log_softmax(logits.float(), dim=-1).topk(2).values
        margins.append((top[:, 0] - top[:, 1]).tolist())
    return {"rows": rows, "margins": margins, "stops": stops}


def record(index: int, prompt_ids: list, output_ids: list) -> dict:
    """A line of evaluate's decoded file (evaluate.decoded_record) whose EAGLE run accepted no draft."""
    steps = len(output_ids) - 1
    return {
        "index": index,
        "category": "c",
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "eagle": {"steps": steps, "emitted": steps, "proposed": [steps], "accepted": [0], "layers": LAYERS},
    }


def engine_run(outputs: list, accepted: list | None = None) -> dict:
    """What serve.decode returns for ``outputs``: each request one verification step per token after the first,
    ``accepted[i]`` of them with one draft accepted (the others none)."""
    accepted = accepted or [0] * len(outputs)
    spec = []
    for output, hits in zip(outputs, accepted):
        steps = len(output) - 1 - hits
        spec.append(
            {"num_spec_steps": steps, "acceptance_histogram": [steps - hits, hits], "num_accepted_draft_tokens": hits}
        )
    counters = {
        "num_drafts": sum(s["num_spec_steps"] for s in spec),
        "num_draft_tokens": 0,
        "num_accepted_tokens": sum(accepted),
        "num_accepted_tokens_per_pos": [],
    }
    log = f"INFO Using auxiliary layers from speculative config: {tuple(LAYERS)}\n"
    return {"outputs": outputs, "spec": spec, "counters": counters, "seconds": 1.0, "tokens": 1, "log": log}


def taking_second(model, row: dict, token: int, stops) -> list:
    """The output an engine decodes when it takes the target's second-best token at ``token`` of ``row`` (evaluate's
    tokens before it) and greedy's after it."""
    prefix = row["output_ids"][:token]
    second = ties.top_two(model, row["prompt_ids"] + prefix).second
    rest = NEW_TOKENS - token - 1
    return prefix + [second] + (greedy(model, row["prompt_ids"] + prefix + [second], rest, stops) if rest else [])


def judge(model, tie_margin: float, loads: list | None = None) -> ties.Judge:
    """A judge whose loader returns the real target (and counts its calls in ``loads``)."""

    def load():
        if loads is not None:
            loads.append(1)
        return model

    return ties.Judge(load, tie_margin)


def tie_case(decoded, model) -> tuple[int, int, list, float]:
    """Prompt 0's position of the smallest margin, the engine output taking the second-best token there, and the
    margin the judge finds there."""
    row = decoded["rows"][0]
    token = min(range(len(row["output_ids"])), key=decoded["margins"][0].__getitem__)
    margin = ties.top_two(model, row["prompt_ids"] + row["output_ids"][:token]).margin
    return row["index"], token, taking_second(model, row, token, decoded["stops"]), margin


def test_a_difference_at_a_near_tie_within_the_margin_is_reported_and_passes(decoded, model):
    rows = decoded["rows"]
    prompt, token, output, margin = tie_case(decoded, model)
    default = config.Serve().tie_margin
    assert margin < default
    outputs = [output] + [r["output_ids"] for r in rows[1:]]
    # the drafter's run also accepted a draft on the prompt that went elsewhere: acceptance is compared on the others
    m = serve.compare(rows, engine_run(outputs, [3, 0, 0]), 0.01, 30, engine_run(outputs), judge(model, default))
    assert m["passed"] and not m["outputs_equal"], m
    assert sorted((w["prompt"], w["run"]) for w in m["mismatches"]) == [(prompt, "eagle"), (prompt, "plain")]
    for w in m["mismatches"]:
        assert w["tie"] and w["first_difference"] == token and w["margin"] == round(margin, 6)
        assert (w["best_token"], w["second_token"]) == (rows[0]["output_ids"][token], output[token])
        assert w["engine_token"] == output[token] and w["logprobs"][0] - w["logprobs"][1] == pytest.approx(
            margin, abs=1e-5
        )
    assert m["tie_margin"] == default and "another_model" not in m
    assert m["acceptance_length"] == m["evaluate_acceptance_length"] == 1.0


def test_the_same_difference_below_the_margin_fails_naming_prompt_and_token(decoded, model):
    rows = decoded["rows"]
    prompt, token, output, margin = tie_case(decoded, model)
    outputs = [output] + [r["output_ids"] for r in rows[1:]]
    m = serve.compare(rows, engine_run(outputs), 0.01, 30, engine_run(outputs), judge(model, margin / 2))
    assert not m["passed"] and not any(w["tie"] for w in m["mismatches"])
    message = serve.failure(m, "metrics/serve.json")
    assert f"prompt {prompt} (vLLM without the drafter) at token {token}" in message, message
    assert f"{m['mismatches'][0]['margin']:.4f} nats" in message and "another model" not in message


def test_a_difference_where_the_target_is_sure_fails(decoded, model):
    rows = decoded["rows"]
    row = rows[1]
    token = max(range(len(row["output_ids"])), key=decoded["margins"][1].__getitem__)
    output = taking_second(model, row, token, decoded["stops"])
    outputs = [rows[0]["output_ids"], output, rows[2]["output_ids"]]
    default = config.Serve().tie_margin
    m = serve.compare(rows, engine_run(outputs), 0.01, 30, engine_run(outputs), judge(model, default))
    assert not m["passed"] and [w["tie"] for w in m["mismatches"]] == [False, False]
    assert m["mismatches"][0]["margin"] > 1.0 > default
    assert f"prompt {row['index']} (vLLM without the drafter) at token {token}" in serve.failure(m, "r.json")


def test_a_plain_run_that_differs_at_the_first_token_everywhere_is_another_model(decoded, model):
    # vLLM 0.32 with an unloaded tied head: token 0 repeated on every prompt
    rows = decoded["rows"]
    outputs = [[0] * len(r["output_ids"]) for r in rows]
    m = serve.compare(rows, engine_run(outputs), 0.01, 30, engine_run(outputs), judge(model, 0.01))
    assert not m["passed"] and {w["first_difference"] for w in m["mismatches"]} == {0}
    message = serve.failure(m, "metrics/serve.json")
    assert "at their first token on 3 of 3 prompts" in message, message
    assert "vLLM computes another model than transformers for this target" in message
    assert "infer's answers, if vLLM generated them" in message and "not the drafter's fault" in message


def test_a_late_difference_on_one_prompt_is_not_another_model(decoded, model):
    rows = decoded["rows"]
    outputs = [r["output_ids"] for r in rows]
    outputs[2] = outputs[2][:-1]  # one output ends a token early: no token to judge, so no tie
    m = serve.compare(rows, engine_run(outputs), 0.01, 30, engine_run(outputs), judge(model, 0.01))
    assert not m["passed"] and "another_model" not in m
    assert m["mismatches"][0]["engine_token"] is None and "margin" not in m["mismatches"][0]
    assert "one output ends where the other goes on" in serve.failure(m, "r.json")


def test_where_every_output_agrees_the_target_is_not_loaded_and_the_metrics_are_unchanged(decoded, model):
    rows = decoded["rows"]
    outputs = [r["output_ids"] for r in rows]
    loads = []
    m = serve.compare(rows, engine_run(outputs), 0.01, 30, None, judge(model, 0.01, loads))
    assert loads == [] and m == serve.compare(rows, engine_run(outputs), 0.01, 30)
    assert m["passed"] and "tie_margin" not in m


def test_the_tie_margin_is_a_validated_param_with_the_same_default_in_params_yaml():
    assert config.load(ROOT / "params.yaml").serve.tie_margin == config.Serve().tie_margin == 0.01
    for bad in (-0.01, 2.0):
        with pytest.raises(ValueError, match="tie_margin"):
            config.Serve(tie_margin=bad)
