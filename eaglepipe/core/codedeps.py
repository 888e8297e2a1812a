"""The project code each stage runs, derived from its imports: the one source of dvc.yaml's ``.py`` ``deps``.

``runs(script)`` is the project's .py files a script (or module) runs, transitively: absolute and relative imports,
also those inside functions (importing ``a.b.c`` runs ``a/__init__``, ``a/b/__init__`` and ``a/b/c``).
``python -m eaglepipe.core.codedeps`` compares every stage of dvc.yaml with it and exits 1 naming each difference;
``--write`` rewrites the ``.py`` entries of each stage's ``deps`` (the script first, then the package in path order;
the rest of the file stays as it is).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import click
import yaml

ROOT = Path(__file__).resolve().parents[2]


def module_file(name: str, root: Path = ROOT) -> Path | None:
    """The file of project module ``name`` (dotted), or None for a module outside the project."""
    base = root / name.replace(".", "/")
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def imported(path: Path, root: Path) -> set[str]:
    """The dotted names of the modules ``path`` imports (every prefix: a.b.c also names a and a.b)."""
    package = path.relative_to(root).parent.as_posix().replace("/", ".")
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            found = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in found:
            parts = name.split(".")
            names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def runs(script, root: Path = ROOT) -> list[str]:
    """The project .py files ``script`` runs, as paths relative to ``root``: the script first, then the rest sorted."""
    script = (root / script).resolve()
    seen, todo = set(), [script]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [f for f in (module_file(n, root) for n in imported(path, root)) if f]
    rest = sorted(p.relative_to(root).as_posix() for p in seen if p != script)
    return [script.relative_to(root).as_posix()] + rest


def script_of(stage: dict) -> str:
    """The stage script a dvc.yaml stage runs (the first ``stages/*.py`` of its command)."""
    return next(w for w in stage["cmd"].split() if w.startswith("stages/") and w.endswith(".py"))


def differences(dvc_yaml: Path) -> dict[str, tuple[list, list]]:
    """{stage: (files it runs but does not list, files it lists but does not run)} for each stage that differs."""
    out = {}
    for name, stage in yaml.safe_load(dvc_yaml.read_text())["stages"].items():
        code = set(runs(script_of(stage), dvc_yaml.parent))
        listed = {d for d in stage.get("deps", []) if isinstance(d, str) and d.endswith(".py")}
        if code != listed:
            out[name] = (sorted(code - listed), sorted(listed - code))
    return out


def rewrite(dvc_yaml: Path) -> str:
    """dvc.yaml's text with each stage's ``.py`` deps replaced by what it runs, in place of the first of them."""
    stages = yaml.safe_load(dvc_yaml.read_text())["stages"]
    out, stage, in_deps, written = [], None, False, False
    for line in dvc_yaml.read_text().splitlines(keepends=True):
        if m := re.match(r"^  (\w[\w-]*):\s*$", line):
            stage, in_deps = m.group(1), False
        elif re.match(r"^    deps:\s*$", line):
            in_deps, written = True, False
        elif re.match(r"^    \w", line):
            in_deps = False
        if in_deps and (m := re.match(r"^(\s+- )(\S+\.py)\s*$", line)):
            if not written:
                out += [f"{m.group(1)}{f}\n" for f in runs(script_of(stages[stage]), dvc_yaml.parent)]
                written = True
            continue
        out.append(line)
    return "".join(out)


@click.command(help=__doc__)
@click.option("--dvc-yaml", default=str(ROOT / "dvc.yaml"), show_default=True, type=click.Path(dir_okay=False))
@click.option("--write", is_flag=True, help="Rewrite the .py deps of every stage from its imports.")
def main(dvc_yaml, write):
    path = Path(dvc_yaml)
    if write:
        path.write_text(rewrite(path))
    diff = differences(path)
    for name, (missing, extra) in diff.items():
        click.echo(f"{path}: stage {name} runs but does not list {missing}; lists but does not run {extra}")
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
