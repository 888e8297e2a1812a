"""hidden: the target's hidden states on the merged training sequences, for training the drafter.

Reads data/sequences/ and params.yaml (target, hidden); writes data/hidden/ (safetensors shards with input_ids,
loss_mask, offsets, aux = the states entering decoder layers [2, L // 2, L - 3] concatenated, final = the normed last
state; index.json states the layer convention) and metrics/hidden.json (bytes per token, tokens, tokens/s, layers).
Finished shards are kept in .cache/hidden/<fingerprint>/ as they are written, so an interrupted run resumes; the
folder is moved to the output at the end. See eaglepipe/hidden.py for the format.
"""
import logging
import sys
from pathlib import Path

import click
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import hidden, target  # noqa: E402
from eaglepipe.records import write_json  # noqa: E402


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, help="Parameters file.")
@click.option("--sequences", "seq_folder", default="data/sequences", show_default=True, help="Merged sequences.")
@click.option("--out", default="data/hidden", show_default=True, help="Output folder.")
@click.option("--report", default="metrics/hidden.json", show_default=True, help="Run report (DVC metrics).")
@click.option("--cache", default=str(target.CACHE / "hidden"), show_default=True,
              help="Folder of resumable work folders (one per fingerprint).")
def main(params, seq_folder, out, report, cache):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = yaml.safe_load(Path(params).read_text())
    folder = target.resolve(cfg["target"]["model"])
    model = target.load_model(folder)
    rep = hidden.run(Path(seq_folder), Path(out), model, cfg["hidden"], target.fingerprint(folder), Path(cache))
    write_json(report, {"model": cfg["target"]["model"], **rep})
    logging.info("hidden: %d tokens, %s bytes/token, %s tokens/s, layers %s", rep["tokens"], rep["bytes_per_token"],
                 rep["tokens_per_s"], rep["layers"])


if __name__ == "__main__":
    main()
