"""Source readers: a source's raw records, streamed (``raw_records``), and each as a Prompt by its format
(``read_source``, formats.py).

A source is a JSON Lines or JSON array file (gzipped when named ``.gz``), a ``datasets`` ``save_to_disk`` folder, a
``.parquet`` or ``.arrow`` file or a folder of them (read offline), or ``pkg:<package>/<path>`` (``resolve``). A
record that cannot be read or converted becomes a ``records.RecordError`` naming file, position, field and reason.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import io
import json
import os
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import ijson

from eaglepipe.core.config import CACHE, PACKAGE_PATH
from eaglepipe.core.errors import UserError
from eaglepipe.core.hashing import file_hash
from eaglepipe.core.records import LineError, Prompt, RecordError, content_id, scan_jsonl
from eaglepipe.dataset.formats import CONVERTERS, BadRecord, LeftOut

# ---------------------------------------------------------------------------------------------------------- paths


def resolve(path: str) -> Path:
    """The file or folder a source's ``path`` names. ``pkg:<package>/<file>`` is ``<file>`` inside the installed
    top-level package ``<package>``, found without importing it. Raises FileNotFoundError when the package is not
    installed or lacks the file."""
    match = PACKAGE_PATH.fullmatch(path)
    if not match:
        return Path(path)
    spec = importlib.util.find_spec(match["package"])
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{path}: no installed package {match['package']} (requirements.txt and the "
            "Makefile's venv recipe install the data packages: make venv)"
        )
    for folder in spec.submodule_search_locations:
        if (Path(folder) / match["file"]).exists():
            return Path(folder) / match["file"]
    raise FileNotFoundError(
        f"{path}: the package {match['package']} (in {', '.join(spec.submodule_search_locations)})"
        f" has no {match['file']}"
    )


# ---------------------------------------------------------------------------------------------------------- files

CHUNK = 1 << 16
"""Bytes read at a time from a JSON array file; a record may span any number of chunks."""


def identity(path: str) -> dict:
    """A source file in a report: its path and sha256, for a ``pkg:`` path with its package (``package_file``)."""
    return {"path": path, **(package_file(path) if PACKAGE_PATH.fullmatch(path) else {"sha256": file_hash(path)})}


def package_file(path: str) -> dict:
    """The file a ``pkg:`` path names, for a report: its package's distribution, version and the file's sha256."""
    package = PACKAGE_PATH.fullmatch(path)["package"]
    dists = importlib.metadata.packages_distributions().get(package, [])
    return {
        "distribution": ", ".join(dists),
        "version": ", ".join(importlib.metadata.version(d) for d in dists),
        "sha256": file_hash(resolve(path)),
    }


class Damage(BadRecord):
    """The unreadable tail of a file: from byte ``offset`` to its end (``size`` bytes), after ``records_before``
    whole records. ``damage``: its prepare report entry; in a gzipped file, offsets into the decompressed data
    (``decompressed: true``)."""

    def __init__(self, offset: int, size: int, records_before: int, cause: str, gzipped: bool = False):
        data = " of its decompressed data" if gzipped else ""
        super().__init__("damaged", None, f"is damaged from byte {offset}{data} to its end ({size} bytes): {cause}")
        self.damage = {"offset": offset, "bytes": size, "records_before": records_before}
        if gzipped:
            self.damage["decompressed"] = True


class _Bytes(io.RawIOBase):
    """A source file's bytes, decompressed for a ``.gz`` name, and how many were read (``count``). Where compressed
    data ends early or is corrupt, the bytes end there and ``error`` says why."""

    def __init__(self, path: Path):
        super().__init__()
        self.gzipped = path.suffix == ".gz"
        self.file = gzip.open(path, "rb") if self.gzipped else open(path, "rb")  # noqa: SIM115  close() closes it
        self.error = None
        self.count = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            data = self.file.read1(len(buffer))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            self.error = e
            data = b""
        buffer[: len(data)] = data
        self.count += len(data)
        return len(data)

    def close(self):
        self.file.close()
        super().close()


def _damage(f: io.BufferedReader, offset: int, records_before: int, cause: str) -> Damage:
    """The Damage of ``f``'s file from byte ``offset`` to its end: ``f`` is read to its end for its size and, for a
    gzip stream, for where it breaks off."""
    while f.read(CHUNK):
        pass
    if f.raw.error:
        cause += f"; the gzip stream breaks off: {f.raw.error}"
    return Damage(offset, f.raw.count - offset, records_before, cause, f.raw.gzipped)


def _jsonl(f: io.BufferedReader) -> Iterator[tuple[int, dict | BadRecord]]:
    """(line, object or BadRecord) per non-blank line; a broken line does not stop the rest. A last line without
    its newline that does not parse was cut short: the file's Damage."""
    for index, (n, raw, item) in enumerate(scan_jsonl(f)):
        if isinstance(item, LineError) and not raw.endswith(b"\n"):  # the last line: the file is read to its end
            cause = f"its last line is cut short and {item.problem} (record index {index}, counted from 0)"
            item = _damage(f, f.raw.count - len(raw), index, cause)
        elif isinstance(item, LineError):
            item = BadRecord(item.reason, None, item.problem)
        yield n, item


