"""One entry point for weights (a pagedjax orbax checkpoint folder or a local Hugging Face model folder), and
the module an engine serves (`engine_model`: built from its arguments, or a model of the public contract).

Every problem with the folder's contents (invalid JSON, a config field of the wrong type, a truncated or
corrupted weights file, weights that do not match the config) is a `ModelLoadError` whose message is one line
naming the file and, where there is one, the field or tensor. A missing path is a `FileNotFoundError`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from pagedjax.config import ModelConfig
from pagedjax.config.engine import engine_config
from pagedjax.model.errors import ModelLoadError
from pagedjax.model.families import family_of
from pagedjax.model.llama import Llama, init_model, model_from_state
from pagedjax.model.loading.generation_config import folder_sampling_defaults
from pagedjax.model.loading.hf_classifier import engine_classifier
from pagedjax.model.loading.pooling_config import folder_pooling_defaults

logger = logging.getLogger(__name__)


def is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file())


def load_pretrained(path: str | Path | None = None, dtype: str | None = None, *, mesh=None, quantization=None):
    """Load `(ModelConfig, nnx.State, tokenizer)` from a folder; None means the bundled model. With a
    tensor-parallel `mesh` (`pagedjax.parallel`), each device receives only its slice of each parameter.
    `quantization` (a `pagedjax.config.quant.QuantConfig` or its name, e.g. "int8", "int4:32", "fp8") quantizes
    the linear layers' and MoE experts' weights once loaded (`pagedjax.model.llama.quantize_params`; MoE experts
    after stacking); a checkpoint saved quantized
    loads as it was saved (asking for another scheme then is a ValueError).

    Accepts pagedjax's own orbax checkpoints (a folder with `pagedjax_config.json`, and `tokenizer.json` or a
    byte-level vocabulary) and Hugging Face folders (`config.json` + *.safetensors [+ tokenizer.json]).
    `dtype` ("float32" | "bfloat16" | "float16") overrides the stored one.
    Raises FileNotFoundError for a missing path and ModelLoadError for a folder that cannot be loaded.
    """
    from pagedjax.model.loading import checkpoint

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
        from pagedjax.model.loading import hf_loader

        cfg, state, tokenizer = hf_loader.load_hf(path, dtype=dtype, mesh=mesh)
    else:
        raise ModelLoadError(path, f"neither a pagedjax checkpoint ({checkpoint.CONFIG_FILE} + params/) nor a "
                                   "Hugging Face model folder (config.json + *.safetensors)")
    if quantization is not None:
        cfg, state = _quantized(cfg, state, quantization)
    logger.info("loaded %s in %.2f s", path, time.perf_counter() - start)
    return cfg, state, tokenizer


def _quantized(cfg, state, quantization):
    """`cfg`, `state` with their linears quantized as `quantization` says: a float checkpoint quantized, one
    holding those weights as it is, or with its activations quantized or not as asked; other quantized weights
    are refused."""
    from pagedjax.config.quant import QuantConfig
    from pagedjax.model.llama import quantize_params

    quantization = QuantConfig.coerce(quantization)
    if cfg.quantization is None:
        return quantize_params(cfg, state, quantization)
    if dataclasses.replace(quantization, activations=cfg.quantization.activations) == cfg.quantization:
        # The weights as stored, their activations quantized or not as asked (e.g. an int8 checkpoint, or a
        # pre-quantized W8A16 one, served W8A8): the same arrays, another product.
        return cfg.replace(quantization=quantization), state
    if cfg.quantization != quantization:
        held, detail = cfg.quantization, ""
        if held.name == quantization.name:  # the same scheme otherwise (e.g. a MoE checkpoint's float experts)
            detail = f" (scale_dtype {held.scale_dtype!r}, keep_float {held.keep_float})"
        raise ValueError(f"quantization {quantization.name!r}: the checkpoint holds {held.name!r} weights "
                         f"already{detail}")
    return cfg, state


def load_registered(path, dtype: str | None):
    """`(model, tokenizer or None)` of a Hugging Face folder whose `model_type` is registered in
    `pagedjax.model.registry.ModelRegistry`, by its factory, or is one of the built-in families served as a model
    of the public contract (`pagedjax.model.families.FAMILIES`: its module's `load`, unless a factory is registered
    for it); None for any other folder (a pagedjax
    checkpoint, an unregistered `model_type`, no path: the bundled model), which `load_pretrained` loads or refuses.
    The factory's own errors propagate; a result that is not `(model, tokenizer)` is a TypeError naming it."""
    from pagedjax.model.errors import read_json
    from pagedjax.model.loading import checkpoint
    from pagedjax.model.registry import ModelRegistry

    if path is None:
        return None
    path = Path(path)
    if (path / checkpoint.CONFIG_FILE).is_file() or not (path / "config.json").is_file():
        return None
    model_type = read_json(path / "config.json").get("model_type")
    factory = ModelRegistry.factory_for(model_type)
    family = family_of(model_type)
    if factory is None and family is not None:  # a built-in model of the contract
        factory = family.factory()
    if factory is None:
        return None
    result = factory(path, dtype)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(f"the factory registered for model_type {model_type!r} must return (model, tokenizer or "
                        f"None), got {type(result).__name__}")
    model, tokenizer = result
    if tokenizer is None:
        tokenizer = folder_tokenizer_for(path, model)
    logger.info("loaded %s (model_type %r) with its registered factory", path, model_type)
    return model, tokenizer


def folder_tokenizer_for(path, model):
    """The tokenizer of a factory that returned none (a registered one's, a `--model-class` one's): the
    `tokenizer.json` of the folder `path` it loaded, ending sequences at `model`'s end-of-sequence ids; None
    without one (or when `path` is no folder)."""
    from pagedjax.model.loading.hf_loader import folder_tokenizer

    return folder_tokenizer(path, getattr(getattr(model, "spec", None), "eos_token_ids", ()), None)


