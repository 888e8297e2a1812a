"""infer's store of finished answers: one folder per ``run.fingerprint``, appended and fsync'd answer by answer, so
that a run killed at any point resumes with every finished answer once. A line is a ``Generation`` (core/records.py),
the engine's log-probabilities included; a line written before engines gave them reads with ``logprobs`` None."""

from __future__ import annotations

import io
import os
from collections import Counter
from pathlib import Path

from eaglepipe.core.records import Generation, RecordError, generation_from_json, json_object, scan_jsonl, writer


class Cache:
    """Append-only JSON Lines of finished generations (and of permanent failures) for one fingerprint."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "generations.jsonl"
        self.failures_path = folder / "failures.jsonl"

    def load(self) -> tuple[dict, Counter]:
        """(finished generations by id, counts). A torn last line is dropped and a duplicate id keeps its first
        record, both counted, and the file is rewritten without them (and with a last line's missing newline)."""
        done, counts = {}, Counter()
        if not self.path.exists():
            return done, counts
        good, torn, raw = [], None, b"\n"
        with open(self.path, "rb") as f:
            for n, raw, obj in scan_jsonl(f):
                if torn is not None:  # only the last line can be torn by a kill
                    raise torn
                try:
                    gen = generation_from_json(json_object(obj, self.path, n), self.path, n)
                except RecordError as e:
                    torn = e
                    continue
                if gen.id in done:
                    counts["duplicates"] += 1
                    continue
                done[gen.id] = gen
                good.append(raw.rstrip(b"\n"))
        if torn is not None:
            counts["torn_last_line"] += 1
        if counts or not raw.endswith(b"\n"):
            tmp = self.path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.write(b"".join(g + b"\n" for g in good))
                f.flush()
                os.fsync(f.fileno())  # the rewrite replaces fsynced records: it must be on disk first
            os.replace(tmp, self.path)
        return done, counts

    def _append(self, path: Path, record) -> None:
        """Append one line in one write and fsync it: once this returns, the record survives a kill."""
        line = io.BytesIO()
        writer(line).write(record)
        with open(path, "ab") as f:
            f.write(line.getvalue())
            f.flush()
            os.fsync(f.fileno())

    def add(self, gen: Generation) -> None:
        self._append(self.path, gen)

    def fail(self, rid: str, reason: str) -> None:
        self._append(self.failures_path, {"id": rid, "reason": reason})
