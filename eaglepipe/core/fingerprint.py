"""Cache keys that move only when results can (scheme 2).

Each resumable cache (infer's answers, hidden's states, train's checkpoint) names the project modules whose code
decides its outputs, beside the module that keeps it (``infer.run.GENERATION_CODE``, ``hidden.extract.RESULT_CODE``,
``drafter.train.RESULT_CODE``). ``code_key`` hashes their code after taking out what cannot change a result:

- docstrings, comments and layout;
- import statements (a name's meaning is in the code that uses it);
- the message of a raised exception and of an assert (the exception's type stays);
- logging calls (``log.*``, ``logger.*``, ``logging.*``, ``warnings.warn``, ``print``).

Each top-level definition is hashed on its own and the list is sorted, so a definition moved between the named
modules, or a module renamed, keeps the key. Code the lists do not name never moves it: another stage's code, the
command line, record reading and the transport to a server. ``tests/core/test_fingerprint.py`` checks that every
module a stage runs is either named or listed there as deciding nothing of that cache.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

SCHEME = 2
PACKAGE = Path(__file__).resolve().parents[1]
LOGGERS = frozenset({"log", "logger", "logging", "warnings"})
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def module_path(name: str, package: Path = PACKAGE) -> Path:
    """The file of project module ``name``, dotted below the package (``hidden.extract``)."""
    base = package / name.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    raise FileNotFoundError(f"{name} names no module of the package ({base}.py does not exist)")


def _is_logging(statement: ast.stmt) -> bool:
    if not isinstance(statement, ast.Expr) or not isinstance(statement.value, ast.Call):
        return False
    func = statement.value.func
    if isinstance(func, ast.Name):
        return func.id == "print"
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in LOGGERS


class _Normalise(ast.NodeTransformer):
    """Takes out of a syntax tree what cannot change a result (the module's docstring lists it)."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for field in ("body", "orelse", "finalbody"):
            statements = getattr(node, field, None)
            if not isinstance(statements, list) or not statements or not isinstance(statements[0], ast.stmt):
                continue
            if field == "body" and isinstance(node, DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
                statements = statements[1:]
            kept = [s for s in statements if not _is_logging(s) and not isinstance(s, (ast.Import, ast.ImportFrom))]
            if not kept and field == "body":
                kept = [ast.Pass()]
            setattr(node, field, kept)
        return node

    def visit_Raise(self, node: ast.Raise):
        if isinstance(node.exc, ast.Call):
            node.exc = node.exc.func
        return node

    def visit_Assert(self, node: ast.Assert):
        node.msg = None
        return node


def definitions(path: Path) -> list[str]:
    """The normalised top-level statements of one module, each dumped with its name (a definition's or an
    assignment's), sorted."""
    tree = _Normalise().visit(ast.parse(path.read_text(), filename=str(path)))
    return sorted(ast.dump(statement, include_attributes=False) for statement in tree.body)


def code_key(modules, package: Path = PACKAGE) -> str:
    """sha256 hex digest of the named modules' normalised definitions, pooled and sorted, under this scheme."""
    pooled = sorted(d for name in set(modules) for d in definitions(module_path(name, package)))
    digest = hashlib.sha256(f"scheme {SCHEME}\0".encode())
    for dumped in pooled:
        digest.update(dumped.encode() + b"\0")
    return digest.hexdigest()
