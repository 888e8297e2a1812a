"""Tests of the prepare stage: source readers, mixing, dedup, sampling, errors, the stage script, the shipped data."""

import gzip
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import RecordError, content_id, prompt_from_json, read_jsonl, read_prompts
from eaglepipe.dataset import benchmarks, prepare
from eaglepipe.dataset.sources import CHUNK, raw_records, read_source

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "sources"
FIXTURE = {
    "sharegpt": "sharegpt.jsonl",
    "openai": "openai.json",
    "glaive": "glaive.json",
    "opencodeinstruct": "opencodeinstruct.jsonl",
    "magicoder": "magicoder.jsonl",
    "alpaca": "alpaca.json",
}


def read_ok(path, fmt, source="src"):
    """All prompts of a file, failing the test on any broken record."""
    items = list(read_source(path, fmt, source))
    errors = [str(e) for e in items if isinstance(e, RecordError)]
    assert not errors, errors
    return items


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def alpaca_file(path, texts):
    return write_jsonl(path, [{"instruction": t, "input": "", "output": "ok"} for t in texts])


def source(name, path, n, fmt="alpaca"):
    return {"name": name, "path": str(path), "format": fmt, "n": n}


def fixture_records(fmt):
    return [rec for _, _, rec in raw_records(FIXTURES / FIXTURE[fmt])]


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
def prepare_(section: dict):
    """prepare on a ``prepare`` section as params.yaml holds it (validated as the stage validates it)."""
    return prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare)


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


# ------------------------------------------------------------------------------------------------------- bad input

GOOD = b'{"conversations": [{"from": "human", "value": "fine"}]}'
BAD_LINES = {  # reason: (format, bad line, field named in the error)
    "broken_json": ("sharegpt", b'{"conversations": [', None),
    "not_utf8": ("alpaca", b'{"instruction": "caf\xe9"}', None),
    "missing_field": ("alpaca", b'{"input": "no instruction"}', "instruction"),
    "wrong_type": ("opencodeinstruct", b'{"input": 42}', "input"),
    "unknown_role": (
        "sharegpt",
        b'{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": ""}]}',
        "conversations[1].from",
    ),
    "bad_tool_calls": (
        "openai",
        b'{"messages": [{"role": "user", "content": "u"}, {"role": "assistant", '
        b'"content": "", "tool_calls": [{"function": {"arguments": {}}}]}, '
        b'{"role": "tool", "content": "t"}]}',
        "messages[1].tool_calls",
    ),
    "not_object": ("magicoder", b'["problem"]', None),
    "media": (
        "openai",
        b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}, '
        b'{"type": "text", "text": "what is it?"}]}]}',
        "messages[0].content",
    ),
}


def good_line(fmt):
    return {
        "sharegpt": GOOD,
        "openai": b'{"messages": [{"role": "user", "content": "fine"}]}',
        "alpaca": b'{"instruction": "fine"}',
        "opencodeinstruct": b'{"input": "fine"}',
        "magicoder": b'{"problem": "fine"}',
    }[fmt]


@pytest.mark.parametrize("reason", sorted(BAD_LINES))
def test_bad_line_fails_naming_file_line_and_field(tmp_path, reason):
    fmt, bad, field = BAD_LINES[reason]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(good_line(fmt) + b"\n\n" + bad + b"\n" + good_line(fmt).replace(b"fine", b"also fine") + b"\n")
    with pytest.raises(RecordError) as e:
        prepare_({"sources": [source("bad", path, 5, fmt)]})
    assert (e.value.path, e.value.line, e.value.field) == (str(path), 3, field)
    assert str(e.value).startswith(f"{path}:3:")
    _, report = prepare_({"on_error": "skip", "sources": [source("bad", path, 5, fmt)]})
    counts = report["sources"]["bad"]
    assert (counts["read"], counts["valid"], counts["skipped"], counts["selected"]) == (3, 2, 1, 2)
    assert counts["skipped_by_reason"] == {reason: 1} == report["totals"]["skipped_by_reason"]
    assert "damage" not in counts  # a broken line followed by others is no damage


def test_bad_item_of_a_json_array_names_its_index(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"instruction": "a"}, {"instruction": "b"}, {"output": "no instruction"}]))
    with pytest.raises(RecordError) as e:
        prepare_({"sources": [source("bad", path, 5)]})
    assert (e.value.line, e.value.field) == (2, "instruction") and "JSON array index 2" in str(e.value)


