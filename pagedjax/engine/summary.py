"""What an engine runs, said one way for every front end: `EngineSummary` (`summarize(engine)`), which the CLI's
header, the server's start-up log and `/v1/models` print.

It says what is on, read from the engine itself (not from the flags that asked for it): the model's compute dtype,
how its weights are stored (`StoredParams`: parameters by storage type, bytes, and the quantization scales apart:
"2.36 M params: 1.97 M int4 (0.9 MiB), 0.39 M float32 (1.5 MiB), scales 48 KiB"), the KV cache's dtype, the
speculative method, the parallel layout (tp x dp), the context length and the sampling defaults.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

# A quantized linear's stored weight, by its storage dtype: int4 is packed two per uint8 byte.
_QUANTIZED = {"int8": ("int8", 1), "uint8": ("int4", 2), "float8_e4m3fn": ("fp8", 1)}


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _count(n: int, of: int | None = None) -> str:
    """`n` parameters in the unit of `of` (default `n`) parameters: '2.36 M', '0.53 M', '12.5 K'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if (n if of is None else of) >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


@dataclass(frozen=True)
class StoredParams:
    """A model's parameters by how they are stored: (storage type, parameters, bytes) per type, most bytes
    first (a quantized weight counts its logical parameters: int4 packs two in a byte), and the bytes of the
    quantization scales, which are storage, not parameters."""

    by_type: tuple[tuple[str, int, int], ...]
    scale_bytes: int = 0

    @classmethod
    def of(cls, state) -> StoredParams:
        """From a model's weights (an `nnx.State` or any pytree of arrays): a leaf named `qweight` is a quantized
        weight, a `scale` beside one its scales."""
        import jax

        def name(key) -> str:  # a dict key, an attribute's name or a sequence index
            for field in ("key", "name", "idx"):
                if hasattr(key, field):
                    return str(getattr(key, field))
            return str(key)

        leaves = [(tuple(n for n in map(name, path) if n != "value"), x)  # nnx's Variable.value
                  for path, x in jax.tree_util.tree_leaves_with_path(state)]
        quantized = {path[:-1] for path, _ in leaves if path and path[-1] == "qweight"}
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        scale_bytes = 0
        for path, x in leaves:
            dtype = str(x.dtype)
            if path[:-1] in quantized and path[-1] == "scale":
                scale_bytes += int(x.nbytes)
                continue
            name, per_element = _QUANTIZED.get(dtype, (dtype, 1)) if path[-1] == "qweight" else (dtype, 1)
            counts[name][0] += int(x.size) * per_element
            counts[name][1] += int(x.nbytes)
        by_type = sorted(((t, n, b) for t, (n, b) in counts.items()), key=lambda e: -e[2])
        return cls(tuple(by_type), scale_bytes)

    @property
    def num_params(self) -> int:
        return sum(n for _, n, _ in self.by_type)

    @property
    def nbytes(self) -> int:
        return sum(b for _, _, b in self.by_type) + self.scale_bytes

    def describe(self) -> str:
        """E.g. '2.36 M params, 9.0 MiB float32', or '2.36 M params: 1.97 M int8 (1.9 MiB), 0.39 M float32
        (1.5 MiB), scales 12.0 KiB'."""
        if len(self.by_type) == 1 and not self.scale_bytes:
            (name, _, nbytes), = self.by_type
            return f"{_count(self.num_params)} params, {_size(nbytes)} {name}"
        parts = [f"{_count(n, self.num_params)} {name} ({_size(b)})" for name, n, b in self.by_type]
        scales = [f"scales {_size(self.scale_bytes)}"] if self.scale_bytes else []
        return f"{_count(self.num_params)} params: {', '.join(parts + scales)}"


@dataclass(frozen=True)
class EngineSummary:
    """What an engine runs (see the module docstring)."""

    dtype: str  # the model's compute (activation) dtype
    weights: str  # how the weights are stored: "float32", "int8", "int4", "fp8", or several joined by "+"
    params: StoredParams
    kv_dtype: str
    speculative: str  # "off", or "ngram, 4 tokens" / "draft, 3 tokens"
    tensor_parallel_size: int
    data_parallel_size: int
    max_model_len: int
    sampling_defaults: str  # `SamplingDefaults.describe()`
    kv_host_bytes: int | None = None  # the host tier's budget (`CacheConfig.kv_host_memory_bytes`), None: none
    kv_disk_bytes: int | None = None  # the disk tier's (`CacheConfig.kv_disk_bytes`), None: none

    def lines(self) -> list[str]:
        """The summary as lines for a header or a log."""
        tier = "" if self.kv_host_bytes is None else f", host tier {self.kv_host_bytes / 2**20:.1f} MiB"
        tier += "" if self.kv_disk_bytes is None else f", disk tier {self.kv_disk_bytes / 2**30:.1f} GiB"
        return [f"{self.params.describe()}; compute {self.dtype}, weights {self.weights}, KV cache {self.kv_dtype}"
                f"{tier}",
                f"speculative decoding {self.speculative}; tensor parallel {self.tensor_parallel_size} x data "
                f"parallel {self.data_parallel_size}; context {self.max_model_len:,} tokens",
                f"sampling defaults: {self.sampling_defaults}"]

    def as_dict(self) -> dict:
        """JSON-ready fields (for `/v1/models`)."""
        return {"dtype": self.dtype, "weights": self.weights, "num_params": self.params.num_params,
                "param_bytes": self.params.nbytes,
                "params_by_type": {name: {"params": n, "bytes": b} for name, n, b in self.params.by_type},
                "kv_cache_dtype": self.kv_dtype, "kv_host_tier_bytes": self.kv_host_bytes,
                "kv_disk_tier_bytes": self.kv_disk_bytes,
                "speculative": self.speculative,
                "tensor_parallel_size": self.tensor_parallel_size, "data_parallel_size": self.data_parallel_size,
                "sampling_defaults": self.sampling_defaults}


def summarize(engine) -> EngineSummary:
    """An `LLMEngine`'s (or a `DataParallelEngine`'s: its first replica's, with the replicas counted) summary."""
    replicas = getattr(engine, "replicas", None)
    one = replicas[0] if replicas else engine
    params = StoredParams.of(one.runner.params)
    quantized = [name for name, _, _ in params.by_type if name in ("int8", "int4", "fp8")]
    spec = one.config.speculative_config
    stats = one.stats()
    return EngineSummary(
        dtype=str(one.model_spec.dtype), weights="+".join(quantized) if quantized else params.by_type[0][0],
        params=params, kv_dtype=stats.kv_dtype,
        speculative="off" if spec is None else f"{spec.method}, {spec.num_speculative_tokens} tokens",
        tensor_parallel_size=stats.tensor_parallel_size, data_parallel_size=len(replicas) if replicas else 1,
        max_model_len=one.scheduler_config.max_model_len, sampling_defaults=one.config.sampling_defaults.describe(),
        kv_host_bytes=one.cache_config.kv_host_memory_bytes, kv_disk_bytes=one.cache_config.kv_disk_bytes)