def load_engine_model(path, dtype: str | None, parallel_config, devices, quantization=None):
    """`(model arguments of LLMEngine, tokenizer or None)` of a saved model: `{"model": ...}` from a registered
    factory (`load_registered`, quantized by `quantize_model` with a `quantization`), else `{"model_config": ...,
    "params": ...}` (`load_for`)."""
    registered = load_registered(path, dtype)
    if registered is None:
        cfg, state, tokenizer = load_for(path, dtype, parallel_config, devices, quantization)
        return {"model_config": cfg, "params": state}, tokenizer
    model, tokenizer = registered
    if quantization is not None and getattr(model.spec, "images", None) is not None:
        raise ValueError(f"quantization {quantization!r}: models with images (vision-language) are not quantized "
                         "(their vision tower and projector would be too); load them in float")
    if quantization is not None:
        from pagedjax.model.layers.quant import quantize_model

        quantize_model(model, quantization)
    return {"model": model}, tokenizer


def load_engine_inputs(path, dtype: str | None, quantization, tokenizer, devices, options: dict, owner: str,
                       classifier_from_tokens=None):
    """`(EngineConfig, the engine's other keywords)` of a saved model: what `from_pretrained(path, **options)`
    builds an engine of. `options` are `EngineConfig`'s fields (its `model_config` is the folder's: naming one is a
    TypeError); a `parallel_config` among them reads the weights straight into their shards on the first
    replica's mesh; `sampling_defaults` and `pooling_defaults`, unless given, are the folder's
    (`folder_sampling_defaults`, `folder_pooling_defaults`). The classifier is a sequence-classifier folder's head
    (`load_classifier`), or with `classifier_from_tokens` (negative, positive) the model's LM-head rows of those
    two tokens (`token_classifier`: a Qwen3-Reranker)."""
    if "model_config" in options:
        raise TypeError(f"{owner}: the model's shape (model_config) is the folder's; use LLMEngine(model_config=...)"
                        " for a model of your own shape")
    config = engine_config(None, options, owner)
    weights, folder_tokenizer = load_engine_model(path, dtype, config.parallel_config, devices, quantization)
    config = config.replace(model_config=weights.pop("model_config", None))
    if "sampling_defaults" not in options:
        config = config.replace(sampling_defaults=folder_sampling_defaults(path))
    if "pooling_defaults" not in options:
        config = config.replace(pooling_defaults=folder_pooling_defaults(path))
    config = config.replace(speculative_config=folder_mtp_head(path, config.speculative_config))
    tokenizer = folder_tokenizer if tokenizer is None else tokenizer
    classifier = engine_classifier(path, config.model_config, weights.get("params"), tokenizer,
                                   classifier_from_tokens)
    return config, {**weights, "tokenizer": tokenizer, "image_processor": folder_image_processor(path, weights),
                    "devices": devices, "classifier": classifier}


def folder_mtp_head(path, speculative_config):
    """`speculative_config` with method "mtp" and no head given pointed at the model folder's own `mtp/` (a head
    `pagedjax.spec_decode.mtp_head.save_head` wrote: the bundled model ships one) where there is one; as given
    otherwise (the engine then says that the head is missing)."""
    from pagedjax.model.loading import checkpoint

    if speculative_config is None or speculative_config.method != "mtp" or speculative_config.draft_model is not None:
        return speculative_config
    folder = (checkpoint.bundled_model_path() if path is None else Path(path)) / "mtp"
    if not folder.is_dir():
        return speculative_config
    return dataclasses.replace(speculative_config, draft_model=str(folder))


def folder_image_processor(path, weights: dict):
    """The image processor of a saved vision-language model (`pagedjax.model.multimodal.processor.load_image_processor`)
    when the model `load_engine_model` built (`weights`) takes images; None otherwise."""
    model = weights.get("model")
    if model is None or getattr(model.spec, "images", None) is None:
        return None
    from pagedjax.model.multimodal.processor import load_image_processor

    return load_image_processor(path)


__all__ = ["ModelLoadError", "folder_image_processor", "is_hf_folder", "load_engine_inputs", "load_engine_model",
           "load_pretrained", "load_registered"]


def engine_model(model_config: ModelConfig | None, params, model, seed: int):
    """The module an engine serves: `model` as given, or a built-in one of `model_config` holding `params`
    (random weights from `seed` when None)."""
    if model is not None:
        if model_config is not None or params is not None:
            raise ValueError("LLMEngine: give model=... (a model of the public contract) or model_config (and "
                             "params) for a built-in model, not both")
        return model
    if model_config is None:
        raise TypeError("LLMEngine needs a model: model_config (and params) for a built-in model, or model=... "
                        "(see pagedjax.model.api)")
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"LLMEngine: model_config must be a pagedjax.ModelConfig, got {type(model_config).__name__}"
                        " (a model of your own goes in model=...)")
    if isinstance(params, Llama):
        return params
    if params is None:
        return init_model(model_config, seed)
    return model_from_state(model_config, params)  # no random init materialised


def load_for(path, dtype: str | None, parallel_config, devices, quantization=None):
    """`(ModelConfig, params, tokenizer)` of a saved model (see `load_pretrained`), with a `parallel_config`
    read straight into their shards on the first replica's mesh."""
    mesh = None
    if parallel_config is not None:
        from pagedjax.parallel.mesh import replica_meshes

        mesh = replica_meshes(parallel_config, devices)[0]
    return load_pretrained(path, dtype=dtype, mesh=mesh, quantization=quantization)
