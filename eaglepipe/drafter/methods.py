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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.model_sections import METHOD_SECTIONS


@dataclass(frozen=True)
class Method:
    fixed: dict = field(default_factory=dict)  # DraftConfig fields it sets beyond EAGLE-3's (eagle3/config.py)
    layers: tuple = ("llama", "qwen3", "deepseek_mla")  # the drafter layers (train.drafter) vLLM serves it with


METHODS = {
    "eagle3": Method(),
    "eagle3.1": Method(),  # its knobs: train.eagle3_1
    "peagle": Method(fixed={"parallel_drafting": True}, layers=("llama", "qwen3")),
}


def check_layer(method: str, layer: str) -> None:
    """UserError unless vLLM serves ``method`` with the drafter layer ``layer``."""
    if layer not in METHODS[method].layers:
        raise UserError(
            f"train.method {method} cannot be served with the {layer} drafter layer (train.drafter, or the "
            f"target family's): vLLM 0.32 serves it with {', '.join(METHODS[method].layers)} only"
        )


def draft_options(p: config.Train) -> dict:
    """The ``DraftConfig`` fields ``p.method`` sets beyond EAGLE-3's: its fixed ones and its section's knobs."""
    section = METHOD_SECTIONS.get(p.method)
    knobs = getattr(p, section).model_dump() if section else {}
    return {**METHODS[p.method].fixed, **knobs}
