"""recipes/: each params file validates and holds every key DVC tracks, `make plan` reads each target's config, and a
tiny random target of each structure meets the checks the stages run before loading anything (Llama-3.1 with its
llama3 RoPE scaling, Qwen3 with QK-norm, Kimi-K2.5's DeepseekV3 in its multimodal wrapper)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import stages
from transformers import AutoConfig, AutoModelForCausalLM

from eaglepipe.core import config
from eaglepipe.target import compat, families

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.name for p in (ROOT / "recipes").iterdir() if p.is_dir())
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
}


def test_there_is_a_recipe_for_each_target_the_issue_names():
    assert RECIPES == ["kimi-k2.5", "llama-3.1-8b", "qwen3-8b"]


@pytest.mark.parametrize("name", RECIPES)
def test_the_params_validate_and_hold_every_tracked_key(name):
    path = ROOT / "recipes" / name / "params.yaml"
    params = config.load(path)
    raw = yaml.safe_load(path.read_text())
    for key in {k for stage in stages().values() for k in stage.get("params", [])}:
        section, _, rest = key.partition(".")
        assert rest.split(".")[0] in raw[section], f"{path}: no {key}"
    assert params.infer.engine == "sglang" and params.infer.sglang.launch.model_path == params.target.model


@pytest.mark.parametrize("name", RECIPES)
def test_plan_reads_the_targets_config(name):
    folder = ROOT / "recipes" / name
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "eaglepipe.tools.plan",
            "--target",
            str(folder / "config.json"),
            "--params",
            str(folder / "params.yaml"),
            "--prompt-tokens",
            "300",
            "--answer-tokens",
            "1500",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    assert f"hidden {text['hidden_size']}, {text['num_hidden_layers']} layers" in out.stdout
    assert "offline states, bfloat16" in out.stdout


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b"])
def test_a_tiny_target_of_the_same_structure_passes_the_checks(name, tmp_path, tokenizer):
    """The recipe's config with its widths shrunk: the same model_type, RoPE (scaling included), norms and ties."""
    raw = json.loads((ROOT / "recipes" / name / "config.json").read_text()) | TINY | {"vocab_size": len(tokenizer)}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw))
    model.save_pretrained(tmp_path)
    cfg = compat.check(tmp_path)
    assert cfg.model_type == raw["model_type"] and families.of(cfg).name == raw["model_type"]


def test_kimis_composite_target_passes_the_checks_through_its_language_model(tmp_path, tokenizer):
    """The recipe's text config shrunk (MLA ranks too) inside Kimi-K2.5's wrapper, saved by transformers: served
    text-only, its family the DeepseekV3 of its language model."""
    from transformers import AutoModelForImageTextToText
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    raw = json.loads((ROOT / "recipes" / "kimi-k2.5" / "config.json").read_text())
    text = (
        raw.get("text_config", raw)
        | TINY
        | {
            "model_type": "deepseek_v3",
            "vocab_size": len(tokenizer),
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_routed_experts": 4,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
        }
    )
    text.pop("quantization_config", None)
    vision = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    model = AutoModelForImageTextToText.from_config(
        Kimi_K25Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    )
    model.save_pretrained(tmp_path)  # its layers saved as "blocks" (compat.names)
    text_cfg = compat.check(tmp_path)  # the language model's config
    wrapper = families.load_config(tmp_path)
    assert wrapper.model_type == "kimi_k25" and families.composite(wrapper)
    assert text_cfg.model_type == "deepseek_v3" and families.of(text_cfg).drafter == "deepseek_mla"
