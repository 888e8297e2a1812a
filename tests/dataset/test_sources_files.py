"""Tests of the files prompt sources are read from: gzipped JSON Lines and arrays and their damage, Hugging Face
datasets on disk, and the column mapping of every format's fields."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
from dataset_helpers import FIXTURE, FIXTURES, prepare_

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import Prompt, RecordError
from eaglepipe.dataset import prepare
from eaglepipe.dataset.sources import raw_records, read_source, to_prompt

# ---------------------------------------------------------------------------------------------------------- gzip


def gz_file(path: Path, data: bytes, keep: int | None = None) -> Path:
    """``data`` gzipped into ``path``, cut to its first ``keep`` compressed bytes if given."""
    packed = gzip.compress(data)
    path.write_bytes(packed[:keep] if keep is not None else packed)
    return path


LINES = b"".join(b'{"instruction": "question %d %s"}\n' % (i, b"x" * (i % 70)) for i in range(4000))


def test_a_gzipped_file_reads_as_its_plain_twin(tmp_path):
    plain = tmp_path / "a.jsonl"
    plain.write_bytes(LINES)
    array = json.dumps([json.loads(line) for line in LINES.splitlines()]).encode()
    for data, name in [(LINES, "a.jsonl.gz"), (array, "a.json.gz")]:
        ids = [p.id for p in read_source(gz_file(tmp_path / name, data), "alpaca", "a")]
        assert ids == [p.id for p in read_source(plain, "alpaca", "a")] and len(ids) == 4000


def readable_part(path) -> bytes:
    """What gzip decompresses of a file cut short, up to where its stream breaks off."""
    readable = b""
    with gzip.open(path, "rb") as f:
        try:
            while chunk := f.read1(1 << 16):
                readable += chunk
        except EOFError:
            pass
    return readable


def test_a_gzipped_file_cut_short_reports_the_damage_in_decompressed_bytes(tmp_path):
    path = gz_file(tmp_path / "cut.jsonl.gz", LINES, keep=len(gzip.compress(LINES)) // 2)
    readable = readable_part(path)
    whole = readable[: readable.rindex(b"\n") + 1]
    _, report = prepare_(
        {"on_error": "skip", "sources": [{"name": "c", "path": str(path), "format": "alpaca", "n": 5000}]}
    )
    counts = report["sources"]["c"]
    assert counts["damage"] == {
        "offset": len(whole),
        "bytes": len(readable) - len(whole),
        "records_before": whole.count(b"\n"),
        "decompressed": True,
    }
    assert counts["valid"] == whole.count(b"\n") and counts["skipped_by_reason"] == {"damaged": 1}
    assert "of its decompressed data" in prepare.summary(report)
    with pytest.raises(RecordError) as e:
        prepare_({"sources": [{"name": "c", "path": str(path), "format": "alpaca", "n": 5}]})
    assert f"is damaged from byte {len(whole)} of its decompressed data" in str(e.value)
    assert "the gzip stream breaks off: Compressed file ended" in str(e.value)
    assert e.value.line == whole.count(b"\n") + 1


def test_a_gzipped_json_array_cut_short_is_located_as_its_decompressed_twin(tmp_path):
    array = json.dumps([json.loads(line) for line in LINES.splitlines()], indent=1).encode()
    path = gz_file(tmp_path / "cut.json.gz", array, keep=len(gzip.compress(array)) // 3)
    readable = readable_part(path)
    twin = tmp_path / "twin.json"
    twin.write_bytes(readable)  # the same bytes, not compressed
    [gz_damage], [plain_damage] = (
        [i.damage for i in read_source(p, "alpaca", "a") if isinstance(i, RecordError)] for p in (path, twin)
    )
    assert gz_damage == {**plain_damage, "decompressed": True} and plain_damage["records_before"] > 100


def test_a_gzip_stream_that_breaks_off_after_a_whole_record_is_damage_too(tmp_path):
    head = LINES[: LINES.index(b"\n", 1000) + 1]
    member = gzip.compress(head)
    path = tmp_path / "two.jsonl.gz"
    path.write_bytes(member + gzip.compress(LINES)[:20])  # a whole first member, then a second one broken off
    items = list(read_source(path, "alpaca", "t"))
    assert [type(i) for i in items] == [Prompt] * head.count(b"\n") + [RecordError]
    assert items[-1].damage == {
        "offset": len(head),
        "bytes": 0,
        "records_before": head.count(b"\n"),
        "decompressed": True,
    }


# ------------------------------------------------------------------------------------------- datasets on disk

CHATS = [
    [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}] for i in range(6)
]


def chat_dataset():
    return datasets.Dataset.from_dict({"chat": CHATS, "id": list(range(len(CHATS)))})


def on_disk(tmp_path, kind: str) -> Path:
    ds = chat_dataset()
    if kind == "save_to_disk":
        ds.save_to_disk(str(tmp_path / "saved"))
        return tmp_path / "saved"
    if kind == "parquet":
        ds.to_parquet(str(tmp_path / "chat.parquet"))
        return tmp_path / "chat.parquet"
    if kind == "parquet folder":
        (tmp_path / "shards").mkdir()
        for i in range(2):
            ds.shard(2, i, contiguous=True).to_parquet(str(tmp_path / "shards" / f"train-{i:05d}.parquet"))
        return tmp_path / "shards"
    ds.save_to_disk(str(tmp_path / "saved"))
    return next((tmp_path / "saved").glob("*.arrow"))


@pytest.mark.parametrize("kind", ["save_to_disk", "parquet", "parquet folder", "arrow"])
def test_a_dataset_on_disk_is_read_through_datasets_with_a_column_mapping(tmp_path, kind):
    path = on_disk(tmp_path, kind)
    prompts, report = prepare_(
        {"sources": [{"name": "uc", "path": str(path), "format": "openai", "n": 10, "columns": {"messages": "chat"}}]}
    )
    assert [p.messages for p in prompts] == [chat[:1] for chat in CHATS]
    assert report["sources"]["uc"]["read"] == len(CHATS)


def test_a_dataset_is_read_offline_and_memory_mapped(tmp_path):
    path = on_disk(tmp_path, "save_to_disk")
    code = (
        "import sys; from eaglepipe.dataset.sources import _open_dataset; from pathlib import Path\n"
        f"ds = _open_dataset(Path({str(path)!r}))\nimport datasets\n"
        "assert datasets.config.HF_HUB_OFFLINE, 'the hub is not switched off'\n"
        "print(ds.cache_files[0]['filename'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()).parent == path  # rows are read from the folder's own arrow file, not a copy


def test_a_bad_dataset_row_names_the_row_and_the_field_as_the_data_names_it(tmp_path):
    chats = list(CHATS)
    chats[3] = [{"role": "robot", "content": "beep"}]
    datasets.Dataset.from_dict({"chat": chats}).save_to_disk(str(tmp_path / "bad"))
    section = {
        "sources": [
            {"name": "uc", "path": str(tmp_path / "bad"), "format": "openai", "n": 10, "columns": {"messages": "chat"}}
        ]
    }
    with pytest.raises(RecordError) as e:
        prepare_(section)
    assert (e.value.line, e.value.field) == (3, "chat[0].role")
    assert str(e.value).startswith(f"{tmp_path / 'bad'}:3: field 'chat[0].role' has an unknown role 'robot'")
    assert "(record at dataset row 3, counted from 0)" in str(e.value)
    _, report = prepare_({**section, "on_error": "skip"})
    assert report["sources"]["uc"]["skipped_by_reason"] == {"unknown_role": 1}


def test_a_missing_column_or_a_folder_of_splits_is_named_before_any_row(tmp_path):
    path = on_disk(tmp_path, "parquet")
    with pytest.raises(UserError, match=r"chat.parquet: has no column conversation \(its columns: chat, id\)"):
        prepare_(
            {
                "sources": [
                    {
                        "name": "uc",
                        "path": str(path),
                        "format": "openai",
                        "n": 1,
                        "columns": {"messages": "conversation"},
                    }
                ]
            }
        )
    datasets.DatasetDict({"train": chat_dataset(), "test": chat_dataset()}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(UserError, match=r"holds the splits train, test: name one of them, e.g. .*dict/train"):
        prepare_({"sources": [{"name": "uc", "path": str(tmp_path / "dict"), "format": "openai", "n": 1}]})
    prompts, _ = prepare_(
        {
            "sources": [
                {
                    "name": "uc",
                    "path": str(tmp_path / "dict" / "test"),
                    "format": "openai",
                    "n": 10,
                    "columns": {"messages": "chat"},
                }
            ]
        }
    )
    assert len(prompts) == len(CHATS)


def test_a_folder_that_is_no_dataset_is_refused(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.jsonl").write_text('{"instruction": "a"}\n')
    with pytest.raises(UserError, match="should be a datasets save_to_disk folder, or .parquet or .arrow files"):
        prepare_({"sources": [{"name": "n", "path": str(tmp_path / "notes"), "format": "alpaca", "n": 1}]})


# ---------------------------------------------------------------------------------------------------- columns


def test_columns_rename_fields_of_json_records_and_errors_name_the_file_s_own_field(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "Why?", "instruction": "ignored"}\n{"instruction": "no question"}\n')
    section = {
        "sources": [
            {"name": "q", "path": str(path), "format": "alpaca", "n": 5, "columns": {"instruction": "question"}}
        ]
    }
    with pytest.raises(RecordError) as e:
        prepare_(section)
    assert (e.value.line, e.value.field) == (2, "question")  # a mapped field is read from its column only
    prompts, _ = prepare_({**section, "on_error": "skip"})
    assert [p.messages[0]["content"] for p in prompts] == ["Why?"]


def test_columns_may_name_only_fields_of_the_format(tmp_path):
    with pytest.raises(
        config.ConfigError,
        match=r"prepare.sources\[0\]: columns \['message'\]: format openai reads "
        r"only messages, tools",
    ):
        prepare_(
            {"sources": [{"name": "x", "path": "x.json", "format": "openai", "n": 1, "columns": {"message": "chat"}}]}
        )


@pytest.mark.parametrize("fmt", sorted(config.FORMATS))
def test_every_field_a_format_reads_can_be_mapped(tmp_path, fmt):
    """The format's sample records, every field it reads renamed and read back through ``columns``: the same
    prompts."""
    if fmt == "mtbench":
        records = [{"question_id": 1, "category": "writing", "turns": ["One.", "Two."]}]
    else:
        records = [rec for _, _, rec in raw_records(FIXTURES / FIXTURE[fmt])]
    fields = config.FORMATS[fmt]
    assert set(fields) <= {k for rec in records for k in rec}  # the samples hold every field it reads
    columns = {field: f"the_{field}" for field in fields}
    path = tmp_path / "renamed.jsonl"
    path.write_text("".join(json.dumps({columns.get(k, k): v for k, v in rec.items()}) + "\n" for rec in records))
    mapped = [p.to_json() for p in read_source(path, fmt, "s", columns)]
    assert mapped == [to_prompt(rec, fmt, "s")[0].to_json() for rec in records]
