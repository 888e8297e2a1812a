"""infer: token-exact records, resumable after Ctrl-C or kill -9, incremental, never mixing fingerprints."""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import (
    Prompt,
    content_id,
    prompt_of,
    read_jsonl,
    response_from_json,
    to_json,
    write_jsonl,
)
from eaglepipe.engines import Failure, Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.run import InferRun, Limits, Plan, fingerprint
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive, turns

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 plus 2?",
    "Say hello in Spanish.",
    "Name a planet.",
    "What do bees make?",
    "Spell 'cat' backwards.",
    "What is the opposite of hot?",
]
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


def test_records_are_token_exact(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:3])
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path)
    assert [r.id for r in responses] == [p.id for p in ps]
    stops = target.stop_ids(target_folder, tokenizer)
    for p, r in zip(ps, responses):
        assert r.prompt_ids == chat.prompt_ids(tokenizer, p.messages)
        assert r.text == tokenizer.decode(r.output_ids, skip_special_tokens=False)
        assert r.content == r.text and r.reasoning == ""
        # the same ids as a bare, unbatched greedy model.generate
        bare = model.generate(
            torch.tensor([r.prompt_ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(r.prompt_ids) :].tolist()
        assert r.output_ids == bare[: len(r.output_ids)]
        assert r.finish_reason == ("stop" if r.output_ids[-1] in stops else "length")
    assert report["tokens_out"] == sum(len(r.output_ids) for r in responses)
    assert sum(report["finish_reason"].values()) == 3


def test_rows_leaving_the_batch_keep_every_answer_exact(model, tokenizer, target_folder, tmp_path):
    """Eight prompts in one batch finish at different steps (rows leave as they finish); each answer is still the
    one the prompt gets alone."""
    ps = prompts(QUESTIONS)
    batched, _ = run(ps, model, tokenizer, target_folder, tmp_path / "a", Knobs(max_new_tokens=16, batch_size=8))
    assert len({len(r.output_ids) for r in batched}) > 1, "the rows should finish at different steps"
    alone, _ = run(ps, model, tokenizer, target_folder, tmp_path / "b", Knobs(max_new_tokens=16, batch_size=1))
    assert [r.output_ids for r in batched] == [r.output_ids for r in alone]


@pytest.mark.slow
def test_samples_per_prompt_are_distinct_records_and_grow_incrementally(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:3])
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(samples=2, temperature=1.0))
    assert [r.id for r in responses] == [i for p in ps for i in (p.id, f"{p.id}.1")]
    assert [r.sample for r in responses] == [0, 1] * 3
    assert [prompt_of(r.id) for r in responses] == [p.id for p in ps for _ in (0, 1)]
    assert report["prompts"] == 3 and report["answers"] == 6
    assert any(a.output_ids != b.output_ids for a, b in zip(responses[::2], responses[1::2]))
    again, report = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(samples=3, temperature=1.0))
    assert report["run"]["generated"] == 3  # only the third answer of each prompt
    assert [r.output_ids for r in again if r.sample < 2] == [r.output_ids for r in responses]
    with pytest.raises(config.ConfigError, match="need temperature > 0"):  # refused before any model is loaded
        config.parse({"prepare": {"sources": []}, "infer": {"samples": 2, "temperature": 0.0}})