def test_skip_counts_every_reason(tmp_path):
    lines = [
        good_line("sharegpt"),
        BAD_LINES["broken_json"][1],
        BAD_LINES["unknown_role"][1],
        BAD_LINES["unknown_role"][1],
        BAD_LINES["wrong_type"][1],
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b"\n".join(lines))
    _, report = prepare_({"on_error": "skip", "sources": [source("m", path, 5, "sharegpt")]})
    counts = report["sources"]["m"]
    assert counts["skipped_by_reason"] == {"broken_json": 1, "unknown_role": 2, "missing_field": 1}
    assert counts["read"] == counts["valid"] + counts["skipped"] == 5


LEFT_OUT = {  # rule: (format, a record with no prompt in it)
    "empty_conversation": ("sharegpt", b'{"conversations": []}'),
    "no_user_turn": ("openai", b'{"messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}]}'),
}


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_record_with_no_prompt_is_left_out_and_counted_under_either_on_error(tmp_path, on_error):
    sources = []
    for rule, (fmt, line) in LEFT_OUT.items():
        path = tmp_path / f"{rule}.jsonl"
        path.write_bytes(good_line(fmt) + b"\n" + line + b"\n" + line + b"\n")
        sources.append(source(rule, path, 5, fmt))
    prompts, report = prepare_({"on_error": on_error, "sources": sources})
    for rule in LEFT_OUT:
        counts = report["sources"][rule]
        assert (counts["read"], counts["valid"], counts["left_out"], counts["skipped"]) == (3, 1, 2, 0)
        assert counts["left_out_by_rule"] == {rule: 2}
    assert report["totals"]["left_out_by_rule"] == dict.fromkeys(LEFT_OUT, 2)
    assert len(prompts) == 1  # the two good lines are one prompt: the second is a duplicate
    assert "left out: empty_conversation 2, no_user_turn 2" in prepare.summary(report)


# ---------------------------------------------------------------------------------------------------------- damage

ARRAY_HEAD = b'[\n  {"instruction": "a"},\n  {"instruction": "b"},\n  '
LINES_HEAD = b'{"instruction": "a"}\n\n{"instruction": "b"}\n'
DAMAGED = {  # name: (file, where the damage starts, records before it)
    "array cut in a record": (ARRAY_HEAD + b'{"instruction": "c', len(ARRAY_HEAD), 2),
    "array cut in a character": (ARRAY_HEAD + b'{"instruction": "caf\xc3', len(ARRAY_HEAD), 2),
    "array broken in a record": (b'[\n  {"instruction": "a"},\n  {"instruction": }\n]\n', 28, 1),
    "array cut after a record": (ARRAY_HEAD.rstrip(b" ,\n"), len(ARRAY_HEAD.rstrip(b" ,\n")), 2),
    "array cut at its start": (b'  [\n  {"instr', 6, 0),
    "torn last line": (LINES_HEAD + b'{"instruction": "c', len(LINES_HEAD), 2),
    "torn character": (LINES_HEAD + b'{"instruction": "caf\xc3', len(LINES_HEAD), 2),
}


def damaged_file(tmp_path, name):
    data, offset, before = DAMAGED[name]
    path = tmp_path / ("bad.json" if data.lstrip().startswith(b"[") else "bad.jsonl")
    path.write_bytes(data)
    return path, {"offset": offset, "bytes": len(data) - offset, "records_before": before}


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_damaged_file_keeps_the_records_before_the_damage_under_skip(tmp_path, name):
    path, damage = damaged_file(tmp_path, name)
    ok = alpaca_file(tmp_path / "ok.jsonl", ["fine"])  # a selection with nothing at all fails the stage
    prompts, report = prepare_({"on_error": "skip", "sources": [source("bad", path, 5), source("ok", ok, 1)]})
    assert [p.messages[0]["content"] for p in prompts if p.source == "bad"] == ["a", "b"][: damage["records_before"]]
    counts = report["sources"]["bad"]
    assert counts["damage"] == damage
    assert counts["skipped_by_reason"] == {"damaged": 1}
    assert (counts["read"], counts["valid"]) == (damage["records_before"] + 1, damage["records_before"])
    assert f"damaged: bad from byte {damage['offset']} to its end" in prepare.summary(report)


