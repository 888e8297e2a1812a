"""The engines' own log-probabilities (eaglepipe/engines/logprobs.py): what vLLM and SGLang are asked and how their
answers are read (canned bodies in the shapes vLLM 0.32's token-in token-out API and SGLang 0.5's /generate give),
the rounding, a launched server made to give raw figures (nothing started), and the hf engine's figures against a
direct float32 forward of the embedded target."""

import math
import sys

import pytest
import torch
import yaml
from helpers import ROOT
from test_server import FAILS, launch

from eaglepipe.core import config, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.engines import Sampling, table
from eaglepipe.engines.hf import HFEngine
from eaglepipe.engines.logprobs import BadFigures, Scored, ask, clean, read
from eaglepipe.engines.sglang import SGLang, SGLangEngine
from eaglepipe.engines.vllm import VLLM, VLLMEngine
from eaglepipe.target import chat
from eaglepipe.target import model as target

STOP = 2  # the embedded model's <|im_end|>
SAMPLING = Sampling(temperature=0.7, max_new_tokens=8, stop_token_ids=(STOP,))
PROMPT = [1, 9690, 198, 2683, 314]


# ---- clean ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "figure, kept",
    [
        (-0.0123456789, -0.01235),
        (-2.5, -2.5),
        (0, 0),
        (-1e-9, -0.0),
        (None, None),
        (math.nan, None),
        (-math.inf, None),
        (math.inf, None),
        (-9999.0, None),  # vLLM's stand-in for -inf, NaN and a lost figure
        (-3.4028234663852886e38, None),  # SGLang's clamp to float32's least value
        (-9998.99999, -9998.99999),
    ],
)
def test_clean_rounds_to_five_decimals_and_keeps_no_sentinel(figure, kept):
    assert clean(figure) == kept and (kept is None or type(clean(figure)) is float)


# ---- vLLM ----------------------------------------------------------------------------------------------------------
def vllm_answer(ids, content):
    return {
        "request_id": "generate-tokens-r",
        "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids, "logprobs": content}],
        "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(ids)},
    }


def entry(token, figure, rank=1):
    return {
        "token_id": token,
        "logprob": figure,
        "rank": rank,
        "top_logprobs": [{"token_id": token, "logprob": figure}],
    }


def test_vllm_is_asked_for_the_sampled_tokens_figure_only_inside_its_sampling_params():
    path, body = VLLM().request(PROMPT, SAMPLING, "r", "r")
    asked = ask("vllm", body)
    assert asked["sampling_params"] == {**body["sampling_params"], "logprobs": 0}
    assert "prompt_logprobs" not in asked["sampling_params"] and "logprobs" not in body["sampling_params"]
    assert {k: v for k, v in asked.items() if k != "sampling_params"} == {
        k: v for k, v in body.items() if k != "sampling_params"
    }


def test_vllm_figures_are_read_per_output_id_with_its_sentinel_as_none():
    ids = [5, 6, 7]
    content = {"content": [entry(5, -0.123456789), entry(6, -9999.0, None), entry(7, 0.0)]}
    assert read("vllm", vllm_answer(ids, content), ids) == [-0.12346, None, 0.0]


@pytest.mark.parametrize(
    "content, problem",
    [
        (None, "no logprobs.content"),
        ({"content": None}, "no logprobs.content"),
        ({"content": [entry(5, -0.1)]}, "1 log-probabilities for 2 output ids"),
        ({"content": [entry(5, -0.1), entry(7, -0.2)]}, "position 1 is for id 7, the output id is 6"),
        ({"content": [entry(5, -0.1), entry(6, "x")]}, "not a number"),
        ({"content": [entry(5, -0.1), entry(6, True)]}, "not a number"),
        ({"content": [entry(5, -0.1), entry(6, 0.5)]}, "above 0"),
        ({"content": [entry(5, -0.1), "oops"]}, "no logprobs.content"),
    ],
)
def test_vllm_figures_missing_misaligned_or_not_log_probabilities_are_refused(content, problem):
    with pytest.raises(BadFigures) as e:
        read("vllm", vllm_answer([5, 6], content), [5, 6])
    assert problem in str(e.value)


