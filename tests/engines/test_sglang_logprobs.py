"""SGLang's log-probabilities through the double (tests/sglang_double/generate.py) and infer's SGLang client: the
double answers them as SGLang 0.5 does when asked (raw when greedy or under SGLANG_RETURN_ORIGINAL_LOGPROB, after
temperature otherwise), and the client asks for them, checks them against the ids and keeps them."""

import pytest
import torch
from reasoning_fixtures import reasoning_tokenizer, served_model_folder
from sglang_double.control import post
from sglang_server import CLEAN, configure, free_port, start_server, stop_server

from eaglepipe.core import config
from eaglepipe.engines import Sampling
from eaglepipe.engines.logprobs import Scored
from eaglepipe.engines.server import ServerEngine
from eaglepipe.engines.sglang import SGLang
from eaglepipe.target import chat

pytestmark = pytest.mark.engine  # real server processes over loopback

STOP = 2  # the embedded model's <|im_end|>
QUESTIONS = ["What is 2+2?", "Name a colour.", "Write a haiku about the sea."]


def serve(folder, *args, env=None):
    port = free_port()
    proc = start_server(port, folder / f"server-{port}.log", *args, env=env)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def tempered(tmp_path_factory):
    """The double as SGLang runs by default: figures after temperature when sampling."""
    yield from serve(tmp_path_factory.mktemp("tempered"), env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "false"})


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The double as a launched server runs: SGLANG_RETURN_ORIGINAL_LOGPROB=1, figures before temperature."""
    yield from serve(tmp_path_factory.mktemp("original"), env={"SGLANG_RETURN_ORIGINAL_LOGPROB": "1"})


@pytest.fixture
def fresh(tempered):
    configure(tempered, **CLEAN)
    return tempered


def scoring(url, tokenizer) -> ServerEngine:
    """infer's SGLang client (scores, as table.py builds it) over the server at ``url``."""
    params = config.Servers(urls=[url], concurrency=2, timeout_s=60, retries=2, backoff_s=0.01, backoff_max_s=0.05)
    return ServerEngine(SGLang(), params, tokenizer, scores=True)


