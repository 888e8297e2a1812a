"""The DFlash drafter's config (``DFlashConfig``) and its ``config.json``, as vLLM 0.32 loads it
(``model_executor/models/qwen3_dflash.py``, ``v1/spec_decode/dflash.py``).

``config.json``: ``architectures: ["DFlashDraftModel"]`` (vLLM's registry name; any other is prefixed ``DFlash`` and
unknown), ``model_type: qwen3``, ``num_hidden_layers`` (``train.dflash.num_layers``), the target's widths, heads, RoPE
and vocabulary as an EAGLE-3 drafter's (``head_dim``; Qwen3's per-head ``q_norm``/``k_norm`` always),
``draft_vocab_size`` (the reduced head, with ``d2t``), and the target's layers it reads, once per key vLLM reads:
    ``eagle_aux_hidden_state_layer_ids`` (top level): the HF indices ([2, 15, 27]); vLLM reads it first.
    ``dflash_config.target_layer_ids``: the same layers as layer outputs, the HF indices minus one ([1, 14, 26]).
``dflash_config.mask_token_id``: the mask token; ``dflash_config.block_size`` (and top level): the bonus token plus the
drafts, ``train.ttt_steps + 1`` (vLLM drafts ``num_speculative_tokens`` and does not read it; SGLang does). No
``eagle_config``: vLLM's runner would take the layer ids from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from eaglepipe.drafter.eagle3.config import DraftConfig

ARCHITECTURE = "DFlashDraftModel"


@dataclass
class DFlashConfig(DraftConfig):
    num_layers: int = 1  # decoder layers
    block_size: int = 4  # the bonus token and the drafts after it

    @property
    def qk_norm(self) -> bool:
        """DFlash's layers are Qwen3's: an RMS norm on each head's q and k."""
        return True

    def to_json(self) -> dict:
        """config.json in the layout vLLM loads (module docstring)."""
        out = super().to_json()
        del out["eagle_config"]
        for key in ("fc_norm", "norm_output", "ptd_token_id"):
            out.pop(key, None)
        dflash = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": [i - 1 for i in self.aux_layers],
            "block_size": self.block_size,
        }
        return {
            **out,
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "num_hidden_layers": self.num_layers,
            "block_size": self.block_size,
            "dflash_config": dflash,
        }

    @classmethod
    def from_json(cls, d: dict) -> DFlashConfig:
        if ARCHITECTURE not in d.get("architectures", []):
            raise ValueError(f"not a {ARCHITECTURE} config: {d.get('architectures')}")
        dflash = d["dflash_config"]
        layers = [i + 1 for i in dflash["target_layer_ids"]]
        if d.get("eagle_aux_hidden_state_layer_ids", layers) != layers:
            raise ValueError("config.json's eagle_aux_hidden_state_layer_ids and dflash_config.target_layer_ids differ")
        as_eagle3 = {
            **d,
            "architectures": ["LlamaForCausalLMEagle3"],
            "num_hidden_layers": 1,
            "eagle_aux_hidden_state_layer_ids": layers,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": dflash["target_layer_ids"]},
        }
        base = DraftConfig.from_json(as_eagle3)
        fields = {**base.__dict__, "drafter": "qwen3", "mask_token_id": dflash["mask_token_id"]}
        return cls(**fields, num_layers=d["num_hidden_layers"], block_size=dflash["block_size"])
