"""Cache keys (eaglepipe/core/fingerprint.py): what keeps them and what moves them, on copies of real modules; and
every module a caching stage runs is either named by its cache or listed here as deciding nothing of it."""

import shutil

import pytest
from helpers import ROOT

from eaglepipe.core import codedeps
from eaglepipe.core.fingerprint import PACKAGE, code_key
from eaglepipe.drafter import methods, train
from eaglepipe.hidden import extract
from eaglepipe.infer import run as infer_run

EXTRACT = (PACKAGE / "hidden/extract.py").read_text()
# Edits that cannot change a result, each on hidden's extraction (what it must hold for the edit to apply).
KEEPING = {
    "docstring": ('"""The store\'s name: a hash', '"""The name of the store: a hash'),
    "comment": ("log = logging.getLogger(__name__)\n", "log = logging.getLogger(__name__)  # plain logging\n"),
    "error message": ("sequences fail alone, more than", "sequences fail when run alone, more than"),
    "import line": ("import hashlib\n", "import hashlib\nimport math\n"),
}


def package_copy(tmp_path, edit=None):
    """A copy of the package with one replacement made in hidden/extract.py."""
    copy = tmp_path / "eaglepipe"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if edit:
        old, new = edit
        text = (copy / "hidden/extract.py").read_text()
        assert old in text, old
        (copy / "hidden/extract.py").write_text(text.replace(old, new, 1))
    return copy


@pytest.mark.parametrize("kind", sorted(KEEPING))
def test_an_edit_that_cannot_change_a_result_keeps_the_key(tmp_path, kind):
    copy = package_copy(tmp_path, KEEPING[kind])
    assert code_key(extract.RESULT_CODE, copy) == code_key(extract.RESULT_CODE)


def test_a_log_line_keeps_the_key(tmp_path):
    marker = "    return hashlib.sha256(blob.encode()).hexdigest()[:16]\n"
    assert marker in EXTRACT
    copy = package_copy(tmp_path, (marker, '    log.info("store %s", blob)\n' + marker))
    assert code_key(extract.RESULT_CODE, copy) == code_key(extract.RESULT_CODE)


def test_a_definition_moved_between_named_modules_or_a_renamed_module_keeps_the_key(tmp_path):
    copy = package_copy(tmp_path)
    layout = (copy / "hidden/layout.py").read_text()
    start = layout.index("\ndef layer_ids(")
    end = layout.index("\ndef ", start + 1)
    moved = layout[start:end]
    (copy / "hidden/layout.py").write_text(layout[:start] + layout[end:])
    (copy / "hidden/extract.py").write_text((copy / "hidden/extract.py").read_text() + "\n" + moved)
    assert code_key(extract.RESULT_CODE, copy) == code_key(extract.RESULT_CODE)
    (copy / "hidden/extract.py").rename(copy / "hidden/states.py")
    renamed = [name.replace("hidden.extract", "hidden.states") for name in extract.RESULT_CODE]
    assert code_key(renamed, copy) == code_key(extract.RESULT_CODE)


@pytest.mark.parametrize(
    "module, old, new",
    [
        ("hidden/layout.py", ".clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX", ".clamp(min=1e-12) / FP8_MAX"),
        (
            "drafter/eagle3/ttt.py",
            "total = total + step_weight**k * (loss * weight)",
            "total = total + loss * weight",
        ),
        ("engines/hf.py", "rows = len(batch) + 1", "rows = len(batch) + 2"),
    ],
)
def test_a_change_to_the_arithmetic_moves_the_keys_downstream_of_it_alone(tmp_path, module, old, new):
    """A change to the states' layout moves hidden's and train's keys, not infer's; one to the loss moves only
    train's; one to the in-process engine's sampling only infer's (the hf engine's key)."""
    copy = package_copy(tmp_path)
    text = (copy / module).read_text()
    assert old in text, old
    (copy / module).write_text(text.replace(old, new, 1))
    keys = {
        "infer": (infer_run.GENERATION_CODE + ("engines.hf",)),
        "hidden": extract.RESULT_CODE,
        "train": train.RESULT_CODE + methods.METHODS["eagle3"].code,
    }
    moved = {name for name, modules in keys.items() if code_key(modules, copy) != code_key(modules)}
    dotted = module.removesuffix(".py").replace("/", ".")
    assert moved == {name for name, modules in keys.items() if dotted in modules}
    assert moved


