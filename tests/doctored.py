"""A doctored copy of a target folder: the same files, one weight changed, so that an engine serving it computes
another model than the one transformers loads from the original (infer's pre-flight and hidden's agreement check must
tell them apart).

``how``:
- ``norm``: the final norm's weight times 1.5. Every logit is scaled by 1.5, so greedy answers keep their ids and only
  the log-probabilities reveal the change.
- ``head_row``: the output head's row of the token the target ranks best after a bare chat prompt, times 3 (the
  embedding's row where the head is tied, as in SmolLM2): that token's logit grows wherever it was positive, so the
  answers and their figures change.
"""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglepipe.target import chat, compat
from eaglepipe.target import model as target

NORM_SCALE = 1.5
ROW_SCALE = 3.0


def likeliest_first_token(folder: Path) -> int:
    """The token the target ranks best to open its answer to a bare question."""
    ids = chat.prompt_ids(target.load_tokenizer(folder), [{"role": "user", "content": "Hello?"}])
    model = target.load_model(folder)
    with torch.inference_mode():
        return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())


def doctored_copy(folder: Path, tmp_path: Path, how: str = "norm") -> Path:
    """A copy of ``folder`` under ``tmp_path`` with one weight changed as ``how`` says (module docstring)."""
    folder, copy = Path(folder), Path(tmp_path) / f"doctored-{how}"
    copy.mkdir(parents=True)
    stored = compat.weights(folder)
    names = compat.names(stored)
    if how == "norm":
        name, change = names.norm, lambda w: w * NORM_SCALE
    elif how == "head_row":
        row = likeliest_first_token(folder)
        name = names.head if names.head in stored else names.embed

        def change(w):
            w = w.clone()
            w[row] *= ROW_SCALE
            return w
    else:
        raise ValueError(f"how: norm or head_row, not {how}")
    for item in folder.iterdir():
        if item.suffix != ".safetensors" or item.name != stored[name][0]:
            shutil.copy2(item, copy / item.name)
    tensors = load_file(folder / stored[name][0])
    tensors[name] = change(tensors[name])
    save_file(tensors, copy / stored[name][0], metadata={"format": "pt"})
    return copy
