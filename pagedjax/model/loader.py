"""One entry point for weights: a pagedjax orbax checkpoint folder or a local Hugging Face model folder."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from pagedjax.config import ModelConfig

logger = logging.getLogger(__name__)


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


def load_pretrained(path: str | Path | None = None, dtype: str | None = None):
    """Load `(ModelConfig, nnx.State, tokenizer)` from a folder; None means the bundled model.

    Accepts pagedjax's own orbax checkpoints and Hugging Face folders (config.json + *.safetensors).
    `dtype` ("float32" | "bfloat16" | "float16") overrides the stored one.
    """
    from pagedjax.model import checkpoint

    path = Path(path) if path is not None else checkpoint.bundled_model_path()
    if not path.exists():
        raise FileNotFoundError(f"no model at {path}")
    start = time.perf_counter()
    if checkpoint.is_pagedjax_checkpoint(path):
        from pagedjax.tokenizer import ByteTokenizer

        cfg, state = checkpoint.load_checkpoint(path, dtype=dtype)
        tokenizer = ByteTokenizer() if cfg.vocab_size == ByteTokenizer.vocab_size else None
    elif is_hf_folder(path):
        from pagedjax.model import hf_loader

        cfg, state, tokenizer = hf_loader.load_hf(path, dtype=dtype)
    else:
        raise ValueError(f"{path} is neither a pagedjax checkpoint nor a Hugging Face model folder "
                         "(config.json + *.safetensors)")
    logger.info("loaded %s in %.2f s", path, time.perf_counter() - start)
    return cfg, state, tokenizer


__all__ = ["ModelConfig", "is_hf_folder", "load_pretrained"]