# What each caching stage runs that decides nothing of its cache, with the reason. A module a stage starts to run
# must land in its cache's list or here: the test below fails until it does.
NO_RESULT = {
    "__init__": "the package's docstring",
    "core": "the subpackage's docstring",
    "core.cli": "option parsing, logging set-up and publishing a report",
    "core.config": "params: each cache hashes the values it reads",
    "core.section": "likewise",
    "core.data_sections": "likewise",
    "core.model_sections": "likewise",
    "core.errors": "the user error type",
    "core.explain": "error wording",
    "core.hashing": "file digests: the model's fingerprint hashes the files themselves",
    "core.records": "record schemas and JSON Lines reading and writing",
    "core.codedeps": "dvc.yaml's code deps",
    "core.fingerprint": "computes the keys: its SCHEME is part of each",
    "core.uncertainty": "standard errors of the report's figures",
    "dataset": "the subpackage's docstring",
    "engines.launch": "starting a server: the engine modules predict its identity, hashed as data",
    "engines.pool": "the choice of a server, failover",
    "engines.server": "the transport: requests in flight, retries",
    "engines.table": "which engine a name builds",
    "engines.logprobs": "asks for and reads the engine's log-probabilities, a check's input compared within a "
    "tolerance far above their rounding; no id depends on it",
    "infer.report": "the report's counts",
    "infer.preflight": "checks the engine against transformers before generating; it refuses, changes no answer",
    "hidden.agreement": "checks the answers' engine against the states' model: it stops a run, changes no state",
    "hidden.comparison": "likewise",
    "hidden.fallback": "likewise",
    "infer": "the subpackage's docstring",
    "infer.gates": "quality gates stop a run and change no answer",
    "text": "the subpackage's docstring",
    "target": "the subpackage's docstring",
    "target.remote": "remote code: its files are part of the target's fingerprint",
    "hidden": "the subpackage's docstring",
    "drafter": "the subpackage's docstring",
    "drafter.eagle3": "the subpackage's docstring",
    "drafter.dflash": "the subpackage's docstring",
    "drafter.figures": "the report's figures",
    "drafter.spool": "carries the states from their source to the trainer, byte for byte",
}
# Per stage: what it runs of another stage or of another engine, hashed by that one's own key or not at all.
ELSEWHERE = {
    "infer": {
        "infer.cache": "the store of finished answers: which are reused, not what they hold",
        "target.compat": "checks that refuse a target before any compute",
        "core.runtime": "the device; the hf engine's dtype is in its identity",
        "infer.run": "the run's loop: which prompts, in which order, resumed",
        "dataset.sequences": "the context limit that leaves a prompt out",
        "dataset.shards": "imported by sequences",
        "target.families": "the config's reading: the target's files are in its fingerprint",
        "engines.sglang": "its own key when infer.engine is sglang",
        "engines.vllm": "likewise",
        "engines.hf": "likewise",
        "text.turns": "HISTORY_CODE, under infer.turns: all",
        "text.derive": "HISTORY_CODE",
        "text.reasoning": "HISTORY_CODE",
        "text.harmony": "HISTORY_CODE",
        "text.toolcalls": "HISTORY_CODE",
    },
    "hidden": {
        "target.compat": "checks that refuse a target before any compute",
        "dataset.sequences": "the sequences are hashed by content",
        "hidden.vllm_source": "its own code, when hidden.engine is vllm",
        "hidden.connector": "likewise",
        "engines": "the vLLM client's types",
        "engines.vllm": "the vLLM client",
        "target.chat": "imported by the pool for tokenize checks",
    },
    "train": {
        "hidden.extract": "the states: the features' identity hashes hidden's key",
        "hidden.store": "likewise",
        "hidden.publish": "likewise",
        "hidden.hf_source": "likewise",
        "hidden.vllm_source": "likewise, when train.features is streamed (the source's code in its identity)",
        "hidden.connector": "likewise",
        "engines": "the vLLM client's types",
        "engines.vllm": "the vLLM client",
        "target.chat": "imported by the pool for tokenize checks",
        "core.uncertainty": "the report's standard errors",
    },
}
CACHES = {
    "infer": infer_run.GENERATION_CODE + ("engines.hf", "engines.vllm", "engines.sglang") + infer_run.HISTORY_CODE,
    "hidden": extract.RESULT_CODE,
    "train": train.RESULT_CODE + tuple(name for method in methods.METHODS.values() for name in method.code),
}


def dotted(path: str) -> str:
    name = path.removeprefix("eaglepipe/").removesuffix(".py").removesuffix("/__init__")
    return name.replace("/", ".")


@pytest.mark.parametrize("stage", sorted(CACHES))
def test_every_module_a_caching_stage_runs_is_named_or_said_to_decide_nothing(stage):
    runs = {dotted(p) for p in codedeps.runs(f"stages/{stage}.py", ROOT)[1:]}
    unaccounted = runs - set(CACHES[stage]) - set(NO_RESULT) - set(ELSEWHERE[stage])
    assert not unaccounted, f"{stage} runs {sorted(unaccounted)}: name it in its cache's code or say why not"
    named = set(CACHES[stage]) & set(NO_RESULT)
    assert not named, f"{sorted(named)} both decide {stage}'s cache and not"
