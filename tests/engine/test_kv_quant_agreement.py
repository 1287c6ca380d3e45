"""How often the bundled model's greedy choice with an 8-bit KV cache equals its choice with the unquantized
cache: at every position of a set of code prompts (teacher forcing: one prefill each, prompt log-probabilities),
the top-1 next token of the int8 / fp8 engine against the float32 engine's.

The bounds are the agreement measured when this test was written (JAX 0.10.2, 301 positions: int8 301 / 301 =
100%, fp8 289 / 301 = 96.0%) less a margin of two percentage points (6 positions) for rounding differences
between JAX versions and machines; they are not tuned to pass. `scripts/kv_quant_agreement.py` measures
free-running greedy completions too (docs/quantization.md).
"""

from __future__ import annotations

import functools

import pytest

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
from pagedjax.cli.prompts import DEMO_PREFIX, DEMO_SUFFIXES

TEXTS = [DEMO_PREFIX + s for s in DEMO_SUFFIXES]
MEASURED = {"int8": 301 / 301, "fp8": 289 / 301}
MARGIN = 0.02  # two percentage points


@functools.cache
def top1(kv_dtype: str) -> list[int]:
    """The top-1 next token at every position of every text but the last (texts in order)."""
    engine = LLMEngine.from_pretrained(cache_config=CacheConfig(block_size=16, num_blocks=256, kv_dtype=kv_dtype),
                                       scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048,
                                                                        max_model_len=1024), backend="xla")
    outs = engine.generate(TEXTS, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0), use_tqdm=False)
    return [lp.top[0][0] for out in outs for lp in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_greedy_choice_agrees_with_the_unquantized_cache(kv_dtype):
    base, quant = top1("auto"), top1(kv_dtype)
    assert len(base) == len(quant) == 301
    agreement = sum(a == b for a, b in zip(base, quant, strict=True)) / len(base)
    print(f"{kv_dtype}: {agreement:.4f} of {len(base)} positions")
    assert agreement >= MEASURED[kv_dtype] - MARGIN
