"""infer's answer cache (eaglepipe/infer/cache.py): what a kill leaves in it is repaired on load, and what follows
resumes."""

import json

from eaglepipe.core.records import Generation
from eaglepipe.infer.cache import Cache


def test_torn_last_line_and_duplicates_are_dropped_and_counted(tmp_path):
    cache = Cache(tmp_path)
    line = json.dumps(
        {"id": "a", "source": "s", "prompt_ids": [1], "output_ids": [2], "finish_reason": "stop", "sample": 0}
    )
    cache.path.write_text(line + "\n" + line + "\n" + line[:20])
    done, counts = cache.load()
    assert list(done) == ["a"] and counts == {"duplicates": 1, "torn_last_line": 1}
    assert cache.path.read_text() == line + "\n"


def test_a_whole_last_line_without_its_newline_is_kept_and_what_follows_resumes(tmp_path):
    """A kill after a record's bytes and before its newline leaves a whole last line: load keeps it and ends the file
    with its newline, so records appended after it stay on lines of their own (and a later resume reads them all)."""
    cache = Cache(tmp_path)
    gens = [
        Generation(id=i, source="s", prompt_ids=[1], output_ids=[2], finish_reason="stop", sample=0)
        for i in ("a", "b", "c")
    ]
    cache.add(gens[0])
    cache.path.write_bytes(cache.path.read_bytes().rstrip(b"\n"))
    done, counts = cache.load()
    assert list(done) == ["a"] and not counts
    cache.add(gens[1])
    cache.add(gens[2])
    done, counts = cache.load()
    assert list(done) == ["a", "b", "c"] and not counts and cache.path.read_bytes().count(b"\n") == 3
