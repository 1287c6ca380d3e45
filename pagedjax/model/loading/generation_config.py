"""A model folder's sampling defaults: its `generation_config.json` (Hugging Face's file; vLLM reads the same keys)
as `SamplingDefaults` (`pagedjax.config.sampling`), vLLM's defaults where the folder has none."""

from __future__ import annotations

import json
from pathlib import Path

from pagedjax.config.sampling import SamplingDefaults
from pagedjax.model.loading.checkpoint import bundled_model_path

GENERATION_CONFIG = "generation_config.json"


def folder_sampling_defaults(path) -> SamplingDefaults:
    """The sampling defaults of the model folder `path` (None: the bundled model's): its generation_config.json's
    temperature, top_p, top_k, min_p and repetition_penalty over vLLM's defaults; vLLM's alone when the folder
    has no such file (or `path` is not a folder). ValueError naming the file when it is not JSON or holds a bad
    value."""
    folder = bundled_model_path() if path is None else Path(path)
    file = folder / GENERATION_CONFIG
    if not file.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{file}: not a readable JSON file ({e})") from None
    return SamplingDefaults.from_generation_config(config, str(file))
