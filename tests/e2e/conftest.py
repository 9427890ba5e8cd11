"""Fixtures for the end-to-end tests; the helpers live in harness.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from harness import FIXTURES, NOMIC, start_server, stop_leftovers


def pytest_sessionfinish(session, exitstatus):
    stop_leftovers()


@pytest.fixture(scope="session")
def golden():
    texts = json.loads((FIXTURES / "golden" / "minilm_texts.json").read_text())
    mean = np.load(FIXTURES / "golden" / "minilm_mean_normalized.npy")
    return texts, mean


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One default-settings server shared by the read-only tests of a session."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    code = srv.stop()
    assert code == 0, f"server exited {code}:\n{srv.log()[-4000:]}"


@pytest.fixture(scope="session")
def nomic(tmp_path_factory):
    """The NomicBERT fixture: prompts query/document/classification/clustering
    (no passage), default document. For the APIs that pick a prompt by role."""
    srv = start_server(tmp_path_factory.mktemp("nomic"), "--model", str(NOMIC), "--no-warmup")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]