@pytest.mark.parametrize("name", sorted(DAMAGED))
def test_damaged_file_fails_naming_file_byte_offset_and_record_index(tmp_path, name):
    path, damage = damaged_file(tmp_path, name)
    with pytest.raises(RecordError) as e:
        prepare_({"sources": [source("bad", path, 5)]})
    index = damage["records_before"]
    is_array = path.suffix == ".json"
    assert (e.value.path, e.value.line) == (str(path), index if is_array else DAMAGED[name][0].count(b"\n") + 1)
    assert f"is damaged from byte {damage['offset']} to its end ({damage['bytes']} bytes)" in str(e.value)
    assert (f"JSON array index {index}," if is_array else f"record index {index},") in str(e.value)


def test_damage_is_located_exactly_across_chunks(tmp_path):
    """Records spanning chunk boundaries, one longer than several chunks, then a cut: the offset is still exact."""
    records = [{"instruction": f"question {i} " + "x" * (i % 300)} for i in range(1500)]
    records[700]["instruction"] += "long " * (3 * CHUNK // 5)
    whole = json.dumps(records, indent=1)
    cut = whole.rindex('{\n  "instruction": "question 1499') + 20
    path = tmp_path / "cut.json"
    path.write_text(whole[:cut])
    assert path.stat().st_size > 5 * CHUNK
    _, report = prepare_({"on_error": "skip", "sources": [source("cut", path, 2000)]})
    counts = report["sources"]["cut"]
    assert counts["valid"] == counts["selected"] == 1499
    assert counts["damage"] == {"offset": cut - 20, "bytes": 20, "records_before": 1499}


def test_a_clean_file_reports_no_damage(tmp_path):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps([{"instruction": "a"}]) + "\n")
    jsonl = alpaca_file(tmp_path / "ok.jsonl", ["b"])
    jsonl.write_bytes(jsonl.read_bytes().rstrip(b"\n"))  # a last line without its newline, but whole
    _, report = prepare_({"sources": [source("array", path, 1), source("lines", jsonl, 1)]})
    assert not any("damage" in s or s["skipped"] for s in report["sources"].values())


def test_on_error_can_be_set_per_source(tmp_path):
    path, _ = damaged_file(tmp_path, "torn last line")
    ok = alpaca_file(tmp_path / "ok.jsonl", ["fine"])
    _, report = prepare_({"sources": [source("ok", ok, 1), {**source("bad", path, 5), "on_error": "skip"}]})
    assert report["sources"]["bad"]["skipped_by_reason"] == {"damaged": 1}
    with pytest.raises(RecordError, match="is damaged from byte 43"):
        prepare_({"on_error": "skip", "sources": [source("ok", ok, 1), {**source("bad", path, 5), "on_error": "fail"}]})
    with pytest.raises(config.ConfigError, match=r"prepare.sources\[0\].on_error = 'ignore'"):
        prepare_({"sources": [{**source("bad", path, 5), "on_error": "ignore"}]})


# ------------------------------------------------------------------------------------------------------ stage script

STAGE = ROOT / "stages" / "prepare.py"


def params_file(tmp_path, sources, on_error="fail"):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"prepare": {"seed": 1, "on_error": on_error, "sources": sources}}))
    return path


@pytest.mark.e2e
def test_stage_runs_end_to_end_without_heavy_imports(tmp_path):
    a = alpaca_file(tmp_path / "a.jsonl", [f"Question {i}?" for i in range(8)])
    params = params_file(tmp_path, [source("chat", FIXTURES / "sharegpt.jsonl", 3, "sharegpt"), source("a", a, 5)])
    out, report = tmp_path / "out" / "prompts.jsonl", tmp_path / "metrics" / "prepare.json"
    run = (
        "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert not e.code, e.code\n"
        "assert not {'torch', 'transformers'} & set(sys.modules), 'prepare imported a model library'\n"
    )
    args = [
        str(STAGE),
        "--params",
        str(params),
        "--out",
        str(out),
        "--report",
        str(report),
        "--timings",
        str(tmp_path / "timings.json"),
    ]
    outputs = []
    for _ in range(2):
        subprocess.run([sys.executable, "-c", run, *args], cwd=tmp_path, check=True, capture_output=True)
        outputs.append((out.read_bytes(), report.read_bytes()))
    assert outputs[0] == outputs[1]  # deterministic
    prompts, counts = read_prompts(out), json.loads(report.read_text())
    assert [p.source for p in prompts] == ["chat"] * 3 + ["a"] * 5
    assert counts["totals"]["selected"] == len(prompts) == 8
    assert counts["sources"]["chat"]["read"] == len(fixture_records("sharegpt"))


