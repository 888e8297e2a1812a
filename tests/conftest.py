"""Shared fixtures: the embedded target (tokenizer and model loaded once per test session) and the repo root."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eaglepipe import target  # noqa: E402


@pytest.fixture(scope="session")
def target_folder():
    return target.resolve("embedded")


@pytest.fixture(scope="session")
def tokenizer(target_folder):
    return target.load_tokenizer(target_folder)


@pytest.fixture(scope="session")
def model(target_folder):
    return target.load_model(target_folder)
