"""What tests of several folders share: the project root, the project's params with keys replaced, the tiny
params of the end-to-end runs, dvc.yaml's stages and each stage script's arguments."""

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def stages():
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]


def with_(**sections) -> dict:
    """The project's params with some keys of some sections replaced."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    for name, keys in sections.items():
        raw[name] = {**raw.get(name, {}), **keys}
    return raw


def tiny_params(params: dict) -> dict:
    for source in params["prepare"]["sources"]:
        source["n"] = 2
    params["infer"].update(max_new_tokens=8, batch_size=4)
    params["infer"]["gates"].update(max_truncated=1.0, warmup=4, every=4)
    params["train"].update(epochs=1, draft_vocab_size=256)
    params["evaluate"].update(limit=2, max_new_tokens=8)
    return params


STAGE_ARGS = {
    "prepare": ["--out", "o/p.jsonl", "--report", "o/r.json", "--timings", "o/t.json"],
    "infer": ["--prompts", "o/p.jsonl", "--out", "o/r", "--report", "o/r.json", "--timings", "o/t.json"],
    "merge": ["--responses", "o/r.jsonl", "--out", "o/s", "--report", "o/r.json", "--timings", "o/t.json"],
    "hidden": ["--sequences", "o/s", "--out", "o/h", "--report", "o/r.json", "--timings", "o/t.json"],
    "train": [
        "--hidden",
        "o/h",
        "--sequences",
        "o/s",
        "--out",
        "o/d",
        "--metrics",
        "o/m.json",
        "--plots",
        "o/c.json",
        "--timings",
        "o/t.json",
    ],
    "evaluate": [
        "--prompts",
        "o/p.jsonl",
        "--draft",
        "o/d",
        "--report",
        "o/r.json",
        "--positions",
        "o/p.json",
        "--decoded",
        "o/decoded",
        "--timings",
        "o/t.json",
    ],
    "serve": ["--decoded", "o/d.jsonl", "--draft", "o/d", "--report", "o/r.json", "--timings", "o/t.json"],
}
