"""Gates: when they are checked, what each one counts, and what a breach says."""

import pytest

from eaglepipe.core import config
from eaglepipe.core.records import Response
from eaglepipe.infer.gates import GateBreach, Gates

PARAMS = config.Gates(warmup=4, every=3, min_reasoning=0.5, max_truncated=0.5, max_empty=0.25)
MARKUP = ("<|im_end|>", "<|return|>")


def resp(rid, reasoning="why", content="answer<|im_end|>", finish="stop", closed=True):
    return Response(rid, "s", [1], [2], finish, reasoning + content, reasoning, content, closed, [], {}, {})


def test_checks_after_warmup_then_every():
    g = Gates(PARAMS, True)
    due = []
    for i in range(1, 14):
        g.add(resp(f"r{i}"))
        if g.due():
            due.append(i)
            g.check()
    assert due == [4, 7, 10, 13]


def test_a_resumed_run_is_checked_at_its_first_new_record():
    g = Gates(PARAMS, True)
    for i in range(9):  # loaded from the cache: no check between them
        g.add(resp(f"c{i}", reasoning=""))
    g.add(resp("new", reasoning=""))
    assert g.due()
    with pytest.raises(GateBreach, match="after 10 records"):
        g.check()


def test_min_reasoning_breach_names_gate_rate_limit_and_records():
    g = Gates(PARAMS, True)
    for i, r in enumerate(["a", "", "", ""]):
        g.add(resp(f"id{i}", reasoning=r))
    with pytest.raises(GateBreach) as e:
        g.check()
    msg = str(e.value)
    assert "gate min_reasoning breached: observed 0.250 < 0.5 after 4 records (e.g. id1, id2, id3)" in msg
    assert "target.reasoning" in msg  # and says where to look
    assert (e.value.gate, e.value.rate, e.value.limit, e.value.offenders) == (
        "min_reasoning",
        0.25,
        0.5,
        ["id1", "id2", "id3"],
    )


def test_whitespace_only_reasoning_is_no_reasoning():
    g = Gates(PARAMS, True)
    for i in range(4):
        g.add(resp(f"r{i}", reasoning="\n\n"))
    with pytest.raises(GateBreach, match="min_reasoning"):
        g.check()


def test_a_block_that_never_closes_counts_only_when_cut_short():
    """Under a template that prefills <think>, an answer served without its thinking reads as an unclosed block
    that stopped: that is no reasoning. An unclosed block cut by length is reasoning (and max_truncated counts it)."""
    g = Gates(PARAMS, True)
    g.add(resp("cut", reasoning="Let me", content="", finish="length", closed=False))
    g.add(resp("aborted", reasoning="Let me", content="", finish="abort", closed=False))
    g.add(resp("stopped1", reasoning="4<|im_end|>", content="", closed=False))
    g.add(resp("stopped2", reasoning="4<|im_end|>", content="", closed=False))
    g.add(resp("stopped3", reasoning="4<|im_end|>", content="", closed=False))
    with pytest.raises(GateBreach, match=r"observed 0.400 < 0.5 after 5 records \(e.g. stopped1, stopped2, stopped3\)"):
        g.check()


def test_min_reasoning_is_not_checked_without_a_reasoning_preset():
    g = Gates(PARAMS, False)
    for i in range(4):
        g.add(resp(f"r{i}", reasoning=""))
    g.check()
    assert g.summary() == {"max_truncated": 0.0, "max_empty": 0.0}


def test_max_truncated():
    g = Gates(PARAMS, False)
    for i in range(4):
        g.add(resp(f"r{i}", finish="length" if i else "stop"))
    with pytest.raises(GateBreach, match=r"max_truncated breached: observed 0.750 > 0.5 .*\(e.g. r1, r2, r3\)") as e:
        g.check()
    assert "reasoning block" not in str(e.value)  # these closed their reasoning: the plain hint


def test_max_truncated_counts_answers_cut_inside_an_unclosed_reasoning_block():
    # under a template that prefills <think>, an answer that drops its thinking and runs to the limit is all
    # "reasoning", unclosed: the same ids as thinking past the limit, so the breach names both causes
    g = Gates(PARAMS, True)
    g.add(resp("ok"))
    g.add(resp("long", finish="length"))  # closed reasoning, then an answer cut short
    for i in range(2):
        g.add(resp(f"cut{i}", reasoning="no thinking here, just the answer", content="", finish="length", closed=False))
    with pytest.raises(GateBreach, match=r"max_truncated breached: observed 0.750 > 0.5") as e:
        g.check()
    assert "2 of them end inside a reasoning block that never closed" in str(e.value)
    assert "does not think at all" in str(e.value) and "make inspect" in str(e.value)


def test_max_empty_ignores_special_tokens():
    g = Gates(PARAMS, False, MARKUP)
    g.add(resp("empty", reasoning="", content="<|im_end|>"))  # only an end-of-turn token
    g.add(resp("blank", reasoning=" ", content="\n<|return|>\n"))
    g.add(resp("thought", reasoning="why", content=""))  # truncated in its reasoning: not empty
    g.add(resp("answer", reasoning="", content="4<|im_end|>"))
    assert [g.empty(resp(*a)) for a in [("x", "", "<|im_end|>"), ("y", "", "4")]] == [True, False]
    with pytest.raises(GateBreach, match=r"gate max_empty breached: observed 0.500 > 0.25 .*\(e.g. empty, blank\)"):
        g.check()


def test_without_markup_an_end_of_turn_token_counts_as_text():
    g = Gates(PARAMS, False)
    assert not g.empty(resp("x", reasoning="", content="<|im_end|>"))
    assert g.empty(resp("y", reasoning="", content=" \n"))


def test_limits_at_the_boundary_pass():
    g = Gates(PARAMS.model_copy(update={"min_reasoning": 0.5, "max_truncated": 0.5}), True)
    for i in range(4):
        g.add(resp(f"r{i}", reasoning="why" if i % 2 else "", finish="length" if i % 2 else "stop"))
    g.check()
    assert g.summary() == {"min_reasoning": 0.5, "max_truncated": 0.5, "max_empty": 0.0}


def test_no_records_no_breach():
    Gates(PARAMS, True).check()


@pytest.mark.parametrize(
    "params, match",
    [
        ({"warmup": 0}, "infer.gates.warmup = 0: input should be greater than or equal to 1"),
        ({"every": 0}, "infer.gates.every = 0"),
        ({"max_empty": 1.5}, "infer.gates.max_empty = 1.5: input should be less than or equal to 1"),
        ({"max_empty": "a lot"}, "infer.gates.max_empty = 'a lot': input should be a valid number"),
    ],
)
def test_bad_params_are_refused_naming_the_key(params, match):
    with pytest.raises(config.ConfigError, match=match):
        config.parse(
            {
                "prepare": {"sources": [{"name": "a", "path": "a", "format": "alpaca", "n": 1}]},
                "infer": {"gates": params},
            }
        )
