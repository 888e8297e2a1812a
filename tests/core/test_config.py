"""The typed params: every kind of mistake is refused naming the key, the value and what is allowed, by every stage,
in one line, before it loads a model; speed knobs and result knobs are told apart in one place."""

import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, STAGE_ARGS, with_

from eaglepipe.core import config
from eaglepipe.dataset import formats
from eaglepipe.text import toolcalls

BASE = yaml.safe_load((ROOT / "params.yaml").read_text())


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"infer": {"max_new_token": 64}}, "unknown key infer.max_new_token (did you mean max_new_tokens?)"),
        ({"evaluate": {"num_step": 1}}, "unknown key evaluate.num_step (did you mean num_steps?)"),
        ({"train": {"epochs": "three"}}, "train.epochs = 'three': input should be a valid integer"),
        ({"infer": {"temperature": "hot"}}, "infer.temperature = 'hot': input should be a valid number"),
        ({"infer": {"engine": "vlm"}}, "infer.engine = 'vlm': input should be 'hf', 'sglang' or 'vllm'"),
        ({"infer": {"turns": "every"}}, "infer.turns = 'every': input should be 'last' or 'all'"),
        ({"infer": {"top_p": 1.5}}, "infer.top_p = 1.5: input should be less than or equal to 1"),
        ({"infer": {"samples": 3, "temperature": 0}}, "infer: samples: 3 answers per prompt need temperature > 0"),
        (
            {"infer": {"gates": {"max_truncted": 0.5}}},
            "unknown key infer.gates.max_truncted (did you mean max_truncated?)",
        ),
        ({"infer": {"engine": "sglang"}}, "infer: engine sglang needs sglang.urls (running servers) or sglang.launch"),
        (
            {"infer": {"vllm": {"launch": {"tp": 0}}}},
            "infer.vllm.launch.tp = 0: input should be greater than or equal to 1",
        ),
        ({"target": {"reasoning": "thnk"}}, "target.reasoning = 'thnk': input should be 'none', 'think' or 'harmony'"),
        ({"target": {"reasoning": {"start": "<r>"}}}, "target.reasoning.end is missing"),
        ({"target": {"tool_calls": "openai"}}, "target.tool_calls = 'openai': input should be 'none', 'hermes'"),
        ({"hidden": {"layers": [2, 15.5, 27]}}, "hidden.layers[1] = 15.5: input should be a valid integer"),
        ({"hidden": {"layers": [2, 15]}}, "hidden.layers: should be auto or three strictly increasing layer ids"),
        ({"hidden": {"layers": [15, 2, 27]}}, "hidden.layers: should be auto or three strictly increasing layer ids"),
        (
            {"hidden": {"engine": "vllm", "vllm": {"concurrency": 4}}},
            "hidden: engine vllm needs vllm.urls (running servers) or vllm.launch",
        ),
        ({"evaluate": {"ngram": {"max": 1, "min": 3}}}, "evaluate.ngram: min 3 is above max 1"),
        (
            {"hidden": {"dtype": "fp8"}},
            "hidden.dtype = 'fp8': input should be 'bfloat16', 'float16', 'float32' or 'float8_e4m3fn'",
        ),
        ({"train": {"betas": [0.9]}}, "train.betas[1] is missing"),
        ({"train": {"autocast": True}}, "train.autocast = True: input should be 'auto', 'bfloat16' or 'none'"),
        ({"evaluate": {"ngram": {"maximum": 3}}}, "unknown key evaluate.ngram.maximum (did you mean max?)"),
        (
            {"evaluate": {"benchmarks": {"mtbnch": {}}}},
            "evaluate.benchmarks.mtbnch[key] = 'mtbnch': input should be 'heldout', 'mtbench' or 'humaneval'",
        ),
        (
            {"evaluate": {"benchmarks": {"mtbench": {"n": 0}}}},
            "evaluate.benchmarks.mtbench.n = 0: input should be greater than or equal to 1",
        ),
        ({"evaluate": {"benchmarks": {}}}, "evaluate.benchmarks = {}: dictionary should have at least 1 item"),
        ({"tarjet": {"model": "x"}}, "unknown key tarjet (did you mean target?)"),
    ],
)
def test_each_kind_of_mistake_names_key_value_and_what_is_allowed(sections, message):
    with pytest.raises(config.ConfigError) as e:
        config.parse(with_(**sections), "params.yaml")
    assert str(e.value).startswith("params.yaml: ") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_several_mistakes_are_all_named_at_once():
    with pytest.raises(config.ConfigError) as e:
        config.parse(with_(infer={"max_new_token": 64}, train={"epochs": "three"}), "p.yaml")
    assert "infer.max_new_token" in str(e.value) and "train.epochs" in str(e.value)


def test_the_project_params_are_valid_and_defaults_fill_what_is_left_out():
    p = config.load(ROOT / "params.yaml")
    assert p.infer.samples == BASE["infer"]["samples"]
    minimal = config.parse({"prepare": BASE["prepare"]})
    assert minimal.train == config.Train() and minimal.train.step_weight == 0.8


