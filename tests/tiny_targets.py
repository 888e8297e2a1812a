"""Tiny random targets of the families (tests/target/test_families*.py and the other folders' tests that need one):
the family table, a builder that saves a target of a family as a model folder with the embedded target's tokenizer,
FP8 block storage of its weights, the drafter's deviation from a target layer, and the merged sequences of the
target's own greedy answers that hidden and train read; the train, hidden and evaluate settings of those runs."""

import json

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV3Config,
    GptOssConfig,
    LlamaConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
    Qwen3VLConfig,
)
from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

from eaglepipe.core import config
from eaglepipe.dataset import sequences
from eaglepipe.evaluate import decode
from eaglepipe.hidden import hf_source
from eaglepipe.target import quant

SIZES = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 4,
    "num_key_value_heads": 4,
    "first_k_dense_replace": 1,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,  # the latent vLLM's CPU MLA runs
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",  # DeepSeek-V3's
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 1e4,
        "factor": 4.0,  # routing, read by vLLM
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
FAMILIES = {  # config class, its own keys; vocab and special ids are the embedded target's tokenizer's
    "qwen3": (Qwen3Config, {"num_hidden_layers": 5, "head_dim": 32}),  # train.drafter auto: qwen3; vLLM's CPU
    "qwen3_llama": (Qwen3Config, {"num_hidden_layers": 5, "head_dim": 32}),  # attention: heads of 32 and up
    "qwen2": (
        Qwen2Config,
        {"num_hidden_layers": 4, "tie_word_embeddings": False, "num_attention_heads": 2, "num_key_value_heads": 1},
    ),  # heads of 32
    "qwen3_moe": (
        Qwen3MoeConfig,
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    ),
    "llama": (LlamaConfig, {"num_hidden_layers": 4, "head_dim": 32}),
    "llama_fp8": (LlamaConfig, {"num_hidden_layers": 4, "head_dim": 16}),  # its layers' projections in FP8 blocks
    "deepseek_v3": (DeepseekV3Config, DEEPSEEK_V3),
    "gpt_oss": (
        GptOssConfig,
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_local_experts": 4,  # attention sinks,
            "num_experts_per_tok": 2,
            "sliding_window": 8,  # q/k/v/o biases, windows on every other
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1.5e5,
                "factor": 4.0,  # layer
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    "kimi_k25": (Kimi_K25Config, DEEPSEEK_V3),  # a composite: DeepseekV3 in Kimi-K2.5's wrapper (the seed's target)
    "qwen3_vl": (
        Qwen3VLConfig,
        {
            "num_hidden_layers": 5,
            "head_dim": 16,  # a composite: Qwen3's layer in a wrapper
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
    ),
}
MOE = ("qwen3_moe", "deepseek_v3", "gpt_oss", "kimi_k25")  # routed experts
DRAFTER = {"qwen3_llama": "llama"}  # train.drafter where it is not auto
VISION = {  # a composite's vision tower, never run (prompts are text)
    Qwen3VLConfig: {
        "depth": 1,
        "hidden_size": 32,
        "num_heads": 2,
        "intermediate_size": 64,
        "out_hidden_size": 64,
        "deepstack_visual_indexes": [0],
    },
    Kimi_K25Config: {
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
        "pos_emb_time": 2,
    },
}
BLOCK = [16, 32]  # weight_block_size of llama_fp8: rows, columns
TRAIN = config.Train(
    seed=0,
    draft_vocab_size=256,
    ttt_steps=2,
    epochs=1,
    batch_tokens=128,
    lr=1e-3,
    warmup_steps=1,
    threads=0,
    positions="all",
    autocast="none",
    init="target",
)
MEMORIZE = TRAIN.model_copy(update={"epochs": 40, "lr": 1e-2, "init": "fresh"})  # learns the answers it trains on
HIDDEN = config.Hidden(layers="auto", dtype="bfloat16", batch_tokens=64, shard_tokens=1000)
PROMPTS = [[{"role": "user", "content": "Count from 1 to 20."}], [{"role": "user", "content": "Name three seas."}]]


def build_target(folder, family, tokenizer, published=True):
    """A random target of ``family`` saved as a model folder with the tokenizer. Every norm weight is drawn in
    [0.5, 1.5] and every bias from N(0, 0.1) (they start at 1 and 0), so a norm or bias the drafter drops or copies
    wrongly changes its output; the head is scaled by 30, so the target's next-token distribution (the drafter's
    training target) is peaked as a trained model's is, not nearly uniform. Kimi-K2.5's weights are named as
    published, which vLLM loads, unless not ``published``: as transformers saves them."""
    cls, keys = FAMILIES[family]
    text = dict(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **{**SIZES, **keys},
    )
    composite = cls in VISION
    cfg = cls(text_config=text, vision_config=VISION[cls], tie_word_embeddings=False) if composite else cls(**text)
    torch.manual_seed(0)
    model = (AutoModelForImageTextToText if composite else AutoModelForCausalLM).from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("lm_head.weight"):
                p.mul_(30)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if cls is Kimi_K25Config and published:  # transformers saves its language model's layers as "blocks"
        weights = load_file(str(folder / "model.safetensors"))
        save_file(
            {k.replace("language_model.model.blocks.", "language_model.model.layers."): v for k, v in weights.items()},
            str(folder / "model.safetensors"),
            metadata={"format": "pt"},
        )
    if family.endswith("_fp8"):
        to_fp8(folder, lambda name: ".layers." in name and name.endswith("proj.weight"))


def to_fp8(folder, which):
    """Store the weights ``which(name)`` picks as DeepSeek-V3's FP8 checkpoints do: float8_e4m3fn values and a
    float32 ``weight_scale_inv`` per block of ``BLOCK`` (its absolute maximum over 448); ``quantization_config``
    in config.json."""
    block = BLOCK
    weights = load_file(str(folder / "model.safetensors"))
    for name in [n for n in weights if which(n)]:
        w = weights[name].float()
        (rows, cols), (b0, b1) = w.shape, block
        scale = w.reshape(rows // b0, b0, cols // b1, b1).abs().amax(dim=(1, 3)) / 448
        full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)
        weights[name], weights[name + quant.SCALE] = (w / full).to(torch.float8_e4m3fn), scale
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }
    (folder / "config.json").write_text(json.dumps(cfg))


def deviation(model, drafter, ids, layers) -> float:
    """||drafter step 0 - target layer layers[2]|| / ||target layer's output||, on the target's own states of ``ids``
    (the layer's output is computed by running that layer: hidden_states[L] would be the normed state)."""
    base = hf_source.base_model(model)
    lm = getattr(base, "language_model", base)  # a composite's inner model
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
        i, pos = layers[2], torch.arange(ids.shape[1])[None]
        ref = lm.layers[i](
            states[i], attention_mask=None, position_ids=pos, position_embeddings=lm.rotary_emb(states[i], pos)
        )
        _, h, _ = drafter(ids, drafter.project(torch.cat([states[j] for j in layers], -1)))
    return float((h - ref).norm() / ref.norm())


def generated_sequences(folder, model, prompts, n=5):
    """Merged sequences as infer and merge write them: ``prompts`` (ids), then random prompt ids up to ``n``, each
    followed by the target's own greedy answer (the loss mask), so the target's argmax tokens are the ones the draft
    vocabulary is built from. The last sequence is the validation split."""
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        prompt = (
            prompts[i]
            if i < len(prompts)
            else torch.randint(3, 5000, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        )
        answer = decode.greedy(
            model, prompt, 12 if i < len(prompts) else int(torch.randint(6, 16, (1,), generator=g)), []
        )
        items.append((f"r{i}", "s", prompt + answer, [0] * len(prompt) + [1] * len(answer)))
    sequences.write(folder, {"train": items[:-1], "valid": items[-1:]}, shard_tokens=1000, policy="test")
    return items