def test_stage_help_explains_the_options():
    result = subprocess.run([sys.executable, str(STAGE), "--help"], capture_output=True, text=True, check=True)
    for option in ("--params", "--out", "--report"):
        assert option in result.stdout


def test_stage_stops_on_a_bad_record_with_a_clear_message(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(GOOD + b"\n" + BAD_LINES["broken_json"][1] + b"\n")
    params = params_file(tmp_path, [source("bad", bad, 2, "sharegpt")])
    result = subprocess.run(
        [
            sys.executable,
            str(STAGE),
            "--params",
            str(params),
            "--out",
            "data/prompts.jsonl",
            "--report",
            "data/prepare.json",
            "--timings",
            "data/timings.json",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert f"{bad}:2:" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "data").exists()  # nothing half-written


# -------------------------------------------------------------------------------------------------------- big files

PEAK_RSS = (
    "import resource, runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n"
    "    runpy.run_path(sys.argv[0], run_name='__main__')\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
    "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def repeated_source(path, records, size: int) -> int:
    """A JSON array (``.json``) or JSON Lines file (gzipped for a ``.gz`` name) holding ``records`` over and over
    until it has ``size`` bytes (before compression); returns how many records it holds."""
    array = path.suffixes[0] == ".json"
    block = "".join((json.dumps(r) + (",\n" if array else "\n")) for r in records).encode()
    copies = max(1, size // len(block))
    with (gzip.open if path.suffix == ".gz" else open)(path, "wb") as f:
        f.write(b"[\n" if array else b"")
        for _ in range(copies):
            f.write(block)
        f.write(b'{"instruction": "last"}\n]\n' if array else b'{"instruction": "last"}\n')
    return copies * len(records) + 1


def stage_peak_rss(tmp_path, path, n: int) -> tuple[int, dict]:
    """Peak resident memory (KiB) of the prepare stage run on one source, and its report."""
    params = params_file(tmp_path, [source("s", path, n)])
    out, report = tmp_path / f"{path.name}.prompts.jsonl", tmp_path / f"{path.name}.report.json"
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_RSS,
            str(STAGE),
            "--params",
            str(params),
            "--out",
            str(out),
            "--report",
            str(report),
            "--timings",
            str(tmp_path / "timings.json"),
        ],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    )
    return int(run.stdout.split()[-1]), json.loads(report.read_text())["sources"]["s"]


@pytest.mark.e2e
@pytest.mark.parametrize("container", ["json", "jsonl", "jsonl.gz"])
def test_peak_memory_does_not_grow_with_the_source_file(tmp_path, container):
    """Bound: prepare on a 128 MiB file (gzipped: 128 MiB once decompressed) peaks at less than 1/32 of that size
    (4 MiB) above prepare on a file holding the same distinct records once."""
    records = [{"instruction": f"Prompt {i}: " + "lorem ipsum " * 60, "input": "", "output": "ok"} for i in range(400)]
    tiny, big = tmp_path / f"tiny.{container}", tmp_path / f"big.{container}"
    repeated_source(tiny, records, 0)
    held = repeated_source(big, records, 128 << 20)
    size = 128 << 20
    tiny_peak, tiny_counts = stage_peak_rss(tmp_path, tiny, 50)
    big_peak, big_counts = stage_peak_rss(tmp_path, big, 50)
    big.unlink()
    assert (big_counts["read"], big_counts["duplicates"], big_counts["selected"]) == (held, held - 401, 50)
    assert (tiny_counts["read"], tiny_counts["duplicates"]) == (401, 0)
    assert (big_peak - tiny_peak) * 1024 < size / 32, (tiny_peak, big_peak, size)


# ------------------------------------------------------------------------------------------------------ shipped data


def test_shipped_sources_and_heldout_eval_are_clean_and_disjoint():
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())["prepare"]
    train = []
    for src in (s for s in cfg["sources"] if not s["path"].startswith("pkg:")):  # packaged sources: prepare's check
        prompts = read_ok(ROOT / src["path"], src["format"], src["name"])
        assert len(prompts) >= 40, src["name"]
        train += prompts
    eval_path = ROOT / "data" / "eval" / "heldout.jsonl"
    held = read_ok(eval_path, "openai", "heldout")
    assert len(held) >= 40
    assert all([m["role"] for m in p.messages] == ["user"] for p in held)
    categories = Counter(rec["category"] for _, _, rec in raw_records(eval_path))
    assert set(categories) == {"writing", "reasoning", "math", "coding", "extraction"}
    assert min(categories.values()) >= 8
    assert len({p.id for p in held}) == len(held)
    assert not {p.id for p in held} & {p.id for p in train}
    train_texts = {m["content"].strip().lower() for p in train for m in p.messages if m["role"] == "user"}
    assert not {p.messages[0]["content"].strip().lower() for p in held} & train_texts


# ------------------------------------------------------------------------------------------------ benchmarks kept out


def test_a_benchmark_prompt_is_kept_out_of_training_whitespace_aside_and_counted(tmp_path):
    question, problem = benchmarks.mtbench_questions()[3], benchmarks.humaneval_problems()[9]
    held = next(read_prompts_of(ROOT / "data/eval/heldout.jsonl"))
    chats = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            {
                "conversations": [
                    {"from": "human", "value": "  " + question.turns[1].replace(" ", "\n  ", 3)},
                    {"from": "gpt", "value": "ok"},
                ]
            },
            {
                "conversations": [
                    {"from": "human", "value": "Hello"},
                    {"from": "gpt", "value": "Hi"},
                    {"from": "human", "value": problem.prompt + "\n"},
                ]
            },
            {"conversations": [{"from": "human", "value": held}]},
            {
                "conversations": [{"from": "human", "value": "Hi."}, {"from": "human", "value": question.turns[0]}]
            },  # merged
            {"conversations": [{"from": "human", "value": question.turns[1] + " Answer briefly."}]},  # not the prompt
        ],
    )
    section = {"sources": [source("chats", chats, 10, "sharegpt")]}
    excluded = benchmarks.excluded_texts(ROOT / "data/eval/heldout.jsonl")
    prompts, report = prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare, excluded)
    assert [p.messages[-1]["content"] for p in prompts] == [question.turns[1] + " Answer briefly."]
    assert report["sources"]["chats"]["benchmark"] == 4 == report["totals"]["benchmark"]
    assert report["sources"]["chats"]["rules"]["consecutive_turns_merged"] == 1
    assert " 4 " in prepare.summary(report).splitlines()[1]
    kept, report = prepare.prepare(config.parse({"prepare": section}, "params.yaml").prepare)  # nothing excluded
    assert len(kept) == 5 and report["totals"]["benchmark"] == 0


