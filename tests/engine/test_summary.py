"""What an engine runs, said one way (issue 42, point 7: the CLI header said "float32" under --quantization int8,
parameter counts moved with the scales, nothing named the speculative method or tp/dp): `StoredParams` counts
parameters by storage, a quantized weight by its logical parameters and its scales apart; `summarize` reads
what is on from the engine."""

from __future__ import annotations

import numpy as np

from pagedjax import CacheConfig, LLMEngine, SpeculativeConfig
from pagedjax.engine.summary import StoredParams, summarize


def test_parameters_are_counted_by_storage_and_scales_are_not_parameters():
    state = {"embed": {"embedding": np.zeros((100, 8), np.float32)},
             "q": {"qweight": np.zeros((16, 4), np.uint8), "scale": np.zeros((16, 2), np.float32)},  # int4, packed
             "k": {"qweight": np.zeros((16, 8), np.int8), "scale": np.zeros((16,), np.float32)},
             "norm": {"scale": np.zeros((8,), np.float32)}}  # a "scale" that is no quantization scale
    stored = StoredParams.of(state)
    assert stored.by_type == (("float32", 808, 3232), ("int8", 128, 128), ("int4", 128, 64))
    assert stored.scale_bytes == 4 * (32 + 16) and stored.num_params == 808 + 256
    assert stored.nbytes == 3232 + 128 + 64 + 192
    assert stored.describe() == ("1.06 K params: 0.81 K float32 (3.2 KiB), 0.13 K int8 (128 B), 0.13 K int4 (64 B), "
                                 "scales 192 B")
    plain = StoredParams.of({"w": np.zeros((1000, 1000), np.float32)})
    assert plain.describe() == "1.00 M params, 3.8 MiB float32"


def test_the_summary_says_what_the_engine_runs():
    plain = LLMEngine.from_pretrained(None, cache_config=CacheConfig(num_blocks=16), compile_cache=False)
    quantized = LLMEngine.from_pretrained(None, cache_config=CacheConfig(num_blocks=16, kv_dtype="int8"),
                                          compile_cache=False, quantization="int8",
                                          speculative_config=SpeculativeConfig(method="ngram",
                                                                               num_speculative_tokens=3))
    a, b = summarize(plain), summarize(quantized)
    assert (a.dtype, a.weights, a.kv_dtype, a.speculative) == ("float32", "float32", "float32", "off")
    assert (b.dtype, b.weights, b.kv_dtype, b.speculative) == ("float32", "int8", "int8", "ngram, 3 tokens")
    assert a.params.num_params == b.params.num_params == 2_361_600  # the checkpoint's count, scales apart
    assert b.params.scale_bytes > 0 and dict((t, n) for t, n, _ in b.params.by_type)["int8"] > 0
    assert (a.tensor_parallel_size, a.data_parallel_size) == (1, 1)
    assert "temperature 0.8, top_p 0.95" in a.sampling_defaults
    assert a.lines()[0] == "2.36 M params, 9.0 MiB float32; compute float32, weights float32, KV cache float32"