# ---- SGLang --------------------------------------------------------------------------------------------------------
def sglang_answer(ids, figures):
    meta = {"id": "r", "finish_reason": {"type": "length", "length": 8}, "completion_tokens": len(ids)}
    return {"output_ids": ids, "meta_info": {**meta, **({} if figures is None else {"output_token_logprobs": figures})}}


def test_sglang_is_asked_at_the_top_level_for_the_output_ids_only():
    path, body = SGLang().request(PROMPT, SAMPLING, "r", "r")
    asked = ask("sglang", body)
    assert asked == {
        **body,
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "return_text_in_logprobs": False,
    }
    assert asked["sampling_params"] is body["sampling_params"] and "return_logprob" not in body


def test_sglang_figures_are_read_with_null_and_clamped_ones_as_none():
    ids = [5, 6, STOP]
    figures = [[-0.5, 5, None], [None, 6, None], [-3.4028234663852886e38, STOP, None]]
    assert read("sglang", sglang_answer(ids, figures), ids) == [-0.5, None, None]
    assert read("sglang", [sglang_answer(ids, figures)], ids) == [-0.5, None, None]  # a batch-shaped answer of one


def test_a_stop_id_the_server_left_out_of_output_ids_keeps_its_figure():
    """The client puts back a matched stop id a server left out of output_ids (sglang.check_answer); SGLang's figures
    cover every completion id, that one included, so they align with the ids the client keeps."""
    answer = sglang_answer([5, 6], [[-0.5, 5, None], [-0.25, 6, None], [-0.125, STOP, None]])
    assert read("sglang", answer, [5, 6, STOP]) == [-0.5, -0.25, -0.125]


@pytest.mark.parametrize(
    "figures, problem",
    [
        (None, "no meta_info.output_token_logprobs"),
        ([[-0.5, 5]], "1 log-probabilities for 2 output ids"),
        ([[-0.5, 9690], [-0.5, 5], [-0.5, 6]], "3 log-probabilities for 2 output ids"),  # the #10896 prompt tail
        ([[-0.5, 6, None], [-0.5, 5, None]], "position 0 is for id 6, the output id is 5"),
        ([[-0.5, 5, None], "x"], "no meta_info.output_token_logprobs"),
        ([[-0.5, 5, None], ["-1", 6, None]], "not a number"),
    ],
)
def test_sglang_figures_missing_or_misaligned_are_refused(figures, problem):
    with pytest.raises(BadFigures) as e:
        read("sglang", sglang_answer([5, 6], figures), [5, 6])
    assert problem in str(e.value)


def test_an_engine_without_figures_to_ask_is_an_error():
    with pytest.raises(ValueError, match="'states'"):
        ask("states", {})
    with pytest.raises(ValueError, match="'states'"):
        read("states", {}, [])


# ---- launched servers (nothing started) ----------------------------------------------------------------------------
def test_a_launched_sglang_that_scores_gets_original_logprobs_unless_the_user_sets_them(
    tokenizer, tmp_path, monkeypatch
):
    monkeypatch.delenv("SGLANG_RETURN_ORIGINAL_LOGPROB", raising=False)
    engine = SGLangEngine(launch(tmp_path), tokenizer)
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in engine._launcher().env  # an engine that does not score: nothing
    scoring = SGLangEngine(launch(tmp_path), tokenizer)
    scoring.scores = True
    assert scoring._launcher().env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    assert scoring.describe()["launched"]["env"]["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")  # the user's choice wins (the server inherits it)
    mine = SGLangEngine(launch(tmp_path), tokenizer)
    mine.scores = True
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in mine._launcher().env


