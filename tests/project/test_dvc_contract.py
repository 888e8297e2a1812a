"""The DVC contract: each stage's deps list exactly the project code it runs and its params exactly the result keys it
reads; a full repro followed by a second one runs nothing; a speed knob changes nothing; changing how infer derives
reasoning re-runs infer and what is below it, never prepare."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import ROOT, stages, tiny_params

from eaglepipe.core import codedeps as deps
from eaglepipe.core import config


def test_deps_list_exactly_the_code_each_stage_runs():
    """dvc.yaml's code deps are what each stage script imports, transitively (eaglepipe/core/codedeps.py derives
    them)."""
    assert deps.differences(ROOT / "dvc.yaml") == {}


def test_deps_are_derived_from_imports_also_inside_functions(tmp_path):
    """The import walk follows absolute, relative and function-level imports, and writes them into a dvc.yaml in
    place of the listed .py deps (the other entries stay)."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "stages").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from . import b\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from .c import g\n")
    (tmp_path / "pkg" / "c.py").write_text("import json\n")
    (tmp_path / "pkg" / "unused.py").write_text("")
    (tmp_path / "stages" / "s.py").write_text("import pkg.a\n")
    dvc_yaml = tmp_path / "dvc.yaml"
    dvc_yaml.write_text(
        "stages:\n  s:\n    cmd: python stages/s.py\n    deps:\n      - stages/s.py\n"
        "      - pkg/unused.py\n      - data/x\n    outs:\n      - out\n"
    )
    assert deps.differences(dvc_yaml) == {
        "s": (["pkg/__init__.py", "pkg/a.py", "pkg/b.py", "pkg/c.py"], ["pkg/unused.py"])
    }
    dvc_yaml.write_text(deps.rewrite(dvc_yaml))
    assert yaml.safe_load(dvc_yaml.read_text())["stages"]["s"]["deps"] == [
        "stages/s.py",
        "pkg/__init__.py",
        "pkg/a.py",
        "pkg/b.py",
        "pkg/c.py",
        "data/x",
    ]
    assert deps.differences(dvc_yaml) == {}


