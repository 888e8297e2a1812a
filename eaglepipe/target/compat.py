"""Which targets the pipeline serves (``check``, run before the target is loaded).

A decoder-only causal LM that transformers loads (``AutoModelForCausalLM``), or a composite of
``families.COMPOSITES`` served text-only through its language model (``AutoModelForImageTextToText``), with at least
``MIN_LAYERS`` decoder layers, RMS norms, a ``silu`` gated MLP, rotary position embeddings over the whole head, and
safetensors weights holding the embedding, the final norm and the head (or tied embeddings) under the names ``names``
finds, stored as floats (``FLOAT_DTYPES``; FP8 layers: quant.py). Anything else raises ``UnsupportedTarget``.

``engine_refusal``: why a serving engine would compute another model than transformers for a target (``INCOMPATIBLE``,
the known faults of the engines' own model code), asked by infer and by the serve check before any server starts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from eaglepipe.core.errors import UserError
from eaglepipe.target import families


@dataclass(frozen=True)
class Names:
    """The names of the weights train reads: the embedding, the final norm, the head, and the decoder layers' prefix."""

    embed: str
    norm: str
    head: str
    layers: str


PREFIXES = (
    ("model.", "lm_head.weight"),  # a text-only checkpoint
    ("model.language_model.", "lm_head.weight"),  # transformers' composites (Qwen3-VL, Kimi-K2.5 as saved)
    ("language_model.model.", "language_model.lm_head.weight"),
)  # Kimi-K2.5 as published
"""Where a checkpoint keeps its language model (its ``embed_tokens``, ``norm``, ``layers``) and its head."""


def names(stored) -> Names:
    """The ``Names`` in ``stored`` (tensor names): under the first of ``PREFIXES`` with an embedding (else the
    text-only names), decoder layers under ``layers.``, or ``blocks.`` where only that is stored (Kimi-K2.5 as
    transformers saves it)."""
    prefix, head = next(((p, h) for p, h in PREFIXES if p + "embed_tokens.weight" in stored), PREFIXES[0])
    layers = (
        "blocks."
        if not any(n.startswith(prefix + "layers.") for n in stored)
        and any(n.startswith(prefix + "blocks.") for n in stored)
        else "layers."
    )
    return Names(prefix + "embed_tokens.weight", prefix + "norm.weight", head, prefix + layers)


MIN_LAYERS = 4
FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors dtype names of the weights train reads as they are


class UnsupportedTarget(UserError):
    """The target is one the pipeline cannot serve (``check``); the message names the folder and the reason."""


