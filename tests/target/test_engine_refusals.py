"""Known incompatibilities refused at the door (compat.engine_refusal): vLLM 0.32's and SGLang's DeepseekV2/V3 and
gpt-oss models never tie the output head to the embedding, so a target whose config ties them and whose weights store
no head would be served with an unloaded head. Such tiny targets are refused for those engines, naming the engine's
model file and what to do instead; the untied ones, a tied Llama (whose engine models tie), one that stores its head
and any target for the in-process engine pass. The infer stage refuses it in seconds, before a server starts."""

import json
import time

import pytest
import torch
import yaml
from e2e import PROMPTS, ROOT, run_infer
from safetensors.torch import save_file
from test_families import FAMILIES, build_target
from transformers import DeepseekV3Config
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

from eaglepipe.core import config
from eaglepipe.core.records import write_jsonl
from eaglepipe.evaluate import serve
from eaglepipe.target import compat, families

VLLM = {
    "deepseek_v3": "vLLM 0.32's DeepseekV2ForCausalLM (vllm/model_executor/models/deepseek_v2.py)",
    "gpt_oss": "vLLM 0.32's GptOssForCausalLM (vllm/model_executor/models/gpt_oss.py)",
}
SGLANG = {
    "deepseek_v3": "SGLang 0.5's DeepseekV2ForCausalLM (sglang/srt/models/deepseek_v2.py)",
    "gpt_oss": "SGLang 0.5's GptOssForCausalLM (sglang/srt/models/gpt_oss.py)",
}


def reason(folder, model: str, head: str = "lm_head.weight") -> str:
    """The refusal of a tied target in ``folder`` whose engine runs ``model``."""
    return (
        f"target {folder}: {model} never ties the output head to the embedding, and this target's config ties them "
        f"(tie_word_embeddings) with no {head} stored: the engine would answer from an unloaded head, not the model "
        f"transformers computes. Generate with infer.engine: hf, or store the embedding as {head} too"
    )


@pytest.fixture
def tied(monkeypatch, tmp_path, tokenizer):
    """Build a tiny random target of a family with its head tied to the embedding, saved as transformers saves
    it: a ``<family>_tied`` entry beside the family's own in the tiny targets' table."""

    def build(family: str):
        cls, keys = FAMILIES[family]
        monkeypatch.setitem(FAMILIES, f"{family}_tied", (cls, {**keys, "tie_word_embeddings": True}))
        folder = tmp_path / f"{family}_tied"
        build_target(folder, f"{family}_tied", tokenizer)
        return folder

    return build


def with_weights(folder, config, prefix: str = "model.", head: str | None = None):
    """``config`` saved in ``folder`` with a safetensors file of the embedding and the final norm under ``prefix``
    (and the head, if named): what engine_refusal reads of a target."""
    config.save_pretrained(folder)
    tensors = {prefix + "embed_tokens.weight": torch.zeros(8, 4), prefix + "norm.weight": torch.ones(4)}
    save_file({**tensors, **({head: torch.zeros(8, 4)} if head else {})}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("family", list(VLLM))
def test_a_tied_deepseek_v3_or_gpt_oss_is_refused_for_the_server_engines_naming_why(family, tied):
    folder = tied(family)
    assert "lm_head.weight" not in compat.weights(folder)  # what the engines would have to tie
    assert compat.engine_refusal("vllm", folder) == reason(folder, VLLM[family])
    assert compat.engine_refusal("sglang", folder) == reason(folder, SGLANG[family])
    assert compat.engine_refusal("hf", folder) is None  # transformers ties it
    refused = serve.refusal(folder, families.load_config(folder), None, config.Serve())  # before the drafter is read
    assert refused.startswith("the serve check runs vLLM") and refused.endswith(reason(folder, VLLM[family]))


@pytest.mark.parametrize("family", list(VLLM))
def test_an_untied_deepseek_v3_or_gpt_oss_passes(family, tmp_path, tokenizer):
    build_target(tmp_path, family, tokenizer)
    assert compat.engine_refusal("vllm", tmp_path) is None
    assert compat.engine_refusal("sglang", tmp_path) is None


def test_a_tied_llama_passes_its_engine_models_tie(tied):
    folder = tied("llama")
    assert "lm_head.weight" not in compat.weights(folder)
    assert compat.engine_refusal("vllm", folder) is None
    assert compat.engine_refusal("sglang", folder) is None


def test_a_tied_deepseek_v3_that_stores_its_head_passes(tmp_path):
    """vLLM loads a stored head whatever the config says (transformers too, where it differs from the embedding)."""
    with_weights(tmp_path, DeepseekV3Config(tie_word_embeddings=True), head="lm_head.weight")
    assert compat.engine_refusal("vllm", tmp_path) is None


def test_a_kimi_k25_whose_deepseek_v3_ties_its_head_is_refused(tmp_path):
    """Kimi-K2.5's language model is vLLM's DeepseekV2ForCausalLM; its weights as published, with no head."""
    text = {"model_type": "deepseek_v3", "tie_word_embeddings": True}
    kimi = Kimi_K25Config(text_config=text, tie_word_embeddings=True)
    folder = with_weights(tmp_path / "tied", kimi, prefix="language_model.model.")
    head = "language_model.lm_head.weight"
    assert compat.engine_refusal("vllm", folder) == reason(folder, VLLM["deepseek_v3"], head)
    assert compat.engine_refusal("vllm", folder, kimi) == reason(folder, VLLM["deepseek_v3"], head)  # serve's call
    stored = with_weights(tmp_path / "stored", kimi, prefix="language_model.model.", head=head)
    assert compat.engine_refusal("vllm", stored) is None


def test_a_target_without_safetensors_weights_is_not_judged(tmp_path):
    DeepseekV3Config(tie_word_embeddings=True).save_pretrained(tmp_path)
    assert compat.engine_refusal("vllm", tmp_path) is None


@pytest.mark.e2e
def test_the_infer_stage_refuses_a_tied_deepseek_v3_for_vllm_in_seconds(tied, tmp_path):
    """One line naming why, exit code 1, nothing written to the out folder or the cache, and the launcher vLLM
    would start with never run (it would write ``launched``)."""
    folder = tied("deepseek_v3")
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2])
    launched = tmp_path / "launched"
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg["target"]["model"] = str(folder)
    cfg["infer"].update(engine="vllm", samples=1, temperature=0.0, max_new_tokens=4)
    cfg["infer"]["vllm"] = {
        "health_timeout_s": 5.0,
        "launch": {"command": ["python", "-c", f"open({json.dumps(str(launched))}, 'w')"]},
    }
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    out = run_infer(tmp_path, params, tmp_path / "prompts.jsonl", timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"Error: {reason(folder, VLLM['deepseek_v3'])}"
    assert time.monotonic() - start < 30
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists() and not launched.exists()
