"""infer: token-exact records, incremental, never mixing fingerprints; batches, budgets and prompts that cannot train;
the hf engine's sampling. Every turn answered is in test_infer_turns.py, the stage resumable after Ctrl-C or kill -9
in test_infer_stage.py."""

import json

import pytest
import torch
from infer_helpers import GATES, QUESTIONS, Knobs, prompts, run, same_but_figures

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import Prompt, prompt_of, to_json
from eaglepipe.engines import Failure, Sampling
from eaglepipe.engines.hf import HFEngine
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.run import InferRun, Limits, Plan
from eaglepipe.target import chat
from eaglepipe.target import model as target
from eaglepipe.text import derive


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
    the same bytes whatever the batch size, and when the prompts come in two increments (but for the last decimals
    of the engine's log-probabilities, which other batch mates move)."""
    ps = prompts(QUESTIONS)
    kw = {"max_new_tokens": 12, "samples": 2, "temperature": 0.8}
    whole, _ = run(ps, model, tokenizer, target_folder, tmp_path / "a", Knobs(batch_size=8, **kw))
    other, _ = run(ps, model, tokenizer, target_folder, tmp_path / "b", Knobs(batch_size=3, **kw))
    run(ps[:5], model, tokenizer, target_folder, tmp_path / "c", Knobs(batch_size=4, **kw))
    grown, report = run(ps, model, tokenizer, target_folder, tmp_path / "c", Knobs(batch_size=4, **kw))
    assert report["run"]["generated"] == 6
    same_but_figures([to_json(r) for r in other], [to_json(r) for r in whole])  # the figures to within 1e-4
    same_but_figures([to_json(r) for r in grown], [to_json(r) for r in whole])
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
