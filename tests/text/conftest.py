"""Fixtures of the text tests: the test tokenizer (the embedded target's with <think> and </think> as special
tokens) and its model folder, from reasoning_fixtures.py."""

import pytest
from reasoning_fixtures import model_folder, reasoning_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return reasoning_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return model_folder(tmp_path_factory)
