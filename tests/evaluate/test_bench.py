"""make bench's logic (eaglepipe/evaluate/bench.py) without a server: the decode steps counted from vLLM's counters,
acceptance per group with its error, paired differences, speeds, the table, and the decoding order (turn 1, then
each turn 2 after the target's own first answer) against a fake server. The whole command runs against vLLM in
tests/evaluate/test_serve.py."""

import types

import pytest

from eaglepipe.evaluate import bench

SAMPLING = object()  # passed through to the server untouched


def conversation(category: str, turns: int = 1):
    """A benchmark conversation: its chat asks turn len(answers) + 1."""
    return types.SimpleNamespace(
        category=category,
        turns=turns,
        tools=None,
        messages_for=lambda answers: [{"role": "user", "content": "q"}, *answers],
    )


class Chat:
    """Renders a chat as one id per message; an answer is the output's length."""

    def ids(self, messages, tools):
        return list(range(len(messages)))

    def answer(self, prompt_ids, output):
        return {"role": "assistant", "content": str(len(output))}


class Server:
    """Decodes each row to ``per_row`` tokens, one draft step per two tokens, and records what it was asked."""

    def __init__(self, per_row: int = 5):
        self.per_row, self.asked = per_row, []

    def decode(self, rows, sampling):
        assert sampling is SAMPLING
        self.asked.append([(r["conversation"], r["turn"]) for r in rows])
        outputs = [[r["index"]] * self.per_row for r in rows]
        spec = [{"num_spec_steps": 2, "num_accepted_draft_tokens": 1} for _ in rows]
        return {"outputs": outputs, "spec": spec, "seconds": 2.0, "tokens": self.per_row * len(rows)}


def decoded(per_row: list[tuple[int, int, int]]) -> dict:
    """A method's decode of rows: per row (tokens out, steps that proposed drafts, accepted drafts)."""
    return {
        "outputs": [[0] * n for n, _, _ in per_row],
        "spec": [{"num_spec_steps": s, "num_accepted_draft_tokens": a} for _, s, a in per_row],
    }


def test_steps_count_the_draftless_steps_vllm_leaves_out():
    # 9 tokens out: the prefill's, then 8 over 3 draft steps accepting 4 drafts (7 tokens) and 1 step without drafts
    assert bench.steps_of([0] * 9, {"num_spec_steps": 3, "num_accepted_draft_tokens": 4}) == 4
    assert bench.steps_of([0] * 3, {"num_spec_steps": 2, "num_accepted_draft_tokens": 2}) == 2  # never negative


def test_report_groups_by_category_and_turn_with_outputs_against_plain():
    conversations = [conversation("a", 2), conversation("b", 2)]
    rows = [{"conversation": c, "turn": t} for t in (1, 2) for c in (0, 1)]
    got = decoded([(5, 2, 2), (3, 2, 0), (5, 4, 0), (5, 2, 2)])
    plain = got["outputs"][:3] + [[1]]
    report = bench.report(conversations, rows, got, plain)
    assert report["turns"] == 4 and report["equal_to_plain"] == 3
    assert report["acceptance_length"] == pytest.approx(14 / 10)  # (4 + 2 + 4 + 4) tokens over (2 + 2 + 4 + 2) steps
    assert report["acceptance_length_se"] is not None
    assert set(report["per_category"]) == {"a", "b"} and set(report["per_turn"]) == {"1", "2"}
    assert report["per_turn"]["1"]["acceptance_length"] == pytest.approx(6 / 4)


def test_versus_is_the_paired_difference_of_the_two_lengths():
    conversations = [conversation("a"), conversation("a"), conversation("a")]
    rows = [{"conversation": c, "turn": 1} for c in range(3)]
    a = decoded([(7, 2, 4), (5, 2, 2), (6, 3, 2)])
    b = decoded([(4, 3, 0), (5, 4, 0), (3, 2, 0)])
    d = bench.versus(conversations, rows, a, b)
    assert d["difference"] == pytest.approx(round(15 / 7 - 9 / 9, 4))  # (6 + 4 + 5) / (2 + 2 + 3) against 1
    assert d["se"] is not None and d["beyond_2se"] == (abs(d["difference"]) > 2 * d["se"])
    assert "per_category" not in d and "per_turn" not in d  # one category, one turn


