"""In-process Hugging Face engine: batched ``model.generate`` with left padding, for the embedded model or any
Hugging Face model folder."""
from __future__ import annotations

import hashlib

import torch
from transformers import GenerationConfig

from . import Output, Sampling


class HFEngine:
    name = "hf"

    def __init__(self, model, pad_token_id: int, batch_size: int = 16):
        # transformers fills every knob left at its default from the model's generation_config.json (a
        # repetition_penalty, a top_k, ...); a neutral config leaves only the explicit Sampling in force.
        model.generation_config = GenerationConfig(pad_token_id=pad_token_id)
        self.model = model
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size

    def identity(self) -> dict:
        """What, beyond the model files, decides this engine's ids (part of the infer cache's fingerprint)."""
        return {"dtype": str(self.model.dtype), "batch_size": self.batch_size}

    def describe(self) -> dict:
        """What the stage keeps about the engine next to its records (engine.json)."""
        return {"engine": self.name, "model": type(self.model).__name__, **self.identity()}

    def stream(self, prompts: list[list[int]], sampling: Sampling, rids: list[str]):
        """Generate in batches of similar length (less padding), longest first; yield (index, Output)."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        for b in range(0, len(order), self.batch_size):
            batch = order[b:b + self.batch_size]
            outs = self.generate([prompts[i] for i in batch], sampling, [rids[i] for i in batch])
            yield from zip(batch, outs)

    def generate(self, prompts: list[list[int]], sampling: Sampling, rids: list[str] | None = None) -> list[Output]:
        rids = rids or [str(i) for i in range(len(prompts))]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, ids in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            attention[row, width - len(ids):] = 1
        # One seed per batch, derived from the run's seed and the batch's record ids: reruns are reproducible.
        seed = int(hashlib.sha256(f"{sampling.seed}:{','.join(rids)}".encode()).hexdigest()[:8], 16)
        torch.manual_seed(seed)
        greedy = sampling.temperature <= 0
        knobs = {} if greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                   "top_k": max(sampling.top_k, 0),  # 0 = off (GenerationConfig's default is 50)
                                   "min_p": sampling.min_p or None}
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=input_ids, attention_mask=attention, max_new_tokens=sampling.max_new_tokens,
                do_sample=not greedy, eos_token_id=list(sampling.stop_token_ids) or None,
                pad_token_id=self.pad_token_id, **knobs)
        stops = set(sampling.stop_token_ids)
        results = []
        for row in out[:, width:].tolist():
            cut = next((i for i, t in enumerate(row) if t in stops), None)
            if cut is not None:
                results.append(Output(row[:cut + 1], "stop"))
            else:
                results.append(Output(row, "length"))
            results[-1].meta = {"engine": self.name, "batch_size": len(prompts), "seed": seed}
        return results
