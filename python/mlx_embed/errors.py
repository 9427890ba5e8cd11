"""Exceptions the engine raises on purpose, typed for the Rust bridge.

The bridge maps :class:`InvalidInput` to a client error (HTTP 400) and any
other exception to a model failure (500), so only input the caller could have
got right raises ``InvalidInput``. It subclasses ``ValueError`` so plain
Python callers can keep catching that.

A load's own failures are typed too, each its own kind across the seam
(``crates/mlx-embed-python/src/error.rs``), so a Rust program tells a bad
setting from a bad model folder without reading the message:
:class:`InvalidOption` (a ``load()`` keyword argument the engine cannot
take) and :class:`InvalidModel` (the folder is missing, or its files make
no model this engine runs). Each keeps the built-in class Python callers
caught before (``ValueError``, ``TypeError``, ``FileNotFoundError``). A
missing folder or file (:class:`ModelFolderMissing`, ``hub.ModelNotFound``)
is a ``ValueError`` now too, as every ``InvalidModel`` is: a caller's
``except ValueError`` placed before its ``except FileNotFoundError`` takes it.
A package only some models need (:class:`MissingDependency`, an
``ImportError`` too) is the model's kind: the bridge keeps
``EngineUnavailable`` for the engine's own import failing, the one
``ImportError`` a load leaves untyped. Nothing a load raises is
``InvalidInput``: a load has no input to blame.
"""

from __future__ import annotations

import numpy as np


class MlxEmbedError(Exception):
    """Base of the engine's own exceptions."""


class InvalidInput(MlxEmbedError, ValueError):
    """The request itself is wrong (bad token id, empty sequence, over the
    model's length, unknown prompt name); retrying it cannot succeed."""


class InvalidOption(MlxEmbedError, ValueError):
    """A ``load()`` setting the engine cannot take: out of its range
    (``workers`` past what the cores run, ``max_length`` past the model's
    positions), or a name it does not know. The message names the setting."""


class InvalidOptionType(InvalidOption, TypeError):
    """A ``load()`` setting of the wrong type (``pipeline="no"``)."""


class InvalidModel(MlxEmbedError, ValueError):
    """The model folder's files make no model this engine runs: an
    architecture or layout it does not know, a config or tokenizer file it
    cannot read, a setting in them it does not support."""


class ModelFolderMissing(InvalidModel, FileNotFoundError):
    """The model folder, or a file it must have (``config.json``, a
    weights shard its index lists), is not there."""


class MissingDependency(InvalidModel, ImportError):
    """A Python package this model needs cannot be imported (``mlx_lm``,
    whose layers the decoder architectures run), though the engine itself
    imports: the engine runs other models, not this one here. Typed as the
    model's (``InvalidModel``), so the bridge does not report the engine
    unavailable (``EngineUnavailable`` is the engine's own import failing:
    ``mlx_embed``'s modules or MLX); the message names the package. Still an
    ``ImportError`` for Python callers."""


# The engine's own packages: one of them missing is the engine unavailable,
# never a model's dependency.
ENGINE_PACKAGES = ("mlx_embed", "mlx")


# Packages imported by another name than pip installs them by, among those
# mlx_lm and the tokenizer stack import (the hint would name a wrong one).
_PIP_NAMES = {"yaml": "pyyaml", "google": "protobuf", "sklearn": "scikit-learn", "PIL": "pillow"}


def missing_package(err: ImportError) -> str | None:
    """The top-level package an ``ImportError`` could not import, from its
    ``name`` or those of the errors it was raised from; None if none says."""
    seen = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        name = getattr(e, "name", None) if isinstance(e, ImportError) else None
        if name:
            return name.split(".", 1)[0]
        e = e.__cause__ or e.__context__
    return None


def as_missing_dependency(err: ImportError, what: str) -> ImportError:
    """An ``ImportError`` raised while loading ``what`` (not while importing
    the engine), typed: a package other than the engine's own
    (``ENGINE_PACKAGES``) becomes :class:`MissingDependency` naming it; the
    engine's own, or an error already typed, is returned as it is."""
    if isinstance(err, MlxEmbedError):
        return err
    package = missing_package(err)
    if package in ENGINE_PACKAGES:
        return err
    needs = f"the Python package {package!r}" if package else "a Python package"
    install = f" (pip install {_PIP_NAMES.get(package, package.replace('_', '-'))})" if package else ""
    typed = MissingDependency(f"{what} needs {needs}, which cannot be imported here{install}: {err}")
    typed.name = package
    return typed


class CutTooShort(InvalidInput):
    """A call's ``truncate_to`` is too short for the model's own tokens
    (its special tokens), so no input could fit; the message says the cut
    that does. The bridge gives it its own kind, so a server names the
    request's cut field rather than an input."""


class InputTooLong(InvalidInput):
    """Input ``index`` (a text or a pair) has ``tokens`` tokens, more than
    ``max_length``, and truncation was turned off."""

    def __init__(self, what: str, index: int, tokens: int, max_length: int,
                 limit_name: str = "max_length"):
        self.what, self.index, self.tokens, self.max_length = what, index, tokens, max_length
        # ``limit_name``: the setting that made the limit (a call's
        # ``truncate_to`` below the model's ``max_length``), as it was typed.
        super().__init__(
            f"{what} {index} has {tokens} tokens, more than {limit_name}={max_length} "
            "(pass truncate=True to cut it)"
        )


def check_switches(**switches) -> None:
    """A per-call switch must be a bool: ``normalize="no"`` would normalize
    and ``truncate=None`` refuse long texts, as Python reads them."""
    for key, value in switches.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{key} must be True or False, got {value!r}")