def test_comparisons_pair_each_drafter_with_prompt_lookup_and_the_others_with_the_drafter():
    assert bench.comparisons(["eagle3", "ngram", "eagle3:big"]) == [
        ("eagle3", "ngram"),
        ("eagle3:big", "ngram"),
        ("eagle3:big", "eagle3"),
    ]
    assert bench.comparisons(["ngram"]) == []


def test_plain_decoding_asks_each_turn_2_after_the_targets_own_first_answer():
    chat, server = Chat(), Server()
    sets = {"mtbench": {"conversations": [conversation("a", 2), conversation("b", 1)], "decoded": {}}}
    sets["mtbench"]["rows"] = bench.turns_of(sets["mtbench"]["conversations"], chat)
    timed = bench.decode_plain(server, sets, chat, SAMPLING)
    assert server.asked == [[(0, 1), (1, 1)], [(0, 2)]]  # only the two-turn conversation has a second turn
    rows = sets["mtbench"]["rows"]
    assert [r["index"] for r in rows] == [0, 1, 2] and rows[2]["prompt_ids"] == [0, 1]  # the question, its answer
    assert timed == {"mtbench": {"seconds": 4.0, "tokens": 15}} and len(sets["mtbench"]["plain"]) == 3

    figures = bench.decode_method(Server(), sets, "eagle3", SAMPLING)["mtbench"]
    # each row: 4 tokens after the prefill's, 2 draft steps emitting 3 and one step without drafts
    assert figures["equal_to_plain"] == 3 and figures["acceptance_length"] == pytest.approx(round(12 / 9, 4))
    assert sets["mtbench"]["decoded"]["eagle3"]["outputs"] == sets["mtbench"]["plain"]


def test_speeds_are_tokens_per_second_and_their_ratio_to_plain():
    results = {"heldout": {"plain": {"seconds": 2.0, "tokens": 100}, "eagle3": {"seconds": 4.0, "tokens": 100}}}
    bench.add_speeds(results)
    assert results["heldout"]["plain"] == {"seconds": 2.0, "tokens": 100, "tokens_per_s": 50.0, "speedup": 1.0}
    assert results["heldout"]["eagle3"]["tokens_per_s"] == 25.0 and results["heldout"]["eagle3"]["speedup"] == 0.5


def test_the_table_shows_every_group_the_pairs_and_the_crossings():
    group = {"turns": 2, "equal_to_plain": 2, "acceptance_length": 1.5, "acceptance_length_se": 0.1}
    result = {
        "benchmarks": {
            "mtbench": {
                "plain": {"tokens_per_s": 10.0, "speedup": 1.0},
                "eagle3": {**group, "tokens_per_s": 8.0, "speedup": 0.8, "per_turn": {"1": group, "2": group}},
            }
        },
        "paired": {"eagle3 - ngram": {"mtbench": {"difference": -0.25, "se": 0.1, "beyond_2se": True}}},
        "crossing": {"big": {"mtbench": dict.fromkeys(("slope", "slope_se", "gap", "gap_se", "beyond_se"), 0.1)}},
    }
    result["crossing"]["big"]["mtbench"]["beyond"] = None
    text = bench.table(result)
    assert "| mtbench | all | plain | 1 | | 10.0 | 1.00 |" in text
    assert "| mtbench | turn 2 | eagle3 | 1.500 ± 0.100 | 2/2 |  |  |" in text
    assert "| eagle3 - ngram | mtbench | all | -0.250 ± 0.100 | yes |" in text
    assert "never (slope <= 0)" in text