def test_adding_a_source_generates_only_its_prompts(model, tokenizer, target_folder, tmp_path):
    first = prompts(QUESTIONS[:3], "a")
    _, report = run(first, model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 3
    responses, report = run(first + prompts(QUESTIONS[3:5], "b"), model, tokenizer, target_folder, tmp_path)
    assert report["run"]["generated"] == 2
    assert len(responses) == 5 and report["per_source"] == {"a": 3, "b": 2}


@pytest.mark.slow
def test_a_sampled_answer_depends_on_its_record_alone(model, tokenizer, target_folder, tmp_path):
    """Under sampling, each answer is a function of the model, the sampling params, the seed and its record id:
    the same bytes whatever the batch size, and when the prompts come in two increments."""
    ps = prompts(QUESTIONS)
    kw = {"max_new_tokens": 12, "samples": 2, "temperature": 0.8}
    whole, _ = run(ps, model, tokenizer, target_folder, tmp_path / "a", Knobs(batch_size=8, **kw))
    other, _ = run(ps, model, tokenizer, target_folder, tmp_path / "b", Knobs(batch_size=3, **kw))
    run(ps[:5], model, tokenizer, target_folder, tmp_path / "c", Knobs(batch_size=4, **kw))
    grown, report = run(ps, model, tokenizer, target_folder, tmp_path / "c", Knobs(batch_size=4, **kw))
    assert report["run"]["generated"] == 6
    as_bytes = lambda rs: [json.dumps(to_json(r)) for r in rs]  # noqa: E731
    assert as_bytes(whole) == as_bytes(other) == as_bytes(grown)
    assert len({tuple(r.output_ids) for r in whole}) > len(ps)  # the two samples of a prompt differ


def test_a_poison_record_never_takes_its_batch_mates_down(model, tokenizer, target_folder):
    good = [chat.prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:5]]
    poison = good[2][:-1] + [model.config.vocab_size + 7]  # an id the embedding does not have
    batch = good[:2] + [poison] + good[2:]
    sampling = Sampling(max_new_tokens=8, stop_token_ids=tuple(target.stop_ids(target_folder, tokenizer)))
    engine = HFEngine(model, tokenizer.pad_token_id, batch_size=6)
    outs = dict(engine.stream(batch, sampling, [f"r{i}" for i in range(len(batch))]))
    assert sorted(outs) == list(range(6))
    assert [i for i, o in outs.items() if isinstance(o, Failure)] == [2] and "IndexError" in outs[2].reason
    alone = HFEngine(model, tokenizer.pad_token_id, batch_size=1)
    for i in (0, 1, 3, 4, 5):
        assert outs[i].output_ids == next(alone.stream([batch[i]], sampling, [f"r{i}"]))[1].output_ids


def test_a_token_budget_splits_long_prompts_into_smaller_batches(model, tokenizer, target_folder):
    """batch_tokens bounds rows x (longest prompt + max_new_tokens): a long chat runs in a smaller batch than short
    ones, and every answer is the one it gives alone."""
    short = [chat.prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    long = chat.prompt_ids(tokenizer, [{"role": "user", "content": " ".join(QUESTIONS * 6)}])
    prompts = short + [long]
    sampling = Sampling(max_new_tokens=4, stop_token_ids=tuple(target.stop_ids(target_folder, tokenizer)))
    budget = 2 * (len(long) + 4)

    class Recording(HFEngine):
        def isolated(self, batch, *args):
            sizes.append([len(prompts[i]) for i in batch])
            yield from super().isolated(batch, *args)

    sizes = []
    outs = dict(
        Recording(model, tokenizer.pad_token_id, batch_size=8, batch_tokens=budget).stream(
            prompts, sampling, [f"r{i}" for i in range(5)]
        )
    )
    assert len(sizes) > 1 and all(len(b) * (max(b) + 4) <= budget for b in sizes)
    assert sizes[0][0] == len(long) and sum(map(len, sizes)) == 5
    alone = HFEngine(model, tokenizer.pad_token_id, batch_size=1)
    for i, ids in enumerate(prompts):
        assert outs[i].output_ids == next(alone.stream([ids], sampling, [f"r{i}"]))[1].output_ids


def test_prompts_that_cannot_train_get_no_generation(model, tokenizer, target_folder, tmp_path):
    """A 5 MB turn (beyond the target's context), a 500-turn conversation and a prompt longer than merge.max_length
    are left out before any generation under skip, counted with their ids; under fail the first is an error naming
    the prompts file's line, the source and the lengths."""
    huge = Prompt("a" * 16, "big", [{"role": "user", "content": "lorem ipsum dolor sit amet " * 200_000}])
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} of a long chat"} for i in range(499)]
    long_chat = Prompt("b" * 16, "chat", turns)
    wordy = Prompt("c" * 16, "code", [{"role": "user", "content": "explain this code: " + "x = x + 1; " * 300}])
    ps = [*prompts(QUESTIONS[:2]), huge, long_chat, wordy]
    context = target.context_length(target_folder)
    skip = Limits(context, 1024, "skip", "prompts.jsonl")
    engine = HFEngine(model, tokenizer.pad_token_id, 4)
    sampling = Sampling(max_new_tokens=8, stop_token_ids=tuple(target.stop_ids(target_folder, tokenizer)))
    cache = Cache(tmp_path / "skip")
    responses, report = InferRun(
        engine,
        tokenizer,
        sampling,
        derive.spec_from_params("none"),
        Gates(config.Gates(**GATES), False),
        cache,
        Plan({}, limits=skip),
    ).run(ps)
    assert [r.id for r in responses] == [p.id for p in ps[:2]]
    assert report["left_out_ids"] == {"exceeds_context": [huge.id], "no_room_in_max_length": [long_chat.id, wordy.id]}
    assert report["left_out"] == {"exceeds_context": 1, "no_room_in_max_length": 2} and report["run"]["generated"] == 2
    with pytest.raises(
        UserError,
        match=rf"prompts.jsonl:3: prompt {huge.id} of source big: \d+ prompt tokens \+ "
        rf"infer.max_new_tokens 8 exceed the target's context of {context}",
    ):
        InferRun(
            engine,
            tokenizer,
            sampling,
            derive.spec_from_params("none"),
            Gates(config.Gates(**GATES), False),
            Cache(tmp_path / "fail"),
            Plan({}, limits=Limits(context, 1024, "fail", "prompts.jsonl")),
        ).run(ps)
    assert not (tmp_path / "fail" / "generations.jsonl").exists()  # nothing was generated


