"""train.features: streamed (drafter/spool.py). With the embedded target computing the states in this process: the
spool gives each batch what the online source computes, never holds more bytes on disk than its budget (a few
batches; watched while it runs), asks again each epoch unless everything fits, resumes from the files a stopped run
left, and refuses a budget smaller than a batch; a drafter trained through it is the online drafter."""

import threading
import time

import pytest
import torch
from e2e import make_sequences

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.drafter import sources, train
from eaglepipe.drafter.spool import Spool

HIDDEN = config.Hidden(layers="auto", dtype="bfloat16", batch_tokens=512)


@pytest.fixture(scope="module")
def seq(tmp_path_factory):
    folder = tmp_path_factory.mktemp("streamed") / "seq"
    make_sequences(folder)
    return folder


def two_epochs(samples: list, per_batch: int = 2) -> list[tuple[str, list]]:
    """Uses as train.schedule labels them: two epochs of ``samples`` in batches of ``per_batch``, reversed in the
    second."""
    uses = []
    for number, order in enumerate([samples, samples[::-1]]):
        for b in range(0, len(order), per_batch):
            uses.append((f"e{number}-t{b // per_batch}", order[b : b + per_batch]))
    return uses


class DiskWatch:
    """The most bytes ``folder``'s files held at once, sampled every millisecond while it runs."""

    def __init__(self, folder):
        self.folder, self.most, self.running = folder, 0, True
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()

    def watch(self):
        while self.running:
            sizes = []
            for file in self.folder.glob("*") if self.folder.exists() else []:
                try:
                    sizes.append(file.stat().st_size)
                except FileNotFoundError:
                    continue
            self.most = max(self.most, sum(sizes))
            time.sleep(0.001)

    def stop(self) -> int:
        self.running = False
        self.thread.join()
        return self.most


def spooled(seq, model, budget: int) -> Spool:
    """A spool of the embedded target's states computing one batch at a time (window 1), as online computes them: a
    transformers forward's figures depend on what else is in its batch, which the comparisons here leave out."""
    return Spool(sources.Online(seq, model, HIDDEN), budget, window=1)


def batches_worth(seq, model, uses: list, batches: int) -> int:
    """A budget of ``batches`` times the largest batch's cost (spool files and the engine's)."""
    spool = spooled(seq, model, 1)
    return batches * max(sum(spool.cost(s) for s in batch) for _, batch in uses)


def assert_same_states(got: list[dict], want: list[dict]):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_spool_gives_the_online_states_within_a_budget_of_a_few_batches(seq, model, tmp_path):
    samples = sources.load_samples(seq, "train")
    uses = two_epochs(samples)
    online = sources.Online(seq, model, HIDDEN)
    budget = batches_worth(seq, model, uses, 3)
    spool = spooled(seq, model, budget)
    watch = DiskWatch(tmp_path / "spool")
    spool.start(uses, tmp_path / "spool")
    for _, batch in uses:
        assert_same_states(spool.states(batch), online.states(batch))
    spool.close()
    most = watch.stop()
    report = spool.report()
    assert 0 < most <= report["peak_bytes"] <= budget, (most, report)
    assert not report["kept_across_epochs"]
    assert report["engine_tokens"] == 2 * sum(s.ids.shape[0] for s in samples)  # every epoch asked again
    assert not any((tmp_path / "spool").iterdir()), "what the trainer read is deleted"


def test_states_that_all_fit_are_computed_once_and_read_again(seq, model, tmp_path):
    samples = sources.load_samples(seq, "train")
    spool = spooled(seq, model, 10**9)
    spool.start(two_epochs(samples), tmp_path / "spool")
    for _, batch in two_epochs(samples):
        spool.states(batch)
    report = spool.report()
    assert report["kept_across_epochs"] and report["engine_tokens"] == sum(s.ids.shape[0] for s in samples)


def test_a_rerun_reuses_the_files_a_stopped_run_left_and_computes_the_rest(seq, model, tmp_path):
    samples = sources.load_samples(seq, "train")
    uses = two_epochs(samples)
    budget = batches_worth(seq, model, uses, 3)
    first = spooled(seq, model, budget)
    first.start(uses, tmp_path / "spool")
    for _, batch in uses[:3]:
        first.states(batch)
    first.thread.join()  # stopped with the files of uses ahead in the spool, as a killed trainer leaves them
    left = {p.name for p in (tmp_path / "spool").iterdir()}
    rerun = spooled(seq, model, budget)
    rerun.start(uses[3:], tmp_path / "spool")
    online = sources.Online(seq, model, HIDDEN)
    for _, batch in uses[3:]:
        assert_same_states(rerun.states(batch), online.states(batch))
    ahead = sum(s.ids.shape[0] for _, batch in uses[3:] for s in batch)
    reused = sum(s.ids.shape[0] for label, batch in uses[3:] for s in batch if rerun.name(label, s) in left)
    assert reused > 0 and rerun.report()["engine_tokens"] == ahead - reused


def test_a_budget_below_one_batch_is_refused_by_its_key(seq, model, tmp_path):
    samples = sources.load_samples(seq, "train")
    spool = spooled(seq, model, 1000)
    with pytest.raises(UserError, match="train.spool_bytes 1000 holds less than one batch"):
        spool.start(two_epochs(samples), tmp_path / "spool")


@pytest.mark.e2e
def test_a_drafter_trained_through_the_spool_is_the_online_drafter(seq, model, target_folder, tmp_path):
    p = config.Train(
        draft_vocab_size=128, epochs=2, batch_tokens=256, warmup_steps=2, checkpoint_every=2, threads=0, autocast="none"
    )
    online, *_ = train.run(sources.Online(seq, model, HIDDEN), target_folder, p, tmp_path / "online")
    budget = batches_worth(seq, model, [("all", sources.load_samples(seq, "train"))], 1)
    streamed, report, _ = train.run(spooled(seq, model, budget), target_folder, p, tmp_path / "streamed")
    assert report["features"] == "streamed" and report["run"]["spool"]["peak_bytes"] <= budget
    want = online.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in streamed.state_dict().items())
