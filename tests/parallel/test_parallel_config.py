"""ParallelConfig, the sharding rules and the failure paths, in this process (one CPU device is enough)."""

from __future__ import annotations

import logging

import jax
import pytest
from jax.sharding import PartitionSpec as P

from pagedjax import CacheConfig, FullAttention, LatentAttention, LLMEngine, ModelConfig, ModelSpec
from pagedjax.config.kv_spec import RecurrentState
from pagedjax.config.moe import MoEConfig
from pagedjax.parallel import ParallelConfig, replica_meshes
from pagedjax.parallel.sharding import default_param_partition, log_replicated, param_spec, per_device_model

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_q_heads=8, num_kv_heads=2, head_dim=16,
                  intermediate_size=64, tie_word_embeddings=False)


@pytest.mark.parametrize("field", ["tensor_parallel_size", "data_parallel_size"])
def test_sizes_are_checked(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        ParallelConfig(**{field: 0})
    with pytest.raises(TypeError, match=f"{field} must be an int"):
        ParallelConfig(**{field: True})
    assert ParallelConfig(tensor_parallel_size=4, data_parallel_size=2).world_size == 8


def test_heads_must_split():
    spec = lambda q, kv: ModelSpec(vocab_size=8, num_layers=2, num_q_heads=q, num_kv_heads=kv, head_dim=4)
    with pytest.raises(ValueError, match="must divide the model's 8 query heads"):
        ParallelConfig(tensor_parallel_size=3).check_model(spec(8, 2))
    with pytest.raises(ValueError, match="one must divide the other"):
        ParallelConfig(tensor_parallel_size=2).check_model(spec(6, 3))
    ParallelConfig(tensor_parallel_size=8).check_model(spec(8, 2))  # replicated KV heads: fine
    ParallelConfig(tensor_parallel_size=2).check_model(CFG)  # a ModelConfig is checked by the same fields
    latent = ModelSpec(vocab_size=8, num_layers=2, num_q_heads=8, kv_layers=(LatentAttention(16, 4),) * 2)
    ParallelConfig(tensor_parallel_size=2).check_model(latent)  # query heads split, latent pages whole
    with pytest.raises(ValueError, match="must divide the model's 8 query heads"):
        ParallelConfig(tensor_parallel_size=3).check_model(latent)
    mixed = latent.replace(kv_layers=(LatentAttention(16, 4), FullAttention(2, 4)))
    with pytest.raises(ValueError, match="mixes full-attention layers with latent ones"):
        ParallelConfig(tensor_parallel_size=2).check_model(mixed)
    # A hybrid of full attention and recurrent states (Qwen3-Next, Nemotron-H): both split by heads, evenly.
    hybrid = latent.replace(kv_layers=(RecurrentState((4, 8, 8), (48, 3)), FullAttention(2, 4)))
    ParallelConfig(tensor_parallel_size=2).check_model(hybrid)
    # A per-device memory budget counts one device's share of both: half the state heads and channels, KV heads.
    assert per_device_model(hybrid, 2).kv_layers == (RecurrentState((2, 8, 8), (24, 3)), FullAttention(1, 4))
    with pytest.raises(ValueError, match="must divide a recurrent layer's 4 state heads and 48 conv channels"):
        ParallelConfig(tensor_parallel_size=8).check_model(hybrid.replace(num_q_heads=8))
    with pytest.raises(ValueError, match="must divide the 2 KV heads of a model with recurrent-state layers"):
        ParallelConfig(tensor_parallel_size=4).check_model(hybrid)
    assert ParallelConfig(tensor_parallel_size=8).kv_heads_per_device(2) == 1
    assert ParallelConfig(tensor_parallel_size=8).kv_heads_stored(2) == 8
    assert ParallelConfig(tensor_parallel_size=2).kv_heads_per_device(8) == 4


def test_too_few_devices():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {2 * n} devices; {n} available"):
        replica_meshes(ParallelConfig(tensor_parallel_size=n, data_parallel_size=2))
    with pytest.raises(ValueError, match="needs"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=4),
                  parallel_config=ParallelConfig(tensor_parallel_size=8 * n))


def test_engine_refuses_bad_parallel_configs():
    with pytest.raises(TypeError, match="parallel_config must be a ParallelConfig"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=4), parallel_config={"tensor_parallel_size": 1})
    with pytest.raises(ValueError, match="query heads"):
        LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=4),
                  parallel_config=ParallelConfig(tensor_parallel_size=3))