def weights(folder: Path) -> dict[str, tuple[str, str, tuple]]:
    """Every tensor of the target's safetensors files: name -> (file, safetensors dtype, shape), from the headers."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    if not (folder / files[0]).exists():
        raise UnsupportedTarget(
            f"target {folder}: no safetensors weights (model.safetensors or its index): train "
            "reads the target's embedding, head and one layer from them"
        )
    found = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  safe_open has keys() but is not iterable
                view = f.get_slice(name)
                found[name] = (file, view.get_dtype(), tuple(view.get_shape()))
    return found


def read(folder: Path, wanted: dict, stored: dict | None = None) -> dict:
    """{key: tensor} for ``wanted`` = {key: weight name} (names the files lack left out) from the target's
    safetensors files (``stored``: ``weights(folder)`` if not given); an FP8 weight with block scales comes
    dequantized to float32 (quant.py)."""
    from safetensors import safe_open

    from eaglepipe.target import quant

    folder = Path(folder)
    stored = weights(folder) if stored is None else stored
    wanted = {**wanted, **{k + quant.SCALE: n + quant.SCALE for k, n in wanted.items() if n + quant.SCALE in stored}}
    by_file = {}
    for key, name in wanted.items():
        if name in stored:
            by_file.setdefault(stored[name][0], {})[key] = name
    found = {}
    for file, names_ in by_file.items():
        with safe_open(str(folder / file), framework="pt") as f:
            found.update({key: f.get_tensor(name) for key, name in names_.items()})
    for key in [k for k in found if k + quant.SCALE in found]:
        found[key] = quant.dequantize(found[key], found.pop(key + quant.SCALE), quant.block_size(folder))
    return found


def head_and_norm(folder: Path, stored: dict | None = None) -> tuple:
    """(the output head, the final norm's weight), float32; the head is the embedding where they are tied."""
    stored = weights(folder) if stored is None else stored
    n = names(stored)
    found = read(folder, {"head": n.head if n.head in stored else n.embed, "norm": n.norm}, stored)
    return found["head"].float(), found["norm"].float()


def check(folder: Path):
    """The target's (text) transformers config, once every requirement above holds; else ``UnsupportedTarget``
    naming the first that does not. Reads config.json and the safetensors headers only."""
    folder = Path(folder)
    config = _readable_config(folder)
    _decoder_only(folder, config)
    _served_composite(folder, config)
    _loadable_class(folder, config)
    text = families.text_config(config)
    _drafter_fields(folder, text)
    _enough_layers(folder, text)
    _silu_mlp(folder, text)
    _attention_heads(folder, text)
    rope = dict(text.rope_parameters)
    _whole_head_rotary(folder, text, rope)
    _computed_rope(folder, rope, families.composite(config))
    stored = weights(folder)
    _float_weights(folder, stored, _tied(config))
    _decoder_layers(folder, stored)
    _embedding_shape(folder, stored, text)
    return text


def _readable_config(folder: Path):
    """The target's transformers config, which transformers must be able to read."""
    try:
        return families.load_config(folder)
    except (OSError, ValueError, KeyError) as e:  # no config.json, an unknown model_type
        raise UnsupportedTarget(
            f"target {folder}: transformers cannot read its config.json ({str(e).splitlines()[0][:200]})"
        ) from e


def _decoder_only(folder: Path, config) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedTarget(
            f"target {folder}: {config.model_type} is an encoder-decoder model; EAGLE-3 drafts for decoder-only targets"
        )


def _served_composite(folder: Path, config) -> None:
    """A composite (multimodal) config is served only if it is one of ``families.COMPOSITES``."""
    if families.composite(config) and config.model_type not in families.COMPOSITES:
        raise UnsupportedTarget(
            f"target {folder}: {config.model_type} nests its language model in a composite (multimodal) config; of "
            f"those, only {', '.join(families.COMPOSITES)} are served (text-only)"
        )


def _loadable_class(folder: Path, config) -> None:
    """transformers has the model class the target loads as: a causal LM, or for a composite an image-text-to-text
    model (whose language model serves it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    kind = config.model_type
    if families.composite(config):
        if type(config) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
            raise UnsupportedTarget(
                f"target {folder}: transformers has no image-text-to-text model for model_type {kind} "
                "(AutoModelForImageTextToText), which serves a composite's language model"
            )
    elif type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedTarget(
            f"target {folder}: transformers has no causal LM for model_type {kind} (AutoModelForCausalLM): not a "
            "decoder-only LM"
        )


DRAFTER_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "rms_norm_eps",
    "hidden_act",
    "max_position_embeddings",
    "vocab_size",
    "rope_parameters",
)
"""The fields of the target's text config that the drafter's Llama config takes."""


def _drafter_fields(folder: Path, text) -> None:
    for field in DRAFTER_FIELDS:
        if getattr(text, field, None) is None:
            raise UnsupportedTarget(
                f"target {folder}: its {text.model_type} config has no {field}, which the drafter's Llama config "
                "takes from the target"
            )


def _enough_layers(folder: Path, text) -> None:
    if text.num_hidden_layers < MIN_LAYERS:
        raise UnsupportedTarget(
            f"target {folder}: it has {text.num_hidden_layers} decoder layers, fewer than {MIN_LAYERS}: EAGLE-3 "
            "reads the inputs of three distinct layers, and layer 0's (the embeddings) is one several SGLang and "
            "vLLM models cannot capture"
        )


def _silu_mlp(folder: Path, text) -> None:
    if text.hidden_act != "silu":
        raise UnsupportedTarget(
            f"target {folder}: its MLP activation is {text.hidden_act}; the drafter's Llama layer in SGLang and vLLM "
            "has silu only"
        )


def _attention_heads(folder: Path, text) -> None:
    """Grouped-query attention the drafter computes: whole query heads per KV head, an even head size (RoPE)."""
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if heads % kv_heads or head_dim % 2:
        raise UnsupportedTarget(
            f"target {folder}: {heads} attention heads over {kv_heads} KV heads of size {head_dim}: the drafter's "
            "grouped-query attention needs a whole number of query heads per KV head and an even head size (RoPE)"
        )


def _whole_head_rotary(folder: Path, text, rope: dict) -> None:
    partial = rope.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise UnsupportedTarget(
            f"target {folder}: its RoPE rotates {partial} of each head; the drafter's Llama attention rotates the "
            "whole head"
        )


def _computed_rope(folder: Path, rope: dict, composite: bool) -> None:
    """A RoPE the drafter's attention computes: a transformers rope type with a ``rope_theta``; M-RoPE only in a
    composite (whose language model runs on text positions alone)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if (
        "mrope_section" in rope
        and not composite
        or rope.get("rope_type", "default") not in ("default", *ROPE_INIT_FUNCTIONS)
        or "rope_theta" not in rope
    ):
        raise UnsupportedTarget(f"target {folder}: its RoPE {rope} is not one the drafter's Llama attention computes")


def _float_weights(folder: Path, stored: dict, tied: bool) -> None:
    """The embedding, the final norm and the head (unless tied and not stored) are in the safetensors files
    (``stored``: ``weights``), as floats."""
    n = names(stored)
    for name in (n.embed, n.norm) + (() if tied and n.head not in stored else (n.head,)):
        if name not in stored:
            raise UnsupportedTarget(
                f"target {folder}: its weights have no {name} (the Hugging Face Llama-style names train reads)"
            )
        if stored[name][1] not in FLOAT_DTYPES:
            raise UnsupportedTarget(
                f"target {folder}: its {name} is stored as {stored[name][1]}, not as floats (train reads it as it is)"
            )


def _decoder_layers(folder: Path, stored: dict) -> None:
    layers = names(stored).layers
    if not any(name.startswith(layers) for name in stored):
        raise UnsupportedTarget(
            f"target {folder}: its weights have no {layers}* (the decoder layers, one of which the drafter starts from)"
        )


def _embedding_shape(folder: Path, stored: dict, text) -> None:
    embed = names(stored).embed
    if stored[embed][2] != (text.vocab_size, text.hidden_size):
        raise UnsupportedTarget(
            f"target {folder}: its {embed} is {list(stored[embed][2])}, not [vocab_size, hidden_size] "
            f"[{text.vocab_size}, {text.hidden_size}]"
        )


# ------------------------------------------------------------------------------ engines that compute another model
def _tied(config) -> bool:
    """Whether the config ties the output head to the embedding (a composite's or its language model's says so)."""
    text = families.text_config(config)
    return bool(getattr(config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False))


def _unloaded_head(*model_types: str) -> Callable[[object, dict], bool]:
    """The predicate of a fault: the target's language model is of one of ``model_types``, and its head is left for
    the engine to tie (the config ties it, the weights ``stored``, as ``weights`` lists them, hold none). An engine
    model that never ties then answers from its head as allocated, never loaded."""

    def applies(config, stored: dict) -> bool:
        kind = families.text_config(config).model_type
        return kind in model_types and _tied(config) and names(stored).head not in stored

    return applies


def _never_ties(model: str) -> str:
    """The reason of an ``_unloaded_head`` row whose engine runs ``model`` (its class and file), to be formatted with
    the target's folder and the name of its head's weight."""
    return (
        f"target {{folder}}: {model} never ties the output head to the embedding, and this target's config ties them "
        "(tie_word_embeddings) with no {head} stored: the engine would answer from an unloaded head, not the model "
        "transformers computes. Generate with infer.engine: hf, or store the embedding as {head} too"
    )


@dataclass(frozen=True)
class Incompatibility:
    """A known fault of ``engine`` (an ``infer.engine`` name) with the targets ``applies`` picks (from their
    transformers config and ``weights``): ``reason`` says what the engine does and what to do instead."""

    engine: str
    applies: Callable[[object, dict], bool]
    reason: str


DEEPSEEK = ("deepseek_v2", "deepseek_v3")  # Kimi-K2.5's language model too (families.text_config)
VLLM_DEEPSEEK = "vLLM 0.32's DeepseekV2ForCausalLM (vllm/model_executor/models/deepseek_v2.py)"
VLLM_GPT_OSS = "vLLM 0.32's GptOssForCausalLM (vllm/model_executor/models/gpt_oss.py)"
SGLANG_DEEPSEEK = "SGLang 0.5's DeepseekV2ForCausalLM (sglang/srt/models/deepseek_v2.py)"
SGLANG_GPT_OSS = "SGLang 0.5's GptOssForCausalLM (sglang/srt/models/gpt_oss.py)"
INCOMPATIBLE = (
    Incompatibility("vllm", _unloaded_head(*DEEPSEEK), _never_ties(VLLM_DEEPSEEK)),
    Incompatibility("vllm", _unloaded_head("gpt_oss"), _never_ties(VLLM_GPT_OSS)),
    Incompatibility("sglang", _unloaded_head(*DEEPSEEK), _never_ties(SGLANG_DEEPSEEK)),
    Incompatibility("sglang", _unloaded_head("gpt_oss"), _never_ties(SGLANG_GPT_OSS)),
)
"""What the engines' own model code gets wrong, as read in their sources (vLLM's Llama, Mistral, Qwen2, Qwen3,
Qwen3-MoE and Qwen3-VL models tie their head where the config says so; these do not)."""


def engine_refusal(engine: str, folder: Path, config=None) -> str | None:
    """Why ``engine`` (an ``infer.engine`` name; the serve check's is vllm) would compute another model than
    transformers for the target in ``folder``, or None: the first row of ``INCOMPATIBLE`` that applies. Reads its
    config.json (unless given its transformers ``config``) and its safetensors headers; a target without safetensors
    weights is not judged (``check`` refuses it where the pipeline reads them)."""
    rows = [row for row in INCOMPATIBLE if row.engine == engine]
    if not rows:
        return None
    config = families.load_config(folder) if config is None else config
    try:
        stored = weights(folder)
    except UnsupportedTarget:
        return None
    refused = next((row for row in rows if row.applies(config, stored)), None)
    return refused.reason.format(folder=folder, head=names(stored).head) if refused else None
