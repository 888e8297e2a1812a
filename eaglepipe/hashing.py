"""Content hashes of files, read in blocks (a file may be larger than memory)."""
from __future__ import annotations

import hashlib

BLOCK = 1 << 22


def files_hash(paths) -> str:
    """sha256 hex digest of the files' bytes, one after the other in the order given."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(BLOCK), b""):
                h.update(block)
    return h.hexdigest()


def file_hash(path) -> str:
    """sha256 hex digest of one file's bytes."""
    return files_hash([path])
