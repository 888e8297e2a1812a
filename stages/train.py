"""train: the EAGLE-3 drafter on the target's stored hidden states, with training-time test.

Reads data/hidden (the hidden stage's shards) and params.yaml (target, train); writes the drafter to models/draft
(config.json + model.safetensors in SGLang's LlamaForCausalLMEagle3 layout), the last epoch's per-step train/valid
loss_i and acc_i to metrics/train.json and one row per epoch to metrics/train_curves.json (DVC plots). The state is
checkpointed in .cache/train/<fingerprint>/ (inputs, params, code, target), so an interrupted run resumes exactly.
"""
import logging
import sys
from pathlib import Path

import click
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import draft, target, train  # noqa: E402
from eaglepipe.records import write_json  # noqa: E402


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, help="Parameters file.")
@click.option("--hidden", "hidden_folder", default="data/hidden", show_default=True, help="Hidden-state shards.")
@click.option("--target", "target_model", default=None, help="Target model folder [default: params target.model].")
@click.option("--out", default="models/draft", show_default=True, help="Output folder of the drafter.")
@click.option("--metrics", default="metrics/train.json", show_default=True, help="Final metrics (DVC metrics).")
@click.option("--plots", default="metrics/train_curves.json", show_default=True, help="Per-epoch rows (DVC plots).")
@click.option("--checkpoints", default=None, help="Checkpoint folder [default: .cache/train/<fingerprint>].")
def main(params, hidden_folder, target_model, out, metrics, plots, checkpoints):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = yaml.safe_load(Path(params).read_text())
    folder = target.resolve(target_model or cfg["target"]["model"])
    fp = train.fingerprint(hidden_folder, cfg["train"], target.fingerprint(folder))
    ckpt = Path(checkpoints) if checkpoints else target.CACHE / "train" / fp
    model, report, history = train.run(hidden_folder, folder, cfg["train"], ckpt)
    draft.save(model, out)
    write_json(metrics, {"fingerprint": fp, **report})
    write_json(plots, history)
    logging.info("drafter in %s; valid acc %s", out, report["valid"])


if __name__ == "__main__":
    main()