def _json_array(f: io.BufferedReader, path: Path) -> Iterator[tuple[int, object]]:
    """(array index, item) per item of a JSON array file, streamed (memory: a chunk and the item being read). When
    the file is cut short or broken, the last pair is (index of the first item not read, Damage)."""
    index = 0
    try:
        for item in ijson.items(f, "item", use_float=True):
            yield index, item
            index += 1
    except ijson.JSONError as e:
        cause = f"the JSON array breaks off ({_first_line(e)})"
        yield index, _damage(f, _after_items(path, index), index, cause)


def _first_line(error: Exception) -> str:
    """The first line of the parser's message (the others point into the text)."""
    message = error.args[0] if error.args else ""
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    return (message.strip().splitlines() or ["not valid JSON"])[0]


_BEFORE_ITEM = re.compile(r"[ \t\r\n]*[\[,]?[ \t\r\n]*")
"""What comes before an item of a JSON array: blanks, its opening bracket or a comma, blanks."""
_ITEM = json.JSONDecoder(strict=False)  # items the parser has read whole; this one only finds where they end


def _after_items(path: Path, count: int) -> int:
    """The byte offset of a JSON array file after its opening bracket, its first ``count`` items and the comma after
    them: a second read from the start. The bytes are read as Latin-1, a character each, so that positions in the
    text are byte offsets (JSON's syntax is ASCII, and no byte of a UTF-8 character beyond ASCII is)."""
    ends = [_before_item_end] + [_item_end, _before_item_end] * count
    with _Bytes(path) as stream:
        text = ""  # what was read and not yet dropped
        dropped = 0  # bytes dropped from the front of text
        at = 0  # where the walk is in text
        for end_of in ends:
            end = end_of(text, at)
            while end in (None, len(text)) and (chunk := stream.read(max(CHUNK, len(text) - at))):
                dropped += at  # what ends where the text read so far ends may go on: read more
                text = text[at:] + chunk.decode("latin-1")
                at = 0
                end = end_of(text, at)
            at = end
    return dropped + at


def _before_item_end(text: str, at: int) -> int:
    return _BEFORE_ITEM.match(text, at).end()


def _item_end(text: str, at: int) -> int | None:
    """Where the JSON value at ``at`` in ``text`` ends; None when ``text`` does not hold it whole."""
    try:
        return _ITEM.raw_decode(text, at)[1]
    except json.JSONDecodeError:
        return None


def _starts_array(path: Path) -> bool:
    """Whether the first character of the file that is not blank is ``[``."""
    with _Bytes(path) as stream:
        while chunk := stream.read(CHUNK):
            if text := chunk.lstrip(b" \t\r\n"):
                return text.startswith(b"[")
    return False


def _json_records(path: Path) -> Iterator[tuple[int, str | None, dict | BadRecord]]:
    """The records of a JSON Lines or JSON array file, plain or gzipped (``raw_records``)."""
    unit = "JSON array index" if _starts_array(path) else None
    with io.BufferedReader(_Bytes(path), CHUNK) as f:
        pos = 0
        count = 0
        for pos, item in _json_array(f, path) if unit else _jsonl(f):
            yield pos, unit, item
            if isinstance(item, Damage):
                return
            count += 1
        if f.raw.error:  # the records decompressed so far end whole, and nothing after them is readable
            cause = f"the gzip stream breaks off after the last whole record: {f.raw.error}"
            yield (count if unit else pos + 1), unit, Damage(f.raw.count, 0, count, cause, gzipped=True)


DATASET_FILES = (".parquet", ".arrow")


