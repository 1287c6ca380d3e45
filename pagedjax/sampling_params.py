"""What a caller asks of a request: `SamplingParams`, `StructuredOutput` (a constraint on the output) and
`BeamSearchParams`. Plain data, no JAX; each checks its fields on construction (`InvalidType`, a TypeError, or
`InvalidRequest`, a ValueError, its `param` the field: `pagedjax.errors`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from pagedjax.config.fields import check_int
from pagedjax.config.sampling import DEFAULT_KEYS, SamplingDefaults
from pagedjax.errors import InvalidRequest, InvalidType

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1  # seeds travel to the device as two uint32 halves


def _check_int(name: str, value, *, lo: int | None, hi: int | None) -> None:
    """`check_int`'s check of field `name`, refused as the request errors naming it."""
    try:
        check_int("SamplingParams", name, value, lo=lo, hi=hi)
    except TypeError as e:
        raise InvalidType(str(e), param=name) from None
    except ValueError as e:
        raise InvalidRequest(str(e), param=name) from None


def _check_float(name: str, value, *, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidType(f"SamplingParams.{name} must be a number, got {type(value).__name__} {value!r}",
                          param=name)
    if not math.isfinite(value):
        raise InvalidRequest(f"SamplingParams.{name} must be finite, got {value}", param=name)
    if lo is not None and value < lo:
        raise InvalidRequest(f"SamplingParams.{name} must be >= {lo}, got {value}", param=name)


# Greedy over the raw logits, whatever the engine's defaults: for the engine's own requests (beam search, scoring).
RAW_SAMPLING = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's API allows
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text; exactly one kind is given:

    json         a JSON schema (a dict, or its JSON text): the output is one JSON value valid under it
    json_object  True: the output is any JSON object
    regex        the output matches this regular expression (whole)
    choice       the output is one of these strings
    grammar      the output is a sentence of this Lark-syntax grammar (llguidance's dialect; `start` rule)

    Each generated token is sampled from the tokens that keep the output a prefix of something the constraint
    allows (EOS only where it is complete). The schema is stored as canonical JSON text (hashable)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        owner = "StructuredOutput"
        if self.json is not None:
            import json as jsonlib

            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise InvalidRequest(f"{owner}.json is not valid JSON: {e}", param="structured") from None
            if not isinstance(schema, dict | bool):
                raise InvalidType(f"{owner}.json must be a JSON schema (a dict or its JSON text), got "
                                  f"{type(schema).__name__}", param="structured")
            object.__setattr__(self, "json", jsonlib.dumps(schema, sort_keys=True, separators=(",", ":")))
        if not isinstance(self.json_object, bool):
            raise InvalidType(f"{owner}.json_object must be a bool, got {self.json_object!r}", param="structured")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidType(f"{owner}.{name} must be a non-empty string, got {value!r}", param="structured")
        if self.choice is not None:
            choice = (self.choice,) if isinstance(self.choice, str) else self.choice
            if not hasattr(choice, "__iter__") or isinstance(choice, bytes):
                raise InvalidType(f"{owner}.choice must be a sequence of strings, got {type(choice).__name__}",
                                  param="structured")
            choice = tuple(choice)
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequest(f"{owner}.choice must hold one or more non-empty strings, got {choice!r}",
                                     param="structured")
            object.__setattr__(self, "choice", choice)
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(f"{owner}: give exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                                 f"{', '.join(given) or 'none'}", param="structured")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token, and when to stop (vLLM's / OpenAI's semantics).

    temperature == 0 means greedy. top_k 0 (or -1), top_p == 1 and min_p == 0 disable those filters.
    `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` default to None: the model's default, which
    the engine fills in when it takes the request (`with_defaults`, with the engine's `SamplingDefaults`: the model
    folder's generation_config.json, else vLLM's defaults, temperature 1.0 and every filter and penalty off). A
    value given, 0 or 1.0 included, is never replaced; give temperature=0 for greedy decoding whatever the model.
    `max_tokens` None (the default) generates until the model stops (EOS, a stop id or string) or the context is
    full: the engine sets it to what the context leaves after the prompt (`with_room`: its `max_request_tokens`
    minus the prompt's tokens) when it takes the request, the rule of every entry point (pagedjax-generate without
    --max-tokens, the server's completions and chat without max_tokens). A `max_tokens` past the context (the
    prompt's tokens + max_tokens > the engine's max_model_len) is refused when the request is added, never cut
    short silently.
    `seed` makes a request's samples reproducible regardless of what it is batched with.

    Several samples: `best_of` samples (default `n`) are drawn from one prefill of the prompt (the KV cache is
    forked, see `Scheduler`); sample i uses seed `seed + i`, so it equals a single request with that seed. The
    output holds the `n` samples with the highest cumulative log-probability (all of them, in index order,
    when best_of == n).

    Log-probabilities are log-softmax (float32) of the model's raw logits, before temperature, filters or
    penalties: `logprobs=k` returns, for each generated token, its log-probability and the k most likely
    alternatives; `prompt_logprobs=k` the same for every prompt token after the first (such a request does not
    take prefix-cache hits: its prompt is recomputed so that every position has logits).

    Penalties (OpenAI semantics, applied to the logits before sampling, greedy included): `presence_penalty`
    is subtracted once from every token that occurs in the output so far, `frequency_penalty` once per
    occurrence; `repetition_penalty` (CTRL / Hugging Face) divides positive logits and multiplies negative ones of
    every token seen in the prompt or the output. `min_tokens`: stop ids and EOS cannot be sampled before that
    many outputs. `stop`: strings that end the output (host-side, on the detokenized text; needs a tokenizer):
    the text is cut before the stop string unless `include_stop_str_in_output`. `structured`: a
    `StructuredOutput` (JSON schema, regex, choice, grammar; needs a tokenizer): tokens the constraint does not
    allow next are masked out of the logits before anything else, so log-probabilities reflect it too.

    Every field is validated at construction (types too: no silent coercion); a bad one raises `InvalidType` (a
    TypeError) or `InvalidRequest` (a ValueError) naming it, its `param` the field (`pagedjax.errors`).
    """

    max_tokens: int | None = None  # None: the rest of the context (see above)
    temperature: float | None = None  # None: the model's default (see above), as top_k ... repetition_penalty
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    best_of: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Every field is checked here, types included, so that a bad value fails at construction with
        # the field's name instead of on device, inside a step that also carries other requests.
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=INT32_MAX)
        if self.temperature is not None:
            _check_float("temperature", self.temperature, lo=0.0)
        if self.top_k is not None:
            _check_int("top_k", self.top_k, lo=-1, hi=INT32_MAX)
        if self.top_p is not None:
            _check_float("top_p", self.top_p)
            if not 0.0 < self.top_p <= 1.0:
                raise InvalidRequest(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if self.min_p is not None:
            _check_float("min_p", self.min_p)
            if not 0.0 <= self.min_p <= 1.0:
                raise InvalidRequest(f"SamplingParams.min_p must be in [0, 1], got {self.min_p}", param="min_p")
        _check_int("n", self.n, lo=1, hi=INT32_MAX)
        if self.best_of is not None:
            _check_int("best_of", self.best_of, lo=self.n, hi=INT32_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=SEED_MAX - (self.num_samples - 1))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_float(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)}",
                                     param=name)
        if self.repetition_penalty is not None:
            _check_float("repetition_penalty", self.repetition_penalty)
            if self.repetition_penalty <= 0.0:
                raise InvalidRequest(f"SamplingParams.repetition_penalty must be > 0, got {self.repetition_penalty}",
                                     param="repetition_penalty")
        _check_int("min_tokens", self.min_tokens, lo=0, hi=INT32_MAX if self.max_tokens is None else self.max_tokens)
        object.__setattr__(self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop", _str_tuple("stop", self.stop))
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidType(f"SamplingParams.{name} must be a bool, got {getattr(self, name)!r}", param=name)
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise InvalidType(f"SamplingParams.structured must be a StructuredOutput, got "
                              f"{type(self.structured).__name__}", param="structured")

    def with_defaults(self, defaults: SamplingDefaults) -> SamplingParams:
        """These parameters with every field left None (the model's default) set from `defaults`; self when none
        is (the values given stay as they are)."""
        unset = {name: getattr(defaults, name) for name in DEFAULT_KEYS if getattr(self, name) is None}
        return dataclasses.replace(self, **unset) if unset else self

    def with_room(self, room: int) -> SamplingParams:
        """These parameters with `max_tokens` None (the rest of the context) set to `room`, the tokens the
        context leaves after the prompt (at least 1: a prompt that leaves none is the scheduler's to refuse, as too
        long); self when max_tokens is given. InvalidRequest (param min_tokens) when it asks for more than `room`."""
        if self.max_tokens is not None:
            return self
        if room < 1:  # the prompt fills the context: refused as too long (the scheduler's error, not this one's)
            return dataclasses.replace(self, max_tokens=max(1, self.min_tokens))
        if self.min_tokens > room:
            raise InvalidRequest(f"SamplingParams.min_tokens ({self.min_tokens}) is more than the {room} tokens the "
                                 "context leaves after the prompt (max_tokens None: the rest of the context)",
                                 param="min_tokens")
        return dataclasses.replace(self, max_tokens=room)

    @property
    def has_defaults_applied(self) -> bool:
        """Whether no field is left to the model's default (`with_defaults` was applied, or every one given)."""
        return all(getattr(self, name) is not None for name in DEFAULT_KEYS)

    def _resolved(self, what: str) -> None:
        if not self.has_defaults_applied:
            raise ValueError(f"SamplingParams.{what} is not known before the engine's defaults are applied "
                             "(with_defaults): a field is None, the model's default")

    @property
    def greedy(self) -> bool:
        """temperature 0 (only known once the defaults are applied: ValueError before)."""
        self._resolved("greedy")
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Samples drawn: best_of (default n)."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def has_penalties(self) -> bool:
        """Any penalty or min_tokens on (only known once the defaults are applied: ValueError before)."""
        self._resolved("has_penalties")
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)


def _int_tuple(name: str, value) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise InvalidType(f"SamplingParams.{name} must be a sequence of ints, got {type(value).__name__}",
                          param=name)
    out = tuple(value)
    for t in out:
        _check_int(name, t, lo=0, hi=INT32_MAX)
    return tuple(int(t) for t in out)


def _str_tuple(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, bytes) or not hasattr(value, "__iter__"):
        raise InvalidType(f"SamplingParams.{name} must be a string or a sequence of strings, got "
                          f"{type(value).__name__}", param=name)
    out = tuple(value)
    for s in out:
        if not isinstance(s, str) or not s:
            raise InvalidRequest(f"SamplingParams.{name} must hold non-empty strings, got {s!r}", param=name)
    return out


@dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False
    structured: StructuredOutput | None = None  # a constraint every beam keeps (see the module docstring)

    def __post_init__(self) -> None:
        check_int("BeamSearchParams", "beam_width", self.beam_width, lo=1, hi=MAX_LOGPROBS // 2)
        check_int("BeamSearchParams", "max_tokens", self.max_tokens, lo=1)
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, int | float):
            raise ValueError(f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"BeamSearchParams.ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise TypeError(f"BeamSearchParams.structured must be a StructuredOutput, got "
                                f"{type(self.structured).__name__}")
            if self.ignore_eos:
                raise ValueError("BeamSearchParams.ignore_eos cannot be combined with structured: the constraint "
                                 "ends the text with EOS")


@dataclass(frozen=True)
class LoRARequest:
    """A request's LoRA adapter, as vLLM names it: `lora_int_id` (>= 1; 0 is the base model) is the adapter's
    identity in the engine (its device slot, and its blocks' hash key: two adapters never share KV blocks), and
    must stay bound to one `lora_name` and `lora_path` (a PEFT folder) for the engine's life."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        for name in ("lora_name", "lora_path"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise TypeError(f"LoRARequest.{name} must be a non-empty str, got {value!r}")
        object.__setattr__(self, "lora_int_id", check_int("LoRARequest", "lora_int_id", self.lora_int_id, lo=1))
