"""The shell commands of the README, recipes/README.md and every docs/*.md page work as written, in a fresh shell
without the venv activated, from the repository root: each command a page shows is either run here (the cheap ones)
or named below as one that runs the pipeline or the tests. Every relative link of those pages points at a file that
exists (and at a heading of it, for a #fragment)."""

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "recipes" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Commands that run stages, tests, benchmarks or experiments (minutes to hours), need a GPU or a server, or change git
# or DVC's config: shown, not run here.
EXPENSIVE = re.compile(
    r"^(\w+=\S+ )*(make (repro|test|test-fast|plots|inspect|prepare|infer|merge|hidden|train|"
    r"evaluate|serve|vllm-venv|bench|gpu-check)\b|dvc (repro|exp run|push|pull|remote)\b|git |"
    r"python bench/|python -m sglang|python -m vllm|python -m eaglepipe.core.runtime |torchrun |export |"
    r"sh -c )"
)


def commands(page: Path) -> list[str]:
    """The command lines of the page's ```bash, ```sh and ```console blocks, comments and prompts stripped."""
    found = []
    for block in re.findall(r"```(?:bash|sh|console)\n(.*?)```", page.read_text(), re.S):
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line and not line.startswith("#"):
                found.append(line.removeprefix("$ "))
    return found


def readme_commands() -> list[str]:
    return commands(ROOT / "README.md")


def cheap_commands() -> list:
    return [
        pytest.param(command, id=f"{page.relative_to(ROOT)}: {command}")
        for page in PAGES
        for command in dict.fromkeys(commands(page))
        if not EXPENSIVE.match(command)
    ]


def test_the_readme_shows_commands():
    commands = readme_commands()
    assert "make repro" in commands and "make test" in commands
    assert any(c.startswith("dvc exp run ") and " -S " in c for c in commands)


@pytest.mark.e2e
@pytest.mark.parametrize("command", cheap_commands())
def test_a_cheap_command_works_in_a_fresh_shell(command):
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"), "LANG": "C.UTF-8"}
    out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"{command}:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"


def anchors(page: Path) -> set[str]:
    """GitHub's ids of the page's headings: lower case, punctuation but hyphens dropped, spaces made hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def links() -> list:
    found = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if not re.match(r"[a-z]+:", target):
                found.append(pytest.param(page, target, id=f"{page.relative_to(ROOT)}: {target}"))
    return found


@pytest.mark.parametrize("page,target", links())
def test_a_relative_link_points_at_something_in_the_repository(page, target):
    path, _, fragment = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    assert resolved.exists() and ROOT in (resolved, *resolved.parents), (
        f"{page.name}: {target} is not in the repository"
    )
    if fragment and resolved.suffix == ".md":
        assert fragment in anchors(resolved), f"{page.name}: no heading #{fragment} in {resolved.name}"
