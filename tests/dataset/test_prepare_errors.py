"""Tests of the prepare stage's bad input: a bad line or array item named by file, line and field, under on_error
fail or counted under skip; records with no prompt left out; damaged files (cut, torn, broken) located to the byte;
the stage script stopping on a bad record."""

import json
import subprocess
import sys

import pytest
from dataset_helpers import STAGE, alpaca_file, params_file, prepare_, source

from eaglepipe.core import config
from eaglepipe.core.records import RecordError
from eaglepipe.dataset import prepare
from eaglepipe.dataset.sources import CHUNK

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


# ------------------------------------------------------------------------------------- the stage script on a bad record
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
