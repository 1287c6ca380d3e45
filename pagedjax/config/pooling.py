"""`PoolingDefaults`: how a model pools an embedding when a request does not say (`PoolingParams` fields left None).

A sentence-transformers folder says it (`modules.json`: a Transformer, then a `Pooling` module whose `config.json`
names the mode, then an optional `Normalize`): `PoolingDefaults.from_sentence_transformers` reads those files'
parsed contents. A folder without them pools the last token and normalises (what decoder embedding models such as
Qwen3-Embedding do, and vLLM's default for decoder models). A folder whose modules pagedjax cannot reproduce (a
`Dense` projection after pooling, max pooling, mean without the prompt) says so in `refused`: its pooling requests
are refused with that reason (never a vector that differs from the model's own). Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_bool, check_choice, describe

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config: the flag of each mode pagedjax computes (any other flag on is refused).
_MODE_FLAGS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_MODE_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}  # its `pooling_mode` string (newer versions)
_ST_MODULE = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingDefaults:
    """A model's pooling: `pooling` ("last", "mean", "cls"), `normalize` (L2), `refused` (why this model's embeddings
    cannot be computed, None when they can), `source` (where they come from, for errors and logs)."""

    pooling: str = "last"
    normalize: bool = True
    refused: str | None = None
    source: str = "the default for decoder models (last token, normalized)"

    def __post_init__(self) -> None:
        check_choice("PoolingDefaults", "pooling", self.pooling, POOLING_TYPES, optional=False)
        check_bool("PoolingDefaults", "normalize", self.normalize)
        for name in ("refused", "source"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (name == "refused" and value is None)):
                raise TypeError(f"PoolingDefaults.{name} must be a str, got {describe(value)}")

    @classmethod
    def from_sentence_transformers(cls, modules, pooling_configs: dict, source: str) -> PoolingDefaults:
        """The pooling of a sentence-transformers folder: `modules` its parsed `modules.json` (a list of
        {"type", "path"}), `pooling_configs` the parsed `config.json` of each Pooling module by its path. ValueError
        naming `source` for files of the wrong shape; modules pagedjax does not compute give a `refused` reason."""
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise ValueError(f"{source}: must hold a list of module objects, got {type(modules).__name__}")
        kinds = [str(m.get("type", "")).removeprefix(_ST_MODULE) for m in modules]
        pools = [m for m, kind in zip(modules, kinds, strict=True) if kind == "Pooling"]
        if kinds[:1] != ["Transformer"] or len(pools) != 1:
            return cls(refused=f"{source}: modules {kinds} are not a Transformer, one Pooling and an optional "
                               "Normalize", source=source)
        others = [k for k in kinds[1:] if k not in ("Pooling", "Normalize")]
        if others:
            return cls(refused=f"{source}: modules {others} after the Transformer are not computed by pagedjax",
                       source=source)
        config = pooling_configs.get(pools[0].get("path"))
        where = f"{source} ({pools[0].get('path')}/config.json)"
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
        return cls(pooling=modes[0], normalize="Normalize" in kinds, source=source)

    def describe(self) -> str:
        """One line: "last token, normalized (modules.json)" or the refusal."""
        if self.refused is not None:
            return f"refused: {self.refused}"
        name = {"last": "last token", "mean": "mean", "cls": "first token"}[self.pooling]
        return f"{name}, {'normalized' if self.normalize else 'not normalized'} ({self.source})"
