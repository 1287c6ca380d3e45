"""Errors of model loading, and the one JSON reader every loader uses: the bottom of `pagedjax.model`.

Every problem with a model folder's contents is a `ModelLoadError` whose message is one line naming the file
and, where there is one, the field or tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class ModelLoadError(ValueError):
    """A model folder that cannot be loaded; `str(e)` is one line naming the file (and field or tensor)."""

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = Path(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever the underlying library said
        super().__init__(f"{self.path}: {self.problem}")


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from `path`; ModelLoadError naming the file if it is unreadable, invalid or not an object."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except UnicodeDecodeError as e:
        raise ModelLoadError(path, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise ModelLoadError(path, f"invalid JSON: {e}") from None
    except OSError as e:
        raise ModelLoadError(path, f"cannot read: {e.strerror or e}") from None
    if not isinstance(value, dict):
        raise ModelLoadError(path, f"expected a JSON object, got {type(value).__name__}")
    return value
