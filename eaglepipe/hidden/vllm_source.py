"""``hidden.engine: vllm``: the target's hidden states from a vLLM server instead of an in-process forward.

The server runs vLLM's ``extract_hidden_states`` with the project's KV connector (``server_args``; connector.py). Each
sequence is one request through infer's vLLM client (``StatesApi``) for one greedy token, naming the file its states
go to. The server captures the inputs of the ``layout.layer_ids`` layers and the last layer's output; ``VLLMStates``
turns them into what the hf engine computes: ``aux`` the three layers' states, ``final`` the last one through the
target's final RMS norm, ``top`` the argmax of the head over it and ``target_logprob`` each id's log-probability
under it (norm and head from the checkpoint, float32; hf_source.head_figures). Ids or layers other than those sent
fail the sequence. The server's greedy last token is compared with ``top``:
disagreements are counted (``last_token_disagreements``) and, above ``MOST_DISAGREEMENTS`` of 8 or more sequences,
stop the stage. A server given by url must share this machine's filesystem and run with ``server_args``. A launched
server starts only when states are asked for: the cache key needs only its version, read where it would run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from eaglepipe.core.errors import UserError
from eaglepipe.engines import Failure, Sampling
from eaglepipe.engines.launch import ROOT, LaunchedServer, servers
from eaglepipe.engines.pool import Server, ServerError, ServerPool
from eaglepipe.engines.server import BadAnswer, ServerEngine
from eaglepipe.engines.vllm import VLLM
from eaglepipe.hidden import layout
from eaglepipe.hidden.connector import DEFAULT_FOLDER, ERROR_KEY, NAME, PATH_KEY, read
from eaglepipe.hidden.hf_source import head_figures
from eaglepipe.target import compat, families

log = logging.getLogger(__name__)
MOST_DISAGREEMENTS = 0.5  # the share of sequences whose last token may differ from the server's


def server_args(layers: list[int], folder: str | Path = DEFAULT_FOLDER) -> list[str]:
    """The vLLM arguments that capture the states of ``layers`` (Hugging Face ``hidden_states`` ids; the layer count
    is the last layer's output) and write them through the connector, inside ``folder`` only."""
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
    }
    kv = {
        "kv_connector": NAME,
        "kv_connector_module_path": "eaglepipe.hidden.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"folder": str(folder)},
    }
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


class StatesApi(VLLM):
    """vLLM's API with states: each request names its states file, ``<files' name>/<rid>.safetensors`` inside the
    server's states folder, and each answer must say where it was written; a launched server gets ``server_args``
    (its folder: ``files``' parent) and this repository on its PYTHONPATH."""

    title = "vLLM (hidden states)"

    def __init__(self, layers: list[int], files: Path, interpreter: str | None = None):
        super().__init__(interpreter)
        self.layers, self.files = list(layers), Path(files)

    def launcher(self, cfg) -> LaunchedServer:
        server = super().launcher(cfg)
        server.extra_args += server_args(self.layers, self.files.parent)
        server.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        return server

    async def read(self, pool: ServerPool, server: Server) -> None:
        """Also: one probe request, whose states must come back from ``layers``; otherwise the server is refused."""
        await super().read(pool, server)
        rid = f"probe-{os.getpid()}-{server.url.rsplit(':', 1)[-1]}"
        path, body = self.request(pool.probe_ids[0] or [0], Sampling(max_new_tokens=1), rid, rid)
        answer = await pool.post_json(server, path, body)
        where = _states_path(answer)
        if not where:
            raise ServerError(
                f"{server.url} captures no hidden states ({_missing(answer)}): start it "
                "with eaglepipe.hidden.vllm_source.server_args, as hidden.vllm.launch does"
            )
        try:
            layers = (await asyncio.to_thread(read, where, pool.timeout_s))[2]
        finally:
            Path(where).unlink(missing_ok=True)
        if layers != self.layers:
            raise ServerError(
                f"{server.url} captures layers {layers}, not {self.layers} (hidden.layers and the "
                "layer count): restart it with eaglepipe.hidden.vllm_source.server_args"
            )

    def request(self, prompt_ids: list, sampling: Sampling, record_id: str, rid: str) -> tuple[str, dict]:
        """Also: the one token asked for may be the end of sequence (after a finished answer, it is), which vLLM
        would report as a stop that no stop id explains: its end of sequence is ignored."""
        path, body = super().request(prompt_ids, sampling, record_id, rid)
        states = {PATH_KEY: f"{self.files.name}/{rid}.safetensors"}
        return path, {
            **body,
            "sampling_params": {**body["sampling_params"], "ignore_eos": True},
            "kv_transfer_params": states,
        }

    def check(self, answer, prompt_ids: list, sampling: Sampling, rid: str) -> tuple[list, str, dict]:
        ids, reason, meta = super().check(answer, prompt_ids, sampling, rid)
        where = _states_path(answer)
        if not where:
            raise BadAnswer(f"{_missing(answer)}: start the server with eaglepipe.hidden.vllm_source.server_args")
        return ids, reason, {**meta, PATH_KEY: where}


