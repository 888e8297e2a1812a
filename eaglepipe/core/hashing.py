"""Content hashes of files (read in blocks; ``file_digest`` reads each once)."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
from pathlib import Path

BLOCK = 1 << 22


log = logging.getLogger(__name__)


def file_hash(path) -> str:
    """sha256 hex digest of one file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(BLOCK), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path, memo: Path) -> str:
    """``file_hash`` of ``path``, read once: the digest is kept in the folder ``memo``, keyed by the file's resolved
    path, inode, size and mtime (a rewrite changes them). One process at a time reads a file (a lock beside its
    memo); the others, ranks of the same job, wait for its digest outside any collective."""
    path = Path(path).resolve()
    st = path.stat()
    key = f"{path}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
    kept = Path(memo) / hashlib.sha256(key.encode()).hexdigest()[:32]
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        with open(kept.with_name(f"{kept.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not kept.exists():
                if st.st_size > 1 << 30:
                    log.info("reading %s (%.1f GB) for its digest, once", path, st.st_size / 1e9)
                tmp = kept.with_name(f"{kept.name}.tmp{os.getpid()}")
                tmp.write_text(file_hash(path))
                os.replace(tmp, kept)
    return kept.read_text()