def params_read(script: Path) -> set:
    """The params keys a stage script reads: ``cfg.<section>`` (the whole section) or ``cfg.<section>.<key>``,
    each expanded to the result keys (``config.Section.tracked_keys``)."""
    chains, inner = [], set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Attribute):
                inner.add(id(node.value))
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.insert(0, cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "cfg":
                chains.append((id(node), parts))
    keys = set()
    for node_id, parts in chains:
        if node_id in inner:
            continue  # part of a longer chain
        section = config.Params.model_fields[parts[0]].annotation
        if len(parts) == 1:
            keys |= {f"{parts[0]}.{k}" for k in section.tracked_keys()}
        elif parts[1] in section.tracked_keys():
            keys.add(f"{parts[0]}.{parts[1]}")
    return keys


@pytest.mark.parametrize("name", list(stages()))
def test_params_list_exactly_the_result_keys_each_stage_reads(name):
    stage = stages()[name]
    script = next(w for w in stage["cmd"].split() if w.startswith("stages/") and w.endswith(".py"))
    reads = params_read(ROOT / script)
    assert reads and set(stage["params"]) == reads, f"stage {name}: reads {sorted(reads)}"


def test_every_tracked_key_is_in_params_yaml():
    """DVC refuses to run a stage whose tracked key is missing from params.yaml (defaults do not count)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, stage in stages().items():
        for key in stage["params"]:
            section, _, field = key.partition(".")
            assert field in params.get(section, {}), f"stage {name} tracks {key}, which params.yaml lacks"


@pytest.fixture(scope="module")
def project(tmp_path_factory, target_folder):
    """A copy of the project (code, data sources, DVC config) in a fresh git repo, with tiny params."""
    dst = tmp_path_factory.mktemp("project")
    skip = {".git", ".venv", ".venv-vllm", ".cache", ".pytest_cache", "__pycache__", "models", "dvc.lock", "docs"}
    outputs = {"prompts", "responses", "sequences", "hidden"}

    def ignore(folder, names):
        here = Path(folder).name
        return [
            n
            for n in names
            if n in skip or (here == "data" and n in outputs) or (here == "metrics" and n.endswith(".json"))
        ]

    shutil.copytree(ROOT, dst, dirs_exist_ok=True, ignore=ignore)
    (dst / ".venv-vllm").symlink_to(ROOT / ".venv-vllm")  # infer's launched vLLM and the serve check run it
    params = tiny_params(yaml.safe_load((dst / "params.yaml").read_text()))
    (dst / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"],
    ):
        subprocess.run(cmd, cwd=dst, check=True)
    return dst


def dvc(project: Path, *args) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", EAGLEPIPE_CACHE=str(project / ".cache")
    )
    out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def make_repro(project: Path, *args) -> str:
    """What ``make repro`` runs (eaglepipe/tools/repro.py) in ``project``; its output."""
    env = dict(
        os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", EAGLEPIPE_CACHE=str(project / ".cache")
    )
    out = subprocess.run(
        [sys.executable, "-m", "eaglepipe.tools.repro", *args], cwd=project, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def assert_sequences_whose_engine_and_states_agree(project: Path) -> None:
    """merge wrote sequences; vLLM wrote each answer with its log-probabilities, and hidden's model agrees with them."""
    index = json.loads((project / "data/sequences/index.json").read_text())
    assert index["train"]["samples"] + index["valid"]["samples"] > 0
    figures = json.loads((project / "metrics/infer.json").read_text())["logprobs"]
    assert figures["records_with"] > 0 and figures["records_without"] == 0, figures
    agreement = json.loads((project / "metrics/hidden.json").read_text())["agreement"]
    assert agreement["verdict"] == "pass" and agreement["engines"] == ["vllm"], agreement
    logprobs = agreement["logprobs"]
    assert logprobs["tokens"] > 0 and logprobs["mean_abs_diff"] <= logprobs["max_mean_abs_diff"], agreement


@pytest.mark.e2e
@pytest.mark.smoke
def test_repro_then_nothing_then_only_downstream_of_a_changed_module(project):
    first = make_repro(project)
    plan, _, rest = first.partition("\n\n")
    assert plan.startswith("make repro: the plan") and all(f"  {name} " in plan for name in stages())
    for name in stages():
        assert f"Running stage '{name}'" in rest
    timed = json.loads((project / "metrics/timings/stages.json").read_text())
    assert set(timed) == set(stages()) and all(t["seconds"] > 0 for t in timed.values())
    ev = json.loads((project / "metrics/eval.json").read_text())["benchmarks"]["heldout"]
    summary = rest[rest.index("acceptance length (tokens per target forward") :]
    assert (
        f"heldout    {ev['acceptance_length']:.3f} ± " in summary
        and "serve check (vLLM serving the drafter): passed" in summary
        and "models/draft/" in summary
        and "make metrics" in summary
    )
    assert_sequences_whose_engine_and_states_agree(project)

    second = make_repro(project)
    assert "every stage is up to date" in second and "Running stage" not in second, second

    params = yaml.safe_load((project / "params.yaml").read_text())
    fast = yaml.safe_load((project / "params.yaml").read_text())
    fast["train"].update(threads=1, checkpoint_every=7)
    fast["evaluate"].update(threads=2, limit=1)
    fast["infer"]["sglang"] = {"urls": ["http://127.0.0.2:30000"], "concurrency": 8}  # params.yaml has none
    fast["infer"]["batch_size"] = 3
    fast["serve"].update(port=8012, health_timeout_s=300.0, extra_args=["--enforce-eager", "--max-num-seqs", "4"])
    (project / "params.yaml").write_text(yaml.safe_dump(fast, sort_keys=False))
    assert json.loads(dvc(project, "status", "--json").stdout) == {}  # a bigger machine invalidates nothing
    changed = yaml.safe_load((project / "params.yaml").read_text())
    changed["train"]["lr"] = 0.002
    (project / "params.yaml").write_text(yaml.safe_dump(changed, sort_keys=False))
    assert set(json.loads(dvc(project, "status", "--json").stdout)) == {"train"}  # evaluate waits on train's output
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))

    # a version is its commit plus the remote: pushed here, pulled into another clone, every output is back
    remote = project.parent / "remote"
    dvc(project, "remote", "modify", "--local", "local", "url", str(remote))
    dvc(project, "push")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "add", "-A"], cwd=project, check=True)
    subprocess.run([*git, "commit", "-qm", "v1"], cwd=project, check=True)
    clone = project.parent / "clone"
    subprocess.run(["git", "clone", "-q", str(project), str(clone)], check=True)
    dvc(clone, "remote", "modify", "--local", "local", "url", str(remote))
    dvc(clone, "pull")
    # every output but data/hidden (cache: false: hidden's store holds its states once) comes back; hidden's are
    # recomputed from an empty store, the very bytes, so nothing below it is stale
    assert set(json.loads(dvc(clone, "status", "--json").stdout)) == {"hidden", "train"}
    assert "Running stage 'train'" not in dvc(clone, "repro").stdout
    assert json.loads(dvc(clone, "status", "--json").stdout) == {}
    for out in ("data/responses/responses.jsonl", "models/draft/model.safetensors", "data/hidden/index.json"):
        assert (clone / out).read_bytes() == (project / out).read_bytes()

    with open(project / "eaglepipe/text/reasoning.py", "a") as f:
        f.write("\n# a change to how reasoning is derived\n")
    stale = json.loads(dvc(project, "status", "--json").stdout)
    readers = {name for name, stage in stages().items() if "eaglepipe/text/reasoning.py" in stage["deps"]}
    assert "infer" in readers and set(stale) == readers, stale  # infer and the stages below it that read it
    dry = dvc(project, "repro", "--dry").stdout
    assert "Running stage 'infer'" in dry and "Running stage 'prepare'" not in dry
    plan = make_repro(project, "--dry")  # what will run, each with its wall time from the first run
    assert "  infer     to run" in plan and "  prepare " not in plan and "its last run here" in plan


