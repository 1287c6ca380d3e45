"""One entry point for weights: a pagedjax orbax checkpoint folder or a local Hugging Face model folder.

Every problem with the folder's contents (invalid JSON, a config field of the wrong type, a truncated or
corrupted weights file, weights that do not match the config) is a `ModelLoadError` whose message is one line
naming the file and, where there is one, the field or tensor. A missing path is a `FileNotFoundError`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from pagedjax.config import ModelConfig

logger = logging.getLogger(__name__)


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


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


def load_pretrained(path: str | Path | None = None, dtype: str | None = None, *, mesh=None):
    """Load `(ModelConfig, nnx.State, tokenizer)` from a folder; None means the bundled model. With a
    tensor-parallel `mesh` (`pagedjax.parallel`), each device receives only its slice of each parameter.

    Accepts pagedjax's own orbax checkpoints (a folder with `pagedjax_config.json`, and `tokenizer.json` or a
    byte-level vocabulary) and Hugging Face folders (`config.json` + *.safetensors [+ tokenizer.json]).
    `dtype` ("float32" | "bfloat16" | "float16") overrides the stored one.
    Raises FileNotFoundError for a missing path and ModelLoadError for a folder that cannot be loaded.
    """
    from pagedjax.model import checkpoint

    path = Path(path) if path is not None else checkpoint.bundled_model_path()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    start = time.perf_counter()
    # Decided by which config file is present, not by whether it parses: a broken pagedjax_config.json is
    # reported as such, not as "not a model folder".
    if (path / checkpoint.CONFIG_FILE).is_file():
        cfg, state = checkpoint.load_checkpoint(path, dtype=dtype, mesh=mesh)
        tokenizer = checkpoint.load_checkpoint_tokenizer(path, cfg)
    elif (path / "config.json").is_file():
        from pagedjax.model import hf_loader

        cfg, state, tokenizer = hf_loader.load_hf(path, dtype=dtype, mesh=mesh)
    else:
        raise ModelLoadError(path, f"neither a pagedjax checkpoint ({checkpoint.CONFIG_FILE} + params/) nor a "
                                   "Hugging Face model folder (config.json + *.safetensors)")
    logger.info("loaded %s in %.2f s", path, time.perf_counter() - start)
    return cfg, state, tokenizer


__all__ = ["ModelConfig", "ModelLoadError", "is_hf_folder", "load_pretrained", "read_json"]
