"""A step verifying speculative proposals pads its tokens and sampled rows to `inputs.fine_bucket` (at most 25%
more), not to a power of two: 1 + k = 5 tokens of batch 1 run as 5, not 8. The padding changes the step's cost, not
its results: the logits of every verified position are the dense model's, and those of the power-of-two program."""

from __future__ import annotations

import numpy as np
import pytest

from pagedjax import ModelConfig
from pagedjax.device.sampling import SamplingMetadata
from pagedjax.model.llama import init_model
from pagedjax.runner.inputs import bucket, fine_bucket, pad_step
from pagedjax.runner.runner import ModelRunner, cpu_compiler_options
from pagedjax.runner.shapes import repad_step, step_shape
from tests.dense import dense_forward

# hidden 1024 float32: the runner compiles its few-row steps with XLA's own dots (`cpu_compiler_options`), the
# dots a verifying step of the 156M shape runs on the CPU; one layer and 96 words keep it fast.
BIG = ModelConfig(vocab_size=96, hidden_size=1024, num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=128,
                  intermediate_size=1024)
BLOCK = 16


def test_fine_bucket_sizes():
    assert [fine_bucket(n) for n in range(1, 18)] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 10, 12, 12, 14, 14, 16, 16, 20]
    assert [fine_bucket(n) for n in (0, 33, 40, 41, 80, 81)] == [1, 40, 40, 48, 80, 96]
    sizes = [fine_bucket(n) for n in range(1, 4097)]
    for n, size in enumerate(sizes, 1):
        assert n <= size <= max(8, 1.25 * n) and size <= bucket(n)  # never more padding than a power of two
        assert fine_bucket(size) == size  # a padded step keeps its size
    assert sizes == sorted(sizes)


def _step(num_tokens: int, context: int, rows: int | None, first_token: int = 1, seqs: int = 1):
    """Inputs of a step of `seqs` sequences of `num_tokens` tokens each after `context` cached ones; `rows`: every
    token sampled (a verifying step), None: one row per sequence (its last token, a prefill's step)."""
    blocks = -(-(context + num_tokens) // BLOCK)
    tables = np.arange(seqs * blocks, dtype=np.int32).reshape(seqs, blocks)  # i32[S, B]
    positions = np.tile(np.arange(context, context + num_tokens, dtype=np.int32), seqs)  # i32[T]
    seq = np.repeat(np.arange(seqs), num_tokens)  # i32[T]
    slots = (tables[seq, positions // BLOCK] * BLOCK + positions % BLOCK).astype(np.int32)  # i32[T]
    n = seqs * num_tokens if rows else seqs
    return pad_step(token_ids=(first_token + np.arange(seqs * num_tokens, dtype=np.int32)) % BIG.vocab_size,
                    positions=positions, slot_mapping=slots, block_tables=tables,
                    kv_lens=np.full(seqs, context + num_tokens, np.int32),
                    cu_q_lens=np.arange(seqs + 1, dtype=np.int32) * num_tokens,
                    sampling=SamplingMetadata.from_lists([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n),
                    logits_indices=np.arange(n, dtype=np.int32) if rows else None)


@pytest.mark.parametrize("seqs, per_seq, tokens, rows, sequences", [
    (1, 5, 5, 5, 1),  # batch 1, k = 4: as it is, not 8
    (1, 3, 3, 3, 1),
    (2, 5, 10, 10, 2),  # not 16
    (8, 5, 40, 40, 8),  # not 64
    (5, 1, 8, 8, 5),  # one row per sequence: tokens and rows at least the sequences' bucket
])
def test_a_verifying_step_pads_to_fine_buckets(seqs, per_seq, tokens, rows, sequences):
    inputs = _step(per_seq, 16, rows=True, seqs=seqs)
    assert (len(inputs.token_ids), len(inputs.logits_indices), inputs.meta.kv_lens.shape[0]) == (
        tokens, rows, bucket(sequences))


def test_a_prefill_step_still_pads_to_a_power_of_two_from_16():
    inputs = _step(5, 0, rows=None)
    assert (len(inputs.token_ids), len(inputs.logits_indices)) == (16, 1)


def test_the_verifying_step_of_5_rows_gives_the_dense_logits_and_those_of_8_rows():
    """A context of 11 tokens prefilled, then 5 tokens verified: the runner's 5-row program (its few-row dots, as the
    156M shape's) and the same step padded to 8 tokens and rows, as before, against the dense model."""
    assert cpu_compiler_options(BIG, 5) is not None  # the dots a verifying step of a big float32 model runs
    runner = ModelRunner(init_model(BIG, seed=3), 8, BLOCK, backend="xla", compile_in_background=False)
    context = _step(11, 0, rows=None, first_token=7)
    runner.execute(context)
    verify = _step(5, 11, rows=True, first_token=18)
    assert (len(verify.token_ids), len(verify.logits_indices)) == (5, 5)
    fine = runner.execute(verify, return_logits=True)
    padded = repad_step(verify, step_shape(verify)._replace(tokens=8, rows=8), BIG.vocab_size)
    assert (len(padded.token_ids), len(padded.logits_indices)) == (8, 8)
    before = runner.execute(padded, return_logits=True)  # rewrites the same 5 tokens' KV
    tokens = (7 + np.arange(16)) % BIG.vocab_size  # the context's 11 tokens, then the verified 5
    dense = np.asarray(dense_forward(BIG, 3)(tokens[None]))[0, 11:]  # f32[5, vocab]
    assert np.abs(dense).max() > 0.1  # logits worth comparing
    np.testing.assert_allclose(fine.logits, dense, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(fine.logits, before.logits[:5], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(fine.tokens, np.argmax(dense, -1))
    np.testing.assert_array_equal(fine.tokens, before.tokens[:5])
