"""hidden's agreement check on the embedded target: ``target_logprob`` is a bare float32 forward's log-softmax; answers
whose engine figures the same model computed pass (the measured |engine - target| printed with -s); figures of a
doctored model (final norm x 1.5: the same greedy ids) or offset ones stop the stage naming the sequences, publishing
nothing; ``warn`` warns and publishes, ``off`` checks nothing; a resumed run reports the same figures as a fresh one;
answers without figures fall back to the target's sampler (z scores on synthetic cases too); online training checks
the same way."""

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.model_sections import Agreement
from eaglepipe.dataset import sequences
from eaglepipe.drafter import sources, train
from eaglepipe.engines import Sampling
from eaglepipe.hidden import comparison, extract, fallback, hf_source, layout
from eaglepipe.hidden.comparison import Context

PARAMS = config.Hidden(layers="auto", dtype="bfloat16", batch_tokens=128, shard_tokens=100)
EOT = 2  # the embedded target's <|im_end|>
ANSWER = 20  # tokens per answer: the fallback judges records of 16 or more
NAN = float("nan")


@contextlib.contextmanager
def scaled_norm(model, factor: float):
    """The model with its final norm's weight times ``factor`` (every logit scaled: the same argmax), restored after."""
    weight = model.model.norm.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(factor)
    try:
        yield model
    finally:
        with torch.no_grad():
            weight.copy_(saved)


@torch.inference_mode()
def engine_answer(model, prompt: list[int], temperature: float = 0.0, seed: int = 0) -> tuple[list[int], list[float]]:
    """``ANSWER`` ids generated as the hf engine does (a KV cache, one token a step; greedy, or drawn at
    ``temperature``) and each one's raw figure: the float32 log-softmax of the logits it was picked from, rounded."""
    generator = torch.Generator().manual_seed(seed)
    out = model(input_ids=torch.tensor([prompt]), use_cache=True)
    ids, figures = [], []
    for _ in range(ANSWER):
        logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
        if temperature > 0:
            token = int(torch.multinomial(torch.softmax(logprobs / temperature, -1), 1, generator=generator))
        else:
            token = int(logprobs.argmax())
        ids.append(token)
        figures.append(round(float(logprobs[token]), 5))
        out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, figures


def prompts(n: int = 10) -> list[list[int]]:
    """``n`` seeded prompts of 8 to 15 ids."""
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(8, 16, (n,), generator=g).tolist()
    return [[1] + torch.randint(3, 5000, (length - 1,), generator=g).tolist() for length in lengths]


def answers(model, temperature: float = 0.0) -> list[tuple[list[int], list[int], list[float]]]:
    return [(p, *engine_answer(model, p, temperature, seed=i)) for i, p in enumerate(prompts())]


@pytest.fixture(scope="module")
def honest(model):
    return answers(model)


@pytest.fixture(scope="module")
def doctored(model):
    with scaled_norm(model, 1.5):
        return answers(model)


def policy(temperature: float = 0.0, engine_dtype: str | None = "float32") -> dict:
    """data/sequences' policy of answers the hf engine gave in ``engine_dtype`` (as merge read it from engine.json)."""
    sampling = Sampling(temperature=temperature, max_new_tokens=ANSWER, stop_token_ids=(EOT,)).to_json()
    return {"end_of_turn_id": EOT, "sampling": sampling, "engines": ["hf"], "engine_dtype": engine_dtype}


def write(folder, answered, temperature: float = 0.0, offset: float = 0.0, figures: bool = True) -> list:
    """data/sequences of prompt + answer with the engine's figures (plus ``offset``; none without ``figures``)."""
    items = []
    for i, (prompt, ids, engine) in enumerate(answered):
        logprob = [NAN] * len(prompt) + [x + offset for x in engine] if figures else None
        items.append(sequences.Sequence(f"r{i}", "s", prompt + ids, [0] * len(prompt) + [1] * len(ids), logprob))
    sequences.write(folder, {"train": items[:-2], "valid": items[-2:]}, shard_tokens=1000, policy=policy(temperature))
    return items


def hidden(tmp_path, model, params=PARAMS, name="out", cache="cache"):
    return extract.run(tmp_path / "seq", tmp_path / name, model, params, "fp", tmp_path / cache)


