"""What a caller asks of a pooling request (an embedding): `PoolingParams`. Plain data, no JAX; fields checked on
construction (`InvalidType`, a TypeError, or `InvalidRequest`, a ValueError, its `param` the field).

A pooling request runs its prompt through the model (prefill only: chunked and batched with other requests like any
prompt) and returns one vector made of the hidden states of the model's last layer (after its final norm, what
transformers calls `last_hidden_state`): the last prompt token's ("last": decoder embedding models such as
Qwen3-Embedding), the mean over every prompt token ("mean") or the first token's ("cls"); then its first
`dimensions` entries (Matryoshka models) and, with `normalize`, that divided by its L2 norm. Fields left None are
the model's (`pagedjax.config.pooling.PoolingDefaults`: a sentence-transformers folder's `1_Pooling` and
`Normalize` modules).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import check_int
from pagedjax.config.pooling import POOLING_TYPES, PoolingDefaults
from pagedjax.errors import InvalidRequest, InvalidType


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's options (see the module docstring). `pooling`: "last", "mean" or "cls" (None: the
    model's); `normalize`: L2-normalise the result (None: the model's); `dimensions`: keep the first d entries of the
    pooled vector (before normalising), 1 <= d <= the model's hidden size (checked by the engine)."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None:
            if not isinstance(self.pooling, str):
                raise InvalidType(f"PoolingParams.pooling must be a str, got {type(self.pooling).__name__}",
                                  param="pooling")
            if self.pooling not in POOLING_TYPES:
                raise InvalidRequest(f"PoolingParams.pooling must be one of {', '.join(POOLING_TYPES)}, got "
                                     f"{self.pooling!r}", param="pooling")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidType(f"PoolingParams.normalize must be a bool, got {self.normalize!r}", param="normalize")
        if self.dimensions is not None:
            try:
                check_int("PoolingParams", "dimensions", self.dimensions, lo=1, hi=None)
            except TypeError as e:
                raise InvalidType(str(e), param="dimensions") from None
            except ValueError as e:
                raise InvalidRequest(str(e), param="dimensions") from None

    def with_defaults(self, defaults: PoolingDefaults) -> PoolingParams:
        """These options with every field left None set from the model's `defaults` (`dimensions` None stays: the
        whole vector)."""
        return dataclasses.replace(self, pooling=self.pooling or defaults.pooling,
                                   normalize=defaults.normalize if self.normalize is None else self.normalize)

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled vector needs hidden states of positions before the last ("mean", "cls"): such a
        request takes no prefix-cache hits (hidden states are not cached, only KV). A "last" request takes them: its
        last prompt position always runs (a prompt fully in the cache still recomputes its last token)."""
        return self.pooling != "last"
