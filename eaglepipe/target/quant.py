"""Quantized targets: which ones the in-process engine loads here, and the weights train reads from them, in floats.

``loadable`` refuses a ``quantization_config.quant_method`` whose package (``NEEDS``) is not installed. FP8
block-quantized weights (``quant_method: fp8``, ``weight_block_size``: float8 values and a ``<name>_scale_inv`` of one
scale per block) are read by ``dequantize``: ``value * scale`` blockwise in float32, as transformers computes it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from eaglepipe.core.errors import UserError

NEEDS = {"compressed-tensors": "compressed_tensors", "gptq": "gptqmodel", "awq": "awq", "bitsandbytes": "bitsandbytes"}
"""quant_method -> the package transformers' quantizer for it imports (methods not named here need none)."""
SCALE = "_scale_inv"
"""A weight ``w``'s block scales are stored as ``w`` + SCALE."""


def method(folder) -> dict | None:
    """The target's ``quantization_config`` (None: stored as floats)."""
    return json.loads((Path(folder) / "config.json").read_text()).get("quantization_config")


def loadable(folder) -> None:
    """Raise a UserError when transformers cannot load the quantized target in ``folder`` here."""
    qc = method(folder)
    package = NEEDS.get((qc or {}).get("quant_method"))
    if package and importlib.util.find_spec(package) is None:
        raise UserError(
            f"target {folder}: its weights are {qc['quant_method']}-quantized, which the in-process engine "
            f"loads only with the {package} package, not installed here: generate with infer.engine: "
            "sglang or vllm, which serve such checkpoints; hidden, evaluate and online training run the "
            "target in-process"
        )


def block_size(folder) -> list[int]:
    """``weight_block_size`` of the FP8 target in ``folder``: the rows and columns one scale covers."""
    block = (method(folder) or {}).get("weight_block_size")
    if block is None:
        raise UserError(
            f"target {folder}: its weights carry {SCALE} block scales, but config.json's "
            "quantization_config names no weight_block_size"
        )
    return block


def dequantize(weight, scale, block: list[int]):
    """``weight`` [out, in] (float8) times its scales ``scale`` [ceil(out / block[0]), ceil(in / block[1])], one per
    block, in float32 (``block``: ``weight_block_size``)."""
    out_, in_ = weight.shape
    full = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out_, :in_]
    return weight.float() * full
