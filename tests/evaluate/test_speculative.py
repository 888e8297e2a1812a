"""Decoding loops: plain greedy is the target's greedy; speculative decoding is lossless with any drafter (n-gram,
oracle, always-wrong, noisy, an EAGLE drafter); acceptance bookkeeping on hand-built cases; the EAGLE drafter's
incremental cache equals recomputing it from scratch."""

import pytest
import torch

from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.evaluate import decode
from eaglepipe.target import chat
from eaglepipe.target import model as target

PROMPTS = [
    [{"role": "user", "content": "Count from 1 to 40, separated by commas."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Single-token decoding gains nothing from a second thread and loses a lot when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stops(target_folder, tokenizer):
    return target.stop_ids(target_folder, tokenizer)


@pytest.fixture(scope="module")
def cases(tokenizer, model, stops):
    """(prompt ids, plain greedy output) for each prompt, max 16 new tokens."""
    out = []
    for messages in PROMPTS:
        ids = chat.prompt_ids(tokenizer, messages)
        out.append((ids, decode.greedy(model, ids, 16, stops)))
    return out


class Oracle:
    """Proposes the target's own greedy continuation (known in advance); ``wrong`` positions are corrupted."""

    needs_hidden, layers = False, ()

    def __init__(self, plain, vocab, wrong=lambda step, i: False):
        self.plain, self.vocab, self.wrong = plain, vocab, wrong
        self.done, self.step, self.last = 0, 0, []

    def reset(self, prompt_ids, aux, next_token):
        assert next_token == self.plain[0]
        self.done, self.step = 1, 0

    def propose(self, k):
        want = self.plain[self.done : self.done + k]
        want += [0] * (k - len(want))
        self.last = [(t + 1) % self.vocab if self.wrong(self.step, i) else t for i, t in enumerate(want)]
        self.step += 1
        return list(self.last)

    def accept(self, n, aux, next_token):
        assert self.last[:n] == self.plain[self.done : self.done + n]
        self.done += n + 1
        assert self.plain[self.done - 1] == next_token


def test_plain_greedy_equals_hf_generate(model, cases, stops):
    ids, plain = cases[1]
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=stops, pad_token_id=stops[0]
        )
    assert out[0, len(ids) :].tolist() == plain


def test_ngram_drafting_is_lossless(model, cases, stops):
    stats = decode.Stats()
    for ids, plain in cases:
        assert decode.speculative(model, decode.NgramDrafter(), ids, 16, stops, 3, stats) == plain
    assert stats.steps > 0 and stats.acceptance_length >= 1.0
    assert stats.accepted[0] > 0, "counting 1..40 repeats n-grams: some drafts are accepted"


@pytest.mark.parametrize("num_steps,max_new", [(3, 40), (1, 24), pytest.param(5, 40, marks=pytest.mark.slow)])
def test_ngram_replay_gives_the_counts_of_decoding(model, tokenizer, stops, num_steps, max_new):
    """The n-gram baseline replayed from the plain greedy output counts exactly what decoding with the target does:
    steps, tokens, per-position proposals and acceptances, through stop tokens and max_new_tokens cuts."""
    stopped = 0
    for messages in PROMPTS:
        ids = chat.prompt_ids(tokenizer, messages)
        plain = decode.greedy(model, ids, max_new, stops)
        stopped += plain[-1] in stops
        decoded, replayed = decode.Stats(), decode.Stats()
        assert decode.speculative(model, decode.NgramDrafter(3, 1), ids, max_new, stops, num_steps, decoded) == plain
        assert decode.replay(decode.NgramDrafter(3, 1), ids, plain, max_new, stops, num_steps, replayed) == plain
        assert (replayed.steps, replayed.emitted, replayed.tokens, replayed.proposed, replayed.accepted) == (
            decoded.steps,
            decoded.emitted,
            decoded.tokens,
            decoded.proposed,
            decoded.accepted,
        )
        assert decoded.steps > 0
    assert stopped, "one answer ends on a stop token inside max_new_tokens"


@pytest.mark.parametrize("max_new", [8, pytest.param(40, marks=pytest.mark.slow)])
def test_greedy_check_accepts_the_greedy_output_and_finds_where_another_departs(model, tokenizer, stops, max_new):
    """One forward tells the plain greedy output from any other: a changed token, an answer cut short, one that
    runs past its stop id or past max_new_tokens."""
    for messages in PROMPTS:
        ids = chat.prompt_ids(tokenizer, messages)
        plain = decode.greedy(model, ids, max_new, stops)
        assert decode.greedy_check(model, ids, plain, max_new, stops) is None
        for j in {0, len(plain) // 2, len(plain) - 1}:
            changed = plain[:j] + [(plain[j] + 1) % model.config.vocab_size] + plain[j + 1 :]
            assert decode.greedy_check(model, ids, changed, max_new, stops) == j
        if len(plain) > 1:
            assert decode.greedy_check(model, ids, plain[:-1], max_new, stops) == len(plain) - 1
        longer = decode.greedy(model, ids, max_new + 4, stops)
        if longer != plain:  # greedy went on past max_new_tokens
            assert decode.greedy_check(model, ids, longer, max_new, stops) == max_new
    ids = chat.prompt_ids(tokenizer, PROMPTS[1])
    plain = decode.greedy(model, ids, 40, stops)
    assert plain[-1] in stops, "the short answer ends on a stop id"
    past = plain + decode.greedy(model, ids + plain, 3, [])  # what the target says after its stop id
    assert decode.greedy_check(model, ids, past, 40, stops) == len(plain)


def test_replay_refuses_a_drafter_that_reads_hidden_states(model):
    with pytest.raises(ValueError, match="hidden states"):
        decode.replay(decode.EagleDrafter(small_drafter(model)), [1, 2], [3, 4], 4, [], 3)


@pytest.mark.parametrize("num_steps", [1, 3])
def test_oracle_gives_num_steps_plus_one_and_wrong_gives_one(model, tokenizer, stops, num_steps):
    ids = chat.prompt_ids(tokenizer, PROMPTS[0])
    max_new = 1 + (num_steps + 1) * 3  # the prefill token plus three full verification steps
    plain = decode.greedy(model, ids, max_new, stops)
    assert len(plain) == max_new and not set(plain) & set(stops)
    vocab = model.config.vocab_size
    oracle = decode.Stats()
    assert decode.speculative(model, Oracle(plain, vocab), ids, max_new, stops, num_steps, oracle) == plain
    assert oracle.acceptance_length == num_steps + 1 and oracle.steps == 3
    assert oracle.acceptance_rate == [1.0] * num_steps == oracle.conditional_rate
    wrong = decode.Stats()
    out = decode.speculative(model, Oracle(plain, vocab, lambda s, i: True), ids, max_new, stops, num_steps, wrong)
    assert out == plain and wrong.acceptance_length == 1.0 and wrong.steps == max_new - 1
    assert all(r == 0.0 for r in wrong.acceptance_rate)


def test_partial_acceptance_bookkeeping_and_cache_crop(model, cases, stops):
    """Drafts wrong at position 1 of every step: 1 accepted + 1 bonus = 2 tokens per step; rates [1, 0, 0]."""
    ids, plain = cases[0]
    stats = decode.Stats()
    out = decode.speculative(
        model, Oracle(plain, model.config.vocab_size, lambda s, i: i == 1), ids, 16, stops, 3, stats
    )
    assert out == plain
    full = (len(plain) - 1) // 2  # steps that emitted 2 tokens; the last one may be cut by max_new_tokens
    assert stats.steps == full + (len(plain) - 1) % 2
    assert stats.acceptance_rate[0] == 1.0 and stats.acceptance_rate[1] == 0.0
    assert stats.conditional_rate[1] == 0.0
    assert stats.acceptance_length == pytest.approx((len(plain) - 1) / stats.steps)


def test_stats_merge_and_report():
    a, b = decode.Stats(), decode.Stats()
    a.add_step(3, 3, 4)
    b.add_step(3, 0, 1)
    b.add_step(2, 1, 2)
    a.merge(b)
    assert a.steps == 3 and a.acceptance_length == pytest.approx(7 / 3)
    assert a.acceptance_rate == [2 / 3, 1 / 3, 1 / 2] and a.conditional_rate == [2 / 3, 1 / 2, 1.0]
    assert a.report()["acceptance_length"] == round(7 / 3, 4)


def test_ngram_proposals():
    d = decode.NgramDrafter(max_ngram=3)
    d.reset([5, 6, 7, 8, 9, 5, 6], None, 7)
    assert d.propose(3) == [8, 9, 5]  # "5 6 7" seen before, followed by 8 9 5
    d.accept(2, None, 4)  # 8 9 accepted, target says 4
    assert d.tokens[-3:] == [8, 9, 4]
    assert d.propose(2) == []  # "9 4", "4": never seen
    d.accept(0, None, 6)
    assert d.propose(2) == [7, 8]  # "9 4 6", "4 6" unseen; the most recent earlier "6" precedes 7 8


def small_drafter(model, seed=0):
    cfg = draft_config.DraftConfig.from_target(model.config, draft_vocab_size=4096, aux_layers=[2, 15, 27])
    torch.manual_seed(seed)
    m = draft.Eagle3Draft(cfg, model.get_input_embeddings().weight)
    for p in m.parameters():  # make it confident enough to propose varied tokens
        torch.nn.init.normal_(p, std=0.05)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[::12] = True  # every 12th target id: d2t is a real offset table
    ids = t2d.nonzero()[:, 0][: cfg.draft_vocab_size]
    m.set_vocab(ids - torch.arange(cfg.draft_vocab_size), t2d)
    return m.eval()


class CheckedEagle(decode.EagleDrafter):
    """Checks, at every proposal, that the incremental drafter state equals a from-scratch recomputation over the
    committed tokens and all the target states received so far (alignment: state t pairs with token t + 1)."""

    def reset(self, prompt_ids, aux, next_token):
        self.tokens, self.aux = list(prompt_ids) + [next_token], aux.clone()
        super().reset(prompt_ids, aux, next_token)

    def accept(self, n, aux, next_token):
        self.tokens += self.last[:n] + [next_token]
        self.aux = torch.cat([self.aux, aux])
        super().accept(n, aux, next_token)

    def propose(self, k):
        assert self.committed == len(self.tokens) - 1 == len(self.aux)
        m = self.model
        logits, h, cache = m(torch.tensor([self.tokens[1:]]), m.project(self.aux[None]))
        want, tok, hh = [], int(m.to_target(logits[0, -1].argmax())), h[:, -1:]
        for i in range(k):
            want.append(tok)
            if i < k - 1:
                logits, hh, _ = m(torch.tensor([[tok]]), hh, cache)
                tok = int(m.to_target(logits[0, -1].argmax()))
        got = super().propose(k)
        assert got == want
        return got


def test_eagle_drafter_is_lossless_and_its_cache_matches_a_recomputation(model, cases, stops):
    drafter = CheckedEagle(small_drafter(model))
    stats = decode.Stats()
    for ids, plain in cases:
        assert decode.speculative(model, drafter, ids, 16, stops, 3, stats) == plain
    assert stats.steps > 0


def test_eagle_drafter_receives_the_targets_states_at_its_layers(model, cases, stops):
    """The aux rows handed to the drafter equal a bare forward's hidden_states[2, 15, 27] at the same positions."""
    ids, plain = cases[2]
    seen = []

    class Spy(decode.EagleDrafter):
        def reset(self, prompt_ids, aux, next_token):
            seen.append(aux)
            super().reset(prompt_ids, aux, next_token)

        def accept(self, n, aux, next_token):
            seen.append(aux)
            super().accept(n, aux, next_token)

    out = decode.speculative(model, Spy(small_drafter(model)), ids, 16, stops, 3)
    got = torch.cat(seen)
    with torch.inference_mode():
        ref = model(torch.tensor([ids + out]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i][0] for i in (2, 15, 27)], dim=-1)[: len(got)]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_sliding_window_target_crops_rejected_drafts_past_its_window():
    """A target whose layers attend over a sliding window (Mistral's, 4 tokens; gpt-oss's every other layer): its
    cache keeps what a rejected draft needs to be cropped away also once the window is full, and decoding with
    drafts wrong at position 1 of every step stays its greedy decoding."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        MistralConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            max_position_embeddings=128,
        )
    ).eval()
    assert decode._new_cache(model).layers[0].is_sliding
    ids = torch.randint(0, 256, (12,)).tolist()
    plain = decode.greedy(model, ids, 20, [])
    stats = decode.Stats()
    out = decode.speculative(model, Oracle(plain, 256, lambda s, i: i == 1), ids, 20, [], 3, stats)
    assert out == plain and stats.acceptance_rate[1] == 0.0
