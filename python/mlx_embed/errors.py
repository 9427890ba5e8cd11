"""Exceptions the engine raises on purpose, typed for the Rust bridge.

The bridge maps :class:`InvalidInput` to a client error (HTTP 400) and any
other exception to a model failure (500), so only input the caller could have
got right raises ``InvalidInput``. It subclasses ``ValueError`` so plain
Python callers can keep catching that.
"""

from __future__ import annotations


class MlxEmbedError(Exception):
    """Base of the engine's own exceptions."""


class InvalidInput(MlxEmbedError, ValueError):
    """The request itself is wrong (bad token id, empty sequence, over the
    model's length, unknown prompt name); retrying it cannot succeed."""
