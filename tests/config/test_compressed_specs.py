"""DeepSeek V4's KV cache specs and configuration (plain Python): what each spec stores and in which pool, its
bytes, the blocks a sequence holds in a pool sized by sequences, and every field check naming what is wrong."""

from __future__ import annotations

import pytest

from pagedjax.config import CacheConfig
from pagedjax.config.deepseek_v4 import CSA, HCA, SLIDING, DeepSeekV4Config
from pagedjax.config.kv_spec import CompressedEntries, CompressorState, SharedKVWindow

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, head_dim=16, rope_dim=8, q_lora_rank=16,
              o_groups=2, o_lora_rank=8, sliding_window=6, layer_types=(SLIDING, CSA, HCA),
              mlp_layer_types=("hash_moe", "moe", "moe"), csa_rate=2, hca_rate=4, index_n_heads=4, index_head_dim=8,
              index_topk=3, hc_mult=2, hc_sinkhorn_iters=5, hc_eps=1e-6, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=16, n_shared_experts=1, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
              swiglu_limit=10.0, rope_theta=100.0, compress_rope_theta=1000.0)


def test_pages_bytes_and_pools():
    window, entries = SharedKVWindow(512, 128), CompressedEntries(512, 4, 128)
    hca, state = CompressedEntries(512, 128), CompressorState(512, True, 128)
    assert (window.pool, entries.pool, state.pool) == ("window", "kv", "state")
    assert window.page_shapes(10, 256, "bfloat16").pages.shape == (10, 256, 512)
    shapes = entries.page_shapes(10, 256, "bfloat16")
    assert (shapes.entries.shape, shapes.index_keys.shape) == ((10, 64, 512), (10, 64, 128))
    assert hca.page_shapes(10, 256, "bfloat16").index_keys is None
    assert entries.bytes_per_block(256, 2) == 64 * 640 * 2 and hca.bytes_per_block(256, 2) == 2 * 512 * 2
    assert entries.bytes_per_token(2) == 320 and entries.tokens_per_entry == 4
    assert state.page_shapes(10, 256, "bfloat16").compressor.shape == (10, 3, 3, 512)  # float32 whatever the KV's
    assert CompressorState(512, False).page_shapes(10, 256, "float32").indexer is None
    assert state.bytes_per_block(256, 2) == 4 * 3 * 3 * 640 and state.bytes_per_token(2) == 0
    # Blocks a running sequence holds: the window's (p - W, p], one snapshot.
    assert (window.blocks_held(256), SharedKVWindow(512, 128).blocks_held(16), state.blocks_held(16)) == (2, 9, 1)
    assert (window.release_window, entries.release_window, state.release_window) == (128, None, 2)


def test_pools_sized_by_sequences():
    """The window and state pools: twice the blocks the running sequences hold (their blocks_held plus a step's);
    `num_state_blocks` sets both."""
    spec = DeepSeekV4Config(**CONFIG).spec
    assert spec.kv_layout.pools == ("kv", "window", "state")
    cache = CacheConfig(block_size=4, num_blocks=32, state_block_size=8)
    assert cache.resolve_pool_block_sizes(spec) == (4, 4, 8)  # windows in KV-sized blocks; snapshots every 8
    held = SharedKVWindow(16, 6).blocks_held(4)  # 3
    assert cache.resolve_state_blocks(spec, 2, 8) == (2 * (2 * (held + 1) + 2), 2 * (2 * 2 + 1))
    assert CacheConfig(block_size=4, num_blocks=32, num_state_blocks=5).resolve_state_blocks(spec, 2, 8) == (5, 5)


@pytest.mark.parametrize("spec, match", [
    (lambda: SharedKVWindow(0, 4), "SharedKVWindow.head_dim"),
    (lambda: CompressedEntries(16, 0), "CompressedEntries.compress_rate"),
    (lambda: CompressedEntries(16, 4, 0), "CompressedEntries.index_head_dim"),
    (lambda: CompressorState(16, 1), "CompressorState.overlap must be a bool"),
])
def test_spec_fields_are_checked(spec, match):
    with pytest.raises((TypeError, ValueError), match=match):
        spec()


def test_8bit_pages_and_whole_entries_are_refused_by_name():
    with pytest.raises(ValueError, match="not stored 8-bit"):
        SharedKVWindow(16, 4).page_shapes(4, 8, "int8", quantized=True)
    with pytest.raises(ValueError, match="block_size 6 must be a multiple of the compress rate 4"):
        CompressedEntries(16, 4).page_shapes(4, 6, "float32")


@pytest.mark.parametrize("changes, match", [
    (dict(rope_dim=7), "rope_dim must be even"),
    (dict(rope_dim=32), "DeepSeekV4Config.rope_dim"),
    (dict(o_groups=3), "o_groups"),
    (dict(layer_types=(SLIDING, CSA)), "layer_types has 2 entries for 3 layers"),
    (dict(layer_types=(SLIDING, CSA, "full_attention")), "layer_types"),
    (dict(mlp_layer_types=("moe", "moe", "dense")), "mlp_layer_types"),
    (dict(scoring_func="relu"), "scoring_func"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(hc_eps=-1.0), "hc_eps"),
])
def test_config_fields_are_checked(changes, match):
    with pytest.raises((TypeError, ValueError), match=match):
        DeepSeekV4Config(**{**CONFIG, **changes})


def test_the_block_size_must_hold_whole_entries_of_every_rate():
    spec = DeepSeekV4Config(**{**CONFIG, "hca_rate": 128}).spec
    assert spec.block_multiple == 128 and SharedKVWindow(16, 4).block_multiple == 1


def test_kv_layers_in_order():
    """Windows first (layer i is KV layer i), then the compressed layers' entries, then their states."""
    cfg = DeepSeekV4Config(**CONFIG)
    assert [cfg.kv_index(i) for i in range(3)] == [(0, None, None), (1, 3, 5), (2, 4, 6)]
    assert [cfg.rate(i) for i in range(3)] == [None, 2, 4] and cfg.compressed_layers == (1, 2)
