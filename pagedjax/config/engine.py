"""`EngineConfig`: everything an `LLMEngine` is configured by, in one frozen value.

The component configs (model shape, KV cache, scheduler, parallel layout, speculative decoding) and the engine's
own options. `LLMEngine(...)` and `LLMEngine.from_pretrained(...)` take the same fields as keywords (their
signatures list them) and build one of these, so every option is checked in one place, whichever entry point a
caller uses; an engine keeps it as `engine.config`. Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.cache import CacheConfig
from pagedjax.config.fields import check_bool, check_choice, check_int, describe
from pagedjax.config.lora import LoRAConfig
from pagedjax.config.model import ModelConfig
from pagedjax.config.parallel import ParallelConfig
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
    lora_config: multi-LoRA serving's slots and rank (None: no adapters; `LLMEngine(enable_lora=True, ...)`).
    """

    model_config: ModelConfig | None = None
    cache_config: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig | None = None
    speculative_config: SpeculativeConfig | None = None
    backend: str = "auto"
    decode_steps_per_call: int = 1
    seed: int = 0
    compile_cache: bool | str = True
    max_compiled_programs: int = 64
    compile_in_background: bool = False
    batch_invariant: bool = False
    structured_limits: StructuredLimits = dataclasses.field(default_factory=StructuredLimits)
    sampling_defaults: SamplingDefaults = dataclasses.field(default_factory=SamplingDefaults)
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        owner = "LLMEngine"  # its fields are LLMEngine's keywords: errors name the keyword
        # model_config is checked where the model is built (`engine_model`: it or a model=..., never both)
        for name, cls, optional in (("cache_config", CacheConfig, False), ("scheduler_config", SchedulerConfig, False),
                                    ("parallel_config", ParallelConfig, True),
                                    ("speculative_config", SpeculativeConfig, True),
                                    ("structured_limits", StructuredLimits, False),
                                    ("sampling_defaults", SamplingDefaults, False),
                                    ("lora_config", LoRAConfig, True)):
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
