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
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

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
        self.cause = cause
        self.damage = {"offset": offset, "bytes": size, "records_before": records_before}
        if gzipped:
            self.damage["decompressed"] = True


class _Gunzip(io.RawIOBase):
    """The decompressed bytes of a gzip file, seekable (backwards by decompressing again). Where the compressed
    data ends early or is corrupt, the stream ends there and ``error`` says why."""

    def __init__(self, path):
        self.gz, self.error = gzip.open(path, "rb"), None  # noqa: SIM115  this stream owns it: close() closes it

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.gz.tell()

    def readinto(self, buffer) -> int:
        try:
            data = self.gz.read1(len(buffer))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            self.error = e
            return 0
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset, whence=io.SEEK_SET):
        if whence == io.SEEK_END:  # the decompressed size is known only once everything is read
            while self.readinto(bytearray(CHUNK)):
                pass
            return self.tell()
        return self.gz.seek(offset, whence)

    def close(self):
        self.gz.close()
        super().close()


def _skip(f: BinaryIO, offset: int, comma: bool) -> int:
    """The offset of the first byte from ``offset`` on that is neither JSON whitespace nor, with ``comma``, the first
    comma met."""
    f.seek(offset)
    while (b := f.read(1)) and (b in b" \t\r\n" or comma and b == b","):
        comma = comma and b != b","
        offset += 1
    return offset


def _jsonl(f: BinaryIO) -> Iterator[tuple[int, dict | BadRecord]]:
    """(line, object or BadRecord) per non-blank line; a broken line does not stop the rest. A last line without
    its newline that does not parse was cut short: the file's Damage."""
    for index, (n, raw, item) in enumerate(scan_jsonl(f)):
        if isinstance(item, LineError) and not raw.endswith(b"\n"):  # the last line: f is at the end of the file
            item = Damage(
                f.tell() - len(raw),
                len(raw),
                index,
                f"its last line is cut short and {item.problem} (record index {index}, counted from 0)",
            )
        elif isinstance(item, LineError):
            item = BadRecord(item.reason, None, item.problem)
        yield n, item


def _parser(target):
    """An incremental JSON array parser: sent bytes, it sends ``target`` each item as soon as it is whole."""
    return ijson.items_coro(target, "item", use_float=True)


class _Count:
    """A parser target that only counts the items."""

    def __init__(self):
        self.n = 0

    def send(self, _item):
        self.n += 1


def _json_array(f: BinaryIO) -> Iterator[tuple[int, object]]:
    """(array index, item) per item of a JSON array file, read ``CHUNK`` bytes at a time (memory: a chunk and the
    items ending in it). When the file is cut short or broken, the last pair is (index of the first item not read,
    Damage)."""
    items, index, at, error = ijson.sendable_list(), 0, 0, None
    ended_in = 0  # offset of the chunk in which the last item so far ended
    parser = _parser(items)
    while True:
        chunk = f.read(CHUNK)
        try:
            parser.send(chunk) if chunk else parser.close()
        except ijson.JSONError as e:
            error = e
        if items:
            ended_in = at
        for item in items:
            yield index, item
            index += 1
        items.clear()
        if error or not chunk:
            break
        at += len(chunk)
    if error:
        start = _tail_start(f, index, ended_in)
        cause = f"the JSON array breaks off ({_first_line(error)})"
        yield index, Damage(start, f.seek(0, io.SEEK_END) - start, index, cause)


def _first_line(error: Exception) -> str:
    """The first line of the parser's message (the others point into the text)."""
    message = error.args[0] if error.args else ""
    if isinstance(message, bytes):
        message = message.decode("utf-8", "replace")
    return (message.strip().splitlines() or ["not valid JSON"])[0]


def _tail_start(f: BinaryIO, count: int, ended_in: int) -> int:
    """Where the unreadable tail of a JSON array file starts: after its first ``count`` items and their separator.
    ``ended_in``: the offset of the chunk in which the last of those items ended."""
    if count == 0:
        return _skip(f, _skip(f, 0, comma=False) + 1, comma=False)
    done = _Count()
    parser = _parser(done)
    f.seek(0)
    while f.tell() < ended_in:
        parser.send(f.read(min(CHUNK, ended_in - f.tell())))
    end = ended_in
    while done.n < count:
        parser.send(f.read(1))
        end += 1
    return _skip(f, end, comma=True)


@contextmanager
def _open(path: Path):
    """``(binary file, gunzip)``: the file, or for a ``.gz`` name its decompressed data with ``gunzip`` the
    decompressor (its ``error``: why the compressed data broke off); ``gunzip`` is None for a plain file."""
    if path.suffix != ".gz":
        with open(path, "rb") as f:
            yield f, None
        return
    gunzip = _Gunzip(path)
    with io.BufferedReader(gunzip, CHUNK) as f:
        yield f, gunzip


def _json_records(path: Path) -> Iterator[tuple[int, str | None, dict | BadRecord]]:
    """The records of a JSON Lines or JSON array file, plain or gzipped (``raw_records``)."""
    with _open(path) as (f, gunzip):
        f.seek(_skip(f, 0, comma=False))
        unit = "JSON array index" if f.read(1) == b"[" else None
        f.seek(0)
        pos, count = 0, 0
        for pos, item in _json_array(f) if unit else _jsonl(f):
            if gunzip and isinstance(item, Damage):
                break_off = f"; the gzip stream breaks off: {gunzip.error}" if gunzip.error else ""
                d = item.damage
                item = Damage(d["offset"], d["bytes"], d["records_before"], item.cause + break_off, gzipped=True)
            yield pos, unit, item
            if isinstance(item, Damage):
                return
            count += 1
        if gunzip and gunzip.error:  # the records decompressed so far end whole, and nothing after them is readable
            end = f.seek(0, io.SEEK_END)
            yield (
                (count if unit else pos + 1),
                unit,
                Damage(
                    end,
                    0,
                    count,
                    f"the gzip stream breaks off after the last whole record: {gunzip.error}",
                    gzipped=True,
                ),
            )


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
