"""`PoolingDefaults`: how a model pools an embedding when a request does not say (`PoolingParams` fields left None).

A sentence-transformers folder says it (`modules.json`: a Transformer, then a `Pooling` module whose `config.json`
names the mode, then any `Dense` projections (EmbeddingGemma's two), then an optional `Normalize`):
`PoolingDefaults.from_sentence_transformers` reads those files' parsed contents (a Dense module's weights as a
`DenseLayer`). A folder without them pools the last token and normalises (what decoder embedding models such as
Qwen3-Embedding do, and vLLM's default for decoder models). A folder whose modules pagedjax cannot reproduce (max
pooling, mean without the prompt, a Dense activation other than identity or tanh) says so in `refused`: its pooling
requests are refused with that reason (never a vector that differs from the model's own). Plain Python and numpy,
no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedjax.config.fields import check_bool, check_choice, describe

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config: the flag of each mode pagedjax computes (any other flag on is refused).
_MODE_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # its `pooling_mode` string (newer versions)
_ST_MODULE = "sentence_transformers.models."
# sentence-transformers' Dense `activation_function` (a torch class path) -> the function pagedjax applies.
DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


@dataclass(frozen=True, eq=False)
class DenseLayer:
    """A projection after pooling (sentence-transformers' `Dense` module): `x -> activation(weight @ x + bias)`,
    `weight` float32 `[out_features, in_features]`, `bias` float32 `[out_features]` or None, `activation`
    "identity" or "tanh"."""

    weight: np.ndarray
    bias: np.ndarray | None
    activation: str = "identity"

    def __post_init__(self) -> None:
        w, b = self.weight, self.bias
        if not isinstance(w, np.ndarray) or w.ndim != 2 or w.dtype != np.float32 or 0 in w.shape:
            raise ValueError(f"DenseLayer.weight must be a float32 [out, in] array, got {describe(w)}")
        if b is not None and (not isinstance(b, np.ndarray) or b.dtype != np.float32 or b.shape != w.shape[:1]):
            raise ValueError(f"DenseLayer.bias must be None or a float32 [{w.shape[0]}] array, got {describe(b)}")
        check_choice("DenseLayer", "activation", self.activation, ("identity", "tanh"), optional=False)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = self.weight @ x.astype(np.float32) + (0 if self.bias is None else self.bias)
        return np.tanh(y) if self.activation == "tanh" else y


@dataclass(frozen=True)
class PoolingDefaults:
    """A model's pooling: `pooling` ("last", "mean", "cls"), `normalize` (L2), `dense` (projections of the pooled
    vector before `dimensions` and normalising, in order), `refused` (why this model's embeddings cannot be
    computed, None when they can), `source` (where they come from, for errors and logs)."""

    pooling: str = "last"
    normalize: bool = True
    refused: str | None = None
    source: str = "the default for decoder models (last token, normalized)"
    dense: tuple[DenseLayer, ...] = ()

    def __post_init__(self) -> None:
        check_choice("PoolingDefaults", "pooling", self.pooling, POOLING_TYPES, optional=False)
        check_bool("PoolingDefaults", "normalize", self.normalize)
        if not isinstance(self.dense, tuple) or not all(isinstance(d, DenseLayer) for d in self.dense):
            raise TypeError(f"PoolingDefaults.dense must be a tuple of DenseLayer, got {describe(self.dense)}")
        for i, (a, b) in enumerate(zip(self.dense[:-1], self.dense[1:], strict=True)):
            if b.weight.shape[1] != a.weight.shape[0]:
                raise ValueError(f"PoolingDefaults.dense[{i + 1}] takes {b.weight.shape[1]} inputs, but dense[{i}] "
                                 f"gives {a.weight.shape[0]}")
        for name in ("refused", "source"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (name == "refused" and value is None)):
                raise TypeError(f"PoolingDefaults.{name} must be a str, got {describe(value)}")

    @classmethod
    def from_sentence_transformers(cls, modules, pooling_configs: dict, source: str,
                                   dense: dict | None = None) -> PoolingDefaults:
        """The pooling of a sentence-transformers folder: `modules` its parsed `modules.json` (a list of
        {"type", "path"}), `pooling_configs` the parsed `config.json` of each Pooling module by its path, `dense` each
        Dense module's `DenseLayer` by its path (or a str: why it cannot be computed). ValueError naming `source` for
        files of the wrong shape; modules pagedjax does not compute give a `refused` reason."""
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError(f"{source}: must hold a list of module objects, got {type(modules).__name__}")
        kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE) for m in modules]
        shape = kinds[:2] == ["Transformer", "Pooling"] and kinds.count("Pooling") == 1
        rest = kinds[2:]
        if rest[-1:] == ["Normalize"]:
            rest = rest[:-1]
        if not shape or any(k != "Dense" for k in rest):
            return cls(refused=f"{source}: modules {kinds} are not a Transformer, a Pooling, any Dense and an "
                               "optional Normalize (in that order)", source=source)
        config = pooling_configs.get(modules[1].get("path"))
        where = f"{source} ({modules[1].get('path')}/config.json)"
        if not isinstance(config, dict):
            raise ValueError(f"{where}: the Pooling module's config must be a JSON object")
        mode = config.get("pooling_mode")
        if isinstance(mode, str):
            modes = [_MODE_NAMES.get(mode, mode)]
        else:
            modes = [_MODE_FLAGS.get(k, k) for k, on in config.items() if k.startswith("pooling_mode") and on is True]
        if len(modes) != 1 or modes[0] not in POOLING_TYPES:
            return cls(refused=f"{where}: pooling {modes} is not one of pagedjax's ({', '.join(POOLING_TYPES)})",
                       source=source)
        if config.get("include_prompt", True) is not True:
            return cls(refused=f"{where}: include_prompt false (pooling without the prompt's instruction tokens) "
                               "is not computed by pagedjax", source=source)
        dense_modules = modules[2:2 + len(rest)]
        layers = [(dense or {}).get(m.get("path")) for m in dense_modules]
        for m, layer in zip(dense_modules, layers, strict=True):
            if not isinstance(layer, DenseLayer):
                why = layer if isinstance(layer, str) else "not read"
                return cls(refused=f"{source}: Dense module {m.get('path')!r}: {why}", source=source)
        try:
            return cls(pooling=modes[0], normalize="Normalize" in kinds, source=source, dense=tuple(layers))
        except ValueError as e:
            return cls(refused=f"{source}: {e}", source=source)

    def output_size(self, hidden_size: int) -> int:
        """The length of a pooled vector before `dimensions`: the model's hidden size, or the last Dense's output."""
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size

    def describe(self) -> str:
        """One line: "last token, normalized (modules.json)" or the refusal."""
        if self.refused is not None:
            return f"refused: {self.refused}"
        name = {"last": "last token", "mean": "mean", "cls": "first token"}[self.pooling]
        dense = "".join(f", Dense {d.weight.shape[1]} -> {d.weight.shape[0]}" for d in self.dense)
        return f"{name}{dense}, {'normalized' if self.normalize else 'not normalized'} ({self.source})"