def test_head_figures_are_a_bare_forwards_log_softmax_taken_at_the_next_id(model):
    """``target_logprob[t]`` = log_softmax(logits[t - 1])[ids[t]] in float32, NaN at 0; ``top`` the argmax, in chunks
    of any size."""
    ids = torch.tensor(prompts(1)[0] + [42, 7, 99])
    with torch.inference_mode():
        logits = model(input_ids=ids[None]).logits[0].float()
        final = hf_source.forward_states(model, ids[None], [2, 15, 27])[1][0]
        for rows in (3, 512):
            top, target_logprob = hf_source.head_figures(model.get_output_embeddings(), final, ids, rows)
            want = torch.log_softmax(logits, -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            assert math.isnan(target_logprob[0]) and target_logprob.dtype == torch.float32
            torch.testing.assert_close(target_logprob[1:], want, rtol=1e-5, atol=1e-5)
            assert torch.equal(top, logits.argmax(-1))


def test_stored_target_logprob_matches_an_unbatched_forward(tmp_path, model, honest):
    write(tmp_path / "seq", honest)
    hidden(tmp_path, model)
    worst = 0.0
    for split in ("train", "valid"):
        for sample in layout.read(tmp_path / "out", split):
            ids = sample["input_ids"].long()
            with torch.inference_mode():
                want = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)[:-1]
            want = want.gather(-1, ids[1:, None])[:, 0]
            assert math.isnan(sample["target_logprob"][0])
            worst = max(worst, float((sample["target_logprob"][1:] - want).abs().max()))
    print(f"stored target_logprob against an unbatched float32 forward: max |difference| {worst:.2e}")
    assert worst < 1e-4


def test_figures_the_same_model_computed_pass_and_are_reported(tmp_path, model, honest):
    write(tmp_path / "seq", honest)
    got = hidden(tmp_path, model)["agreement"]
    print(f"hf-engine-like figures (KV cache, one token a step) against the store's: {json.dumps(got['logprobs'])}")
    assert got["verdict"] == "pass" and got["mode"] == "on" and got["engines"] == ["hf"]
    assert got["engine_dtype"] == got["target_dtype"] == "float32"
    assert got["sequences"] == got["sequences_with_engine_figures"] == 10
    assert got["logprobs"]["tokens"] == 10 * ANSWER and got["logprobs"]["mean_abs_diff"] < 1e-3
    assert got["logprobs"]["max_mean_abs_diff"] == comparison.AUTO_FLOAT32
    assert got["greedy"]["tokens"] == 10 * ANSWER and got["greedy"]["agreement"] >= 0.95
    assert got["fallback"] == "not applicable"


def test_a_doctored_models_figures_stop_the_stage_naming_the_sequences(tmp_path, model, doctored, honest):
    """The final norm x 1.5: the greedy ids are the target's, only the figures tell; the stage stops in its first
    shards, keeps them, and publishes nothing."""
    assert [ids for _, ids, _ in doctored] == [ids for _, ids, _ in honest]
    write(tmp_path / "seq", doctored)
    with pytest.raises(UserError) as stopped:
        hidden(tmp_path, model)
    text = str(stopped.value)
    assert "the answers' engine (hf) and the states' model disagree" in text
    assert f"max_mean_abs_diff {comparison.AUTO_FLOAT32}" in text
    assert "Likely causes" in text and "first over the tolerance at position" in text
    assert sum(f"r{i} ({len(p) + ANSWER} tokens):" in text for i, (p, _, _) in enumerate(doctored)) == 5
    assert not (tmp_path / "out").exists()
    (store,) = (tmp_path / "cache").iterdir()
    written = list(store.glob("shard-*.safetensors"))
    assert written, "the shards written before the verdict stay: they are valid states"
    print(f"doctored norm: {text.splitlines()[0]}")


def test_offset_figures_warn_in_mode_warn_and_are_not_checked_in_mode_off(tmp_path, model, honest, caplog):
    write(tmp_path / "seq", honest, offset=-0.3)
    with pytest.raises(UserError, match=r"mean \|engine - target\| log-probability 0\.3"):
        hidden(tmp_path, model)
    warn = PARAMS.model_copy(update={"agreement": Agreement(mode="warn")})
    got = hidden(tmp_path, model, warn)["agreement"]
    assert got["verdict"] == "fail" and abs(got["logprobs"]["mean_abs_diff"] - 0.3) < 1e-3
    assert "disagree" in caplog.text and (tmp_path / "out" / "index.json").exists()
    off = PARAMS.model_copy(update={"agreement": Agreement(mode="off")})
    assert hidden(tmp_path, model, off, "out2")["agreement"] == {"mode": "off"}
    loose = PARAMS.model_copy(update={"agreement": Agreement(max_mean_abs_diff=0.5)})
    assert hidden(tmp_path, model, loose, "out3")["agreement"]["verdict"] == "pass"


