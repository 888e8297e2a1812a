"""``train.features: streamed``: each batch's states computed by a serving engine while the trainer works, through a
spool folder bounded in bytes, so that no dataset of states is ever stored.

The trainer's batches are known before it starts (train.py's ``schedule``: each epoch's batches from the resume point,
then its validation batches). A producer thread walks them in that order. It asks the source (sources.py's ``Online``
over hidden/vllm_source.py's ``VLLMStates``: the server, connector and checks of ``hidden.engine: vllm``) for the
states of the next batches, as many samples at once as the engine keeps in flight (``hidden.vllm.concurrency``) and
the budget allows, and writes each sample's states as hidden stores them (``hidden.dtype``; hidden/layout.py) to one
safetensors file per sample and use, written under a temporary name and renamed. The trainer reads a batch's files
when it reaches it, waiting for the engine where it must, and deletes them.

Budget (``train.spool_bytes``): the spool's files and the engine's files in flight (the server writes each sequence's
captured states, which the source reads and deletes) stay within it. A request is made only when its estimated bytes
(``Spool.cost``, at least what is written) fit beside what is spooled and requested; a batch that cannot fit alone
is refused when the run starts.

Epochs: when every sample's states fit in the budget together, they are kept after their first use and later epochs
read them again (reading a file costs less than the target's forward over it: bench/bench_streamed.py measures both);
otherwise every epoch asks the engine again.

Resume: the spool lives in the run's checkpoint folder; files of the uses still ahead are reused, the others deleted.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eaglepipe.core import runtime
from eaglepipe.core.errors import UserError
from eaglepipe.drafter.sources import Online
from eaglepipe.hidden import layout
from eaglepipe.hidden.vllm_source import VLLMStates
from eaglepipe.target import families

log = logging.getLogger(__name__)
HEADER_BYTES = 4096  # a safetensors file's header and alignment, more than the spool's files ever need
TOP_BYTES = 4  # the greedy next token per position, int32


@contextmanager
def streamed(seq_folder, target_folder, cfg, cache_root, rt: runtime.Runtime) -> Iterator[Spool]:
    """The features of ``train.features: streamed`` over ``seq_folder`` (``data/sequences``), from the vLLM server of
    ``cfg.hidden.vllm`` serving ``target_folder`` (launched when first asked, its files under ``cache_root``); the
    server closes on exit. ``cfg``: the params (config.Params)."""
    if rt.world > 1 and not cfg.hidden.vllm.urls:
        raise UserError(
            "train.features streamed under torchrun needs hidden.vllm.urls (a server every rank shares): each rank "
            "would launch its own"
        )
    dtype = runtime.states_dtype(cfg.hidden.compute_dtype, rt.device)
    with VLLMStates(target_folder, cfg.hidden, dtype, cache_root) as source:
        yield Spool(Online(seq_folder, source, cfg.hidden), cfg.train.spool_bytes, cfg.hidden.vllm.concurrency)


def bytes_per_token(hidden_size: int, dtype: str, served_dtype: str) -> int:
    """The spool's bytes per token: the states stored in ``dtype`` (``hidden.dtype``) with their top token, and the
    engine's file of them in its ``served_dtype`` (three aux states and the last layer's)."""
    served = torch.tensor([], dtype=layout.DTYPES[served_dtype]).element_size()
    return layout.bytes_per_token(hidden_size, dtype) + TOP_BYTES + 4 * hidden_size * served


def sample_key(sample_id: str) -> str:
    return hashlib.sha256(sample_id.encode()).hexdigest()[:24]


class Spool:
    """The features of a streamed run: ``source`` (sources.Online) computes them ahead of the trainer into
    ``start``'s folder, within ``budget`` bytes, ``window`` samples per request at most."""

    kind = "streamed"

    def __init__(self, source, budget: int, window: int):
        self.source, self.budget, self.window = source, int(budget), max(1, int(window))
        self.folder, self.layers, self.splits = source.folder, source.layers, source.splits
        hidden_size = families.text_config(source.source.config).hidden_size
        self.per_token = bytes_per_token(hidden_size, source.params.dtype, source.source.compute_dtype)
        self.uses: list[tuple[str, list[layout.Sample]]] = []
        self.path: Path | None = None
        self.keep = False
        self.ready: dict[str, int] = {}  # file name -> its bytes, for the files written
        self.used = self.reserved = self.peak = 0
        self.error: BaseException | None = None
        self.stopping = False
        self.changed = threading.Condition()
        self.figures = {"engine_seconds": 0.0, "engine_tokens": 0, "wait_seconds": 0.0, "read_seconds": 0.0}
        self.next_use = 0
        self.thread: threading.Thread | None = None

    def identity(self) -> dict:
        return self.source.identity()

    def agreement(self, rt) -> dict:
        return self.source.agreement(rt)

    def cost(self, sample: layout.Sample) -> int:
        """The bytes reserved to compute ``sample``: its spool file and the engine's, each with a header."""
        tokens = sample.ids.shape[0]
        return tokens * self.per_token + 2 * HEADER_BYTES

    def name(self, label: str, sample: layout.Sample) -> str:
        """The spool file of ``sample`` used at ``label``: one per sample when kept, else one per use."""
        key = sample_key(sample.id)
        return f"{key}.safetensors" if self.keep else f"{label}-{key}.safetensors"

    def start(self, uses: list[tuple[str, list[layout.Sample]]], folder: Path) -> None:
        """Begin computing ``uses`` ([(label, samples)], in the order ``states`` will ask for them) into
        ``folder``, reusing the files already there for these uses and deleting the rest."""
        self.uses, self.path = uses, Path(folder)
        unique = {s.id: s for _, samples in uses for s in samples}
        largest = max((sum(self.cost(s) for s in samples) for _, samples in uses), default=0)
        if largest > self.budget:
            raise UserError(
                f"train.spool_bytes {self.budget} holds less than one batch's states and the engine's files for it "
                f"({largest} bytes): raise it, or lower train.batch_tokens"
            )
        self.keep = sum(self.cost(s) for s in unique.values()) <= self.budget
        self._adopt()
        log.info(
            "streamed states: %d uses of %d samples, spool %s within %d bytes, %s",
            len(uses),
            len(unique),
            self.path,
            self.budget,
            "kept across epochs (they all fit)" if self.keep else "computed again each epoch",
        )
        self.thread = threading.Thread(target=self._produce, name="spool", daemon=True)
        self.thread.start()

    def _adopt(self) -> None:
        """Keep the finished files of uses still ahead; delete the rest (a killed run's)."""
        self.path.mkdir(parents=True, exist_ok=True)
        ahead = {self.name(label, s) for label, samples in self.uses for s in samples}
        for file in self.path.iterdir():
            if file.name in ahead:
                self.ready[file.name] = file.stat().st_size
            else:
                file.unlink()
        self.used = sum(self.ready.values())
        self.peak = self.used

    def _produce(self) -> None:
        try:
            position = 0
            while position < len(self.uses) and not self.stopping:
                todo, end = self._window(position)
                if todo:
                    self._compute(todo)
                position = end
        except BaseException as error:  # noqa: BLE001 - the trainer raises it when it next asks for states
            with self.changed:
                self.error = error
                self.changed.notify_all()

    def _window(self, position: int) -> tuple[list[tuple[str, layout.Sample]], int]:
        """(the files to compute for the uses from ``position`` on: those of its first use, and of the next ones
        while they fit in the window and in the budget's free bytes now; the position after them)."""
        todo, names, end = [], set(), position
        while end < len(self.uses):
            label, samples = self.uses[end]
            needed = [(self.name(label, s), s) for s in samples]
            needed = [(n, s) for n, s in needed if n not in self.ready and n not in names]
            free = self.budget - self.used - self.reserved - sum(self.cost(s) for _, s in todo)
            if todo and (len(todo) + len(needed) > self.window or sum(self.cost(s) for _, s in needed) > free):
                break
            todo += needed
            names.update(n for n, _ in needed)
            end += 1
        return todo, end

    def _compute(self, todo: list[tuple[str, layout.Sample]]) -> None:
        """Reserve ``todo``'s bytes (waiting until they fit), compute its states and write them."""
        cost = sum(self.cost(s) for _, s in todo)
        with self.changed:
            self.changed.wait_for(lambda: self.stopping or self.used + self.reserved + cost <= self.budget)
            if self.stopping:
                return
            self.reserved += cost
            self.peak = max(self.peak, self.used + self.reserved)
        try:
            started = time.perf_counter()
            stored = self.source.stored([s for _, s in todo])
            self.figures["engine_seconds"] += time.perf_counter() - started
            self.figures["engine_tokens"] += sum(s.ids.shape[0] for _, s in todo)
            for (name, _), tensors in zip(todo, stored):
                self._write(name, tensors)
        finally:
            with self.changed:
                self.reserved -= cost
                self.changed.notify_all()

    def _write(self, name: str, tensors: dict) -> None:
        tmp = self.path / f".{name}.tmp"
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, self.path / name)
        with self.changed:
            self.ready[name] = (self.path / name).stat().st_size
            self.used += self.ready[name]
            self.peak = max(self.peak, self.used + self.reserved)
            self.changed.notify_all()

    def states(self, samples: list[layout.Sample]) -> list[dict]:
        """The decoded states of ``samples``, the next use ``start`` was given (anything else is a bug here)."""
        label, planned = self.uses[self.next_use]
        if [s.id for s in samples] != [s.id for s in planned]:
            raise RuntimeError(f"the trainer asked for other samples than its schedule's at {label}")
        names = [self.name(label, s) for s in samples]
        started = time.perf_counter()
        with self.changed:
            self.changed.wait_for(lambda: self.error is not None or all(n in self.ready for n in names))
            if self.error is not None:
                raise self.error
        self.figures["wait_seconds"] += time.perf_counter() - started
        started = time.perf_counter()
        out = [layout.decode(load_file(str(self.path / n))) for n in names]
        self.figures["read_seconds"] += time.perf_counter() - started
        self.next_use += 1
        if not self.keep:
            self._release(names)
        return out

    def _release(self, names: list[str]) -> None:
        for n in names:
            (self.path / n).unlink()
        with self.changed:
            self.used -= sum(self.ready.pop(n) for n in names)
            self.changed.notify_all()

    def close(self) -> None:
        """Stop computing ahead, once the request in flight is answered (its files stay for a rerun)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if self.thread is not None:
            self.thread.join()

    def report(self) -> dict:
        """The run's spool figures: its budget, peak bytes, whether states were kept, the engine's time."""
        return {
            "budget_bytes": self.budget,
            "peak_bytes": self.peak,
            "kept_across_epochs": self.keep,
            **{k: round(v, 2) if isinstance(v, float) else v for k, v in self.figures.items()},
        }
