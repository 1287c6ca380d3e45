"""Model families: each module holds one Hugging Face family's config mapping, its model and its weight names.

The families a `ModelConfig` describes (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3, OLMo 2, Phi-3, Mixtral,
Qwen3-MoE, gpt-oss) are served by `pagedjax.model.llama` and map in `pagedjax.model.loading.hf_config` (gpt-oss
through its module here). Every other family is a model of the public contract (`pagedjax.model.api`), served from
one module named in `FAMILIES`, which defines
    load_config(path, dtype)  the folder's config.json as the family's config (a ModelLoadError naming the file
                              and field for what it does not compute)
    load(path, dtype)         (the model holding the folder's weights, its tokenizer or None): the `ModelRegistry`
                              factory contract, which `pagedjax.model.loading.loader.load_registered` calls
Adding a family is its module, its entry here, and its tests. Plain data: nothing here imports a family.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """A family served as a model of the contract: its module, the `model_type`s it loads, and how a list of what
    `from_pretrained` loads names the group."""

    module: str
    model_types: tuple[str, ...]
    label: str

    def factory(self) -> Callable:
        """The module's `load(path, dtype)` (importing the module: JAX, Flax)."""
        return importlib.import_module(self.module).load


FAMILIES: tuple[Family, ...] = (
    Family("pagedjax.model.families.deepseek", ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"),
           "DeepSeek"),
    Family("pagedjax.model.families.deepseek_v4", ("deepseek_v4",), "DeepSeek"),
    Family("pagedjax.model.families.qwen3_next",
           ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"), "hybrid recurrent"),
    Family("pagedjax.model.families.nemotron_h", ("nemotron_h",), "hybrid recurrent"),
    Family("pagedjax.model.multimodal.hf_vision", ("llava", "gemma3"), "with images"),
)


def family_of(model_type) -> Family | None:
    """The family whose module loads `model_type`, or None (a ModelConfig family's, or one not built in)."""
    return next((f for f in FAMILIES if model_type in f.model_types), None)


def model_types_of(module: str) -> tuple[str, ...]:
    """The `model_type`s `FAMILIES` gives the family module `module` (its `__name__`): a module's own list."""
    return next(f.model_types for f in FAMILIES if f.module == module)
