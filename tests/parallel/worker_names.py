"""Which checks of `tests/parallel/worker.py` run by default (CI budget) and which only with `-m slow`."""

FAST = [
    "logits_and_shardings",
    "kv_pool_sized_per_device",
    "int8_kv_tensor_parallel",
    "data_parallel_2x2",
    "pallas_under_shard_map",
    "sinks_tensor_parallel",  # attention sinks split as the query heads, at tp 2 and 4 (past the KV heads)
    # window and global layers: a block table per KV cache group, at tp 2 (GQA's KV heads split), through prefix hits,
    # preemption, chunked prefill and fused decode
    "kv_groups_tensor_parallel",
    "steps_export_for_cuda_on_4_devices",
    "orbax_checkpoint_loads_into_shards",
    "qk_norms_tensor_parallel",
    "moe_expert_parallel",  # expert weights sharded by expert over tp
    "latent_layers_tensor_parallel",  # MLA / DSA: query heads split, latent pages replicated
    "lora_tensor_parallel",  # LoRA stacks split as their linears, at tp 2
    "pooling_tensor_and_data_parallel",  # embeddings (and an encoder's) sharded as one device's
]
SLOW = [
        # (CI time: ~11 s) kv_groups_tensor_parallel runs the same flows at tp 2 with GQA's KV heads split (blocks
        # of 8); the newest-JAX pass runs this one
        "greedy_gqa_tp2_block16",
        "cli_tensor_parallel", "greedy_mha_tp8_block16", "greedy_gqa_tp8_block16", "greedy_mha_tp2_block8",
        "greedy_mqa_tp4_block8", "greedy_mha_tp4_block8", "greedy_gqa_tp2_block8", "greedy_mqa_tp8_block8",
        "int8_kv_greedy_tp4", "bring_your_own_model_dp2", "update_weights_tp2", "update_weights_dp2",
        "quantized_tensor_parallel",
        "quantized_moe_expert_parallel",  # (CI time) moe_expert_parallel shards float experts the same way
        # (CI time) moe_expert_parallel and sinks_tensor_parallel split what gpt-oss adds (biases, sinks) the same way
        "gpt_oss_tensor_parallel",
        "greedy_gqa_tp1_block8",  # tp 1 through a one-device mesh
        "greedy_mqa_tp2_block8",  # (CI time) MQA runs at tp 8, tp 2 with GQA
        "cli_data_parallel",  # (CI time) data_parallel_2x2 runs the engine's
        "hf_checkpoint_loads_into_shards",  # (CI time) orbax_checkpoint_loads_into_shards runs the sharded restore
        "speculative_ngram_tp2",  # (CI time) the verifying step is the ragged step every tp check runs
        # (CI time) the draft's runner is the target's (ModelRunner) on the same mesh; the refusal of a draft whose
        # heads do not split runs by default (tests/engine/test_draft.py)
        "speculative_draft_tp2",
        "lora_greedy_tp4",  # (CI time) lora_tensor_parallel runs tp 2 and checks tp 4's shardings
        # (CI time) tp > num_kv_heads: greedy_mqa_tp8_block16 runs replicated KV heads through the same paths
        # (prefix hits, preemption, fused decode), logits_and_shardings GQA's replicated layout at tp 4
        "greedy_gqa_tp4_block8",
        # (CI time) a vision-language model: its tower and encoder cache replicated (shardings of no kind of their
        # own), its decoder split as every greedy check's
        "images_tensor_parallel",
        # (CI time: ~8 s of compiling) data_parallel_2x2 runs the replicas, tests/engine/test_programs.py the warm-up
        "data_parallel_warmup",
        # (CI time) tests/engine/test_host_tier.py runs the tier's moves on one device; GSPMD splits them here
        "host_tier_tensor_parallel",
        # (CI time) data_parallel_2x2 spreads requests over the replicas the same way; beam search's own tests run
        # on one device (tests/engine/test_beam_search_structured.py)
        "beam_search_data_parallel",
        # (CI time) latent_layers_tensor_parallel runs the same MLA layers (and checks their shardings) with V3.2's
        # indexer on
        "mla_tensor_parallel",
        # (CI time) latent_layers_tensor_parallel runs the sparse layers; tests/model/test_hf_glm_moe_dsa.py the shared
        # layer on one device
        "glm5_tensor_parallel",
        # (CI time: ~50 s on 2 cores, two hybrid models' sharded programs) the linear layers and the state pool split
        # by heads; tests/parallel/test_parallel_config.py checks their partition rules and refusals
        "hybrid_tensor_parallel",
        "qwen3_5_tensor_parallel",  # (CI time: ~25 s) hybrid_tensor_parallel runs the same core with Qwen3-Next's
        # (CI time: ~60 s, interpreted kernels) pallas_under_shard_map runs the Pallas path under shard_map
        "hybrid_pallas_under_shard_map",
        # (CI time) kv_groups_tensor_parallel runs prefix hits, preemption and fused decode under shard_map;
        # logits_and_shardings the replicated KV heads of MQA at tp 8, its logits equal to one device's
        "greedy_mqa_tp8_block16",
        # (CI time) latent_layers_tensor_parallel runs a model of the contract (DeepSeek) sharded by its own
        # param_partition at tp 2; test_bring_your_own_model.py runs the example on one device
        "bring_your_own_model_tp2",
        # (CI time: ~45 s) DeepSeek V4's attention split by query heads over whole copies of its pages, as
        # latent_layers_tensor_parallel runs MLA; test_hf_deepseek_v4.py checks its partition rules and refusal
        "deepseek_v4_tensor_parallel"]
# CI's newest-JAX pass (PAGEDJAX_PARALLEL_CHECKS=newest): what differs by JAX version (shard_map, shardings of
# every kind of weight and of 8-bit pages, Pallas under shard_map, export, orbax's sharded restore), once each.
# (CI time) One greedy run: greedy_gqa_tp2_block16's fused decode, prefix hits and preemption under shard_map;
# logits_and_shardings runs the replicated KV heads of MQA at tp 8 (greedy_mqa_tp8_block16's layout).
NEWEST = ["greedy_gqa_tp2_block16", "logits_and_shardings", "int8_kv_tensor_parallel", "pallas_under_shard_map",
          "steps_export_for_cuda_on_4_devices", "orbax_checkpoint_loads_into_shards"]
