"""The serve check: vLLM serves the target with the trained drafter (``--speculative-config`` ``eagle3``; a server
started here and always stopped: engines/vllm.py, launch.py) on the prompts evaluate decoded, at temperature 0, one
request at a time after a short warm-up. Evaluate's outputs are plain greedy's; where one differs, a second server
serves the target alone, to tell the drafter's path from vLLM's numerics (``mismatches`` names each difference's run).

Acceptance length, per verification step like evaluate's (decode.py): the tokens the steps emitted (each
request's output less the prefill's first token) over vLLM's per-request ``num_spec_steps``. vLLM's own "mean
acceptance length" (1 + accepted / drafts) also counts draft tokens accepted past the stop id or the length limit, so
it is reported (``engine_reported_acceptance_length``), not compared.

The check fails when an output differs from evaluate's, unless it first does at a near-tie of the target's two best
tokens (``serve.tie_margin``: ties.py judges each difference), when vLLM feeds the drafter other layers than evaluate
did (``engine_layers``), when the acceptance length differs from evaluate's by more than ``serve.tolerance`` (relative),
or when the server's counters (``/metrics``) do not add up to the per-request counts.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from collections import defaultdict
from itertools import zip_longest

from eaglepipe.core import config
from eaglepipe.core.config import CACHE
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import read_jsonl
from eaglepipe.drafter.methods import read_config, speculative_config
from eaglepipe.engines import Failure, Sampling
from eaglepipe.engines.launch import servers
from eaglepipe.engines.vllm import VLLMEngine, amx, cpu_build
from eaglepipe.evaluate import ties
from eaglepipe.evaluate.decode import first_difference
from eaglepipe.target import compat, families, quant
from eaglepipe.target.model import stop_ids as stop_ids_of

log = logging.getLogger(__name__)

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def load_decoded(path) -> list[dict]:
    """The records of evaluate's decoded file (evaluate.decoded_record); UserError when it holds none."""
    rows = [obj for _, obj in read_jsonl(path)]
    if not rows:
        raise UserError(f"{path} holds no decoded prompts")
    return rows


def counters(url: str) -> dict:
    """The server's speculative-decoding counters from its Prometheus /metrics (summed over engines)."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    per_pos = defaultdict(float)
    for line in text.splitlines():
        m = re.match(r"vllm:spec_decode_(\w+)_total\{([^}]*)\} ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2), float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            per_pos[int(re.search(r'position="(\d+)"', labels).group(1))] += value
        elif name in out:
            out[name] += value
    out["num_accepted_tokens_per_pos"] = [per_pos[i] for i in sorted(per_pos)]
    return out


def delta(after: dict, before: dict) -> dict:
    """``counters`` after less before."""
    d = {k: int(after[k] - before[k]) for k in COUNTERS}
    d["num_accepted_tokens_per_pos"] = [
        int(a - (before["num_accepted_tokens_per_pos"][i] if i < len(before["num_accepted_tokens_per_pos"]) else 0))
        for i, a in enumerate(after["num_accepted_tokens_per_pos"])
    ]
    return d


def engine_layers(log_text: str, num_layers: int) -> list:
    """The HF hidden-state indices vLLM feeds the drafter, from the log of one server run (vLLM's default where it
    logs none)."""
    found = re.findall(r"Using auxiliary layers from speculative config: \(([0-9, ]+)\)", log_text)
    if not found:
        return [2, num_layers // 2, num_layers - 3]
    return [int(i) for i in found[-1].split(",") if i.strip()]


class Served:
    """A vLLM server of the target (with a ``speculative`` config, when given) for a ``with`` block, always stopped on
    leaving; ``decode`` runs prompts with ``concurrency`` requests in flight. ``run`` names the run in messages and the
    log (``.cache/vllm/serve-<run>-<port>.log``, one per listening server); after the block, ``log`` holds the run's."""

    def __init__(
        self,
        folder,
        tokenizer,
        p: config.Serve,
        speculative: dict | None = None,
        run: str = "plain",
        concurrency: int = 1,
    ):
        flags = list(p.extra_args)
        if speculative is not None:
            flags += ["--speculative-config", json.dumps(speculative), "--per-request-spec-decode-metrics", "summary"]
        log_path = CACHE / "vllm" / f"serve-{run}-{p.port}.log"
        launch = config.Launch(host=p.host, port=p.port, extra_args=flags, log=str(log_path))
        section = servers(
            config.Servers(
                launch=launch, concurrency=concurrency, retries=2, timeout_s=600.0, health_timeout_s=p.health_timeout_s
            ),
            folder,
            p.dtype,
        )
        self.engine, self.run, self.speculative = VLLMEngine(section, tokenizer, p.python), run, speculative
        self.warm, self.log = False, ""
        log.info("starting vLLM (%s), log %s", run, launch.log)

    def __enter__(self) -> Served:
        self.engine.__enter__()
        return self

    def __exit__(self, *exc):
        text = self.engine.launched.log_path.read_text(errors="replace")
        self.log = text[text.rfind("\n==== ") :]  # the log file gathers runs; each starts with a header line
        return self.engine.__exit__(*exc)

    @property
    def url(self) -> str:
        return self.engine.launched.url

    def warm_up(self, prompt_ids: list, sampling: Sampling) -> None:
        """One short request (first-call allocations), once."""
        if not self.warm:
            warm = Sampling(max_new_tokens=min(8, sampling.max_new_tokens), stop_token_ids=sampling.stop_token_ids)
            list(self.engine.stream([prompt_ids], warm, ["warmup"]))
            self.warm = True

    def decode(self, rows: list[dict], sampling: Sampling) -> dict:
        """Decode every row's ``prompt_ids`` after the warm-up: ``outputs`` (ids per row), ``spec`` (vLLM's
        per-request counts, or None), ``seconds``, ``tokens``. UserError if a request fails."""
        self.warm_up(rows[0]["prompt_ids"], sampling)
        start = time.perf_counter()
        answers = dict(self.engine.stream([r["prompt_ids"] for r in rows], sampling, [f"p{r['index']}" for r in rows]))
        seconds = time.perf_counter() - start
        failed = {i: a.reason for i, a in answers.items() if isinstance(a, Failure)}
        if failed:
            raise UserError(f"vLLM ({self.run}) failed {len(failed)} prompt(s): {list(failed.items())[:3]}")
        outputs = [answers[i].output_ids for i in range(len(rows))]
        return {
            "outputs": outputs,
            "seconds": seconds,
            "tokens": sum(len(o) for o in outputs),
            "spec": [answers[i].meta.get("speculative_decoding") for i in range(len(rows))]
            if self.speculative
            else None,
        }


