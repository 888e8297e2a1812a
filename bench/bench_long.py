"""Benchmark: the memory of one training step against the sequence's length, attention in blocks against whole.

    python bench/bench_long.py [--params params.yaml] [--length 2048 --length 4096 ...] [--whole-up-to 4096]
                               [--device cuda]

One sequence of each length (random states of the target's width, every position trained, ``train.ttt_steps``)
goes through one TTT forward, backward and AdamW step of the default drafter of the embedded target, each in a
process of its own, and prints the peak memory the step added and the step's seconds. On the CPU that memory is
resident memory (ru_maxrss after the step minus the resident memory before it); with ``--device cuda``, torch's peak
allocation on the GPU during the step minus what was allocated before it (the seconds then include CUDA's set-up of
a first step). ``blocks`` is train's attention (``ttt.CHUNK`` queries at a time, recomputed in backward); ``whole``
sets CHUNK past the length, the full L x L scores per head and step kept for backward, measured up to
``--whole-up-to`` tokens (beyond, it outgrows a 24 GiB machine's memory). Memory growing
linearly with length doubles with each doubling: the last column is each row's ratio to the row of half its length.
"""

import json
import resource
import subprocess
import sys
import time
from collections import Counter

import click
import torch

from eaglepipe.core import config
from eaglepipe.drafter import train
from eaglepipe.drafter.eagle3 import config as draft_config
from eaglepipe.drafter.eagle3 import model as draft
from eaglepipe.drafter.eagle3 import ttt
from eaglepipe.hidden import layout as features
from eaglepipe.target import families
from eaglepipe.target import model as target


def rss_mib() -> float:
    """This process's resident memory now, in MiB."""
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def one_step(params: str, length: int, chunk: int, device: torch.device) -> dict:
    cfg = config.load(params)
    p, folder = cfg.train, target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    torch.set_num_threads(p.threads or torch.get_num_threads())
    tc = families.text_config(families.load_config(folder))
    layers = features.layer_ids(cfg.hidden.layers, tc.num_hidden_layers)
    tgt = train.target_tensors(folder, layers[2])
    torch.manual_seed(p.seed)
    model = draft.Eagle3Draft(draft_config.DraftConfig.from_target(tc, p.draft_vocab_size, layers), tgt["embed"])
    model.set_vocab(*draft.build_vocab(Counter(range(p.draft_vocab_size)), p.draft_vocab_size, tc.vocab_size))
    head_draft = tgt["head"][model.to_target(torch.arange(p.draft_vocab_size))].to(device)
    H, every = tc.hidden_size, torch.ones(length, dtype=torch.bool)
    sample = features.Sample("long", torch.randint(0, tc.vocab_size, (length,)), every, every, None, 0)
    states = {
        "aux": torch.randn(length, 3 * H),
        "final": torch.randn(length, H),
        "top": model.to_target(torch.randint(0, p.draft_vocab_size, (length,))),
    }
    model = model.to(device)
    opt = train.optimizer(model, p)
    ttt.CHUNK = chunk
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) / 2**20 if gpu else rss_mib()
    start = time.perf_counter()
    batch = ttt.collate([sample], [states], p.ttt_steps, head_draft, model.t2d)
    loss, _ = ttt.ttt_forward(model, batch, p.ttt_steps, p.step_weight)
    loss.backward()
    opt.step()
    if gpu:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = (
        torch.cuda.max_memory_allocated(device) / 2**20
        if gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {"peak_mib": peak - before, "seconds": seconds}


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True)
@click.option("--length", "lengths", type=int, multiple=True, default=(1024, 2048, 4096, 8192), show_default=True)
@click.option("--whole-up-to", type=int, default=4096, show_default=True)
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N: where the step runs.")
@click.option("--one", type=(int, int), default=None, hidden=True, help="LENGTH CHUNK: one step, JSON out.")
def main(params, lengths, whole_up_to, device, one):
    if one:
        print(json.dumps(one_step(params, *one, torch.device(device))))
        return
    print("| attention | tokens | step's peak memory (MiB) | seconds | memory / that at half the length |")
    print("|---|---:|---:|---:|---:|")
    for mode, chunk in (("blocks", ttt.CHUNK), ("whole", 1 << 30)):
        peak = {}
        for length in (n for n in lengths if mode == "blocks" or n <= whole_up_to):
            out = subprocess.run(
                [sys.executable, __file__, "--params", params, "--device", device, "--one", str(length), str(chunk)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            got = json.loads(out.strip().splitlines()[-1])
            peak[length] = got["peak_mib"]
            ratio = f"{peak[length] / peak[length // 2]:.2f}" if length // 2 in peak else ""
            print(f"| {mode} | {length} | {got['peak_mib']:.0f} | {got['seconds']:.1f} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