def answers(url, tokenizer, sampling) -> tuple[list, dict]:
    prompts = [chat.prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    with scoring(url, tokenizer) as engine:
        return prompts, dict(engine.stream(prompts, sampling, [f"r{i}" for i in range(len(prompts))]))


def direct(model, prompt: list, answer: list, temperature: float = 1.0) -> torch.Tensor:
    """log p(answer[t] | prompt + answer[:t]) at ``temperature``, from one float32 forward over prompt + answer."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(answer)[:, None])[:, 0]


def apart(model, prompts, outs, temperature: float = 1.0) -> float:
    """The largest |figure - direct forward's| over every answer in ``outs``."""
    worst = 0.0
    for i, out in outs.items():
        assert isinstance(out, Scored) and len(out.logprobs) == len(out.output_ids)
        figures = torch.tensor(out.logprobs)
        worst = max(worst, (figures - direct(model, prompts[i], out.output_ids, temperature)).abs().max().item())
    return worst


def test_greedy_figures_are_raw_and_kept_by_the_client(fresh, model, tokenizer):
    prompts, outs = answers(fresh, tokenizer, Sampling(max_new_tokens=12, stop_token_ids=(STOP,)))
    assert apart(model, prompts, outs) < 1e-4


def test_sampled_figures_are_tempered_unless_the_server_returns_the_original_ones(fresh, original, model, tokenizer):
    sampling = Sampling(temperature=0.5, max_new_tokens=12, seed=3, stop_token_ids=(STOP,))
    prompts, by_default = answers(fresh, tokenizer, sampling)
    assert apart(model, prompts, by_default, 0.5) < 1e-4 and apart(model, prompts, by_default) > 1e-2
    prompts, raw = answers(original, tokenizer, sampling)
    assert apart(model, prompts, raw) < 1e-4
    assert [o.output_ids for o in raw.values()] == [o.output_ids for o in by_default.values()]  # the same draws


def test_a_stop_id_left_out_of_output_ids_keeps_its_figure(fresh, model, tokenizer):
    configure(fresh, exclude_stop=True)
    prompts, outs = answers(fresh, tokenizer, Sampling(max_new_tokens=48, stop_token_ids=(STOP,)))
    assert any(o.output_ids[-1] == STOP for o in outs.values())  # put back by the client, its figure with it
    assert apart(model, prompts, outs) < 1e-4


def test_an_engine_computing_another_model_is_kept_as_it_answers(fresh, model, tokenizer):
    """The client checks that figures align with the ids, not their values: a server whose figures are off (here
    by 0.5 nats) is what hidden's check is for."""
    configure(fresh, logprob_offset=-0.5)
    prompts, outs = answers(fresh, tokenizer, Sampling(max_new_tokens=8, stop_token_ids=(STOP,)))
    for i, out in outs.items():
        assert torch.allclose(torch.tensor(out.logprobs), direct(model, prompts[i], out.output_ids) - 0.5, atol=1e-4)


def test_the_double_answers_the_logprob_fields_as_sglang(fresh, tokenizer):
    prompt = chat.prompt_ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "rid": "x"}
    status, plain = post(fresh, "/generate", body)
    assert status == 200 and "output_token_logprobs" not in plain["meta_info"]
    asked = {**body, "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    status, answer = post(fresh, "/generate", asked)
    meta = answer["meta_info"]
    assert status == 200 and meta["input_token_logprobs"] == []
    assert [e[1] for e in meta["output_token_logprobs"]] == answer["output_ids"]
    assert [e[2] for e in meta["output_token_logprobs"]] == [tokenizer.decode([t]) for t in answer["output_ids"]]
    top = meta["output_top_logprobs"]
    assert [len(t) for t in top] == [2] * 4 and [t[0][1] for t in top] == answer["output_ids"]  # greedy: the argmax
    assert all(t[0][0] >= t[1][0] for t in top)
    for bad, problem in ((len(prompt) + 1, "higher than the number of input tokens"), (-2, "should be -1")):
        status, error = post(fresh, "/generate", {**body, "return_logprob": True, "logprob_start_len": bad})
        assert status == 400 and problem in error["error"]["message"]
    batch = {**body, "input_ids": [prompt, prompt], "rid": None, "return_logprob": [True, False]}
    status, both = post(fresh, "/generate", batch)
    assert status == 200 and "output_token_logprobs" in both[0]["meta_info"]
    assert "output_token_logprobs" not in both[1]["meta_info"]


def test_a_server_without_a_model_gives_no_figures_and_the_client_keeps_none(tmp_path, tokenizer):
    for url in serve(tmp_path, "--no-compute"):
        _, outs = answers(url, tokenizer, Sampling(max_new_tokens=6, stop_token_ids=(STOP,)))
    assert all(out.logprobs == [None] * len(out.output_ids) for out in outs.values())


def test_a_think_block_of_markers_the_model_cannot_read_gets_no_figures_there(tmp_path_factory, model):
    """--reasoning wrap serves a think block whose markers lie past the model's embeddings: those ids get null
    figures, every other id the model's own."""
    tokenizer = reasoning_tokenizer(tmp_path_factory)
    folder = tmp_path_factory.mktemp("reasoning")
    for url in serve(folder, "--model-path", served_model_folder(tmp_path_factory), "--reasoning", "wrap"):
        _, outs = answers(url, tokenizer, Sampling(max_new_tokens=24, stop_token_ids=(STOP,)))
    for out in outs.values():
        unread = [t >= model.config.vocab_size for t in out.output_ids]
        assert any(unread) and [f is None for f in out.logprobs] == unread
        assert all(f <= 0 for f in out.logprobs if f is not None)
