"""families: what compat refuses and how train reads what it accepts: a target the pipeline cannot serve is refused
in seconds, naming why, by each stage before it loads anything; FP8 weights are read as transformers dequantizes
them; a quantization this machine cannot load is refused; the weights train reads are found under each layout,
Kimi-K2.5's as published and as transformers saves it."""

import json
import subprocess
import sys
import time

import pytest
import torch
import yaml
from helpers import ROOT, STAGE_ARGS, with_
from safetensors.torch import save_file
from tiny_targets import SIZES, build_target, to_fp8
from transformers import GemmaConfig, GlmConfig, LlamaConfig, Qwen2VLConfig, T5Config

from eaglepipe.core.errors import UserError
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import init as draft_init
from eaglepipe.target import compat, quant
from eaglepipe.target import model as target


# ------------------------------------------------------------------------------------------- refused in seconds
def small(cls, **keys):
    return cls(**{**SIZES, "num_hidden_layers": 4, "vocab_size": 128, "pad_token_id": None, **keys})


REFUSED = {  # config, reason named in the error
    "three layers": (small(LlamaConfig, num_hidden_layers=3), "it has 3 decoder layers, fewer than 4"),
    "gelu MLP": (small(GemmaConfig, head_dim=16), "its MLP activation is gelu_pytorch_tanh"),
    "encoder-decoder": (T5Config(), "t5 is an encoder-decoder model"),
    "partial RoPE": (small(GlmConfig, head_dim=16), "its RoPE rotates 0.5 of each head"),
    "multimodal": (Qwen2VLConfig(), "qwen2_vl nests its language model in a composite"),
    "no safetensors": (small(LlamaConfig), "no safetensors weights"),
    "untied, no head": (small(LlamaConfig, tie_word_embeddings=False), "its weights have no lm_head.weight"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_target_the_pipeline_cannot_serve_is_refused_naming_why(case, tmp_path):
    cfg, reason = REFUSED[case]
    cfg.save_pretrained(tmp_path)
    if case == "untied, no head":
        save_file(
            {"model.embed_tokens.weight": torch.zeros(128, 64), "model.norm.weight": torch.ones(64)},
            str(tmp_path / "model.safetensors"),
        )
    with pytest.raises(compat.UnsupportedTarget, match=f"^target {tmp_path}: {reason}"):
        compat.check(tmp_path)


@pytest.mark.slow
def test_each_stage_refuses_it_in_seconds_before_loading_anything(tmp_path):
    """hidden, train and evaluate, run as a user runs them (side by side) on a 3-layer target: one line naming the
    layer count and exit code 1 within seconds. The folder holds a config and no weights, so a stage that tried to
    load the target (or read its tokenizer) would end with another error."""
    folder = tmp_path / "target"
    REFUSED["three layers"][0].save_pretrained(folder)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(with_(target={"model": str(folder)})))
    start = time.monotonic()
    procs = {
        stage: subprocess.Popen(
            [sys.executable, str(ROOT / "stages" / f"{stage}.py"), "--params", "params.yaml", *STAGE_ARGS[stage]],
            cwd=tmp_path,
            stderr=subprocess.PIPE,
            text=True,
        )
        for stage in ("hidden", "train", "evaluate")
    }
    for proc in procs.values():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err
        assert err.strip().splitlines() == [
            f"Error: target {folder}: it has 3 decoder layers, fewer than 4: EAGLE-3 reads the inputs of three "
            "distinct layers, and layer 0's (the embeddings) is one several SGLang and vLLM models cannot capture"
        ], err
    assert time.monotonic() - start < 60
    assert not (tmp_path / "o").exists()


def test_fp8_weights_are_read_as_transformers_dequantizes_them(tmp_path, tokenizer):
    """train reads an FP8 layer in float32, equal to the weights of the target transformers loads here (dequantized
    on a machine without FP8 kernels); an FP8 embedding (which FP8 checkpoints do not have) is refused."""
    build_target(tmp_path, "llama_fp8", tokenizer)
    compat.check(tmp_path)
    read = train.target_tensors(tmp_path, 3)
    layer = target.load_model(tmp_path).model.layers[3]
    assert sorted(read["layer"]) == sorted(
        draft_init.LLAMA_ATTENTION + ("input_layernorm.weight",) + draft_init.MLP_WEIGHTS
    )
    for name in read["layer"]:
        assert torch.equal(read["layer"][name], layer.get_parameter(name)), name
    assert read["layer"]["mlp.up_proj.weight"].dtype == torch.float32
    assert not any(n.endswith(quant.SCALE) for n in read["layer_names"])
    to_fp8(tmp_path, lambda name: name == "model.embed_tokens.weight")
    with pytest.raises(compat.UnsupportedTarget, match="model.embed_tokens.weight is stored as F8_E4M3, not as"):
        compat.check(tmp_path)


def test_a_quantization_this_machine_cannot_load_is_refused_in_seconds(tmp_path):
    """compressed-tensors (Kimi-K2.5's INT4 experts) needs its package, not installed here: the in-process loaders
    refuse the target before reading a weight, naming the engines that serve it."""
    if quant.importlib.util.find_spec("compressed_tensors") is not None:
        pytest.skip("compressed-tensors is installed: transformers loads such targets here")
    small(LlamaConfig).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        UserError,
        match="compressed-tensors-quantized, .* compressed_tensors package, not installed "
        "here: generate with infer.engine: sglang or vllm",
    ):
        target.load_model(tmp_path)


def test_the_weights_train_reads_are_found_under_each_layout():
    """A text-only checkpoint's names, transformers' composites' (model.language_model.*), and Kimi-K2.5's as
    published (language_model.model.*, language_model.lm_head)."""
    for prefix, head in compat.PREFIXES:
        stored = {
            f"{prefix}embed_tokens.weight",
            f"{prefix}norm.weight",
            f"{prefix}layers.0.mlp.up_proj.weight",
            head,
            "model.visual.blocks.0.attn.qkv.weight",
        }
        assert compat.names(stored) == compat.Names(
            f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", head, f"{prefix}layers."
        )
        saved = {n.replace("layers.", "blocks.") for n in stored}  # Kimi-K2.5 as transformers 5.23 saves it
        assert compat.names(saved).layers == f"{prefix}blocks."


def test_a_kimi_saved_by_transformers_is_read_as_the_published_one(tmp_path, tokenizer):
    """Kimi-K2.5 with its language model's layers under "blocks" (transformers' save_pretrained) passes the checks,
    and train reads from it the same weights as from the published names."""
    for saved_as in ("published", "saved"):
        build_target(tmp_path / saved_as, "kimi_k25", tokenizer, published=saved_as == "published")
        compat.check(tmp_path / saved_as)
    published, saved = (train.target_tensors(tmp_path / saved_as, 1) for saved_as in ("published", "saved"))
    assert saved["layer_names"] == published["layer_names"] and "self_attn.kv_a_proj_with_mqa.weight" in saved["layer"]
    for key in ("embed", "head", "norm", "layer"):
        assert torch.equal(
            *(
                torch.cat([t.flatten().float() for t in (w[key].values() if key == "layer" else [w[key]])])
                for w in (published, saved)
            )
        ), key