def test_param_specs():
    """Column-parallel by outputs, row-parallel by inputs, vocabulary-sharded embedding and head; replicated
    where tp does not divide (k/v with tp > KV heads, an MLP width of 64 at tp 128), norms replicated."""
    spec = lambda *names, tp=4: param_spec(names, CFG, tp)  # noqa: E731
    assert spec("layers", 0, "self_attn", "q_proj", "kernel") == P(None, "tp")
    assert spec("layers", 0, "self_attn", "q_proj", "bias") == P("tp")
    assert spec("layers", 0, "self_attn", "k_proj", "kernel", tp=2) == P(None, "tp")
    assert spec("layers", 0, "self_attn", "k_proj", "kernel", tp=4) == P()  # 2 KV heads: replicated
    assert spec("layers", 0, "self_attn", "o_proj", "kernel") == P("tp", None)
    assert spec("layers", 0, "mlp", "gate_proj", "kernel") == P(None, "tp")
    assert spec("layers", 0, "mlp", "down_proj", "kernel") == P("tp", None)
    assert spec("layers", 0, "mlp", "down_proj", "kernel", tp=128) == P()
    assert spec("embed_tokens", "embedding") == P("tp", None)
    assert spec("lm_head", "kernel") == P(None, "tp")
    assert spec("layers", 0, "input_layernorm", "weight") == P()
    assert spec("layers", 0, "self_attn", "q_proj", "kernel", tp=1) == P()
    odd = CFG.replace(vocab_size=259)
    assert param_spec(("embed_tokens", "embedding"), odd, 2) == P()  # 259 rows do not split in two


def test_expert_param_specs(caplog):
    """Stacked expert weights `[E, ...]` split by expert where tp divides E (else replicated, and said);
    the router replicated; the default rule of other models' `experts` parameters alike."""
    moe = CFG.replace(moe=MoEConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=16))
    for leaf in ("gate_proj", "up_proj", "down_proj"):
        assert param_spec(("layers", 0, "mlp", "experts", leaf), moe, 4) == P("tp", None, None)
        assert param_spec(("layers", 0, "mlp", "experts", leaf), moe, 8) == P()
    assert param_spec(("layers", 0, "mlp", "gate", "kernel"), moe, 2) == P()
    names = ("blocks", 0, "ffn", "experts", "w_in")
    assert default_param_partition(names, (4, 32, 16), head_dim=16, tp=2) == P("tp", None, None)
    assert default_param_partition(names, (6, 32, 16), head_dim=16, tp=4) == P()
    with caplog.at_level(logging.INFO, logger="pagedjax.parallel.sharding"):
        log_replicated(moe, 8)
    assert "does not divide the 4 experts" in caplog.text


def test_per_device_model_counts_kv_heads_one_device_holds():
    assert per_device_model(CFG, 2).num_kv_heads == 1
    assert per_device_model(CFG, 8).num_kv_heads == 1
    assert CacheConfig(kv_memory_bytes=1 << 20).resolve_num_blocks(per_device_model(CFG, 2)) == \
        2 * CacheConfig(kv_memory_bytes=1 << 20).resolve_num_blocks(CFG)


def test_one_device_engine_is_unchanged():
    """Without a parallel config the runner has no mesh and the KV cache sits on one device."""
    e = LLMEngine(model_config=CFG, cache_config=CacheConfig(num_blocks=4), compile_cache=False)
    assert e.runner.mesh is None and e.parallel_config is None
    assert e.stats().tensor_parallel_size == 1
    assert e.stats().kv_cache_bytes_per_device == e.runner.kv_cache.nbytes


