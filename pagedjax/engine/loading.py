"""What an engine serves: the module built from its arguments (`LLMEngine(model_config, params)` or
`LLMEngine(model=...)`), and a saved model read for it (straight into its shards under a parallel layout)."""

from __future__ import annotations

from pagedjax.config import ModelConfig
from pagedjax.model.llama import Llama, init_model, model_from_state


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
    """`(ModelConfig, params, tokenizer)` of a saved model (see `pagedjax.model.loader.load_pretrained`), with a
    `parallel_config` read straight into their shards on the first replica's mesh."""
    from pagedjax.model.loader import load_pretrained

    mesh = None
    if parallel_config is not None:
        from pagedjax.parallel.mesh import replica_meshes

        mesh = replica_meshes(parallel_config, devices)[0]
    return load_pretrained(path, dtype=dtype, mesh=mesh, quantization=quantization)