def test_a_resumed_run_reports_the_figures_of_a_fresh_one(tmp_path, model, honest, monkeypatch):
    write(tmp_path / "seq", honest)
    real, calls = extract.extract_shard, []

    def interrupted(*args, **kwargs):
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(extract, "extract_shard", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hidden(tmp_path, model)
    monkeypatch.setattr(extract, "extract_shard", real)
    resumed = hidden(tmp_path, model)
    fresh = hidden(tmp_path, model, name="fresh", cache="fresh-cache")
    assert resumed["run"]["reused_shards"] == 1 and fresh["run"]["reused_shards"] == 0
    assert resumed["agreement"] == fresh["agreement"] and resumed["agreement"]["verdict"] == "pass"


def test_sequences_without_policy_or_figures_are_not_applicable_and_pass(tmp_path, model, honest):
    items = write(tmp_path / "unused", honest, figures=False)
    sequences.write(tmp_path / "seq", {"train": items[:3]}, shard_tokens=1000, policy="test")
    got = hidden(tmp_path, model)["agreement"]
    assert got["verdict"] == "not applicable" and got["logprobs"] == "not applicable"
    assert got["greedy"] == "not applicable" and got["fallback"] == "not applicable"


def test_greedy_answers_without_figures_are_checked_by_the_targets_argmax(tmp_path, model, honest):
    write(tmp_path / "seq", honest, figures=False)
    got = hidden(tmp_path, model)["agreement"]
    assert got["verdict"] == "pass" and got["logprobs"] == "not applicable" and got["greedy"]["agreement"] >= 0.95
    shuffled = [(p, ids[1:] + ids[:1], f) for p, ids, f in honest]  # no longer the target's greedy answers
    write(tmp_path / "seq2", shuffled, figures=False)
    with pytest.raises(UserError, match="greedy answers: .* below hidden.agreement.min_greedy_agreement 0.9"):
        extract.run(tmp_path / "seq2", tmp_path / "out2", model, PARAMS, "fp", tmp_path / "cache")


def test_sampled_answers_without_figures_fall_back_to_the_targets_sampler(tmp_path, model, honest):
    """Answers drawn from the target's own sampler at temperature 0.8 pass; its argmax every time under a policy at
    temperature 2 (answers that sampler would hardly give) stops the stage."""
    write(tmp_path / "seq", answers(model, 0.8), temperature=0.8, figures=False)
    got = hidden(tmp_path, model)["agreement"]
    print(f"fallback, answers drawn at temperature 0.8: {got['fallback']}")
    assert got["verdict"] == "pass" and got["greedy"] == "not applicable"
    assert got["fallback"]["sequences"] == got["fallback"]["judged"] == 10 and got["fallback"]["flagged"] == 0
    assert got["fallback"]["not_rechecked"] == 0 and got["fallback"]["outside_support"] == 0
    again = hidden(tmp_path, model, name="again")["agreement"]
    assert again["fallback"]["sequences"] == 0 and again["fallback"]["not_rechecked"] == 10, "reused: not re-checked"
    write(tmp_path / "seq", honest, temperature=2.0, figures=False)
    with pytest.raises(UserError, match=r"sampled answers without engine figures are unlikely") as stopped:
        hidden(tmp_path, model, cache="cache2")
    print(f"fallback, the argmax every time under temperature 2: {str(stopped.value).splitlines()[0]}")


def test_the_fallbacks_z_score_on_synthetic_distributions():
    """Tokens drawn from the sampler's own distribution give |z| of a standard normal; the argmax every time a large
    positive z; tokens top-k rules out are counted outside the support, not scored."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(400, 50, generator=g) * 2
    sampling = Sampling(temperature=0.7, top_k=10).to_json()
    q = fallback.sampler_probs(logits, sampling)
    assert torch.allclose(q.sum(-1), torch.ones(400)) and int((q > 0).sum(-1).max()) == 10
    drawn = torch.multinomial(q, 1, generator=g)[:, 0]
    sampled = fallback.score_rows(logits, drawn, sampling)
    assert sampled.tokens == 400 and sampled.outside == 0 and abs(sampled.z) < 4 and not sampled.flagged
    greedy = fallback.score_rows(logits, logits.argmax(-1), sampling)
    assert greedy.z > 10 and greedy.flagged
    ruled_out = fallback.score_rows(logits, logits.argmin(-1), sampling)
    assert ruled_out.outside == 400 and ruled_out.tokens == 0 and ruled_out.z is None and not ruled_out.flagged
    nucleus = Sampling(temperature=1.0, top_p=0.5, min_p=0.05).to_json()
    kept = fallback.sampler_probs(logits, nucleus) > 0
    probs = torch.softmax(logits, -1)
    assert kept[torch.arange(400), probs.argmax(-1)].all(), "the top token is always kept"
    assert (probs >= 0.05 * probs.amax(-1, keepdim=True))[kept].all(), "min-p"
    ranked = probs.sort(-1, descending=True).values
    assert torch.equal(kept.sum(-1), ((ranked.cumsum(-1) - ranked <= 0.5) & (ranked >= 0.05 * ranked[:, :1])).sum(-1))
    print(f"z: drawn {sampled.z:.2f}, argmax {greedy.z:.1f}")


def test_greedy_agreement_leaves_out_an_appended_end_of_turn():
    ctx = Context.of(Agreement(), policy(), "float32")
    stop = 0  # another stop id: merge appends the end-of-turn id after it
    ids = torch.tensor([1, 5, 6, 7, stop, EOT, 8, EOT])
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1]).bool()
    top = torch.tensor([9, 6, 7, stop, 4, 0, 3, 0])  # the target agrees but after the stop ids
    ctx = replace(ctx, sampling={**ctx.sampling, "stop_token_ids": [stop, EOT]})
    got = comparison.measure(ctx, sequences.Sequence("x", "s", ids, mask), top, torch.zeros(8))
    assert got.greedy.checked == 3 and got.greedy.agreed == 3  # positions 2, 3, 4; 5 and 7 are appended
    assert got.difference is None and got.fallback is None


def test_auto_tolerance_by_the_two_sides_dtypes():
    """The engine's dtype is the sequences' (merge's ``engine_dtype``, from infer's engine.json: test_merge.py)."""
    auto = Agreement()
    assert Context.of(auto, policy(), "float32").tolerance == comparison.AUTO_FLOAT32
    assert Context.of(auto, policy(), "float32").engine_dtype == "float32"
    assert Context.of(auto, policy(engine_dtype="bfloat16"), "float32").tolerance == comparison.AUTO_HALF
    assert Context.of(auto, policy(), "bfloat16").tolerance == comparison.AUTO_HALF
    assert Context.of(auto, policy(engine_dtype=None), "float32").tolerance == comparison.AUTO_HALF  # unknown
    merged_before = {k: v for k, v in policy().items() if k != "engine_dtype"}  # before merge read engine.json
    assert Context.of(auto, merged_before, "float32").engine_dtype is None
    assert Context.of(auto, "test", "float32").tolerance == comparison.AUTO_HALF  # no policy at all
    assert Context.of(Agreement(max_mean_abs_diff=0.2), policy(), "float32").tolerance == 0.2


def test_online_training_checks_the_sequences_it_computes_and_reports_the_figures(
    tmp_path, model, target_folder, honest, doctored
):
    write(tmp_path / "seq", honest)
    online = sources.Online(tmp_path / "seq", model, PARAMS)
    params = config.Train(epochs=1, draft_vocab_size=128, batch_tokens=512, warmup_steps=1)
    _, report, _ = train.run(online, target_folder, params, tmp_path / "checkpoints")
    got = report["run"]["agreement"]
    assert got["verdict"] == "pass" and got["sequences"] == 10 and got["logprobs"]["mean_abs_diff"] < 1e-3
    assert got["greedy"]["agreement"] >= 0.95
    write(tmp_path / "bad", doctored)
    bad = sources.Online(tmp_path / "bad", model, PARAMS)
    with pytest.raises(UserError, match=r"the answers' engine \(hf\) and the states' model disagree"):
        bad.states(sources.load_samples(tmp_path / "bad", "train", "all"))