def test_cli_tensor_parallel_size_needs_the_devices(capsys):
    from pagedjax import cli

    n = len(jax.devices())
    assert cli.main(["--tensor-parallel-size", str(8 * n), "--prompt", "x", "--max-tokens", "1",
                     "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert f"--tensor-parallel-size {8 * n}: only {n} cpu device(s)" in err
    assert "xla_force_host_platform_device_count" in err


def test_bench_projection_for_llama3_70b(monkeypatch):
    """scripts/bench_parallel.py's projection: 70B bf16 weights split 8 ways leave ~109 GB of KV per H200; a
    token's KV is 40 KiB per GPU at tp 8 (one of 8 KV heads), so paging fits two 4k requests per 8k reservation."""
    from tests.scripts_module import load_script

    bench = load_script("bench_parallel", monkeypatch)
    tp8 = bench.projection()[0]
    assert tp8["layout"] == "dp 1 x tp 8"
    assert 17 < tp8["weights_gb"] < 18 and tp8["kv_per_token_kb"] == 40
    assert tp8["paged"] == tp8["tokens"] // 4096
    assert tp8["paged"] in (2 * tp8["reserve_8192"], 2 * tp8["reserve_8192"] + 1)
    assert tp8["reserve_131072"] < tp8["paged"] // 30


@pytest.mark.slow
def test_bench_parallel_quick_runs():
    """scripts/bench_parallel.py --quick end to end (its own process: it asks for 8 CPU devices); every mix's
    greedy tokens equal the one-device run's. Slow (compiles an engine per mix), so out of the default run."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "scripts/bench_parallel.py", "--quick"], cwd=root, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines()
            if line.startswith("| ") and re.fullmatch(r"\s*\d+ x \d+\s*", line.split("|")[1])]
    assert len(rows) >= 3 and all(line.split("|")[6].strip() == "1.000" for line in rows), r.stdout


def test_cli_data_parallel_size_needs_the_devices(capsys):
    from pagedjax import cli

    n = len(jax.devices())
    assert cli.main(["--data-parallel-size", str(2 * n), "--prompt", "x", "--max-tokens", "1",
                     "--no-compile-cache"]) == 2
    err = capsys.readouterr().err
    assert f"--tensor-parallel-size 1 x --data-parallel-size {2 * n} = {2 * n} devices: only {n} cpu" in err


def _partitions(model, tp: int) -> dict:
    """'.'-joined parameter name -> its PartitionSpec on `tp` devices (`param_partition_fn`; nothing allocated)."""
    from flax import nnx

    from pagedjax.model.api import param_partition_fn
    from pagedjax.parallel.sharding import key_names

    partition = param_partition_fn(model, tp)
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    return {".".join(map(str, key_names(kp))): partition(key_names(kp), tuple(x.shape)) for kp, x in leaves}


def test_hybrid_families_split_their_linear_layers_by_heads():
    """Qwen3-Next's gated DeltaNet and Nemotron-H's Mamba-2 layers: projections by columns, out_proj by rows, the
    per-head parameters by heads, the conv whole; tp not dividing the key heads / groups refused by name."""
    from jax.sharding import PartitionSpec as P

    from pagedjax.model.families.nemotron_h import NemotronHConfig, abstract_nemotron_h
    from pagedjax.model.families.qwen3_next import Qwen3NextConfig, abstract_qwen3_next

    qwen = Qwen3NextConfig(vocab_size=64, hidden_size=32, num_layers=2, layer_types=("linear_attention",
                           "full_attention"), num_heads=4, num_kv_heads=4, head_dim=8, rotary_dim=4,
                           rope_theta=1e4, linear_conv_kernel=4, linear_num_key_heads=2, linear_num_value_heads=4,
                           linear_key_head_dim=8, linear_value_head_dim=8, intermediate_size=64,
                           moe_layers=(False, False))
    specs = _partitions(abstract_qwen3_next(qwen), 2)
    assert {k.removeprefix("layers.0.linear_attn."): v for k, v in specs.items() if ".linear_attn." in k} == {
        "in_proj_qkvz.kernel": P(None, "tp"), "in_proj_ba.kernel": P(None, "tp"), "out_proj.kernel": P("tp", None),
        "A_log": P("tp"), "dt_bias": P("tp"), "conv1d.weight": P(), "norm.weight": P()}
    assert specs["layers.1.self_attn.q_proj.kernel"] == P(None, "tp")  # attention by the default rule
    with pytest.raises(ValueError, match="must divide 'linear_num_key_heads' \\(2\\)"):
        _partitions(abstract_qwen3_next(qwen), 4)

    nemotron = NemotronHConfig(vocab_size=64, hidden_size=32, layer_types=("linear_attention", "full_attention"),
                               num_heads=4, num_kv_heads=4, head_dim=8, intermediate_size=64, mamba_num_heads=4,
                               mamba_head_dim=8, ssm_state_size=8, n_groups=2, conv_kernel=4)
    specs = _partitions(abstract_nemotron_h(nemotron), 2)
    assert {k.removeprefix("layers.0.mixer."): v for k, v in specs.items() if k.startswith("layers.0.mixer.")} == {
        "in_proj.kernel": P(None, "tp"), "out_proj.kernel": P("tp", None), "A_log": P("tp"), "D": P("tp"),
        "dt_bias": P("tp"), "norm.weight": P("tp"), "conv1d.weight": P(), "conv1d.bias": P()}
    assert specs["layers.1.mixer.o_proj.kernel"] == P("tp", None)
    with pytest.raises(ValueError, match="must divide 'n_groups' \\(2\\)"):
        _partitions(abstract_nemotron_h(nemotron), 4)
