"""The DVC contract: each stage's deps list exactly the project code it runs; a full repro followed by a second one
runs nothing; changing how infer derives reasoning re-runs infer and what is below it, never prepare."""
import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent


def module_file(name: str) -> Path | None:
    base = ROOT / name.replace(".", "/")
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def imported_files(path: Path, seen: set) -> set:
    """Project .py files that ``path`` runs, transitively: absolute and relative imports, also inside functions."""
    if path in seen:
        return seen
    seen.add(path)
    package = path.relative_to(ROOT).parent.as_posix().replace("/", ".")
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[:len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__, a/b/c
                f = module_file(".".join(parts[:i]))
                if f:
                    imported_files(f, seen)
    return seen


def stages():
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("name", list(stages()))
def test_deps_list_exactly_the_code_each_stage_runs(name):
    stage = stages()[name]
    script = next(w for w in stage["cmd"].split() if w.startswith("stages/") and w.endswith(".py"))
    runs = {p.relative_to(ROOT).as_posix() for p in imported_files(ROOT / script, set())}
    code_deps = {d for d in stage["deps"] if d.endswith(".py")}
    assert runs == code_deps, f"stage {name}: runs but does not list {sorted(runs - code_deps)}; " \
                              f"lists but does not run {sorted(code_deps - runs)}"


def tiny_params(params: dict) -> dict:
    for source in params["prepare"]["sources"]:
        source["n"] = 2
    params["infer"].update(max_new_tokens=8, batch_size=4)
    params["infer"]["gates"].update(max_truncated=1.0, warmup=4, every=4)
    params["train"].update(epochs=1, draft_vocab_size=256)
    params["evaluate"].update(limit=2, max_new_tokens=8)
    return params


@pytest.fixture(scope="module")
def project(tmp_path_factory, target_folder):
    """A copy of the project (code, data sources, DVC config) in a fresh git repo, with tiny params."""
    dst = tmp_path_factory.mktemp("project")
    skip = {".git", ".venv", ".cache", ".pytest_cache", "__pycache__", "models", "dvc.lock", "docs"}
    outputs = {"prompts", "responses", "sequences", "hidden"}

    def ignore(folder, names):
        here = Path(folder).name
        return [n for n in names if n in skip or (here == "data" and n in outputs) or
                (here == "metrics" and n.endswith(".json"))]

    shutil.copytree(ROOT, dst, dirs_exist_ok=True, ignore=ignore)
    params = tiny_params(yaml.safe_load((dst / "params.yaml").read_text()))
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"], ["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                                               "commit", "-qm", "copy"]):
        subprocess.run(cmd, cwd=dst, check=True)
    return dst


def dvc(project: Path, *args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
               EAGLEPIPE_CACHE=str(ROOT / ".cache"))
    out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_repro_then_nothing_then_only_downstream_of_a_changed_module(project):
    first = dvc(project, "repro")
    for name in stages():
        assert f"Running stage '{name}'" in first.stdout
    index = json.loads((project / "data/sequences/index.json").read_text())
    assert index["train"]["samples"] + index["valid"]["samples"] > 0

    second = dvc(project, "repro")
    assert "Running stage" not in second.stdout, second.stdout

    with open(project / "eaglepipe/reasoning.py", "a") as f:
        f.write("\n# a change to how reasoning is derived\n")
    stale = json.loads(dvc(project, "status", "--json").stdout)
    readers = {name for name, stage in stages().items() if "eaglepipe/reasoning.py" in stage["deps"]}
    assert "infer" in readers and set(stale) == readers, stale  # infer and the stages below it that read it
    dry = dvc(project, "repro", "--dry").stdout
    assert "Running stage 'infer'" in dry and "Running stage 'prepare'" not in dry