@pytest.mark.parametrize("flag", [["--logprobs-mode", "processed_logprobs"], ["--logprobs-mode=raw_logits"]])
def test_a_launched_vllm_that_scores_is_refused_another_logprobs_mode(tokenizer, tmp_path, flag):
    engine = VLLMEngine(launch(tmp_path, extra_args=flag), tokenizer, interpreter=sys.executable)
    engine.scores = True
    with pytest.raises(UserError, match="--logprobs-mode") as e:
        engine.identity()
    assert "raw_logprobs" in str(e.value) and engine.launched.proc is None
    VLLMEngine(launch(tmp_path, extra_args=flag), tokenizer, interpreter=sys.executable)._launcher()  # not scoring
    raw = VLLMEngine(launch(tmp_path, extra_args=["--logprobs-mode", "raw_logprobs"]), tokenizer, sys.executable)
    raw.scores = True
    assert raw._launcher().flag("--logprobs-mode") == "raw_logprobs"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_infers_server_engines_score_and_others_do_not(engine, tokenizer, target_folder, tmp_path):
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["infer"].update(engine=engine, **{engine: {"launch": {"command": FAILS, "log": str(tmp_path / "log")}}})
    params = config.parse(raw).infer
    with runtime.start("cpu") as rt, table.create(params, target_folder, tokenizer, rt) as built:
        assert built.scores is True and built.launched is None
    assert SGLangEngine(launch(tmp_path), tokenizer).scores is False


# ---- the in-process engine -----------------------------------------------------------------------------------------
def direct(model, prompt: list, answer: list, temperature: float = 1.0) -> torch.Tensor:
    """log p(answer[t] | prompt + answer[:t]) at ``temperature`` from one float32 forward of ``model`` over prompt +
    answer, alone."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(answer)[:, None])[:, 0]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_hf_engines_figures_are_the_targets_raw_log_probabilities(model, tokenizer, target_folder, temperature):
    """Rows of a left-padded batch (prompts of different lengths, finishing at different steps), greedy and sampled
    at T=0.8: each figure is log_softmax(logits) at the chosen id before temperature, as a direct float32 forward
    over prompt + answer gives it, within 1e-4; the ids are the ones each prompt gets alone."""
    questions = ["What is 2+2?", "Name a colour.", "Write a haiku about the sea and the wind, please.", "Hi"]
    prompts = [chat.prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in prompts}) > 1  # padding in the batch
    sampling = Sampling(temperature, max_new_tokens=12, stop_token_ids=tuple(target.stop_ids(target_folder, tokenizer)))
    rids = [f"r{i}" for i in range(len(prompts))]
    batched = dict(HFEngine(model, tokenizer.pad_token_id, batch_size=4).stream(prompts, sampling, rids))
    alone = HFEngine(model, tokenizer.pad_token_id, batch_size=1)
    worst = 0.0
    for i, out in batched.items():
        assert isinstance(out, Scored) and len(out.logprobs) == len(out.output_ids)
        assert out.output_ids == next(alone.stream([prompts[i]], sampling, [rids[i]]))[1].output_ids
        assert all(type(f) is float and f <= 0 and f == round(f, 5) for f in out.logprobs)
        worst = max(worst, (torch.tensor(out.logprobs) - direct(model, prompts[i], out.output_ids)).abs().max().item())
    assert worst < 1e-4
    assert temperature > 0 or len({len(o.output_ids) for o in batched.values()}) > 1  # rows left at different steps


def test_the_hf_engines_figures_ignore_temperature_and_filters(model, tokenizer, target_folder):
    """Sampled at T=0.5 with top-k 5, the figure of each id is still the one at temperature 1, unfiltered."""
    prompt = chat.prompt_ids(tokenizer, [{"role": "user", "content": "Tell me a story."}])
    sampling = Sampling(0.5, top_k=5, max_new_tokens=8, stop_token_ids=(STOP,))
    out = next(HFEngine(model, tokenizer.pad_token_id).stream([prompt], sampling, ["r"]))[1]
    figures = torch.tensor(out.logprobs)
    assert (figures - direct(model, prompt, out.output_ids)).abs().max() < 1e-4
    assert (figures - direct(model, prompt, out.output_ids, 0.5)).abs().max() > 1e-2
