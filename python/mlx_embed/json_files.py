"""The JSON files of a model folder (config.json, tokenizer_config.json,
modules.json, ...), read one way everywhere."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from .errors import InvalidModel


def read_json(path: str) -> Optional[Any]:
    """The file's value, or None when there is no such file; one that is not
    JSON is an InvalidModel (a ValueError) naming it."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise InvalidModel(f"{path} is not valid JSON: {e}") from None
