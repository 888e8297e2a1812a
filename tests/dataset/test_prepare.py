"""Tests of the prepare stage: source readers of each format, mixing, dedup and sampling, the config check. Bad input
and damaged files are in test_prepare_errors.py, the stage script, big files, the shipped data and the benchmarks
kept out in test_prepare_stage.py."""

import json

import pytest
from dataset_helpers import FIXTURE, FIXTURES, alpaca_file, fixture_records, prepare_, read_ok, source, write_jsonl

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import content_id, prompt_from_json

# ----------------------------------------------------------------------------------------------------------- formats


@pytest.mark.parametrize("container", ["jsonl", "json"])
@pytest.mark.parametrize("fmt", sorted(FIXTURE))
def test_every_format_parses_from_jsonl_and_json_array(tmp_path, fmt, container):
    records = fixture_records(fmt)
    path = tmp_path / f"{fmt}.{container}"
    if container == "jsonl":
        write_jsonl(path, records)
    else:
        path.write_text(json.dumps(records, indent=1), encoding="utf-8")
    prompts = read_ok(path, fmt)
    assert [p.to_json() for p in prompts] == [p.to_json() for p in read_ok(FIXTURES / FIXTURE[fmt], fmt)]
    assert len(prompts) == len(records) >= 2
    for p in prompts:
        assert prompt_from_json(p.to_json()) == p  # valid under the shared schema
        assert p.messages[-1]["role"] in ("user", "tool")
        assert p.id == content_id(p.messages, p.tools)


def test_last_assistant_turn_is_dropped_and_earlier_ones_kept():
    chat = read_ok(FIXTURES / "sharegpt.jsonl", "sharegpt")
    assert [m["role"] for m in chat[0].messages] == ["system", "user", "assistant", "user"]
    assert chat[0].messages[-1]["content"] == "Is 21 prime?"
    assert chat[0].messages[2]["content"].startswith("A whole number above 1")
    assert [m["role"] for m in chat[1].messages] == ["user"]  # {role, content} turns
    assert [m["role"] for m in chat[3].messages] == ["user"]  # no answer to drop
    multi = read_ok(FIXTURES / "openai.json", "openai")[0]
    assert [m["content"] for m in multi.messages] == ["Give me a synonym for 'quick'.", "Rapid.", "And an antonym?"]


def test_single_turn_formats_keep_only_the_prompt():
    code = read_ok(FIXTURES / "opencodeinstruct.jsonl", "opencodeinstruct")
    assert code[0].messages == [{"role": "user", "content": fixture_records("opencodeinstruct")[0]["input"]}]
    oss, evol = read_ok(FIXTURES / "magicoder.jsonl", "magicoder")
    assert oss.messages[0]["content"] == fixture_records("magicoder")[0]["problem"]
    assert evol.messages[0]["content"] == fixture_records("magicoder")[1]["instruction"]
    plain, with_input = read_ok(FIXTURES / "alpaca.json", "alpaca")
    assert plain.messages == [{"role": "user", "content": "List three uses for a paperclip."}]
    assert with_input.messages[0]["content"] == "Translate the sentence into French.\n\nThe library opens at nine."


def test_glaive_functions_become_tools_and_calls_become_turns():
    with_tools, without = read_ok(FIXTURES / "glaive.json", "glaive")
    assert [t["function"]["name"] for t in with_tools.tools] == ["calculate_tip", "get_local_time"]
    assert with_tools.tools[0]["type"] == "function"
    assert with_tools.tools[0]["function"]["parameters"]["required"] == ["bill", "percent"]
    system = with_tools.messages[0]
    assert system["role"] == "system" and not system["content"].startswith("SYSTEM:")
    assert '"name": "calculate_tip"' in system["content"]  # templates without tools still see them
    roles = [m["role"] for m in with_tools.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool"]
    call = with_tools.messages[2]["tool_calls"][0]["function"]
    assert call == {"name": "calculate_tip", "arguments": {"bill": 80, "percent": 15}}
    assert with_tools.messages[3] == {"role": "tool", "content": '{"tip": 12.0}', "name": "calculate_tip"}
    assert with_tools.messages[-1]["content"] == '{"time": "21:40"}'
    assert not any("<|endoftext|>" in m["content"] for m in with_tools.messages)
    assert without.tools is None and [m["role"] for m in without.messages] == ["system", "user"]


def test_glaive_unparsable_functions_keep_the_system_text(tmp_path):
    system = "SYSTEM: You are a helpful assistant with access to the following functions. Use them if required -\n{oops"
    path = write_jsonl(tmp_path / "g.jsonl", [{"system": system, "chat": "USER: hi\nASSISTANT: hello <|endoftext|>"}])
    [p] = read_ok(path, "glaive")
    assert p.tools is None and p.messages[0]["content"].endswith("{oops")


def test_sharegpt_tool_layout():
    p = read_ok(FIXTURES / "sharegpt.jsonl", "sharegpt")[2]
    assert [t["function"]["name"] for t in p.tools] == ["next_train"]
    assert p.messages[0] == {"role": "system", "content": "You can look up train times."}
    assert p.messages[2]["tool_calls"][0]["function"]["arguments"] == {"origin": "Leeds", "destination": "York"}
    assert p.messages[3]["role"] == "tool" and p.messages[3]["name"] == "next_train"


def test_ids_are_stable_and_content_based(tmp_path):
    first = [p.id for p in read_ok(FIXTURES / "alpaca.json", "alpaca", "a")]
    again = [p.id for p in read_ok(FIXTURES / "alpaca.json", "alpaca", "another_name")]
    assert first == again and len(set(first)) == len(first)
    text = "List three uses for a paperclip."
    same, changed = read_ok(alpaca_file(tmp_path / "copy.jsonl", [text, text.replace(".", "!")]), "alpaca")
    assert same.id == first[0] and changed.id != first[0]


# ------------------------------------------------------------------------------------------------ mixing and sampling


def test_duplicates_are_removed_across_sources_and_counted(tmp_path):
    a = alpaca_file(tmp_path / "a.jsonl", ["one", "two", "three"])
    b = alpaca_file(tmp_path / "b.jsonl", ["two", "four", "four", "five"])
    prompts, report = prepare_({"seed": 0, "sources": [source("a", a, 10), source("b", b, 10)]})
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids)) == 5
    assert [p.messages[0]["content"] for p in prompts if p.source == "b"] == ["four", "five"]
    assert report["sources"]["a"]["duplicates"] == 0
    assert report["sources"]["b"]["duplicates"] == 2
    assert report["totals"]["duplicates"] == 2
    assert report["sources"]["b"]["shortfall"] == 8


