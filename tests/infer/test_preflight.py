"""infer's pre-flight (eaglepipe/infer/preflight.py): the engine's log-probabilities of a few prompts' first tokens
against a float32 transformers forward. The embedded target through the hf engine passes; an engine serving a
doctored copy (tests/doctored.py) is refused, naming the records; mode off, a large target under auto, and an engine
without figures are left out; a run whose answers are all cached never asks it."""

import json
from pathlib import Path

import pytest
import yaml
from doctored import doctored_copy
from e2e import PROMPTS, ROOT, run_infer
from infer_helpers import GATES, NONE, QUESTIONS, prompts

from eaglepipe.core import config
from eaglepipe.core.data_sections import Preflight
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import write_jsonl
from eaglepipe.core.runtime import Runtime
from eaglepipe.engines import Failure, Output, Sampling, vllm
from eaglepipe.engines.hf import HFEngine
from eaglepipe.engines.logprobs import Scored
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.preflight import Check
from eaglepipe.infer.run import InferRun, Plan
from eaglepipe.target import chat
from eaglepipe.target import model as target


def sampling(folder, tokenizer, temperature=0.0) -> Sampling:
    return Sampling(
        temperature=temperature, max_new_tokens=16, stop_token_ids=tuple(target.stop_ids(folder, tokenizer))
    )


def asked(tokenizer, n=4) -> tuple[list[str], list[list[int]]]:
    """The record and prompt ids of ``n`` questions, as InferRun hands them to the hook."""
    ps = prompts(QUESTIONS[:n])
    return [p.id for p in ps], [chat.prompt_ids(tokenizer, p.messages) for p in ps]


@pytest.fixture(scope="module")
def doctored(target_folder, tmp_path_factory):
    """Copies of the embedded target, the final norm scaled (``norm``) or one head row changed (``head_row``)."""
    folder = tmp_path_factory.mktemp("doctored")
    return {how: doctored_copy(target_folder, folder, how) for how in ("norm", "head_row")}


class Unasked:
    """An engine the check must not ask."""

    name = "vllm"

    def stream(self, prompts, sampling, rids):
        raise AssertionError("the pre-flight asked the engine")


class Unscored:
    """An engine that answers without log-probabilities (plain ``Output``s)."""

    name = "sglang"

    def stream(self, prompts, sampling, rids):
        for i in range(len(prompts)):
            yield i, Output([17] * sampling.max_new_tokens, "length", {})


class PastTheVocabulary:
    """An engine that answers an id past the target's embeddings (a server serving a model with a larger vocabulary)."""

    name = "sglang"

    def stream(self, prompts, sampling, rids):
        for i in range(len(prompts)):
            yield i, Scored([1, 10**6], "length", {}, logprobs=[-0.5, -0.5])


class Failing:
    """An engine whose every answer fails."""

    name = "vllm"

    def stream(self, prompts, sampling, rids):
        for i in range(len(prompts)):
            yield i, Failure("ServerDisconnectedError")


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_embedded_target_through_the_hf_engine_passes(model, tokenizer, target_folder, temperature):
    engine = HFEngine(model, tokenizer.pad_token_id, batch_size=4)
    check = Check(engine, sampling(target_folder, tokenizer, temperature), target_folder, Runtime(), Preflight())
    check(*asked(tokenizer, 6))
    report = check.report
    assert report["verdict"] == "passed" and report["mode"] == "auto"
    assert report["prompts"] == 4 and 4 <= report["tokens"] <= 32
    assert report["mean_abs_diff"] <= report["max_abs_diff"] < 1e-3  # the same float32 weights: numerics only


@pytest.mark.parametrize("how", ["norm", "head_row"])
def test_an_engine_serving_a_doctored_checkpoint_is_refused_naming_the_records(doctored, tokenizer, target_folder, how):
    engine = HFEngine(target.load_model(doctored[how]), tokenizer.pad_token_id, batch_size=4)
    check = Check(engine, sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight(prompts=2))
    record_ids, prompt_ids = asked(tokenizer)
    with pytest.raises(UserError) as refused:
        check(record_ids, prompt_ids)
    message = str(refused.value)
    assert message.startswith("infer.preflight: the hf engine does not compute the target")
    assert f"records {record_ids[0]}, {record_ids[1]}" in message and record_ids[2] not in message
    assert "(engine -" in message and ", transformers -" in message
    assert "another checkpoint" in message and message.endswith("set infer.preflight.mode: off to skip")
    # a changed norm keeps the greedy ids (only the figures tell); a changed head row changes the first token too
    assert ("transformers would not take" in message) == (how == "head_row")


def test_mode_off_never_asks_the_engine(tokenizer, target_folder):
    check = Check(Unasked(), sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight(mode="off"))
    check(*asked(tokenizer))
    assert check.report == {"mode": "off", "verdict": "left out: infer.preflight.mode: off"}


