"""XLA:CPU's dot library per compiled step: small-row steps of large float32 models use XLA's own dots instead
of YNNPACK (faster there: `runner.cpu_compiler_options`), and that changes nothing but speed."""

from __future__ import annotations

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.runner.runner import cpu_compiler_options
from tests.dense import dense_greedy

BIG = ModelConfig(vocab_size=96, hidden_size=1024, num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128,
                  intermediate_size=1024)


def test_the_rule():
    assert cpu_compiler_options(BIG, 1) == cpu_compiler_options(BIG, 16) == {
        "xla_cpu_experimental_ynn_fusion_type": ""}
    assert cpu_compiler_options(BIG, 32) is None  # prefill and big batches: YNNPACK is faster
    assert cpu_compiler_options(BIG.replace(dtype="bfloat16"), 1) is None  # 16-bit dots need YNNPACK
    assert cpu_compiler_options(BIG.replace(hidden_size=256), 1) is None  # small models: no measured gain
    for rows in (1, 16, 32):  # quantized linears: YNNPACK's dots, XLA's own loops 512 bits wide
        assert cpu_compiler_options(BIG, rows, quantized=True) == {"xla_cpu_prefer_vector_width": 512}


def test_steps_compile_with_their_dot_library_and_match_the_dense_model():
    engine = LLMEngine(model_config=BIG, cache_config=CacheConfig(block_size=16, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
                       seed=1, decode_steps_per_call=4)
    prompts = [[5, 9, 2, 7, 1], [3] * 40]  # a 45-token prefill step (YNNPACK), then decodes of 2 rows (Eigen)
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    texts = {key: exe.as_text() for key, exe in engine.runner.programs.executables.items()}
    assert any(k[0] == "step" and k[1] > 16 for k in texts) and any(k[0] == "decode_loop" for k in texts)
    for key, text in texts.items():
        rows = key[1] if key[0] == "step" else key[1][0]
        assert ("__ynn_fusion" in text) == (rows > 16), key  # the library each step was compiled for
    expected, margin = dense_greedy(BIG, 1, prompts, 6, 64)
    assert margin > 1e-3, margin
    assert [out.output_token_ids for out in outs] == expected