def test_value_lists_are_those_of_the_code_that_implements_them():
    """Every format the schema names has a converter, every tool-call family but none a parser, and no other; the
    schema imports no stage code (it would be a dep of every stage) and no model or data library."""
    assert set(config.FORMATS) == set(formats.CONVERTERS)
    assert set(config.TOOL_CALLS) == {"none", *toolcalls.PARSERS}
    own = (
        "eaglepipe.core",
        "eaglepipe.core.config",
        "eaglepipe.core.section",
        "eaglepipe.core.data_sections",
        "eaglepipe.core.model_sections",
        "eaglepipe.core.errors",
        "eaglepipe.core.explain",
    )
    code = (
        "import sys, eaglepipe.core.config\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'datasets')\n"
        f"             or m.startswith('eaglepipe.') and m not in {own}))"
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_speed_knobs_are_not_tracked():
    assert "threads" not in config.Train.tracked_keys() and "checkpoint_every" not in config.Train.tracked_keys()
    assert {"threads", "limit"}.isdisjoint(config.Evaluate.tracked_keys())
    assert "sglang" not in config.Infer.tracked_keys() and "temperature" in config.Infer.tracked_keys()
    a, b = config.Train(threads=1), config.Train(threads=8, checkpoint_every=7)
    assert a.tracked() == b.tracked() and a.tracked() != config.Train(lr=0.002).tracked()


def test_a_methods_own_knobs_are_tracked_only_where_it_is_the_method():
    """train.eagle3_1 changes nothing under method eagle3, so it stays out of that fingerprint (and its cache)."""
    plain = config.Train()
    assert plain.tracked() == config.Train(eagle3_1={"fc_norm": False, "norm_output": True}).tracked()
    assert "eagle3_1" not in plain.tracked() and plain.tracked()["method"] == "eagle3"
    eagle3_1 = config.Train(method="eagle3.1")
    assert eagle3_1.tracked()["eagle3_1"] == {"fc_norm": True, "norm_output": True}
    assert eagle3_1.tracked() != config.Train(method="eagle3.1", eagle3_1={"fc_norm": False}).tracked()


def test_every_key_is_documented():
    out = subprocess.run(
        [sys.executable, "-m", "eaglepipe.core.config"], capture_output=True, text=True, check=True
    ).stdout
    for section, model in config.Params.model_fields.items():
        for key, field in model.annotation.model_fields.items():
            assert f"{section}.{key}" in out
            assert field.description, f"{section}.{key} has no description"


PROBE = (
    "import runpy, sys\nsys.argv = sys.argv[1:]\ntry:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
    "except SystemExit as e:\n    code = e.code\n"
    "import gc, warnings\nwarnings.simplefilter('ignore')\ntorch = sys.modules.get('torch')\n"
    "print('models', sum(isinstance(o, torch.nn.Module) for o in gc.get_objects()) if torch else 0)\n"
    "sys.exit(code)\n"
)


@pytest.mark.parametrize("stage", list(STAGE_ARGS))
def test_every_stage_refuses_bad_params_in_one_line_before_loading_anything(stage, tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(with_(infer={"engine": "vlm"}, evaluate={"num_step": 1})))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            PROBE,
            str(ROOT / "stages" / f"{stage}.py"),
            "--params",
            str(params),
            *STAGE_ARGS[stage],
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"Error: {params}: infer.engine = 'vlm': input should be 'hf', 'sglang' or 'vllm'; unknown key "
        "evaluate.num_step (did you mean num_steps?)"
    ], out.stderr
    assert "models 0" in out.stdout  # refused before any model was built
    assert not (tmp_path / "o").exists()


def test_a_missing_source_file_is_one_line_naming_the_source(tmp_path):
    raw = with_(
        prepare={
            "sources": [
                *BASE["prepare"]["sources"][:1],
                {"name": "sharegpt", "path": "nowhere/sg.json", "format": "sharegpt", "n": 5},
            ]
        }
    )
    raw["prepare"]["sources"][0]["path"] = str(ROOT / raw["prepare"]["sources"][0]["path"])
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    out = subprocess.run(
        [sys.executable, str(ROOT / "stages/prepare.py"), "--params", "params.yaml", *STAGE_ARGS["prepare"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert out.stderr.strip() == "Error: prepare.sources[1] (sharegpt): no such file nowhere/sg.json", out.stderr


def test_a_missing_params_file_is_one_line(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "stages/train.py"), "--params", "nope.yaml", *STAGE_ARGS["train"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1 and out.stderr.strip() == "Error: nope.yaml: no such params file", out.stderr


def test_the_defaults_are_the_shipped_params():
    """The default a user reads (make params) is the value that runs: params.yaml with every key but the prompt
    sources left out validates to the same params as params.yaml itself."""
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert config.parse({"prepare": {"sources": raw["prepare"]["sources"]}}) == config.parse(raw)


def test_infer_engine_names_the_engines_of_the_table():
    """A new engine is an entry of engines.ENGINES and a value of infer.engine: the two name the same engines."""
    from typing import get_args

    from eaglepipe.engines.table import ENGINES

    assert set(get_args(config.Infer.model_fields["engine"].annotation)) == set(ENGINES)


def test_a_launched_server_serves_the_target_in_infers_dtype(target_folder):
    """The shipped infer.vllm.launch names no model: the server serves the target's folder, in infer.dtype (auto
    resolved as the hf engine resolves it), with the flags given first; a running server's section is left as it is."""
    import torch

    from eaglepipe.core import runtime
    from eaglepipe.engines.launch import servers

    infer = config.load(ROOT / "params.yaml").infer
    assert infer.engine == "vllm" and infer.vllm.launch.model_path is None
    launch = servers(infer.vllm, target_folder, runtime.compute_dtype(infer.dtype, torch.device("cpu"))).launch
    assert launch.model_path == str(target_folder) and launch.extra_args == [
        *infer.vllm.launch.extra_args,
        "--dtype",
        "float32",
    ]
    given = config.Servers(launch=config.Launch(model_path="/models/m", extra_args="--foo 1"))
    assert servers(given, target_folder, "bfloat16").launch.extra_args == ["--foo", "1", "--dtype", "bfloat16"]
    running = config.Servers(urls=["http://h:8000"])
    assert servers(running, target_folder, "bfloat16") is running