def test_other_params_never_reuse_a_cache(model, tokenizer, target_folder, tmp_path):
    ps = prompts(QUESTIONS[:2])
    run(ps, model, tokenizer, target_folder, tmp_path, Knobs(max_new_tokens=6))
    _, report = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(max_new_tokens=7))
    assert report["run"]["generated"] == 2
    assert len(list(tmp_path.iterdir())) == 2


# ---------------------------------------------------------------------------------------------- every turn answered
def chats():
    """A three-turn conversation (the dataset's answers in it), a two-turn one whose first answer calls a tool, and a
    single-turn prompt."""
    three = [
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "DATASET ANSWER ONE"},
        {"role": "user", "content": "Name another one."},
        {"role": "assistant", "content": "DATASET TWO"},
        {"role": "user", "content": "Which is larger?"},
    ]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    tool = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "assistant", "content": "DATASET SUN"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    return [Prompt(content_id(m, None), "t", m) for m in (three, tool)] + prompts(QUESTIONS[:1])


def test_every_turn_is_answered_after_the_targets_own_earlier_answers(model, tokenizer, target_folder, tmp_path):
    ps = chats()
    responses, report = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(turns="all"))
    assert [(r.id, r.turn) for r in responses] == [
        (f"{ps[0].id}@1", 1),
        (f"{ps[0].id}@2", 2),
        (f"{ps[0].id}@3", 3),
        (f"{ps[1].id}@1", 1),
        (f"{ps[1].id}@2", 2),
        (f"{ps[2].id}@1", 1),
    ]
    stops = target.stop_ids(target_folder, tokenizer)
    by_id = {r.id: r for r in responses}
    for p in ps:
        asks, answers = turns.asks(p.messages), []
        for t in range(1, len(asks) + 1):
            r = by_id[f"{p.id}@{t}"]
            assert r.prompt_ids == chat.prompt_ids(tokenizer, turns.interleave(asks, answers))
            answers.append(derive.answer_message(tokenizer, r.prompt_ids, r.output_ids, NONE, stops))
            assert answers[-1]["content"] and answers[-1]["content"] in r.text
    text = tokenizer.decode(by_id[f"{ps[0].id}@3"].prompt_ids)
    assert "DATASET" not in text and by_id[f"{ps[0].id}@1"].content.removesuffix("<|im_end|>") in text
    tool_turn = tokenizer.decode(by_id[f"{ps[1].id}@1"].prompt_ids)  # the call and its result stay, as context
    assert "sunny" in tool_turn and "DATASET SUN" not in tool_turn
    assert report["turns"] == {"mode": "all", "answered": {1: 3, 2: 2, 3: 1}, "unanswered": 0, "ended_at_tool_call": 0}
    _, again = run(ps, model, tokenizer, target_folder, tmp_path, Knobs(turns="last"))  # another cache: nothing shared
    assert again["run"]["generated"] == 3 and "turns" not in again


def test_a_conversation_cut_after_turn_2_resumes_at_turn_3(model, tokenizer, target_folder, tmp_path):
    """The cache as a kill after turn 2 leaves it (every finished answer is fsync'd before the next starts): the
    rerun generates turn 3 only and publishes what an uninterrupted run does."""
    ps = chats()
    full, _ = run(ps, model, tokenizer, target_folder, tmp_path / "full", Knobs(turns="all", temperature=0.8))
    run(ps, model, tokenizer, target_folder, tmp_path / "cut", Knobs(turns="all", temperature=0.8))
    cache = next((tmp_path / "cut").glob("*/generations.jsonl"))
    lines = cache.read_text().splitlines()
    cache.write_text("".join(line + "\n" for line in lines if json.loads(line)["id"] != f"{ps[0].id}@3"))
    resumed, report = run(ps, model, tokenizer, target_folder, tmp_path / "cut", Knobs(turns="all", temperature=0.8))
    assert report["run"]["generated"] == 1
    assert [to_json(r) for r in resumed] == [to_json(r) for r in full]


