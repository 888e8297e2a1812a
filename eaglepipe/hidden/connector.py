"""vLLM's side of ``hidden.engine: vllm``: the KV connector vLLM loads by module path (``StatesConnector``) that
writes a finished request's hidden states to a file, and that file's format (``read``: the hidden stage's side).

The capture (vLLM 0.32): with ``--speculative-config {"method": "extract_hidden_states", "draft_model_config":
{"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}}`` the forward also keeps the inputs of decoder layers ``ids``
(Hugging Face's ``hidden_states[i]``; id L is the last layer's output before the final norm) in a cache-only attention
layer, one head per id, paged ``[blocks, len(ids), block_size, H]``. The connector holds a finished request's blocks;
its worker copies the rows out synchronously (``rows``), writes them and reports the request done. Rank 0 writes.

The file (safetensors, written to ``<path>.tmp`` and renamed, so one that exists is whole; the answer can reach the
client first):
    states  [T, len(ids), H]  the served dtype; row t = prompt position t
    ids     int64 [T]         the prompt's token ids as vLLM ran them
    metadata ``layers``: the ids, JSON
Its path is ``<folder>/<name>``: ``folder`` the server's ``kv_connector_extra_config.folder`` (``server_args``),
``name`` the request's ``kv_transfer_params.states_path`` (a relative path), else ``<request id>.safetensors``. The
server writes nowhere else (``confine``): an absolute name, ``..``, or a symlink leading out of the folder fails the
request's states, nothing written, and its answer's ``kv_transfer_params.states_error`` says why; otherwise the
answer's ``kv_transfer_params.states_path`` names the file written. The vLLM classes are built on first use
(``__getattr__``), so this module imports without vLLM.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

log = logging.getLogger(__name__)
NAME = "StatesConnector"
PATH_KEY = "states_path"
ERROR_KEY = "states_error"
DEFAULT_FOLDER = "/tmp/eaglepipe-states"


def confine(folder: str, name: str) -> str:
    """The path ``name`` names inside ``folder`` (a resolved folder), where it and its ``.tmp`` twin resolve inside it;
    otherwise ValueError with the reason."""
    if os.path.isabs(name):
        raise ValueError(f"the states path {name!r} is not a name relative to the server's states folder")
    if not name.endswith(".safetensors"):
        raise ValueError(f"the states path {name!r} does not end in .safetensors")
    if ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"the states path {name!r} climbs out of the server's states folder ('..')")
    path = os.path.join(folder, name)
    for candidate in (path, path + ".tmp"):
        if os.path.commonpath([folder, os.path.realpath(candidate)]) != folder:
            raise ValueError(f"the states path {name!r} leads out of the server's states folder (a symlink)")
    return path


def rows(cache: torch.Tensor, blocks: list[int], n: int) -> torch.Tensor:
    """[n, heads, H]: the first ``n`` positions of a request whose cache blocks are ``blocks``, out of ``cache``
    ``[num_blocks, heads, block_size, H]``."""
    size = cache.shape[2]
    slots = (torch.as_tensor(blocks, dtype=torch.long)[:, None] * size + torch.arange(size)).flatten()[:n]
    return cache[slots // size, :, slots % size]


def write(path: str, states: torch.Tensor, ids: list[int], layers: list[int]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_file(
        {"states": states.cpu().contiguous(), "ids": torch.tensor(ids, dtype=torch.long)},
        path + ".tmp",
        metadata={"layers": json.dumps(layers)},
    )
    os.replace(path + ".tmp", path)


def read(path: str, timeout_s: float) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(states, ids, layers) of the file at ``path``, waiting up to ``timeout_s`` for the server to write it."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not write {path} within {timeout_s:.0f} s")
        time.sleep(0.01)
    with safe_open(path, framework="pt") as f:
        return f.get_tensor("states"), f.get_tensor("ids"), json.loads(f.metadata()["layers"])


@dataclass
class Saves:
    """The scheduler's word to the worker for one step (pickled: module level): the requests finished since the last
    step, each (request id, path, prompt ids, block ids)."""

    todo: list = field(default_factory=list)


class _WorkerSide:
    """StatesConnector's worker side (mixed into the class ``_build`` makes): each step, write the states of the
    requests in ``Saves`` and report them done."""

    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        name = next(n for n in kv_caches if "cache_only_layers" in n)
        self.cache, self.writer = kv_caches[name], get_tensor_model_parallel_rank() == 0

    def get_finished(self, finished_req_ids):
        done = set()
        if self.has_connector_metadata():
            for rid, path, ids, blocks in self._get_connector_metadata().todo:
                if self.writer:
                    try:
                        write(path, rows(self.cache, blocks, len(ids)), ids, self.layers)
                    except OSError as error:  # the client times out on this file; the server serves on
                        log.error("%s: states of %s not written to %s: %s", NAME, rid, path, error)
                done.add(rid)
        return done or None, None

    def get_finished_count(self):
        return 1  # only rank 0 writes

    def start_load_kv(self, *args, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, *args, **kwargs):
        pass

    def wait_for_save(self):
        pass


@functools.cache
def _build():
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    class StatesConnector(_WorkerSide, KVConnectorBase_V1, SupportsHMA):
        """The scheduler's side: hold a finished request's blocks and name its file for the worker."""

        def __init__(self, vllm_config, role, kv_cache_config=None):
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            spec = vllm_config.speculative_config
            if spec is None or spec.method != "extract_hidden_states":
                raise ValueError(f"{NAME} needs --speculative-config with method extract_hidden_states")
            self.layers = list(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", []))
            folder = self._kv_transfer_config.get_from_extra_config("folder", DEFAULT_FOLDER)
            os.makedirs(folder, exist_ok=True)
            self.folder = os.path.realpath(folder)
            groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
            self.group = next((i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)), 0)
            self.todo, self.cache, self.writer = [], None, True

        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            return 0, False

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            pass

        def build_connector_meta(self, scheduler_output):
            meta, self.todo = Saves(self.todo), []
            return meta

        def request_finished_all_groups(self, request, block_ids):
            if not 0 <= self.group < len(block_ids) or request.prompt_token_ids is None:
                return False, None  # never scheduled: nothing cached
            name = (request.kv_transfer_params or {}).get(PATH_KEY) or f"{request.request_id}.safetensors"
            try:
                path = confine(self.folder, str(name))
            except ValueError as refused:
                return False, {ERROR_KEY: str(refused)}
            self.todo.append((request.request_id, path, list(request.prompt_token_ids), list(block_ids[self.group])))
            return True, {PATH_KEY: path}

        def request_finished(self, request, block_ids):
            return self.request_finished_all_groups(request, (block_ids,))

    return StatesConnector


def __getattr__(name):
    if name == NAME:
        return _build()
    raise AttributeError(name)
