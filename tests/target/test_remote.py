"""target.trust_remote_code on a copy of the embedded target whose tokenizer class is remote code: refused in the first
seconds when off, run when on, its code in the fingerprint and in engine.json, and ``--trust-remote-code`` for the
servers launched for it."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import yaml
from e2e import PROMPTS, ROOT, run_infer

from eaglepipe.core import config
from eaglepipe.core.errors import UserError
from eaglepipe.core.records import write_jsonl
from eaglepipe.engines import launch
from eaglepipe.engines.sglang import SGLangEngine
from eaglepipe.evaluate import serve
from eaglepipe.target import model as target
from eaglepipe.target import remote

CODE = """from transformers import PreTrainedTokenizerFast


class ProbeTokenizer(PreTrainedTokenizerFast):
    probe = "remote code ran"
"""


@pytest.fixture
def custom(target_folder, tmp_path):
    """The embedded target with its tokenizer class in tokenization_probe.py (named by tokenizer_config's auto_map)."""
    folder = tmp_path / "custom"
    folder.mkdir()
    for p in target_folder.iterdir():
        if p.suffix == ".safetensors":
            (folder / p.name).symlink_to(p.resolve())
        else:
            shutil.copy(p, folder / p.name)
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    tok.update(
        tokenizer_class="ProbeTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_probe.ProbeTokenizer"]}
    )
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    (folder / "tokenization_probe.py").write_text(CODE)
    return folder


def test_remote_code_is_refused_unless_trusted_then_runs(custom, target_folder):
    with pytest.raises(UserError, match=r"needs remote code \(tokenization_probe.py\).*target.trust_remote_code: true"):
        target.resolve(str(custom))
    folder = target.resolve(str(custom), trust_remote_code=True)
    assert folder == custom and remote.trusted(folder)
    tok = target.load_tokenizer(folder)
    assert type(tok).__name__ == "ProbeTokenizer" and tok.probe == "remote code ran"
    text = "Hello, world! <|im_start|>user\nhi<|im_end|>"
    assert tok(text)["input_ids"] == target.load_tokenizer(target_folder)(text)["input_ids"]
    assert target.resolve(str(target_folder)) == target_folder  # a folder without code needs nothing


def test_trust_goes_with_the_resolved_folder_not_with_the_process(custom):
    trusted = target.resolve(str(custom), trust_remote_code=True)
    assert remote.trusted(trusted) and remote.trusted(trusted.resolve())
    assert not remote.trusted(custom) and not remote.trusted(str(trusted)) and not remote.trusted(Path(trusted))
    with pytest.raises(ValueError, match="trust_remote_code"):
        target.load_tokenizer(custom)  # the same folder, resolved and trusted above, reached another way


def test_the_code_is_part_of_the_fingerprint(custom):
    before = target.fingerprint(custom)
    assert remote.hashes(custom) == {"tokenization_probe.py": hashlib.sha256(CODE.encode()).hexdigest()}
    (custom / "tokenization_probe.py").write_text(CODE + "    # changed\n")
    assert target.fingerprint(custom) != before


def test_code_from_elsewhere_or_missing_is_refused(custom):
    tok = json.loads((custom / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": [None, "someone/repo--tokenization_probe.ProbeTokenizer"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="another repository, which is never downloaded"):
        target.resolve(str(custom), trust_remote_code=True)
    tok["auto_map"] = {"AutoTokenizer": [None, "tokenization_gone.ProbeTokenizer"]}
    (custom / "tokenizer_config.json").write_text(json.dumps(tok))
    with pytest.raises(UserError, match="not in the folder: tokenization_gone.py"):
        target.resolve(str(custom), trust_remote_code=True)


def test_launched_servers_trust_remote_code_only_for_a_trusted_target(custom, target_folder, tokenizer):
    section = config.Servers(launch=config.Launch(model_path="m", extra_args="--foo 1"))
    assert launch.servers(section, target_folder) is section
    assert launch.servers(section, custom) is section
    trusted = target.resolve(str(custom), trust_remote_code=True)
    argv = SGLangEngine(launch.servers(section, trusted), tokenizer)._launcher().argv()
    assert argv[-3:] == ["--foo", "1", "--trust-remote-code"]
    assert "--trust-remote-code" in serve.Served(trusted, tokenizer, config.Serve()).engine.launch.extra_args
    assert "--trust-remote-code" not in serve.Served(custom, tokenizer, config.Serve()).engine.launch.extra_args
    assert "--trust-remote-code" not in serve.Served(target_folder, tokenizer, config.Serve()).engine.launch.extra_args


@pytest.mark.e2e
def test_the_infer_stage_refuses_then_runs_and_records_the_code(custom, tmp_path):
    write_jsonl(tmp_path / "prompts.jsonl", PROMPTS[:2])
    cfg = yaml.safe_load((ROOT / "params.yaml").read_text())
    cfg["target"]["model"] = str(custom)
    cfg["infer"].update(engine="hf", samples=1, temperature=0.0, max_new_tokens=4)
    cfg["infer"]["gates"].update(max_empty=1.0)
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(cfg))
    out = run_infer(tmp_path, params, tmp_path / "prompts.jsonl")
    assert out.returncode != 0 and "target.trust_remote_code: true" in out.stderr and not (tmp_path / "out").exists()
    cfg["target"]["trust_remote_code"] = True
    params.write_text(yaml.safe_dump(cfg))
    out = run_infer(tmp_path, params, tmp_path / "prompts.jsonl")
    assert out.returncode == 0, out.stderr[-3000:]
    engine = json.loads((tmp_path / "out" / "engine.json").read_text())
    assert engine["remote_code"] == remote.hashes(custom)
    assert len((tmp_path / "out" / "responses.jsonl").read_text().splitlines()) == 2
