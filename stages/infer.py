"""infer: the target regenerates every prompt's answer, token-exact.

Reads data/prompts/prompts.jsonl and params.yaml (target, infer); writes data/responses/responses.jsonl (one record
per prompt: prompt_ids, output_ids, finish_reason, and text/reasoning/content derived from the ids) and the run
report metrics/infer.json. Finished generations are kept in .cache/infer/<fingerprint>/ as they arrive, so an
interrupted run resumes where it stopped and adding a source generates only its prompts.
"""
import logging
import sys
from pathlib import Path

import click
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eaglepipe import infer, reasoning, target  # noqa: E402
from eaglepipe.engines import Sampling, create  # noqa: E402
from eaglepipe.gates import GateBreach, Gates  # noqa: E402
from eaglepipe.records import read_prompts, write_json, write_jsonl  # noqa: E402


@click.command(help=__doc__)
@click.option("--params", default="params.yaml", show_default=True, help="Parameters file.")
@click.option("--prompts", default="data/prompts/prompts.jsonl", show_default=True, help="Prompt records.")
@click.option("--out", default="data/responses", show_default=True, help="Output folder.")
@click.option("--report", default="metrics/infer.json", show_default=True, help="Run report (DVC metrics).")
@click.option("--cache", default=".cache/infer", show_default=True, help="Folder of resumable generation caches.")
def main(params, prompts, out, report, cache):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cfg = yaml.safe_load(Path(params).read_text())
    folder = target.resolve(cfg["target"]["model"])
    tokenizer = target.load_tokenizer(folder)
    p = cfg["infer"]
    sampling = Sampling.from_params(p, target.stop_ids(folder, tokenizer))
    spec = reasoning.spec_from_params(cfg["target"]["reasoning"], cfg["target"].get("tool_calls", "none"))
    with create(p, folder, tokenizer) as engine:  # leaving it closes the engine (and a server it launched)
        template_kwargs = cfg["target"].get("chat_template_kwargs") or {}
        fp = infer.fingerprint(target.fingerprint(folder), engine.name, engine.identity(), sampling, template_kwargs)
        try:
            responses, rep = infer.run(read_prompts(prompts), engine, tokenizer, sampling, spec,
                                       Gates(p["gates"], spec.expects_reasoning, reasoning.markup(tokenizer)),
                                       infer.Cache(Path(cache) / fp),
                                       template_kwargs, float(p["max_failure_rate"]), int(p["samples"]))
        except GateBreach as e:
            raise click.ClickException(f"{e}. Nothing was published; the records are in {Path(cache) / fp}")
        write_jsonl(Path(out) / "responses.jsonl", responses)
        write_json(Path(out) / "engine.json", {"fingerprint": fp, **engine.describe()})
    write_json(report, {"fingerprint": fp, "model": cfg["target"]["model"], **rep})
    logging.info("wrote %d records to %s: %s", len(responses), out, rep["finish_reason"])


if __name__ == "__main__":
    main()
