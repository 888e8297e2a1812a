"""infer: the target regenerates `infer.samples` answers to every prompt (to its last turn, or to every turn in order
under infer.turns: all), token-exact, resumable and incremental (eaglepipe/infer/run.py); records as in
eaglepipe/core/records.py (Response). Before the first answer is generated, infer.preflight checks the engine's
log-probabilities against a float32 transformers forward (eaglepipe/infer/preflight.py)."""

import logging
from pathlib import Path

import click

from eaglepipe.core import cli, runtime
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import read_prompts, write_json, write_jsonl
from eaglepipe.engines import Sampling, table
from eaglepipe.infer.cache import Cache
from eaglepipe.infer.gates import Gates
from eaglepipe.infer.preflight import Check
from eaglepipe.infer.run import InferRun, Limits, Plan, fingerprint
from eaglepipe.target import compat, remote
from eaglepipe.target import model as target
from eaglepipe.text import derive


@click.command(help=__doc__)
@click.option("--params", required=True, type=click.Path(dir_okay=False), help="params.yaml (target, infer).")
@click.option("--prompts", required=True, type=click.Path(dir_okay=False), help="Prompt records (prepare's).")
@click.option(
    "--out", required=True, type=click.Path(file_okay=False), help="Output folder: responses.jsonl and engine.json."
)
@click.option("--report", required=True, type=click.Path(dir_okay=False), help="Run report (DVC metrics).")
@cli.timings
@cli.cache("infer")
@cli.stage
def main(params, prompts, out, report, timings, cache):
    cfg = cli.params(params)
    p = cfg.infer
    spec = derive.spec_from_params(cfg.target.reasoning, cfg.target.tool_calls)
    prompt_list = read_prompts(prompts)
    folder = target.resolve(cfg.target.model, cfg.target.trust_remote_code)
    if why := compat.engine_refusal(p.engine, folder):  # before a server starts: it would answer as another model
        raise UserError(why)
    tokenizer = target.load_tokenizer(folder)
    sampling = Sampling.from_params(p, target.stop_ids(folder, tokenizer))
    with runtime.start(cfg.runtime.device) as rt, table.create(p, folder, tokenizer, rt) as engine:
        template_kwargs = cfg.target.chat_template_kwargs
        fp = fingerprint(
            target.fingerprint(folder),
            engine.name,
            engine.identity(),
            sampling,
            template_kwargs,
            spec if p.turns == "all" else None,
        )
        work = Path(cache) / fp
        try:
            with rt.locked(work):  # another run on this cache waits for this one, then reuses what it generated
                gates = Gates(p.gates, spec.expects_reasoning, derive.markup(tokenizer))
                limits = Limits(target.context_length(folder), cfg.merge.max_length, p.on_error, prompts)
                plan = Plan(template_kwargs, p.max_failure_rate, p.samples, limits, p.turns)
                preflight = Check(engine, sampling, folder, rt, p.preflight)
                run = InferRun(engine, tokenizer, sampling, spec, gates, Cache(work), plan, before_generating=preflight)
                responses, rep = run.run(prompt_list)
        except UserError as e:
            raise UserError(f"{e}. Nothing was published; the records are in {work}") from None
        write_jsonl(Path(out) / "responses.jsonl", responses)
        code = {"remote_code": remote.hashes(folder)} if remote.trusted(folder) else {}
        described = engine.describe()
        # the servers asked, if any were (none when every answer was cached): what this run met, not what it published
        rep["run"]["servers"] = described.pop("servers", None)
        rep["run"]["preflight"] = preflight.report
        write_json(Path(out) / "engine.json", {"fingerprint": fp, **described, **code})
    cli.publish(rep, report, timings)
    logging.info("wrote %d records to %s: %s", len(responses), out, rep["finish_reason"])


if __name__ == "__main__":
    main()