# Edits that cannot change a result, one per caching stage's code, and one that changes the arithmetic of the states.
COSMETIC = {
    "eaglepipe/infer/run.py": ('"""The cache\'s key.', '"""The key of the cache.'),
    "eaglepipe/hidden/extract.py": ("sequences fail alone, more than", "sequences fail when run alone, more than"),
    "eaglepipe/drafter/train.py": (
        "log = logging.getLogger(__name__)\n",
        'log = logging.getLogger(__name__)\nlog.info("")\n',
    ),
    "eaglepipe/target/model.py": ("import hashlib\n", "import hashlib\nimport math\n"),
}
STATES_ARITHMETIC = (
    "eaglepipe/hidden/layout.py",
    "return x.to(DTYPES[dtype]), None",
    "return (x + 0).to(DTYPES[dtype]), None",
)


def cache_folders(project: Path) -> dict[str, set[str]]:
    return {stage: {p.name for p in (project / ".cache" / stage).iterdir()} for stage in ("infer", "hidden", "train")}


def run_of(project: Path, stage: str) -> dict:
    """What a stage's last run computed or reused (its timings file)."""
    return json.loads((project / "metrics/timings" / f"{stage}.json").read_text())


def edit(project: Path, path: str, old: str, new: str) -> None:
    text = (project / path).read_text()
    assert old in text, (path, old)
    (project / path).write_text(text.replace(old, new, 1))


@pytest.mark.e2e
def test_caches_move_only_when_results_can(project):
    """An error message, a log line, a docstring or an import edited in the code of every caching stage: dvc reruns
    them (their code deps changed) and each gives back its cache whole, nothing generated, computed or trained anew.
    An edit to the arithmetic of the states: hidden's and train's caches start afresh, infer's answers are kept."""
    originals = {path: (project / path).read_text() for path in [*COSMETIC, STATES_ARITHMETIC[0]]}
    try:
        dvc(project, "repro", "train")
        before = cache_folders(project)
        for path, (old, new) in COSMETIC.items():
            edit(project, path, old, new)
        assert {"infer", "hidden", "train"} <= set(json.loads(dvc(project, "status", "--json").stdout))
        dvc(project, "repro", "train")
        assert cache_folders(project) == before
        assert run_of(project, "infer")["generated"] == 0
        assert run_of(project, "hidden")["computed_tokens"] == 0

        edit(project, *STATES_ARITHMETIC)
        dvc(project, "repro", "train")
        after = cache_folders(project)
        assert after["infer"] == before["infer"]
        assert len(after["hidden"] - before["hidden"]) == 1 and len(after["train"] - before["train"]) == 1
        assert run_of(project, "hidden")["computed_tokens"] > 0
    finally:
        for path, text in originals.items():
            (project / path).write_text(text)


@pytest.mark.e2e
def test_online_training_repro_runs_no_hidden_pass(project):
    """train.features: online: dvc repro runs hidden as a no-op (an index saying why, no states), train computes the
    states itself, evaluate decodes with that drafter."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"]["features"] = "online"
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert {"hidden", "train"} <= set(json.loads(dvc(project, "status", "--json").stdout))
    dvc(project, "repro", "evaluate")
    assert [p.name for p in (project / "data/hidden").iterdir()] == ["index.json"]
    assert "skipped" in json.loads((project / "metrics/hidden.json").read_text())
    trained = json.loads((project / "metrics/train.json").read_text())
    assert trained["features"] == "online" and trained["steps"] > 0
    assert json.loads((project / "metrics/eval.json").read_text())["lossless"]


@pytest.mark.engine
def test_streamed_training_repro_stores_no_states_and_reruns_train_alone_on_a_train_param(project):
    """train.features: streamed: dvc repro runs hidden as a no-op, train has a launched vLLM server compute the states
    within train.spool_bytes and deletes them; a speed knob (the budget) leaves train up to date, a result param of
    train reruns train alone."""
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["train"].update(features="streamed", spool_bytes=50_000_000)
    launch = {"port": 8037, "extra_args": ["--enforce-eager", "--dtype", "float32"]}
    params["hidden"].update(compute_dtype="float32", vllm={"concurrency": 4, "launch": launch})
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc(project, "repro", "train")
    assert [p.name for p in (project / "data/hidden").iterdir()] == ["index.json"]
    trained = json.loads((project / "metrics/train.json").read_text())
    spool = json.loads((project / "metrics/timings/train.json").read_text())["spool"]
    assert trained["features"] == "streamed" and trained["steps"] > 0 and 0 < spool["peak_bytes"] <= 50_000_000
    stale = set(json.loads(dvc(project, "status", "--json").stdout))  # downstream of train, not run here
    assert not stale & {"prepare", "infer", "merge", "hidden", "train"}, stale
    params["train"]["spool_bytes"] = 60_000_000
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert set(json.loads(dvc(project, "status", "--json").stdout)) == stale
    params["train"]["lr"] = params["train"]["lr"] / 2
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    assert set(json.loads(dvc(project, "status", "--json").stdout)) == stale | {"train"}
