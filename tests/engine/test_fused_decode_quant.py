"""The fused decode (`runner._fused_decode_loop`) of a model with quantized weights computes their conversions
inside the loop, as a single step does: the compiled program holds no float copy of a quantized kernel outside
its `while` (XLA's loop-invariant code motion hoisted every kernel's conversion there, a float copy of the
weights before the first iteration that every iteration then read: int8 decode of the 156M shape at batch 1 ran
at 0.4x the single step's speed, int4 at 0.07x)."""

from __future__ import annotations

import math
import re

import pytest
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.moe import MoEConfig
from pagedjax.config.quant import QuantConfig

# Kernel sizes (64 x 64, 64 x 32, 64 x 128, their int4 planes, 4 experts of 64 x 32) none of which is a KV
# layer's (10 blocks x 4 tokens x 2 heads x 16 = 1280 values): the check below tells arrays apart by size.
CFG = ModelConfig(vocab_size=96, hidden_size=64, num_layers=1, num_q_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate_size=128, tie_word_embeddings=False)
MOE = CFG.replace(moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=32))
# An instruction of the entry computation: its name, element type, dimensions and opcode.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* ([\w-]+)\(", re.M)
_FLOATS = ("f32", "bf16", "f16")


def _kernel_sizes(params: nnx.State) -> set[int]:
    """Element counts of every float form of each quantized kernel of `params`: one expert's or linear's `[out,
    in]`, int4's nibble planes (`[out, in // 2]` each) and, for stacked experts, all of them at once."""
    sizes = set()
    for path, var in nnx.to_flat_state(params):
        if str(path[-1]) != "qweight":
            continue
        for q in (var.get_value() if isinstance(var.get_value(), tuple) else (var.get_value(),)):
            unpacked = 2 if q.dtype.name == "uint8" else 1
            sizes |= {math.prod(q.shape[-2:]), unpacked * math.prod(q.shape[-2:]), unpacked * q.size}
    return sizes


# The default run proves the one-row products of the stored bytes (int8) and of nibble planes (int4), `-m slow`
# fp8's conversion and quantized experts.
_slow = pytest.mark.slow


@pytest.mark.parametrize("cfg, quant", [(CFG, "int8"), (CFG, "int4:32"), pytest.param(CFG, "fp8", marks=_slow),
                                        pytest.param(MOE, "int8", marks=_slow)],
                         ids=["int8", "int4:32", "fp8", "moe-int8"])
def test_the_fused_decode_converts_quantized_kernels_inside_its_loop(cfg, quant):
    engine = LLMEngine(model_config=cfg.replace(quantization=QuantConfig.parse(quant)),
                       cache_config=CacheConfig(block_size=4, num_blocks=10),
                       scheduler_config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=16),
                       seed=0, decode_steps_per_call=4)
    # Two sequences decode together (several rows: each kernel converted for its dot), then one alone (one row:
    # int8 and int4 read the stored bytes in a fused matrix-vector product, fp8 converts).
    engine.generate([[5, 9, 2], [3, 1]], [SamplingParams(temperature=0.0, max_tokens=n) for n in (3, 9)],
                    use_tqdm=False)
    sizes = _kernel_sizes(engine.runner.params)
    kv = {math.prod(x.shape) for layer in engine.runner.kv_cache.layers for x in layer if x is not None}
    assert sizes and not sizes & kv  # the shapes above keep kernels and KV pages apart
    loops = {key.tables[0]: exe.as_text() for key, exe in engine.runner.programs.executables.items()
             if key[0] == "decode_loop"}
    assert sorted(loops) == [1, 2]
    for rows, text in loops.items():
        entry = text.split("\nENTRY")[1].split("\n}")[0]  # outside the loop: the loop is its `while`
        assert " while(" in entry, rows
        copies = [f"{name} = {dtype}[{dims}] {op}" for name, dtype, dims, op in _INSTRUCTION.findall(entry)
                  if dtype in _FLOATS and op != "parameter"
                  and math.prod(int(d) for d in dims.split(",") if d) in sizes]
        assert not copies, (rows, copies)
