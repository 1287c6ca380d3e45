"""What changes an engine's state between steps, as data: the commands process 0 of a multi-host engine sends
the others (`pagedjax.engine.multihost`), and their wire form.

A message is UTF-8 JSON with a fixed schema, never pickle (a pickle from the network runs code):

    {"v": 1, "op": "step" | "idle" | "warmup" | "save_kv_tiers" | "stop", "commands": [command, ...]}
    command: {"add": {"request_id", "prompt_token_ids", "sampling_params", "cache_salt", "lora_request", "pooling"}}
           | {"abort": {"request_id"}} | {"add_lora": LoRARequest's fields} | {"remove_lora": {"lora_int_id"}}

Parameter objects (`SamplingParams`, `PoolingParams`, `LoRARequest`, a nested `StructuredOutput`) travel as their
dataclass fields, every field present; decoding rebuilds them through their constructors, whose checks apply
again. Any other key, a missing one or a wrong type is a `WireError` naming it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass

from pagedjax.pooling_params import PoolingParams
from pagedjax.sampling_params import LoRARequest, SamplingParams

WIRE_VERSION = 1
OPS = ("step", "idle", "warmup", "save_kv_tiers", "stop")


class WireError(ValueError):
    """A message that is not a valid command message (names the key or value)."""


@dataclass(frozen=True)
class Add:
    """Queue a request: what `LLMEngine.make_request` takes. `sampling_params` and `pooling` are the made
    request's own (the engine's defaults already applied, so making it again gives the same request)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams | None
    cache_salt: str | None
    lora_request: LoRARequest | None
    pooling: PoolingParams | None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class AddLoRA:
    lora_request: LoRARequest


@dataclass(frozen=True)
class RemoveLoRA:
    lora_int_id: int


Command = Add | Abort | AddLoRA | RemoveLoRA


@dataclass(frozen=True)
class Message:
    """One exchange: the commands since the last one, then `op` (run a step, nothing, the warm-up, save the
    KV tiers, or stop following)."""

    op: str
    commands: tuple[Command, ...] = ()

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise WireError(f"op must be one of {OPS}, got {self.op!r}")


_KEYS = {"add": Add, "abort": Abort, "add_lora": AddLoRA, "remove_lora": RemoveLoRA}


def encode(message: Message) -> bytes:
    """The message's wire bytes."""
    commands = []
    for c in message.commands:
        key = next(k for k, cls in _KEYS.items() if isinstance(c, cls))
        commands.append({key: c.lora_request if isinstance(c, AddLoRA) else c})
    doc = {"v": WIRE_VERSION, "op": message.op, "commands": [{k: _to_json(v) for k, v in c.items()}
                                                             for c in commands]}
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def decode(data: bytes) -> Message:
    """The message of wire bytes; WireError for anything but what `encode` makes."""
    try:
        doc = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"not a JSON message: {e}") from None
    _check_keys("message", doc, {"v", "op", "commands"})
    if type(doc["v"]) is not int or doc["v"] != WIRE_VERSION:
        raise WireError(f"wire version {doc['v']!r}; this pagedjax speaks {WIRE_VERSION}")
    if not isinstance(doc["commands"], list):
        raise WireError("commands must be a list")
    commands = []
    for c in doc["commands"]:
        if not isinstance(c, dict) or len(c) != 1 or next(iter(c)) not in _KEYS:
            raise WireError(f"a command is one of {sorted(_KEYS)} with its fields, got {str(c)[:200]}")
        (key, fields), = c.items()
        if key == "add_lora":
            commands.append(AddLoRA(_from_json(LoRARequest, fields, "add_lora")))
        else:
            commands.append(_from_json(_KEYS[key], fields, key))
    return Message(doc["op"], tuple(commands))


def _to_json(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_to_json(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"{type(value).__name__} has no wire form")


def _from_json(cls: type, doc, where: str):
    """A `cls` dataclass from its fields' JSON (types checked by the field annotations here, values by `cls`)."""
    names = [f.name for f in dataclasses.fields(cls)]
    _check_keys(where, doc, set(names))
    hints = _hints(cls)
    values = {name: _value(hints[name], doc[name], f"{where}.{name}") for name in names}
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise WireError(f"{where}: {e}") from None


def _value(hint, value, where: str):
    if value is None:
        if hint is type(None) or type(None) in typing.get_args(hint):
            return None
        raise WireError(f"{where} may not be null")
    options = [a for a in typing.get_args(hint) if a is not type(None)] if _is_union(hint) else [hint]
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, dict):
            return _from_json(option, value, where)
        if typing.get_origin(option) is tuple and isinstance(value, list):
            (item, *_) = typing.get_args(option)
            return tuple(_value(item, v, where) for v in value)
        if option is float and isinstance(value, int | float) and not isinstance(value, bool):
            return float(value) if isinstance(value, int) else value
        if option in (int, str, bool) and type(value) is option:
            return value
    raise WireError(f"{where}: {value!r} is not a {hint}")


def _is_union(hint) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _check_keys(where: str, doc, expected: set[str]) -> None:
    if not isinstance(doc, dict):
        raise WireError(f"{where} must be an object, got {type(doc).__name__}")
    if set(doc) != expected:
        missing, extra = sorted(expected - set(doc)), sorted(set(doc) - expected)
        raise WireError(f"{where}: " + "; ".join(([f"missing {missing}"] if missing else [])
                                                 + ([f"unknown {extra}"] if extra else [])))


