"""Shared fixtures: the embedded target (tokenizer and model loaded once per test session); each test's tier; one
torch thread per pytest-xdist worker."""

import os

import pytest
import torch

from eaglepipe.target import model as target

TIERS = ("unit", "e2e", "engine")


def pytest_configure(config):
    """A pytest-xdist worker (``make test`` runs one per core) and every process it starts use one torch thread, so
    the workers share the cores without oversubscribing them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def target_folder():
    return target.resolve("embedded")


@pytest.fixture(scope="session")
def tokenizer(target_folder):
    return target.load_tokenizer(target_folder)


@pytest.fixture(scope="session")
def model(target_folder):
    return target.load_model(target_folder)


def pytest_collection_modifyitems(items):
    """Every test is in exactly one tier (pyproject.toml says what each means): a test its file marks ``e2e`` or
    ``engine`` is in that tier, any other test is in ``unit``."""
    for item in items:
        tiers = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if len(tiers) > 1:
            raise pytest.UsageError(f"{item.nodeid} is marked {' and '.join(sorted(tiers))}: one tier per test")
        if not tiers:
            item.add_marker(pytest.mark.unit)