def test_max_turns_cuts_a_conversation_after_its_kth_user_turn_and_counts_it(tmp_path):
    turns = [("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3"), ("gpt", "a3")]
    chats = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"conversations": [{"from": f, "value": v} for f, v in turns]},
            {"conversations": [{"from": f, "value": v} for f, v in turns[:2]]},
            {"conversations": [{"from": f, "value": v + "!"} for f, v in turns[:4]]},
        ],
    )
    whole, _ = prepare_({"seed": 0, "sources": [source("c", chats, 3, "sharegpt")]})
    cut, report = prepare_({"seed": 0, "sources": [{**source("c", chats, 3, "sharegpt"), "max_turns": 2}]})
    assert [[m["content"] for m in p.messages] for p in cut] == [["q1", "a1", "q2"], ["q1"], ["q1!", "a1!", "q2!"]]
    assert [p.id for p in cut][1:] == [p.id for p in whole][1:] and cut[0].id != whole[0].id
    assert cut[0].id == content_id(cut[0].messages, None)
    assert report["sources"]["c"]["rules"]["cut_to_max_turns"] == 1
    first, report = prepare_({"seed": 0, "sources": [{**source("c", chats, 3, "sharegpt"), "max_turns": 1}]})
    assert [[m["content"] for m in p.messages] for p in first] == [["q1"], ["q1!"]]
    assert report["sources"]["c"]["duplicates"] == 1  # cut to one turn, the first two chats are one prompt
    with pytest.raises(Exception, match="max_turns"):
        config.Source(name="c", path="x.jsonl", format="sharegpt", n=1, max_turns=0)


def selection(cfg, name):
    return [p.id for p in prepare_(cfg)[0] if p.source == name]


def test_sampling_of_a_source_ignores_the_other_sources(tmp_path):
    x = alpaca_file(tmp_path / "x.jsonl", [f"Describe item {i} of list x." for i in range(30)])
    y = alpaca_file(tmp_path / "y.jsonl", [f"Describe item {i} of list y." for i in range(30)])
    z = alpaca_file(tmp_path / "z.jsonl", [f"Describe item {i} of list z." for i in range(30)])
    base = selection({"seed": 3, "sources": [source("x", x, 10), source("y", y, 5)]}, "x")
    assert len(base) == 10
    assert selection({"seed": 3, "sources": [source("x", x, 10), source("y", y, 25)]}, "x") == base
    assert selection({"seed": 3, "sources": [source("z", z, 7), source("x", x, 10), source("y", y, 5)]}, "x") == base
    assert set(base) < set(selection({"seed": 3, "sources": [source("x", x, 15)]}, "x"))
    assert selection({"seed": 4, "sources": [source("x", x, 10)]}, "x") != base
    assert selection({"seed": 3, "sources": [source("renamed", x, 10)]}, "renamed") != base


def test_shortfall_takes_everything_and_is_reported(tmp_path):
    x = alpaca_file(tmp_path / "x.jsonl", ["a", "b", "c"])
    prompts, report = prepare_({"seed": 0, "sources": [source("x", x, 5)]})
    assert [p.messages[0]["content"] for p in prompts] == ["a", "b", "c"]
    assert (report["sources"]["x"]["selected"], report["sources"]["x"]["shortfall"]) == (3, 2)


def test_config_is_checked(tmp_path):
    x = alpaca_file(tmp_path / "x.jsonl", ["a"])
    with pytest.raises(config.ConfigError, match=r"prepare.sources\[0\].format = 'csv': input should be 'sharegpt'"):
        prepare_({"sources": [source("x", x, 1, fmt="csv")]})
    with pytest.raises(config.ConfigError, match=r"\['x'\] used twice"):
        prepare_({"sources": [source("x", x, 1), source("x", x, 2)]})
    with pytest.raises(config.ConfigError, match="prepare.on_error = 'ignore': input should be 'fail' or 'skip'"):
        prepare_({"on_error": "ignore", "sources": [source("x", x, 1)]})
    with pytest.raises(config.ConfigError, match=r"prepare.sources\[0\].n = -1: input should be greater"):
        prepare_({"sources": [source("x", x, -1)]})


def test_a_selection_with_no_prompt_fails_there(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    with pytest.raises(UserError, match=r"prepare: no prompt selected from 1 source\(s\) \(0 records read"):
        prepare_({"sources": [source("x", empty, 5)]})


def test_a_missing_source_file_is_named_before_any_source_is_read(tmp_path):
    x = alpaca_file(tmp_path / "x.jsonl", ["a"])
    with pytest.raises(UserError, match=r"prepare.sources\[1\] \(gone\): no such file .*nowhere.jsonl"):
        prepare_({"sources": [source("x", x, 1), source("gone", tmp_path / "nowhere.jsonl", 1)]})
