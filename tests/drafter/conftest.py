"""The drafter's tests' data: the tiny target and its synthetic hidden states (synthetic.py), once per module."""

import pytest
from synthetic import synthetic_hidden, tiny_target


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    embed = tiny_target(tmp / "target")
    synthetic_hidden(tmp / "hidden", embed)
    return tmp