def decode(
    folder,
    tokenizer,
    p: config.Serve,
    rows: list[dict],
    sampling: Sampling,
    speculative: dict | None = None,
    run: str = "plain",
) -> dict:
    """``Served.decode`` over ``rows`` on a server of its own, one request at a time, with ``counters`` (the
    server's, for these requests only) and ``log``."""
    with Served(folder, tokenizer, p, speculative, run) as server:
        server.warm_up(rows[0]["prompt_ids"], sampling)  # not counted
        before = counters(server.url) if speculative is not None else None
        result = server.decode(rows, sampling)
        result["counters"] = delta(counters(server.url), before) if speculative is not None else None
    return result | {"log": server.log}


def per_step(rows: list[dict], outputs: list, spec: list) -> dict:
    """Acceptance in the engine per verification step: length, rate per draft position (from the requests'
    histograms of accepted drafts), steps, and vLLM's own figure."""
    steps = sum(s["num_spec_steps"] for s in spec)
    emitted = sum(len(o) - 1 for o in outputs)
    accepted = sum(s["num_accepted_draft_tokens"] for s in spec)
    hist = [sum(c) for c in zip_longest(*(s["acceptance_histogram"] for s in spec), fillvalue=0)]
    return {
        "acceptance_length": emitted / steps if steps else 0.0,
        "steps": steps,
        "emitted": emitted,
        "accepted": accepted,
        "reported_acceptance_length": 1 + accepted / steps if steps else 0.0,
        "rate_per_position": [sum(hist[k + 1 :]) / steps if steps else 0.0 for k in range(len(hist) - 1)],
    }


def evaluate_figures(rows: list[dict]) -> dict:
    """Evaluate's acceptance length, steps and rate per draft position over ``rows`` (its decoded records)."""
    steps = sum(r["eagle"]["steps"] for r in rows)
    emitted = sum(r["eagle"]["emitted"] for r in rows)
    proposed = [sum(c) for c in zip_longest(*(r["eagle"]["proposed"] for r in rows), fillvalue=0)]
    accepted = [sum(c) for c in zip_longest(*(r["eagle"]["accepted"] for r in rows), fillvalue=0)]
    return {
        "acceptance_length": emitted / steps if steps else 0.0,
        "steps": steps,
        "rate_per_position": [a / n if n else 0.0 for a, n in zip(accepted, proposed)],
    }


def differences(rows: list[dict], outputs: list, run: str) -> list[dict]:
    """Where a run's ``outputs`` differ from evaluate's plain greedy ``output_ids`` of ``rows``."""
    return [
        {"prompt": r["index"], "run": run, "first_difference": first_difference(out, r["output_ids"])}
        for r, out in zip(rows, outputs)
        if out != r["output_ids"]
    ]