@pytest.mark.parametrize("template, joined", [(None, True), ("rewrites history", False)])
def test_turns_share_a_training_sequence_only_where_the_ids_extend(
    model, tokenizer, target_folder, tmp_path, template, joined
):
    """SmolLM's template renders the target's answers back to the ids it generated: merge joins a conversation's
    turns into one sequence with a masked segment per turn. A template that rewrites history (here, every earlier
    answer shown as its length) cannot: each turn is its own sequence. Either way every masked token is an output
    id, in the context it was generated in."""
    from copy import deepcopy

    from eaglepipe.dataset import merge, sequences

    tok = deepcopy(tokenizer)
    if template:
        tok.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
            "[an answer of {{ m.content | length }} characters]"
            "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    ps = chats()[:1]
    responses, _ = run(ps, model, tok, target_folder, tmp_path / "cache", Knobs(turns="all", max_new_tokens=16))
    write_jsonl(tmp_path / "responses.jsonl", responses)
    eot = target.end_of_turn_id(target_folder, tokenizer)
    stats = merge.run(
        tmp_path / "responses.jsonl",
        tmp_path / "seq",
        tok,
        NONE,
        eot,
        config.Merge(valid_fraction=0.0, max_length=1024),
    )
    seqs = list(sequences.read(tmp_path / "seq", "train"))
    by_id = {r.id: r for r in responses}
    if joined:
        assert stats["turns"] == {"joined": 2, "apart": 0} and [s[0] for s in seqs] == [f"{ps[0].id}@3"]
    else:
        assert stats["turns"] == {"joined": 0, "apart": 2} and len(seqs) == 3
    for rid, _, ids, mask in seqs:
        last = by_id[rid]
        assert ids.tolist() == last.prompt_ids + last.output_ids
        covered = [r for r in responses if r.turn <= last.turn] if joined else [last]
        assert ids[mask.bool()].tolist() == [t for r in covered for t in r.output_ids]


def write_params(tmp_path, **infer_overrides):
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["infer"].update(
        {"engine": "hf", "batch_size": 1, "max_new_tokens": 24, "samples": 1, "temperature": 0.0, **infer_overrides}
    )
    params["infer"]["gates"].update(GATES)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    return path


def stage(tmp_path, params, name="out"):
    return [
        sys.executable,
        str(ROOT / "stages/infer.py"),
        "--params",
        str(params),
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--out",
        str(tmp_path / name),
        "--report",
        str(tmp_path / "report.json"),
        "--timings",
        str(tmp_path / "timings.json"),
        "--cache",
        str(tmp_path / f"cache-{name}"),
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_interrupted_run_resumes_with_every_record_once(tmp_path, sig):
    """Under sampling, a run interrupted and resumed publishes the very bytes an uninterrupted run publishes."""
    ps = prompts(QUESTIONS)
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    params = write_params(tmp_path, batch_size=4, samples=2, temperature=0.8)
    cmd = stage(tmp_path, params)
    # A shell running the tests in the background leaves SIGINT ignored in its children; a user's Ctrl-C is not.
    restore_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=restore_sigint)
    deadline = time.time() + 120
    cache_file = None
    while time.time() < deadline and proc.poll() is None:  # wait until some, not all, records are in the cache
        files = list((tmp_path / "cache-out").glob("*/generations.jsonl"))
        if files and 2 <= len(files[0].read_text().splitlines()) <= len(ps):  # at most half of the 2 x 8 answers
            cache_file = files[0]
            break
        time.sleep(0.05)
    assert cache_file is not None, "the stage never reached the middle of its run"
    os.kill(proc.pid, sig)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert not (tmp_path / "out" / "responses.jsonl").exists()
    done_before = len({json.loads(line)["id"] for line in cache_file.read_text().splitlines() if line.endswith("}")})

    subprocess.run(cmd, check=True, capture_output=True)
    records = [response_from_json(obj) for _, obj in read_jsonl(tmp_path / "out" / "responses.jsonl")]
    assert sorted(r.id for r in records) == sorted(i for p in ps for i in (p.id, f"{p.id}.1"))
    timings = json.loads((tmp_path / "timings.json").read_text())
    assert timings["generated"] == 2 * len(ps) - done_before
    subprocess.run(stage(tmp_path, params, "uninterrupted"), check=True, capture_output=True)
    published = (tmp_path / "out" / "responses.jsonl").read_bytes()
    assert published == (tmp_path / "uninterrupted" / "responses.jsonl").read_bytes()


