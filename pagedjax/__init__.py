"""pagedjax: a JAX/Pallas LLM inference engine built on PagedAttention.

The engine's public names are imported lazily so that the host-side core (`pagedjax.core`, plain Python
and numpy) can be used without importing JAX.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "LLMEngine": "pagedjax.engine.llm_engine",
    "DataParallelEngine": "pagedjax.engine.data_parallel",
    "Engine": "pagedjax.engine.protocol",
    "make_engine": "pagedjax.engine.factory",
    "load_engine": "pagedjax.engine.factory",
    "SamplingParams": "pagedjax.sampling_params",
    "StructuredOutput": "pagedjax.sampling_params",
    "BeamSearchParams": "pagedjax.sampling_params",
    "LoRARequest": "pagedjax.sampling_params",
    "PoolingParams": "pagedjax.pooling_params",
    "LoRAConfig": "pagedjax.config",
    "RequestOutput": "pagedjax.outputs",
    "CompletionOutput": "pagedjax.outputs",
    "TokenLogprobs": "pagedjax.outputs",
    "BeamSearchOutput": "pagedjax.outputs",
    "BeamSequence": "pagedjax.outputs",
    "EmbeddingRequestOutput": "pagedjax.outputs",
    "EmbeddingOutput": "pagedjax.outputs",
    "ClassificationRequestOutput": "pagedjax.outputs",
    "ClassificationOutput": "pagedjax.outputs",
    "ScoringRequestOutput": "pagedjax.outputs",
    "ScoringOutput": "pagedjax.outputs",
    "ModelRegistry": "pagedjax.model.registry",
    "ModelConfig": "pagedjax.config",
    "ModelSpec": "pagedjax.config",
    "CacheConfig": "pagedjax.config",
    "KVCacheSpec": "pagedjax.config",
    "FullAttention": "pagedjax.config",
    "LatentAttention": "pagedjax.config",
    "IndexedSparse": "pagedjax.config",
    "ImageSpec": "pagedjax.config",
    "DeepSeekConfig": "pagedjax.config",
    "SchedulerConfig": "pagedjax.config",
    "SpeculativeConfig": "pagedjax.config",
    "ParallelConfig": "pagedjax.config",
    "QuantConfig": "pagedjax.config",
    "MoEConfig": "pagedjax.config",
    "EngineConfig": "pagedjax.config",
    "SamplingDefaults": "pagedjax.config",
    "PoolingDefaults": "pagedjax.config",
    "kv_cache_bytes": "pagedjax.config",
    "InvalidRequest": "pagedjax.errors",
    "InvalidType": "pagedjax.errors",
    "ContextLengthExceeded": "pagedjax.errors",
    "UnsupportedFeature": "pagedjax.errors",
    "InvalidConstraint": "pagedjax.errors",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedjax' has no attribute {name!r}")