def read_prompts_of(path):
    return (m["content"] for _, rec in read_jsonl(path) for m in rec["messages"] if m["role"] == "user")


@pytest.mark.e2e
def test_e2e_the_stage_keeps_every_benchmark_prompt_out_of_the_projects_training_prompts(tmp_path):
    """The prepare stage as dvc.yaml runs it, on the project's sources with MT-bench and HumanEval added as sources
    (formats mtbench and opencodeinstruct): none of their prompts, nor any held-out one, is selected."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    project = params["prepare"]["sources"]  # paths relative to the repository, where the stage runs
    params["prepare"]["sources"] = project + [
        {"name": "mtbench", "path": benchmarks.MTBENCH, "format": "mtbench", "n": 80},
        {
            "name": "humaneval",
            "path": benchmarks.HUMANEVAL,
            "format": "opencodeinstruct",
            "n": 164,
            "columns": {"input": "prompt"},
        },
    ]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out, report = tmp_path / "prompts.jsonl", tmp_path / "prepare.json"
    ran = subprocess.run(
        [
            sys.executable,
            "stages/prepare.py",
            "--params",
            str(tmp_path / "params.yaml"),
            "--out",
            str(out),
            "--report",
            str(report),
            "--heldout",
            "data/eval/heldout.jsonl",
            "--timings",
            str(tmp_path / "t.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]
    texts = {benchmarks.normalise(t) for p in read_prompts(out) for t in benchmarks.user_texts(p.messages)}
    assert texts and not texts & benchmarks.excluded_texts(ROOT / "data/eval/heldout.jsonl")
    counts = json.loads(report.read_text())["sources"]
    assert (counts["mtbench"]["benchmark"], counts["mtbench"]["selected"]) == (80, 0)
    assert (counts["humaneval"]["benchmark"], counts["humaneval"]["selected"]) == (164, 0)
    assert sum(c["selected"] for c in counts.values()) == sum(s["n"] for s in project)
