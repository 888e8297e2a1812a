"""Shared fixtures: the embedded target (tokenizer and model loaded once per test session)."""
import pytest

from eaglepipe import target


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
    """A test that runs the real model (the ``model`` fixture) or a stage end to end (``e2e`` in its name) is slow:
    `make test-fast` leaves it out."""
    for item in items:
        if "model" in getattr(item, "fixturenames", ()) or "e2e" in item.name:
            item.add_marker(pytest.mark.slow)
