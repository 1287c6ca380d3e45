"""`SamplingDefaults`: what a request's sampling fields left unset (None in `SamplingParams`) become.

One default everywhere, as vLLM has it: a model folder's `generation_config.json` sets them where it has them
(`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`: `SamplingDefaults.from_generation_config`), and
vLLM's `SamplingParams` defaults fill the rest (`SamplingDefaults()`: temperature 1.0, top_p 1.0, top_k 0 (off),
min_p 0.0, repetition_penalty 1.0). An engine holds one (`EngineConfig.sampling_defaults`; `from_pretrained`
reads the folder's), and applies it to every request it takes, whichever entry point made the request (Python,
`pagedjax-generate`, `pagedjax-serve`); a value a request gives is never replaced. Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import check_float, check_int, describe

# generation_config.json's keys that are sampling defaults (its other keys, max_new_tokens included, are not read).
DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults of `SamplingParams`' model-dependent fields (see the module docstring); each checked as
    `SamplingParams` checks it (TypeError / ValueError naming the field). `source`: where they come from, for
    headers and logs ("vLLM's defaults", or the generation_config.json they were read from)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    source: str = "vLLM's defaults"

    def __post_init__(self) -> None:
        owner = "SamplingDefaults"
        object.__setattr__(self, "temperature", check_float(owner, "temperature", self.temperature))
        top_p = check_float(owner, "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{owner}.top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "top_p", top_p)
        top_k = check_int(owner, "top_k", self.top_k, lo=-1, hi=2**31 - 1)
        object.__setattr__(self, "top_k", max(top_k, 0))  # -1 (vLLM's and Hugging Face's "off") is 0 here
        min_p = check_float(owner, "min_p", self.min_p)
        if min_p > 1.0:
            raise ValueError(f"{owner}.min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "min_p", min_p)
        object.__setattr__(self, "repetition_penalty",
                           check_float(owner, "repetition_penalty", self.repetition_penalty, positive=True))
        if not isinstance(self.source, str):
            raise TypeError(f"{owner}.source must be a str, got {describe(self.source)}")

    @classmethod
    def from_generation_config(cls, config: dict, source: str) -> SamplingDefaults:
        """The defaults a `generation_config.json` (its parsed `config`, read from `source`) sets, vLLM's for the
        keys it does not have (nor sets to null). A bad value is a ValueError naming the file and the key."""
        if not isinstance(config, dict):
            raise ValueError(f"{source}: must hold a JSON object, got {type(config).__name__}")
        given = {k: config[k] for k in DEFAULT_KEYS if config.get(k) is not None}
        try:
            return cls(**given, source=source)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {str(e).replace('SamplingDefaults.', '')}") from None

    def describe(self) -> str:
        """E.g. 'temperature 0.8, top_p 0.95 (pagedjax/assets/tiny/generation_config.json)': the fields that differ
        from vLLM's defaults, or 'temperature 1.0' when none does, and the source."""
        vllm = SamplingDefaults()
        fields = [f.name for f in dataclasses.fields(self) if f.name != "source"]
        changed = [n for n in fields if getattr(self, n) != getattr(vllm, n)] or ["temperature"]
        return f"{', '.join(f'{n} {getattr(self, n)}' for n in changed)} ({self.source})"