@pytest.mark.e2e
def test_the_stage_checks_the_limits_before_generating(tmp_path):
    """The real stage on a prompt too long for merge.max_length: one line naming it under fail; left out and counted
    under skip, the other prompts generated."""
    long_prompt = [{"role": "user", "content": "Summarise: " + "the cat sat on the mat. " * 40}]
    ps = [*prompts(QUESTIONS[:2]), Prompt(content_id(long_prompt, None), "wordy", long_prompt)]
    write_jsonl(tmp_path / "prompts.jsonl", ps)
    for on_error in ("fail", "skip"):
        params = yaml.safe_load(write_params(tmp_path, max_new_tokens=4, on_error=on_error).read_text())
        params["merge"]["max_length"] = 64
        (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
        out = subprocess.run(stage(tmp_path, tmp_path / "params.yaml", on_error), capture_output=True, text=True)
        if on_error == "fail":
            assert out.returncode == 1, out.stderr
            assert (
                out.stderr.strip()
                .splitlines()[-1]
                .startswith(f"Error: {tmp_path / 'prompts.jsonl'}:3: prompt {ps[2].id} of source wordy: ")
            ), out.stderr
            assert "leave no room for an answer within merge.max_length 64" in out.stderr
            assert not list((tmp_path / "cache-fail").glob("*/generations.jsonl"))  # nothing generated
        else:
            assert out.returncode == 0, out.stderr
            report = json.loads((tmp_path / "report.json").read_text())
            assert report["left_out"] == {"no_room_in_max_length": 1} and report["completions"] == 2
            assert report["left_out_ids"] == {"no_room_in_max_length": [ps[2].id]}


def test_hf_engine_ignores_sampling_defaults_of_the_model_folder(target_folder, tokenizer, tmp_path):
    """Only the explicit sampling params count: a generation_config.json with a repetition penalty and a top_k
    (which transformers would otherwise apply) changes nothing."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(target_folder, folder)
    gen_config = json.loads((folder / "generation_config.json").read_text())
    gen_config.update(repetition_penalty=1.8, top_k=3, no_repeat_ngram_size=2)
    (folder / "generation_config.json").write_text(json.dumps(gen_config))
    ids = [chat.prompt_ids(tokenizer, [{"role": "user", "content": "Write a haiku about rain."}])]
    sampling = Sampling(max_new_tokens=24, stop_token_ids=(tokenizer.eos_token_id,))
    plain = next(HFEngine(target.load_model(target_folder), tokenizer.pad_token_id).stream(ids, sampling, ["a"]))[1]
    tweaked = next(HFEngine(target.load_model(folder), tokenizer.pad_token_id).stream(ids, sampling, ["a"]))[1]
    assert tweaked.output_ids == plain.output_ids


def test_sampling_filters_follow_sglang():
    from eaglepipe.engines.hf import pick

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    top = logits.argmax(-1)
    rngs = lambda seed: [torch.Generator().manual_seed(seed + row) for row in range(4)]  # noqa: E731
    draw = lambda **kw: pick(logits, Sampling(temperature=1.0, **kw), rngs(1))  # noqa: E731
    for only_the_top in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        assert torch.equal(draw(**only_the_top), top), only_the_top
    assert torch.equal(draw(), draw())  # seeded
    probs = torch.softmax(logits, -1)
    for _ in range(20):  # top_k=3 only ever draws among the three best; top_p=0.5 among the nucleus
        seed = rngs(_ * 4)
        picked = pick(logits, Sampling(temperature=1.0, top_k=3), seed)
        assert all(p in row for p, row in zip(picked.tolist(), logits.topk(3).indices.tolist()))
        picked = pick(logits, Sampling(temperature=1.0, top_p=0.5), seed)
        sorted_probs, order = probs.sort(-1, descending=True)
        for row, p in enumerate(picked.tolist()):
            rank = order[row].tolist().index(p)
            assert sorted_probs[row, :rank].sum() <= 0.5
    assert torch.equal(pick(logits, Sampling(), None), top)  # temperature 0: greedy
    alone = [pick(logits[i : i + 1], Sampling(temperature=1.0), rngs(7)[i : i + 1]) for i in range(4)]
    assert torch.equal(torch.cat(alone), pick(logits, Sampling(temperature=1.0), rngs(7)))  # batch mates don't matter
