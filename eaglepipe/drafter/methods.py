"""The drafters ``train.method`` names, one entry each. Adding a method: its module (a folder per algorithm, as
``eagle3/``), its entry in ``METHODS``, its name in ``train.method`` (core/model_sections.py) and, if it has knobs of
its own, their section there (``METHOD_SECTIONS``, which keeps them out of other methods' fingerprints).

    eagle3    EAGLE-3 (Li et al. 2025, arXiv:2503.01840): one decoder layer over three of the target's layers,
              trained with training-time test (eagle3/). vLLM and SGLang serve it.
    eagle3.1  the same layer with the EAGLE-3.1 toggles vLLM 0.32 reads from the checkpoint's config.json
              (eagle3/config.py): ``fc_norm`` and ``norm_output``, each a knob in ``train.eagle3_1``.
    peagle    parallel drafting (P-EAGLE, arXiv:2602.01469; vLLM 0.32's ``parallel_drafting``): the same layer
              proposes all its tokens in one forward, the first from the last committed position and each further
              one from a mask slot (a mask token and a learned ``mask_hidden``); trained as TTT with mask slots
              in place of the fed-back steps (eagle3/ttt.py). vLLM serves it with the Llama and Qwen3 layers;
              SGLang does not serve it.
    dflash    block drafting (DFlash, arXiv:2602.06036; vLLM 0.32's ``dflash``): ``train.dflash.num_layers`` Qwen3
              layers read the aux states as context and draft ``train.ttt_steps`` tokens after a bonus token in one
              non-causal forward (dflash/), trained on the TTT batches; vLLM serves it beside any target it captures
              states from.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.model_sections import METHOD_SECTIONS
from eaglepipe.drafter.dflash.config import ARCHITECTURE as DFLASH_ARCHITECTURE
from eaglepipe.drafter.dflash.config import DFlashConfig
from eaglepipe.drafter.dflash.model import DFlashDraft
from eaglepipe.drafter.dflash.objective import dflash_forward
from eaglepipe.drafter.eagle3.config import MASK_KEY, DraftConfig
from eaglepipe.drafter.eagle3.model import Eagle3Draft
from eaglepipe.drafter.eagle3.ttt import ttt_forward

EAGLE3_CODE = (
    "drafter.eagle3.config",
    "drafter.eagle3.model",
    "drafter.eagle3.attention",
    "drafter.eagle3.init",
    "drafter.eagle3.ttt",
)
"""The modules that decide an EAGLE-3 drafter (train's cache key: drafter/train.py's ``fingerprint``)."""
DFLASH_CODE = (*EAGLE3_CODE, "drafter.dflash.config", "drafter.dflash.model", "drafter.dflash.objective")
"""DFlash's: its own and the EAGLE-3 pieces it builds on (attention, vocabulary, batches)."""


def _no_options(p: config.Train) -> dict:
    return {}


@dataclass(frozen=True)
class Method:
    options: Callable[[config.Train], dict] = _no_options  # DraftConfig fields beyond EAGLE-3's and the section's
    layers: tuple = ("llama", "qwen3", "deepseek_mla")  # the drafter layers (train.drafter) vLLM serves it with
    own_layer: str | None = None  # the layer it always has, whatever the target's family
    config: type = DraftConfig
    model: type = Eagle3Draft
    objective: Callable = ttt_forward  # (model, batch, steps, step_weight, per_row) -> (loss, StepStats)
    code: tuple = EAGLE3_CODE  # the modules that decide its drafter beside train's own (train.RESULT_CODE)


METHODS = {
    "eagle3": Method(),
    "eagle3.1": Method(),  # its knobs: train.eagle3_1
    "peagle": Method(options=lambda p: {"parallel_drafting": True}, layers=("llama", "qwen3")),
    "dflash": Method(
        options=lambda p: {"parallel_drafting": True, "block_size": p.ttt_steps + 1},
        layers=("qwen3",),
        own_layer="qwen3",
        config=DFlashConfig,
        model=DFlashDraft,
        objective=dflash_forward,
        code=DFLASH_CODE,
    ),
}


def layer_of(p: config.Train, family_layer: str) -> str:
    """The drafter layer ``p`` trains (train.drafter, else the method's own, else the target family's ``family_layer``);
    UserError unless vLLM serves ``p.method`` with it."""
    method = METHODS[p.method]
    layer = p.drafter if p.drafter != "auto" else method.own_layer or family_layer
    if layer not in method.layers:
        raise UserError(
            f"train.method {p.method} cannot be served with the {layer} drafter layer (train.drafter, or the "
            f"target family's): vLLM 0.32 serves it with {', '.join(method.layers)} only"
        )
    return layer


def objective_of(model) -> Callable:
    """The training objective of ``model``'s method."""
    return next(method.objective for method in METHODS.values() if isinstance(model, method.model))


def draft_options(p: config.Train) -> dict:
    """The config fields ``p.method`` sets beyond EAGLE-3's: its own and its section's knobs."""
    section = METHOD_SECTIONS.get(p.method)
    knobs = getattr(p, section).model_dump() if section else {}
    return {**METHODS[p.method].options(p), **knobs}


def read_config(folder) -> DraftConfig:
    """The config of the drafter saved in ``folder`` (its config.json, whichever method), without its weights."""
    d = json.loads((Path(folder) / "config.json").read_text())
    if DFLASH_ARCHITECTURE in d.get("architectures", []):
        return DFlashConfig.from_json(d)
    return DraftConfig.from_json(d)


def load(folder, target_embeddings):
    """The drafter saved in ``folder`` (eagle3/model.py's ``save``), in eval mode."""
    cfg = read_config(folder)
    model_class = next(method.model for method in METHODS.values() if type(cfg) is method.config)
    model = model_class(cfg, target_embeddings)
    model.load_state_dict(load_file(str(Path(folder) / "model.safetensors")), strict=True)
    return model.eval()


def speculative_config(folder, num_steps: int) -> dict:
    """vLLM's ``--speculative-config`` for the drafter saved in ``folder`` (``method`` named, or vLLM silently picks
    another): ``dflash`` for a block drafter, else ``eagle3``, with ``parallel_drafting`` for one with a mask token.
    It reads only the config.json keys that pick these, so a checkpoint ``read_config`` refuses is still served as
    vLLM would serve it."""
    d = json.loads((Path(folder) / "config.json").read_text())
    spec = {"model": str(folder), "num_speculative_tokens": num_steps}
    if DFLASH_ARCHITECTURE in d.get("architectures", []):
        return {"method": "dflash", **spec}
    return {"method": "eagle3", **spec, **({"parallel_drafting": True} if d.get(MASK_KEY) is not None else {})}