def _open_dataset(path: Path):
    """The rows of a dataset on disk, the hub switched off: a ``save_to_disk`` folder or ``.arrow`` files
    memory-mapped, ``.parquet`` files streamed. Raises UserError for a split dataset or a folder of neither kind."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets

    if (path / "dataset_dict.json").is_file():
        splits = json.loads((path / "dataset_dict.json").read_text())["splits"]
        raise UserError(f"{path}: holds the splits {', '.join(splits)}: name one of them, e.g. {path / splits[0]}")
    if (path / "state.json").is_file():
        return datasets.load_from_disk(str(path))
    files = sorted(p for p in path.iterdir() if p.suffix in DATASET_FILES) if path.is_dir() else [path]
    kinds = {p.suffix for p in files}
    if len(kinds) != 1:
        raise UserError(
            f"{path}: should be a datasets save_to_disk folder, or .parquet or .arrow files "
            f"(found {'both kinds' if kinds else 'neither'})"
        )
    if kinds == {".arrow"}:
        return datasets.concatenate_datasets([datasets.Dataset.from_file(str(p)) for p in files])
    return datasets.load_dataset(
        "parquet", data_files=[str(p) for p in files], split="train", streaming=True, cache_dir=str(CACHE / "datasets")
    )  # where it keeps a lock file, no data


def _no_nulls(value):
    """``value`` without the None entries of its objects (arrow gives every row every key of a struct column)."""
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def _dataset_records(path: Path, columns: tuple) -> Iterator[tuple[int, str, dict]]:
    """The rows of a dataset on disk (``raw_records``); ``columns`` must be among its columns."""
    import pyarrow

    try:
        rows = _open_dataset(path)
        missing = sorted(set(columns) - set(rows.column_names or columns))
        if missing:
            raise UserError(f"{path}: has no column {', '.join(missing)} (its columns: {', '.join(rows.column_names)})")
        for row, rec in enumerate(rows):
            yield row, "dataset row", _no_nulls(rec)
    except (OSError, ValueError, pyarrow.ArrowException) as e:
        raise UserError(f"{path}: not readable as a dataset ({type(e).__name__}: {str(e).splitlines()[0]})") from None


def raw_records(path, columns: tuple = ()) -> Iterator[tuple[int, str | None, dict | BadRecord]]:
    """Yield ``(position, unit, record or BadRecord)`` for every record of a source, streamed. ``path`` may be a
    ``pkg:`` path; ``columns``: the columns a dataset must have.

    A folder, ``.parquet`` or ``.arrow`` file is a dataset (position: the row from 0, unit ``dataset row``). A file
    whose first non-blank character is ``[`` is a JSON array (the index from 0, unit ``JSON array index``), any other
    JSON Lines (the line number from 1, unit None); a file unreadable to its end ends with a ``Damage``."""
    path = resolve(str(path))
    yield from _dataset_records(path, columns) if path.is_dir() or path.suffix in DATASET_FILES else _json_records(path)


# -------------------------------------------------------------------------------------------------------- prompts


def to_prompt(rec, fmt: str, source: str) -> tuple[Prompt, set]:
    """A raw record of format ``fmt`` as a Prompt, and the keys of the conversation rules that concern it (raises
    BadRecord)."""
    if not isinstance(rec, dict):
        raise BadRecord("not_object", None, f"should be a JSON object, got {type(rec).__name__}")
    messages, tools, rules = CONVERTERS[fmt](rec)
    return Prompt(content_id(messages, tools), source, messages, tools), rules


def _as_named(field: str | None, columns: dict) -> str | None:
    """A format field named as the data names it (``messages[2].role`` read from column ``chat``: ``chat[2].role``)."""
    head = re.match(r"[^.\[]+", field or "")
    return columns[head[0]] + field[head.end() :] if head and head[0] in columns else field


def read_source(path, fmt: str, source: str, columns: dict | None = None, rules=None) -> Iterator[Prompt | RecordError]:
    """Each record of a source as a Prompt, or a RecordError when broken or left out, with ``.reason``,
    ``.left_out`` (True for a record with no prompt in it: no error) and ``.damage`` (None, or for a damaged file's
    tail ``{offset, bytes, records_before}``). ``columns`` maps format fields onto the record's names for them;
    ``rules`` (a Counter), when given, counts the prompts each conversation rule concerns."""
    columns, file = columns or {}, resolve(str(path))
    for pos, unit, rec in raw_records(file, tuple(columns.values())):
        try:
            if isinstance(rec, BadRecord):
                raise rec
            if isinstance(rec, dict) and columns:  # a mapped field is read from its column only
                rec = {
                    **{k: v for k, v in rec.items() if k not in columns},
                    **{field: rec[column] for field, column in columns.items() if column in rec},
                }
            prompt, applied = to_prompt(rec, fmt, source)
            if rules is not None:
                rules.update(applied)
            yield prompt
        except BadRecord as bad:
            problem = bad.problem + (f" (record at {unit} {pos}, counted from 0)" if unit else "")
            err = RecordError(file, pos, _as_named(bad.field, columns), problem)
            err.reason, err.damage, err.left_out = bad.reason, bad.damage, isinstance(bad, LeftOut)
            yield err
