"""The README's shell commands work as written, in a fresh shell without the venv activated: each command it shows
is either run here (the cheap ones) or named below as one that runs the pipeline or the tests."""
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Commands that run stages, tests or experiments (minutes to hours), or change git: shown, not run here.
EXPENSIVE = re.compile(r"^(\w+=\S+ )*(make (repro|test|test-fast|plots|inspect|prepare|infer|merge|hidden|train|"
                       r"evaluate|serve|vllm-venv)\b|dvc (repro|exp run|push|pull|remote)\b|git |python bench/|"
                       r"python -m sglang|python -m vllm|python -m eaglepipe.runtime |torchrun |export |sh -c )")


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", text, re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                commands.append(line.removeprefix("$ "))
    return commands


def test_the_readme_shows_commands():
    commands = readme_commands()
    assert "make repro" in commands and "make test" in commands
    assert any(c.startswith("dvc exp run ") and " -S " in c for c in commands)


@pytest.mark.parametrize("command", [c for c in readme_commands() if not EXPENSIVE.match(c)])
def test_a_cheap_readme_command_works_in_a_fresh_shell(command):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{command}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
