"""`ModelRegistry`: Hugging Face `model_type`s served by a model of one's own (`pagedjax.model.api`).

    from pagedjax import ModelRegistry
    ModelRegistry.register_model("gpt2", load_gpt2)   # then: LLMEngine.from_pretrained("gpt2-folder"),
                                                      #       pagedjax-serve --model gpt2-folder

Plain Python: registering imports nothing; the loader (`pagedjax.model.loading.loader.load_registered`) reads a
folder's `config.json` and calls the factory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from pagedjax.config.fields import describe

ENTRY_POINT_GROUP = "pagedjax.models"  # a package's factories, by model_type (`ModelRegistry`)
# factory(folder, dtype) -> (model, tokenizer or None): see `ModelRegistry`.
ModelFactory = Callable[[Path, "str | None"], tuple[Any, Any]]


class ModelRegistry:
    """Which factory builds the model of a Hugging Face folder whose `config.json` has a given `model_type`.

    `LLMEngine.from_pretrained(folder)`, `load_engine(folder)`, `pagedjax-generate --model folder` and
    `pagedjax-serve --model folder` consult it first: a registered `model_type` is served by its factory (a
    built-in one too: registering is asking for it), any other goes to the built-in loader, which refuses the
    `model_type`s it does not know. A pagedjax checkpoint folder (`pagedjax_config.json`) never consults it.

    The factory contract: `factory(folder: pathlib.Path, dtype: str | None)` is called with the folder given
    and the dtype asked for (`dtype=` / `--dtype`: "float32" | "bfloat16" | "float16", or None for the
    factory's own choice; a factory that cannot honour one raises ValueError rather than ignore it). It returns
    `(model, tokenizer)`: `model` an `nnx.Module` of the public contract (`pagedjax.model.api`: `spec`,
    `__call__`, `compute_logits`, optionally `param_partition`), which the engine checks on construction;
    `tokenizer` one with `encode` / `decode` (e.g. `pagedjax.model.hf_tokenizer.HFTokenizer`), or None for the
    folder's `tokenizer.json` (none there: token-id prompts only). `quantization=` / `--quantization` is applied
    to the returned model (`quantize_model`). Whatever the factory raises reaches the caller as raised.

    A command (`pagedjax-serve --model DIR`) runs no code of yours before it loads: a package of yours declares
    its factories as entry points of the group `pagedjax.models`, named by `model_type`
    (`gpt2 = "mypkg.gpt2:from_hf_folder"` under `[project.entry-points."pagedjax.models"]`), which are loaded the
    first time a `model_type` is looked up that nothing registered in-process.

    Invariant: one factory per `model_type`, a non-empty string; registering it again replaces the factory (a
    module re-imported registers itself again); an entry point never replaces one registered in-process.
    """

    _factories: ClassVar[dict[str, ModelFactory]] = {}
    _entry_points_loaded: ClassVar[bool] = False

    @classmethod
    def register_model(cls, model_type: str, factory: ModelFactory) -> None:
        """Serve Hugging Face folders of `model_type` with `factory` (the contract: the class docstring)."""
        if not isinstance(model_type, str) or not model_type:
            raise TypeError(f"ModelRegistry.register_model: model_type must be a non-empty string, got "
                            f"{describe(model_type)}")
        if not callable(factory):
            raise TypeError(f"ModelRegistry.register_model({model_type!r}): factory must be callable, got "
                            f"{type(factory).__name__}")
        cls._factories[model_type] = factory

    @classmethod
    def factory_for(cls, model_type) -> ModelFactory | None:
        """The factory registered for `model_type` (in-process, else by an entry point), or None."""
        if not isinstance(model_type, str):
            return None
        if model_type not in cls._factories and not cls._entry_points_loaded:
            cls._load_entry_points()
        return cls._factories.get(model_type)

    @classmethod
    def _load_entry_points(cls) -> None:
        """Register every `pagedjax.models` entry point not registered in-process (once per process: imports are
        not free, and an entry point that fails to import fails the lookup, loudly, every time otherwise)."""
        from importlib.metadata import entry_points

        cls._entry_points_loaded = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name not in cls._factories:
                cls.register_model(point.name, point.load())

    @classmethod
    def model_types(cls) -> tuple[str, ...]:
        """The `model_type`s registered in-process, sorted."""
        return tuple(sorted(cls._factories))

    @classmethod
    def model_factories(cls) -> dict[str, ModelFactory]:
        """A copy of the in-process registrations, `model_type` -> factory."""
        return dict(cls._factories)
