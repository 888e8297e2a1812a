"""Content hashes of files, read in blocks (a file may be larger than memory), and of Python code by what it does."""
from __future__ import annotations

import ast
import hashlib

BLOCK = 1 << 22
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)  # nodes that may open with a docstring


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


def code_hash(paths) -> str:
    """sha256 hex digest of Python modules' syntax trees without their docstrings, in the order given (what cache
    fingerprints hash of code): comments, docstrings and layout do not change it."""
    h = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        h.update(ast.dump(tree, include_attributes=False).encode() + b"\0")
    return h.hexdigest()