def _transfer(answer) -> dict:
    return (answer.get("kv_transfer_params") or {}) if isinstance(answer, dict) else {}


def _states_path(answer) -> str | None:
    """Where the server wrote an answer's states (its ``kv_transfer_params``), or None."""
    return _transfer(answer).get(PATH_KEY)


def _missing(answer) -> str:
    """Why an answer names no states file: the connector's refusal, or no connector."""
    refused = _transfer(answer).get(ERROR_KEY)
    if refused:
        return f"the server refused to write the states: {refused}"
    return "the answer names no states file (kv_transfer_params.states_path)"


class VLLMStates:
    """hidden.run's states source on vLLM; a context manager that closes the engine (and a launched server) and
    removes its folder of files in flight."""

    def __init__(self, folder: Path, params, compute_dtype: str, cache_root: Path, interpreter: str | None = None):
        """``params``: the ``hidden`` section (config.Hidden); ``compute_dtype``: the served dtype (--dtype)."""
        from eaglepipe.target.model import load_tokenizer

        self.config = families.load_config(folder)
        text = families.text_config(self.config)
        self.num_layers = text.num_hidden_layers
        self.head, self.norm = compat.head_and_norm(folder)
        self.eps = float(text.rms_norm_eps)
        self.timeout_s = params.vllm.timeout_s
        self.files = Path(cache_root) / f"states-{os.getpid()}"
        for stale in Path(cache_root).glob("states-*"):  # a killed run's, whose process is gone
            if stale.is_dir() and not _alive(stale.name.split("-", 1)[1]):
                shutil.rmtree(stale, ignore_errors=True)
        self.layers = None
        self._params, self._folder, self._dtype, self._interpreter = params, folder, compute_dtype, interpreter
        self._tokenizer = load_tokenizer(folder)
        self.engine = None
        self.compute_dtype = compute_dtype
        self.report = {"last_token_disagreements": 0}
        self.compared = 0  # sequences whose last token was compared, over every call of ``states``
        self.code = ("hidden.vllm_source", "hidden.connector")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.engine is not None:
            self.engine.close()
        shutil.rmtree(self.files, ignore_errors=True)
        return False

    @property
    def dtype(self) -> str:
        """What besides the params decides the states (hidden's fingerprint): the engine, its version, the dtype. A
        launched server's version is read where it would run, without starting it."""
        return f"vllm {self._engine().identity().get('vllm_version')} {self._dtype}"

    def _engine(self) -> ServerEngine:
        """The client, built once; it starts when it is first asked for states (or for the identity of servers given
        by url)."""
        if self.engine is None:
            self.layers = layout.layer_ids(self._params.layers, self.num_layers)
            section = servers(self._params.vllm, self._folder, self._dtype)
            api = StatesApi([*self.layers, self.num_layers], self.files, self._interpreter)
            self.engine = ServerEngine(api, section, self._tokenizer)
        return self.engine

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 logits of the checkpoint's head over normed final states [n, H] (the agreement check's fallback)."""
        return final.float() @ self.head.T

    def states(self, samples: list, layers: list[int], batch_tokens: int):
        """Yield (index into ``samples`` = [(key, ids, mask)], (aux, final, top, target_logprob) or the reason it
        failed), as the server answers, ``hidden.vllm.concurrency`` in flight (``batch_tokens`` is the hf engine's)."""
        engine = self._engine()
        if layers != self.layers:
            raise ValueError(f"the server captures layers {self.layers}, not {layers}")
        sampling = Sampling(temperature=0.0, max_new_tokens=1)
        for i, out in engine.stream([list(map(int, s[1])) for s in samples], sampling, [s[0] for s in samples]):
            if isinstance(out, Failure):
                yield i, out.reason
                continue
            path = out.meta[PATH_KEY]
            try:
                got, ids, captured = read(path, self.timeout_s)
            finally:
                Path(path).unlink(missing_ok=True)
            sent = torch.as_tensor(samples[i][1]).long()
            if captured != [*layers, self.num_layers] or not torch.equal(ids, sent):
                yield (
                    i,
                    (
                        f"the server captured layers {captured} of {ids.numel()} ids, not "
                        f"{[*layers, self.num_layers]} of the {sent.numel()} sent"
                    ),
                )
                continue
            final = F.rms_norm(got[:, 3].float(), self.norm.shape, self.norm, self.eps)  # every served family's
            top, target_logprob = head_figures(self.logits, final, sent)
            self.report["last_token_disagreements"] += int(top[-1]) != out.output_ids[0]
            self.compared += 1
            yield i, (got[:, :3].flatten(1), final, top, target_logprob)
        done = self.compared
        if self.report["last_token_disagreements"] > MOST_DISAGREEMENTS * done and done >= 8:
            raise UserError(
                f"hidden (vllm): the head over the normed last state picks the server's own next token on "
                f"only {done - self.report['last_token_disagreements']} of {done} sequences: the target's "
                "final norm or head is not the RMS norm and head read from its checkpoint"
            )


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
