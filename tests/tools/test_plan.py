"""The plan (eaglepipe/tools/plan.py): bytes per token against the measured run, the text config of a composite config,
a missing field, and the CLI on the Kimi-K2.5 recipe and on the embedded target with measured figures."""

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from eaglepipe.core import config
from eaglepipe.tools import plan

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"
KIMI = ROOT / "recipes" / "kimi-k2.5" / "config.json"


def run(*args):
    out = CliRunner().invoke(plan.main, ["--params", str(PARAMS), *args])
    assert out.exit_code == 0, out.output
    return out.output


def test_bytes_per_token_is_what_hidden_stored_for_the_embedded_target(target_folder):
    measured = json.loads((ROOT / "metrics" / "hidden.json").read_text())
    H = plan.text_config(target_folder / "config.json")["hidden_size"]
    per_token = plan.bytes_per_token(H, config.load(PARAMS).hidden.dtype)
    assert per_token - plan.PER_TOKEN_COLUMNS == measured["hidden_bytes_per_token"]
    # the measured figure is the bytes stored over the tokens stored: shard headers and offsets add under 0.1%
    assert per_token < measured["bytes_per_token"] < per_token * 1.001


def test_a_composite_config_is_read_through_its_text_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "vlm",
                "hidden_size": 1,
                "vision_config": {"hidden_size": 2},
                "text_config": {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 100},
            }
        )
    )
    assert plan.text_config(path) == {"hidden_size": 64, "num_hidden_layers": 8, "vocab_size": 100, "composite": True}
    kimi = plan.text_config(KIMI)
    assert (kimi["hidden_size"], kimi["num_hidden_layers"], kimi["vocab_size"]) == (7168, 61, 163840)


def test_a_missing_field_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"text_config": {"hidden_size": 64, "vocab_size": 100}}))
    with pytest.raises(click.ClickException, match=rf"{path}: no integer text_config.num_hidden_layers"):
        plan.text_config(path)


def test_the_seeds_case_prints_its_terabytes():
    out = run("--target", str(KIMI), "--samples", "88000")
    params = config.load(PARAMS)
    tokens = 88000 * params.merge.max_length  # no means given: the bounds fill every sequence
    assert plan.size(tokens * plan.bytes_per_token(7168, "bfloat16")) in out
    assert plan.size(tokens * plan.bytes_per_token(7168, "float8_e4m3fn")) in out
    assert "TB" in out and "bound: infer.max_new_tokens" in out and "no figure: --train-tokens-per-s" in out


def test_given_lengths_and_speeds_are_used_and_answers_capped():
    out = run(
        "--target",
        str(KIMI),
        "--samples",
        "1000",
        "--prompt-tokens",
        "100",
        "--answer-tokens",
        "5000",
        "-S",
        "infer.max_new_tokens=400",
        "--generate-tokens-per-s",
        "100",
    )
    assert "answer 400 (given, capped at infer.max_new_tokens)" in out
    assert "400,000  infer" in out and "1.1 h  at 100.0 tokens/s (given)" in out


def test_the_params_own_target_uses_the_measured_run(tmp_path):
    (tmp_path / "timings").mkdir()
    (tmp_path / "hidden.json").write_text(json.dumps({"hidden_size": 576}))
    (tmp_path / "infer.json").write_text(json.dumps({"completions": 10, "tokens_in": 1000, "tokens_out": 500}))
    (tmp_path / "timings" / "train.json").write_text(json.dumps({"tokens_per_s": 50.0}))
    out = run("--metrics", str(tmp_path), "--samples", "10")
    assert f"prompt 100 tokens (mean of {tmp_path}/infer.json), answer 50" in out
    assert f"at 50.0 tokens/s ({tmp_path}/timings/train.json" in out and "no figure: --hidden-tokens-per-s" in out
    other = run("--metrics", str(tmp_path), "--samples", "10", "--target", str(KIMI))
    assert "mean of" not in other and "timings" not in other


def test_streamed_states_take_the_spool_budget_and_run_the_engine_once_only_when_they_all_fit():
    params = config.load(PARAMS)
    seed = run("--target", str(KIMI), "--samples", "88000", "--hidden-tokens-per-s", "1000", "-S", "train.epochs=3")
    engine = next(line for line in seed.splitlines() if line.startswith("time: streamed engine"))
    tokens = 88000 * params.merge.max_length
    assert f"{plan.size(params.train.spool_bytes)}  at most train.spool_bytes" in seed
    assert "every epoch (3 times hidden's tokens)" in seed and f"{3 * tokens / 1000 / 3600:,.1f} h" in engine
    small = run("--target", str(KIMI), "--samples", "10", "--hidden-tokens-per-s", "1000")
    engine = next(line for line in small.splitlines() if line.startswith("time: streamed engine"))
    assert "all kept, the engine runs once" in small
    assert f"{10 * params.merge.max_length / 1000 / 60:,.1f} min" in engine


def test_the_readmes_seed_case_is_what_the_plan_prints():
    kimi = ROOT / "recipes" / "kimi-k2.5" / "params.yaml"
    out = CliRunner().invoke(plan.main, ["--params", str(kimi), "--target", str(KIMI), "--samples", "88000"])
    assert out.exit_code == 0, out.output
    readme = " ".join((ROOT / "README.md").read_text().split())
    for line in out.output.splitlines():
        if line.startswith(("offline states, bfloat16", "offline states, float8_e4m3fn", "streamed (")):
            figure = " ".join(line[34:].split()[:2])
            assert figure in readme, (figure, line)
