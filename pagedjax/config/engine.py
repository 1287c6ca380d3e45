"""`EngineConfig`: everything an `LLMEngine` is configured by, in one frozen value.

The component configs (model shape, KV cache, scheduler, parallel layout, speculative decoding) and the engine's
own options: the one definition of each option and its default. `LLMEngine(config, **options)`,
`LLMEngine.from_pretrained(path, **options)` and the command lines (`pagedjax.cli.args`, whose flags read their
defaults from these fields) all build one of these (`engine_config`), so every option is defined and checked in one
place, whichever entry point a caller uses; an engine keeps it as `engine.config`. Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass

from pagedjax.config.cache import CacheConfig
from pagedjax.config.fields import check_bool, check_choice, check_int, describe, option
from pagedjax.config.lora import LoRAConfig
from pagedjax.config.model import ModelConfig
from pagedjax.config.parallel import ParallelConfig
from pagedjax.config.pooling import PoolingDefaults
from pagedjax.config.sampling import SamplingDefaults
from pagedjax.config.scheduler import SchedulerConfig
from pagedjax.config.speculative import SpeculativeConfig
from pagedjax.config.structured import StructuredLimits

BACKENDS = ("auto", "pallas", "xla")


@dataclass(frozen=True)
class EngineConfig:
    """An engine's whole configuration.

    model_config: a built-in model's shape (None: the model comes with its own, `model=`; checked where the model is
      built).
    backend: "auto" (Pallas kernels on a GPU/TPU, the XLA path on a CPU) | "pallas" | "xla".
    decode_steps_per_call: decode iterations one device call runs when every running request decodes (fused
      decode; 1 = off).
    seed: the engine's seed, in [0, 2**32): random weights, and requests without a seed of their own.
    compile_cache: JAX's persistent compilation cache: True (the default folder), a folder, or False.
    max_compiled_programs: compiled step programs kept (least recently used dropped past it).
    compile_in_background: a step whose program is not compiled yet runs on a bigger compiled one while its own
      compiles (the server's choice, with `warmup()`).
    batch_invariant: every step runs one program of the engine's largest shape (needs decode_steps_per_call 1
      and no speculative decoding).
    structured_limits: what a request's output constraint may ask of the grammar compiler, checked before it is
      compiled (`pagedjax.structured_output.limits`: a constraint past a limit is a ValueError naming it).
    sampling_defaults: what a request's sampling fields left None become (`pagedjax.config.sampling`; vLLM's
      defaults unless given: `from_pretrained` gives the model folder's generation_config.json).
    lora_config: multi-LoRA serving's slots and rank (None: no adapters).
    pooling_defaults: how an embedding request's pooling fields left None are set (`pagedjax.config.pooling`; last
      token, normalized, unless given: `from_pretrained` gives a sentence-transformers folder's modules).
    """

    model_config: ModelConfig | None = None
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    backend: str = option("auto", "attention backend: auto = Pallas on GPU, XLA elsewhere")
    decode_steps_per_call: int = option(1, "decode iterations per device call when every sequence is decoding "
                                           "(fused decode: one host round trip per call; tokens stream in bursts "
                                           "of up to N)")
    seed: int = option(0, "engine seed: random weights, and requests without a seed of their own (reproducible "
                          "per seed and request)")
    compile_cache: bool | str = option(True, "keep compiled programs in DIR, so that the next run loads them "
                                             "instead of compiling (a warm start) (default: "
                                             "$PAGEDJAX_COMPILE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}/pagedjax/jax)")
    max_compiled_programs: int = option(64, "compiled step programs kept; past N the least recently used is "
                                            "dropped (and compiled again, or loaded from the compile cache, if "
                                            "needed again): bounds memory")
    compile_in_background: bool = option(False, "compile programs that can run every step (pagedjax-generate: "
                                                 "before the first step; pagedjax-serve: in the background from "
                                                 "start-up, answering at once): a step whose own program is new "
                                                 "then runs on one of them while its own compiles in the "
                                                 "background, instead of waiting for it")
    batch_invariant: bool = False
    structured_limits: StructuredLimits = dataclasses.field(default_factory=StructuredLimits)
    sampling_defaults: SamplingDefaults = dataclasses.field(default_factory=SamplingDefaults)
    lora_config: LoRAConfig | None = None
    pooling_defaults: PoolingDefaults = dataclasses.field(default_factory=PoolingDefaults)

    def __post_init__(self) -> None:
        owner = "LLMEngine"  # its fields are LLMEngine's keywords: errors name the keyword
        # model_config is checked where the model is built (`engine_model`: it or a model=..., never both)
        for name, cls, optional in (("cache_config", CacheConfig, False), ("scheduler_config", SchedulerConfig, False),
                                    ("parallel_config", ParallelConfig, True),
                                    ("speculative_config", SpeculativeConfig, True),
                                    ("structured_limits", StructuredLimits, False),
                                    ("sampling_defaults", SamplingDefaults, False),
                                    ("lora_config", LoRAConfig, True),
                                    ("pooling_defaults", PoolingDefaults, False)):
            value = getattr(self, name)
            if not (isinstance(value, cls) or (optional and value is None)):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__} ({owner}.{name})")
        check_choice(owner, "backend", self.backend, BACKENDS, optional=False)
        for name, lo, hi in (("decode_steps_per_call", 1, None), ("seed", 0, 2**32 - 1),
                             ("max_compiled_programs", 1, None)):
            object.__setattr__(self, name, check_int(owner, name, getattr(self, name), lo=lo, hi=hi))
        if not isinstance(self.compile_cache, bool | str):
            raise TypeError(f"{owner}.compile_cache must be a bool or a folder (str), got "
                            f"{describe(self.compile_cache)}")
        check_bool(owner, "compile_in_background", self.compile_in_background)
        check_bool(owner, "batch_invariant", self.batch_invariant)
        if self.batch_invariant and self.decode_steps_per_call != 1:  # a fused decode is a program of its own
            raise ValueError(f"{owner}: batch_invariant=True needs decode_steps_per_call=1, got "
                             f"{self.decode_steps_per_call}")
        if self.batch_invariant and self.speculative_config is not None:
            # verifying steps sample more rows than the one program has
            raise ValueError(f"{owner}: batch_invariant=True cannot be combined with speculative_config")

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)


OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(EngineConfig))


def takes_options(*, but: tuple[str, ...] = ()):
    """A decorator: the function's `**options` shown (by `help()` and `inspect.signature`) as `EngineConfig`'s
    fields, keyword-only with their defaults, `but` those; what it accepts is unchanged (`engine_config` checks)."""

    def decorate(function):
        signature = inspect.signature(function)
        params = [p for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        params += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                                     default=f.default if f.default is not dataclasses.MISSING else f.default_factory())
                   for f in dataclasses.fields(EngineConfig) if f.name not in but]
        function.__signature__ = signature.replace(parameters=params)
        return function

    return decorate


def engine_config(config: EngineConfig | None, options: dict, owner: str) -> EngineConfig:
    """`config` (None: `EngineConfig()`) with `options` (its fields by name) over it: what `LLMEngine(config,
    **options)` and the other entry points are configured by. TypeError for a `config` that is not an
    EngineConfig (naming the keyword a model's config goes in) or an option that is not one of its fields."""
    if config is None:
        config = EngineConfig()
    elif not isinstance(config, EngineConfig):
        hint = " (a model's shape goes in model_config=...)" if isinstance(config, ModelConfig) else ""
        raise TypeError(f"{owner}: config must be an EngineConfig, got {type(config).__name__}{hint}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"{owner}: unknown option(s) {', '.join(unknown)}; the options are EngineConfig's fields: "
                        f"{', '.join(OPTIONS)}")
    return config.replace(**options) if options else config
