"""A step's adapter slots among its padded inputs: one per token (ragged) or per row (fused decode), padding on
slot 0, and carried when a step is padded further to a bigger program (a stand-in)."""

from __future__ import annotations

import numpy as np

from pagedjax.device.sampling import SamplingMetadata
from pagedjax.runner.inputs import pad_fused_decode, pad_step
from pagedjax.runner.shapes import loop_shape, repad_fused_decode, repad_step, step_shape


def _sampling(n):
    return SamplingMetadata.from_lists([0.0] * n, [0] * n, [1.0] * n, [0] * n, [0] * n)


def test_ragged_step_slots_pad_with_zero_and_survive_repadding():
    # Two sequences: 3 prefill tokens under slot 2, 1 decode token under slot 1.
    step = pad_step(token_ids=np.arange(4, dtype=np.int32), positions=np.array([0, 1, 2, 5], np.int32),
                    slot_mapping=np.arange(4, dtype=np.int32), block_tables=np.zeros((2, 1), np.int32),
                    kv_lens=np.array([3, 6], np.int32), cu_q_lens=np.array([0, 3, 4], np.int32),
                    sampling=_sampling(2), lora_slots=np.array([2, 2, 2, 1], np.int32))
    assert len(step.lora_slots) == len(step.token_ids) == 16
    np.testing.assert_array_equal(step.lora_slots[:4], [2, 2, 2, 1])
    assert not step.lora_slots[4:].any()
    bigger = step_shape(step)._replace(tokens=32, tables=(4, 4))
    wider = repad_step(step, bigger, vocab_size=11)
    assert len(wider.lora_slots) == 32 and list(wider.lora_slots[:4]) == [2, 2, 2, 1] and not wider.lora_slots[4:].any()


def test_fused_decode_slots_are_per_row():
    decode = pad_fused_decode(tokens=np.array([1, 2, 3], np.int32), block_tables=np.zeros((3, 2), np.int32),
                              seq_lens=np.array([4, 5, 6], np.int32), lent_blocks=np.zeros(0, np.int32),
                              sampling=_sampling(3), stop_ids=[[], [], []], max_new=np.array([2, 2, 2], np.int32),
                              num_steps=2, block_size=4, lora_slots=[0, 3, 1])
    np.testing.assert_array_equal(decode.lora_slots, [0, 3, 1, 0])
    shape = loop_shape(decode)
    wider = repad_fused_decode(decode, shape._replace(tables=(8, shape.tables[1])), vocab_size=11)
    np.testing.assert_array_equal(wider.lora_slots, [0, 3, 1, 0, 0, 0, 0, 0])