def per_category(rows: list[dict], eagle: dict) -> dict:
    """Per category: its prompts, vLLM's acceptance length with the drafter and evaluate's."""
    out = {}
    for cat in sorted({r["category"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["category"] == cat]
        sub = [rows[i] for i in idx]
        out[cat] = {
            "prompts": len(idx),
            "acceptance_length": round(
                per_step(sub, [eagle["outputs"][i] for i in idx], [eagle["spec"][i] for i in idx])["acceptance_length"],
                4,
            ),
            "evaluate_acceptance_length": round(evaluate_figures(sub)["acceptance_length"], 4),
        }
    return out


def speeds(eagle: dict, plain: dict | None) -> dict:
    """Tokens per second and seconds of each run."""
    run = {
        "speculative_tokens_per_s": round(eagle["tokens"] / eagle["seconds"], 2),
        "seconds": {"eagle": round(eagle["seconds"], 2)},
    }
    if plain is not None:
        run["plain_tokens_per_s"] = round(plain["tokens"] / plain["seconds"], 2)
        run["seconds"]["plain"] = round(plain["seconds"], 2)
    return run


def alike(rows: list[dict], eagle: dict) -> tuple[list[dict], list, list]:
    """The rows whose output with the drafter is evaluate's, with those outputs and vLLM's counts: where a near-tie
    led an output elsewhere, acceptance is compared on the rest (on every row where none is left)."""
    same = [i for i, (r, out) in enumerate(zip(rows, eagle["outputs"])) if out == r["output_ids"]] or range(len(rows))
    return [rows[i] for i in same], [eagle["outputs"][i] for i in same], [eagle["spec"][i] for i in same]


def judged(rows: list[dict], eagle: dict, plain: dict | None, judge: ties.Judge | None) -> tuple[list[dict], dict]:
    """Every run's differences from evaluate's outputs, judged where ``judge`` is given, and what the metrics say of
    them beyond the list: ``tie_margin``, and ``another_model`` where it holds (ties.another_model)."""
    mismatches = (differences(rows, plain["outputs"], "plain") if plain is not None else []) + differences(
        rows, eagle["outputs"], "eagle"
    )
    if not mismatches or judge is None:
        return mismatches, {}
    outputs = {"eagle": eagle["outputs"]} | ({"plain": plain["outputs"]} if plain is not None else {})
    mismatches = judge(rows, mismatches, outputs)
    found = {"tie_margin": judge.tie_margin}
    if why := ties.another_model(mismatches, len(rows), "plain" if plain is not None else "eagle"):
        found["another_model"] = why
    return mismatches, found


def compare(
    rows: list[dict],
    eagle: dict,
    tolerance: float,
    num_layers: int,
    plain: dict | None = None,
    judge: ties.Judge | None = None,
) -> dict:
    """The serve check's metrics from the run with the drafter (and the plain run, if any); ``passed``: it holds. A
    difference ``judge`` (ties.Judge) finds a near-tie does not fail it; without ``judge`` every difference does."""
    layers, served = rows[0]["eagle"]["layers"], engine_layers(eagle["log"], num_layers)
    mismatches, found = judged(rows, eagle, plain, judge)
    compared, outputs, spec = alike(rows, eagle)
    engine, ours = per_step(compared, outputs, spec), evaluate_figures(compared)
    difference = abs(engine["acceptance_length"] - ours["acceptance_length"]) / ours["acceptance_length"]
    every = per_step(rows, eagle["outputs"], eagle["spec"])  # the server's counters count every request
    c = eagle["counters"]
    counters_agree = c["num_drafts"] == every["steps"] and c["num_accepted_tokens"] == every["accepted"]
    failed = [m for m in mismatches if not m.get("tie")]
    return {
        "prompts": len(rows),
        "passed": not failed and layers == served and difference <= tolerance and counters_agree,
        "outputs_equal": not mismatches,
        "mismatches": mismatches,
        **found,
        "layers": layers,
        "engine_layers": served,
        "acceptance_length": round(engine["acceptance_length"], 4),
        "evaluate_acceptance_length": round(ours["acceptance_length"], 4),
        "relative_difference": round(difference, 6),
        "tolerance": tolerance,
        "verification_steps": engine["steps"],
        "evaluate_verification_steps": ours["steps"],
        "engine_reported_acceptance_length": round(engine["reported_acceptance_length"], 4),
        "acceptance_rate_per_position": [round(x, 4) for x in engine["rate_per_position"]],
        "evaluate_acceptance_rate_per_position": [round(x, 4) for x in ours["rate_per_position"]],
        "per_category": per_category(rows, eagle),
        "counters": c,
        "counters_agree": counters_agree,
        "run": speeds(eagle, plain),
    }


def refusal(folder, target_config: dict, drafter, p: config.Serve) -> str | None:
    """Why vLLM (``p.python``) cannot run the serve check of ``drafter`` beside the target in ``folder``, and what to do
    instead, or None: the known limits, checked before any server starts (the composite targets' torchvision:
    engines/vllm.py, at launch)."""
    if why := compat.engine_refusal("vllm", folder, target_config):
        return f"the serve check runs vLLM ({p.python}), which computes another model than transformers here: {why}"
    rows = (
        (
            families.of(target_config).mla and not drafter.mla and cpu_build(p.python),
            f"the CPU build of vLLM ({p.python}) cannot serve the {drafter.drafter} drafter beside {folder}: the "
            "target's MLA attention (CPU_MLA) pages its KV cache in blocks of 16 tokens, the drafter's attention "
            "(CPU_ATTN) in multiples of 32, and vLLM needs one block size for both. Train the MLA drafter "
            "(train.drafter: deepseek_mla, auto's choice), or run the serve check with a GPU build of vLLM "
            "(serve.python)",
        ),
        (
            drafter.mla and p.dtype == "float32" and cpu_build(p.python) and amx(),
            f"the CPU build of vLLM ({p.python}) cannot serve the {drafter.drafter} drafter in float32 on this CPU: "
            "on a CPU with AMX it loads an MLA drafter with its AMX MLA kernels whatever --attention-backend says "
            "(vLLM 0.32), and those take bf16, fp16 or quantized weights only. Set serve.dtype: bfloat16 (where "
            "bfloat16 rounds a greedy choice otherwise, its outputs will differ from evaluate's float32), or run the "
            "serve check with a GPU build of vLLM (serve.python)",
        ),
        (
            (quant.method(folder) or {}).get("quant_method") == "fp8" and p.dtype == "float32",
            f'vLLM serves the FP8 target {folder} in bfloat16 or float16 only (vLLM 0.32: "torch.float32 is not '
            "supported for quantization method fp8\"; its CPU build's FP8 block kernels also need AMX), and the check "
            "compares with evaluate's float32 decoding token for token. Set serve.dtype: bfloat16 to run it anyway: "
            "where bfloat16 rounds a greedy choice otherwise, its outputs will differ",
        ),
    )
    return next((why for refused, why in rows if refused), None)


def check(
    folder,
    tokenizer,
    draft,
    rows: list[dict],
    p: config.Serve,
    num_steps: int,
    max_new_tokens: int,
    judge: ties.Judge,
) -> dict:
    """``compare`` of the run with the drafter (as evaluate decoded ``rows``: ``evaluate.num_steps`` draft tokens per
    step, ``evaluate.max_new_tokens``, the target's stop ids) and, where an output differs, the plain run, each
    difference judged by ``judge`` (the target against ``serve.tie_margin``); UserError with ``refusal``'s reason
    first where vLLM cannot run the check."""
    target_config = families.load_config(folder)
    if why := refusal(folder, target_config, read_config(draft), p):
        raise UserError(why)
    stop_ids = stop_ids_of(folder, tokenizer)
    sampling = Sampling(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=tuple(sorted(stop_ids)))
    num_layers = families.text_config(target_config).num_hidden_layers
    eagle = decode(folder, tokenizer, p, rows, sampling, speculative_config(draft, num_steps), "eagle")
    plain = None
    if differences(rows, eagle["outputs"], "eagle"):
        log.info("an output with the drafter differs from evaluate's: decoding without it too")
        plain = decode(folder, tokenizer, p, rows, sampling)
    metrics = compare(rows, eagle, p.tolerance, num_layers, plain, judge)
    for mismatch in metrics["mismatches"]:
        if mismatch["tie"]:
            log.warning("a numerics tie, not failed (serve.tie_margin %s): %s", p.tie_margin, ties.describe(mismatch))
    return metrics


def failure(metrics: dict, report) -> str:
    """Why the check failed (``compare``'s ``metrics``; ``report``: their file): vLLM computing another model, where
    it does, then each figure, the differences that are not ties named by prompt and token."""
    failed = [ties.describe(m) for m in metrics["mismatches"] if not m.get("tie")]
    listed = "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
    another = f"{metrics['another_model']}. " if "another_model" in metrics else ""
    return (
        f"the serve check failed (see {report}): {another}outputs equal {metrics['outputs_equal']} "
        f"[{listed}], layers {metrics['engine_layers']} in vLLM vs "
        f"{metrics['layers']} in evaluate, acceptance length {metrics['acceptance_length']} in vLLM vs "
        f"{metrics['evaluate_acceptance_length']} in evaluate (relative difference "
        f"{metrics['relative_difference']}, tolerance {metrics['tolerance']}), counters agree "
        f"{metrics['counters_agree']}"
    )
