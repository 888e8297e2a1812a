"""What the end-to-end tests share: for the infer stage against servers (tests/test_sglang_e2e.py,
tests/test_vllm_engine.py, tests/test_serve.py) reading the generation cache, comparing records, waiting; for stages
under torchrun (tests/test_distributed.py, tests/test_train.py) finding the ranks' processes; for decoding tests
(tests/test_evaluate.py, tests/test_serve.py, tests/test_distributed.py) an untrained drafter."""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path


def cache_lines(folder: Path) -> list[dict]:
    """Complete lines of the generation cache under ``folder/cache`` (a line torn by kill -9 is left out)."""
    out = []
    for path in (folder / "cache").glob("*/generations.jsonl"):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def assert_same_records(got: list[dict], reference: list[dict], engine: str) -> None:
    """Byte for byte in format: the same fields in the same order with the same values; only meta may differ (it
    names ``engine`` in ``got``, the embedded engine in ``reference``)."""
    assert [r["id"] for r in got] == [r["id"] for r in reference]
    for g, ref in zip(got, reference):
        assert list(g) == list(ref), (list(g), list(ref))
        assert {k: v for k, v in g.items() if k != "meta"} == {k: v for k, v in ref.items() if k != "meta"}, g["id"]
        assert g["meta"]["engine"] == engine and ref["meta"]["engine"] == "hf"


def port_closed(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def ranks_of(agent: int) -> dict[int, int]:
    """{rank: pid} of the torchrun workers that are children of the agent process ``agent``."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                environ = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
                if "RANK" in environ:
                    ranks[int(environ["RANK"])] = int(proc.name)
        except (FileNotFoundError, ProcessLookupError):
            continue  # a process that ended meanwhile
    return ranks


def untrained_drafter(target_folder, layers: list[int], draft_vocab: int = 2048):
    """A drafter started from the target (its midlayer the target's last layer read, ``draft.init_from_target``),
    its draft vocabulary the first ``draft_vocab`` ids: untrained, yet some of its drafts are accepted."""
    from collections import Counter

    import torch
    from transformers import AutoConfig

    from eaglepipe import draft, train

    tgt = train.target_tensors(target_folder, layers[-1])
    cfg = draft.DraftConfig.from_target(AutoConfig.from_pretrained(target_folder), draft_vocab, layers)
    torch.manual_seed(0)
    drafter = draft.Eagle3Draft(cfg, tgt["embed"])
    drafter.set_vocab(*draft.build_vocab(Counter(range(draft_vocab)), draft_vocab, cfg.vocab_size))
    draft.init_from_target(drafter, tgt)
    return drafter