def test_auto_leaves_out_a_server_engine_whose_target_is_over_max_weights_gib(tokenizer, target_folder):
    params = Preflight(max_weights_gib=0.1)  # the embedded target's weights: about 0.5 GiB
    check = Check(Unasked(), sampling(target_folder, tokenizer), target_folder, Runtime(), params)
    check(*asked(tokenizer))
    assert check.report["verdict"].startswith("left out: auto: the target's weights, 0.")


def test_an_engine_without_figures_is_refused_under_on_and_left_out_under_auto(tokenizer, target_folder, caplog):
    check = Check(Unscored(), sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight(mode="on"))
    with pytest.raises(UserError, match=r"mode: on\): the sglang engine returned no log-probabilities"):
        check(*asked(tokenizer))
    check = Check(Unscored(), sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight())
    check(*asked(tokenizer))
    assert check.report["verdict"] == "left out: the sglang engine returned no log-probabilities"
    assert "pre-flight left out" in caplog.text


def test_an_engine_answering_an_id_past_the_targets_embeddings_is_refused_naming_it(tokenizer, target_folder):
    check = Check(PastTheVocabulary(), sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight())
    with pytest.raises(UserError, match=r"with token id 1000000, past the 49152 embeddings .* serves another model"):
        check(*asked(tokenizer))


def test_an_engine_whose_answers_all_fail_is_left_out_under_auto(tokenizer, target_folder, caplog):
    check = Check(Failing(), sampling(target_folder, tokenizer), target_folder, Runtime(), Preflight())
    check(*asked(tokenizer))
    assert check.report["verdict"] == "left out: the vllm engine gave no answer (its failures are above)"
    assert "failed: ServerDisconnectedError" in caplog.text


def test_a_run_whose_answers_are_all_cached_never_calls_the_hook(model, tokenizer, target_folder, tmp_path):
    calls = []
    engine = HFEngine(model, tokenizer.pad_token_id, batch_size=4)
    ps = prompts(QUESTIONS[:3])

    def hook(record_ids, prompt_ids):
        calls.append(record_ids)

    for _ in range(2):
        gates = Gates(config.Gates(**GATES), False)
        run_sampling = sampling(target_folder, tokenizer)
        run = InferRun(engine, tokenizer, run_sampling, NONE, gates, Cache(tmp_path), Plan({}), before_generating=hook)
        run.run(ps)
    assert calls == [[p.id for p in ps]]  # the first run only: the second finds every answer cached


def stage_params(folder: Path, engine: str, **infer) -> Path:
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg["infer"].update(engine=engine, batch_size=4, max_new_tokens=8, temperature=0.0, samples=1, **infer)
    cfg["infer"]["gates"].update(GATES)
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.mark.e2e
def test_e2e_the_stage_reports_its_preflight_and_an_all_cached_rerun_skips_it(tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    params = stage_params(tmp_path, "hf")
    verdicts = []
    for _ in range(2):
        out = run_infer(tmp_path, params, tmp_path / "prompts.jsonl")
        assert out.returncode == 0, out.stderr[-3000:]
        verdicts.append(json.loads((tmp_path / "timings.json").read_text())["preflight"])  # the report's run part
    assert verdicts[0]["verdict"] == "passed" and verdicts[0]["prompts"] == 4
    assert verdicts[1] == {"mode": "auto", "verdict": "not run: nothing to generate"}


@pytest.mark.engine
@pytest.mark.skipif(
    not Path(vllm.python()).exists() and not (ROOT / vllm.python()).exists(),
    reason="no .venv-vllm: run make vllm-venv (make test does)",
)
def test_engine_a_vllm_serving_a_doctored_checkpoint_is_refused_before_generating(doctored, tmp_path):
    """A real vLLM (CPU build, float32) launched on the copy whose final norm is scaled, while the target is the
    embedded one: the pre-flight refuses it, nothing is published and the cache holds no answer."""
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    launch = {
        "model_path": str(doctored["norm"]),
        "port": 8027,
        "extra_args": ["--enforce-eager"],
        "stop_timeout_s": 30,
    }
    params = stage_params(
        tmp_path, "vllm", dtype="float32", vllm={"concurrency": 4, "health_timeout_s": 300, "launch": launch}
    )
    out = run_infer(tmp_path, params, tmp_path / "prompts.jsonl")
    assert out.returncode != 0
    assert "infer.preflight: the vllm engine does not compute the target" in out.stderr
    assert all(p.id in out.stderr for p in PROMPTS[:4])
    assert "Nothing was published" in out.stderr and not (tmp_path / "out" / "responses.jsonl").exists()
    assert not any(line.strip() for f in (tmp_path / "cache").glob("*/generations.jsonl") for line in f.open())
