"""Every frozen configuration of pagedjax, in one tier (plain Python, no JAX: the host side imports it too).

  model.py        ModelSpec (what the engine needs of any model), ModelConfig (the built-in decoders' shape)
  cache.py        CacheConfig: the paged KV pool (block size, blocks or bytes, KV dtype, prefix caching)
  kv_spec.py      KVCacheSpec and its kinds FullAttention, LatentAttention, IndexedSparse: what one layer's KV cache
                  holds and how its blocks are treated (ModelSpec.kv_layers)
  kv_layout.py    KV cache groups: layers of equal specs share a block table; the page arrays backing them
  scheduler.py    SchedulerConfig: token budget, sequences per step, context length, chunked prefill
  parallel.py     ParallelConfig: tensor / data parallelism
  quant.py        QuantConfig: weight-only quantized linears and experts
  moe.py          MoEConfig: mixture-of-experts routing and its computation
  multimodal.py   ImageSpec: a model's image placeholders (ModelSpec.images)
  vision.py       VisionConfig, LlavaConfig, Gemma3VisionConfig: the vision-language models (an image encoder, a
                  projector, a ModelConfig language model)
  deepseek.py     DeepSeekConfig, DeepSeekMoEConfig, DeepSeekIndexerConfig: the DeepSeek V2 / V3 / V3.2 family (MLA,
                  YaRN, DeepSeek's routers, V3.2's sparse-attention indexer)
  speculative.py  SpeculativeConfig: speculative decoding's method and proposal length
  lora.py         LoRAConfig: multi-LoRA serving's device slots, rank and host cache
  structured.py   StructuredLimits: what an output constraint may ask of the grammar compiler
  sampling.py     SamplingDefaults: what a request's sampling fields left unset become (generation_config.json)
  pooling.py      PoolingDefaults: how a model pools embeddings (a sentence-transformers folder's modules)
  engine.py       EngineConfig: every engine option (the component configs, backend, fused decode steps, ...)
  fields.py       the field checks every config uses (TypeError / ValueError naming the field)
"""

from pagedjax.config.cache import KV_DTYPES, CacheConfig, kv_cache_bytes
from pagedjax.config.deepseek import DeepSeekConfig, DeepSeekIndexerConfig, DeepSeekMoEConfig
from pagedjax.config.engine import EngineConfig
from pagedjax.config.kv_spec import FullAttention, IndexedSparse, KVCacheSpec, KVLayerSpec, LatentAttention
from pagedjax.config.lora import LoRAConfig
from pagedjax.config.model import ModelConfig, ModelSpec
from pagedjax.config.moe import MoEConfig
from pagedjax.config.multimodal import ImageSpec
from pagedjax.config.parallel import ParallelConfig
from pagedjax.config.pooling import PoolingDefaults
from pagedjax.config.quant import QuantConfig
from pagedjax.config.sampling import SamplingDefaults
from pagedjax.config.scheduler import SchedulerConfig
from pagedjax.config.speculative import SpeculativeConfig
from pagedjax.config.structured import StructuredLimits

__all__ = ["KV_DTYPES", "CacheConfig", "DeepSeekConfig", "DeepSeekIndexerConfig", "DeepSeekMoEConfig", "EngineConfig",
           "FullAttention", "ImageSpec", "IndexedSparse", "KVCacheSpec", "KVLayerSpec", "LatentAttention", "LoRAConfig",
           "ModelConfig", "ModelSpec", "MoEConfig", "ParallelConfig", "PoolingDefaults", "QuantConfig",
           "SamplingDefaults", "SchedulerConfig", "SpeculativeConfig", "StructuredLimits", "kv_cache_bytes"]
