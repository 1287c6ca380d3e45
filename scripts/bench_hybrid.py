"""What the recurrent-state hybrids (Qwen3-Next / Qwen3.5: gated DeltaNet layers beside full attention) save and
cost, measured in one run: three tables.

memory   KV + state bytes one sequence holds at 4k / 32k / 128k tokens for a Qwen3.5-27B-shaped model (64 layers,
         3 of 4 gated DeltaNet; the shape of the published Qwen/Qwen3.5-27B config.json: hidden 5120, 24 query heads
         and 4 KV heads of 256, linear layers 16 key heads and 48 value heads of 128, conv kernel 4; the fields it
         leaves to transformers' `Qwen3_5TextConfig` defaults are pagedjax's `_DEFAULTS_OF["qwen3_5_text"]`, the
         smoke test checks them against transformers) against the same model with every layer full attention:
         bfloat16 K/V, float32 state snapshots, as the specs declare (`Qwen3NextConfig.spec`, `CacheConfig`). The
         blocks each group holds are checked against the real scheduler (a request of that many tokens run to the
         end of its prefill), and the pools against the bytes of the arrays the engine allocates (traced, nothing
         allocated). Sequences per pool: `--pool-gib` of KV + state split as the engine splits it (its state pool
         sized for `max_num_seqs` sequences first: `CacheConfig.resolve_state_blocks`), and by bytes held alone.
         Then the snapshot overhead of prefix caching: per KV block size, the state pool's block size the engine
         picks (one snapshot of every state layer per that many tokens), a snapshot against the K/V of the tokens
         it covers, and for a `--prefix-tokens` prefix its snapshots against its K/V.
speed    a ~150M-parameter Qwen3.5-like hybrid (hidden 768, 12 layers 3:1 linear:full, dense SwiGLU, random weights
         written by transformers and loaded with `LLMEngine.from_pretrained`, so both sides hold the same weights)
         against a full-attention model of the same width (pagedjax's built-in Llama family: hidden 768, 12 layers,
         12 query / 4 KV heads of 64, the same MLP, random init) through `LLMEngine` on the CPU (XLA backend,
         float32): prefill tokens/s of a `--contexts` prompt and decode tokens/s at that context (`--batch`
         sequences, `--decode-steps` steps), and transformers' `Qwen3_5ForCausalLM` on the same checkpoint decoding
         greedily at the same context (its modeling code driven by hand: one prefill forward, then one-token
         forwards with its cache; the fastest of `--torch-threads`), with the fraction of sequences whose greedy
         tokens agree with pagedjax's.
prefix   `--prefix-requests` requests sharing a `--system-tokens` system prompt plus distinct `--suffix-tokens`
         suffixes on the hybrid, all queued at once, with `enable_prefix_caching` on and off: the prefix-cache hit
         rate (engine stats), TTFT mean / p50 / p90 (time from queueing to a request's first token, by stepping the
         engine), total time; the tokens of the two runs are asserted identical.

Every time is the best of `--repeats` runs after a warm-up run that compiles (a different random prompt of the same
shape), the process's CPU time (user + system, every thread) beside the wall time: on a shared machine the wall time
overstates. Ratios compare rows of the same run only.

    python scripts/bench_hybrid.py                    # the three tables (over 10 minutes on a 2-core CPU)
    python scripts/bench_hybrid.py --contexts 512 2048 8192 --repeats 1 --torch-threads 1 \
        --prefix-requests 16 --system-tokens 1024     # the reduced run in docs/models.md (9 minutes there)
    python scripts/bench_hybrid.py --tables memory    # the memory tables only (seconds)
    python scripts/bench_hybrid.py --contexts 512 2048 8192 --batch 1 --repeats 2
    python scripts/bench_hybrid.py --quick            # tiny sizes, seconds: the smoke test
"""

from __future__ import annotations

import argparse
import logging
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config import ModelSpec  # noqa: E402
from pagedjax.core.kv_cache_manager import cdiv  # noqa: E402
from pagedjax.core.memory_stats import kv_memory_stats  # noqa: E402
from pagedjax.core.request import Request  # noqa: E402
from pagedjax.core.scheduler import Scheduler  # noqa: E402
from pagedjax.model.families.qwen3_next import Qwen3NextConfig, config_from_hf  # noqa: E402

logger = logging.getLogger("bench_hybrid")
TABLES = ("memory", "speed", "prefix")
GIB = 2**30

# ------------------------------------------------------------------------------------------------------- memory
# The published Qwen/Qwen3.5-27B text config (the fields it sets; the rest are Qwen3_5TextConfig's defaults, which
# pagedjax's config_from_hf fills in as transformers does: head_dim 256, 4 KV heads, linear 16 key heads of 128 and
# value heads of 128, conv kernel 4, a full-attention layer every 4th).
QWEN3_5_27B = {"model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120, "num_hidden_layers": 64,
               "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256, "intermediate_size": 17408,
               "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
               "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                   "mrope_section": [11, 11, 10], "mrope_interleaved": True},
               "tie_word_embeddings": False, "dtype": "bfloat16"}


def qwen3_5_27b(all_full: bool = False) -> Qwen3NextConfig:
    """The Qwen3.5-27B shape (`QWEN3_5_27B`) as pagedjax maps it, or the same with every layer full attention."""
    cfg = config_from_hf(QWEN3_5_27B, "bfloat16", None, ())
    if all_full:
        cfg = cfg.replace(layer_types=("full_attention",) * cfg.num_layers)
    return cfg


def held_after_prefill(spec: ModelSpec, block_size: int, tokens: int, chunk: int) -> tuple[int, ...]:
    """Blocks each KV cache group of `spec` holds (the real scheduler, its pools) for one request of `tokens` prompt
    tokens at the end of its prefill."""
    layout = spec.kv_layout
    sched_cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=tokens + 2)
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=False, kv_dtype="bfloat16")
    extra = cache.resolve_state_blocks(spec, 1, chunk)
    sched = Scheduler(sched_cfg, cache, layout.num_groups * (tokens // block_size + 2),
                      group_windows=layout.windows, group_pools=layout.group_pools, extra_pools=extra,
                      pool_block_sizes=cache.resolve_pool_block_sizes(spec))
    request = Request("r", list(range(tokens)), SamplingParams(temperature=0.0, max_tokens=2))
    sched.add_request(request)
    while not request.output_token_ids:
        plan = sched.schedule()
        sched.update(plan, np.ones(plan.num_seqs, np.int32))
    return kv_memory_stats(sched.kv_cache_manager, sched.running, with_free_runs=False).group_blocks


def held_blocks(spec: ModelSpec, cache: CacheConfig, tokens: int) -> tuple[int, ...]:
    """From the specs: what each group holds while a request of `tokens` tokens decodes, in blocks of its pool's
    size (a group that keeps every block all of them; a release window W, those its next query reads: positions
    from tokens - W + 1 on)."""
    layout = spec.kv_layout
    sizes = cache.resolve_pool_block_sizes(spec)
    return tuple(cdiv(tokens, sizes[p]) - (0 if w is None else max(0, (tokens - w + 1) // sizes[p]))
                 for w, p in zip(layout.windows, layout.group_pools, strict=True))


def allocated_bytes(spec: ModelSpec, cache: CacheConfig, extra_pools: tuple[int, ...]) -> int:
    """Bytes of the pools the engine allocates for `spec` (`init_kv_cache`'s arrays, traced: nothing allocated)."""
    import jax

    from pagedjax.device.kv_cache import init_kv_cache

    num_blocks = cache.resolve_num_blocks(spec, extra_pools=extra_pools)
    pool = jax.eval_shape(lambda: init_kv_cache(spec.kv_layout, num_blocks, cache.block_size,
                                                cache.kv_array_dtype(spec), extra_pools=extra_pools))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(pool))


def engine_sequences(spec: ModelSpec, cache: CacheConfig, tokens: int, chunk: int) -> int:
    """The most `tokens`-token sequences the engine's pools hold at once out of `cache.kv_memory_bytes`, sized as the
    engine sizes them for max_num_seqs = that many (its state pool first, `resolve_state_blocks`: twice each
    sequence's live state, its last boundary's and a step's boundaries)."""
    need = cdiv(tokens, cache.block_size)

    def fits(n: int) -> bool:
        try:
            return cache.resolve_num_blocks(spec, extra_pools=cache.resolve_state_blocks(spec, n, chunk)) >= n * need
        except ValueError:  # the state pool alone past the budget
            return False

    lo, hi = 0, cache.kv_memory_bytes // max(1, need * cache.block_bytes(spec)) + 1
    while lo < hi:  # the largest n that fits (fits is monotone in n)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def memory_table(pool_gib: float, block_size: int, contexts: tuple[int, ...], chunk: int, measure: bool = True,
                 quiet: bool = False) -> list[dict]:
    """Per model (the hybrid, all full attention) and context: KV and state bytes a decoding sequence holds, and
    the sequences a `pool_gib` pool holds."""
    budget = int(pool_gib * GIB)
    rows = []
    for name, cfg in (("hybrid 3:1", qwen3_5_27b()), ("all full attention", qwen3_5_27b(all_full=True))):
        spec = cfg.spec
        layout = spec.kv_layout
        cache = CacheConfig(block_size=block_size, kv_memory_bytes=budget, kv_dtype="bfloat16")
        block = [cache.block_bytes(spec, p) for p in range(len(layout.pools))]
        for tokens in contexts:
            held = held_blocks(spec, cache, tokens)
            if measure:
                measured = held_after_prefill(spec, block_size, tokens, chunk)
                assert measured == held, (name, tokens, measured, held)
            kv = sum(h * block[p] for h, p in zip(held, layout.group_pools, strict=True) if layout.pools[p] == "kv")
            state = sum(h * block[p] for h, p in zip(held, layout.group_pools, strict=True)
                        if layout.pools[p] == "state")
            seqs = engine_sequences(spec, cache, tokens, chunk)
            extra = cache.resolve_state_blocks(spec, max(seqs, 1), chunk)
            allocated = allocated_bytes(spec, cache, extra) if seqs else 0
            if seqs:
                assert allocated == cache.pool_bytes(spec, extra) <= budget, (name, tokens, allocated)
            rows.append({"model": name, "tokens": tokens, "layers": cfg.num_layers,
                         "full_layers": cfg.layer_types.count("full_attention"),
                         "kv_bytes_per_token": cache.kv_bytes_per_token(spec), "kv_bytes": kv, "state_bytes": state,
                         "bytes": kv + state, "held_blocks": held, "groups": layout.describe(),
                         "sequences_by_bytes": budget // (kv + state), "sequences": seqs,
                         "state_blocks": extra[0] if extra else 0,
                         "state_pool_bytes": (extra[0] if extra else 0) * (block[1] if len(block) > 1 else 0),
                         "allocated_bytes": allocated})
    full = {r["tokens"]: r for r in rows if r["model"] == "all full attention"}
    for r in rows:
        r["full_over_this"] = full[r["tokens"]]["bytes"] / r["bytes"]
    if quiet:
        return rows
    print(f"\nmemory: KV + state per sequence, Qwen3.5-27B shape ({rows[0]['layers']} layers; bf16 K/V, f32 state), "
          f"block {block_size}, prefill chunks of {chunk}, a {pool_gib:g} GiB pool")
    print("| model | tokens | K/V per seq | state per seq | total per seq | full / this | seqs in pool (engine) "
          "| its state pool | seqs by bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['tokens']:,} | {_gib(r['kv_bytes'])} | {_gib(r['state_bytes'])} | "
              f"{_gib(r['bytes'])} | {r['full_over_this']:.2f}x | {r['sequences']:,} | "
              f"{_gib(r['state_pool_bytes']) if r['state_blocks'] else '-'} | {r['sequences_by_bytes']:,} |")
    hybrid = rows[0]
    print(f"layouts: hybrid {hybrid['groups']}; all full: {rows[-1]['groups']}. K/V per token: hybrid "
          f"{hybrid['kv_bytes_per_token']:,} B ({hybrid['full_layers']} full layers), all full "
          f"{rows[-1]['kv_bytes_per_token']:,} B. Per sequence: the blocks each group holds while it decodes (checked "
          "against the scheduler after its prefill): a state group one snapshot of every state layer, whatever the "
          "context. Seqs in pool (engine): the engine's split of the pool (its state pool sized for that many "
          "sequences first: twice the snapshots a step of them holds at most, 2 per sequence and 1 per state block "
          "of a prefill chunk, `resolve_state_blocks`; arrays checked against the specs' bytes); its state pool: "
          "the snapshots that reserves; seqs by bytes: the pool over the bytes a sequence holds.")
    return rows


def snapshot_table(block_sizes: tuple[int, ...], prefix_tokens: int, quiet: bool = False) -> list[dict]:
    """Per KV block size: the state pool's block size the engine picks (`CacheConfig.resolve_pool_block_sizes`: one
    snapshot of every state layer per that many tokens), a snapshot against the K/V of the tokens it covers, and for
    a cached prefix of `prefix_tokens` every state block's snapshot kept against the prefix's K/V."""
    spec = qwen3_5_27b().spec
    layout = spec.kv_layout
    state_pool = layout.pools.index("state")
    rows = []
    for bs in block_sizes:
        cache = CacheConfig(block_size=bs, kv_dtype="bfloat16")
        every = cache.resolve_pool_block_sizes(spec)[state_pool]
        snapshot, kv_block = cache.block_bytes(spec, state_pool), cache.block_bytes(spec, 0)
        covered = every // bs * kv_block  # K/V of the tokens one snapshot covers
        prefix_kv = prefix_tokens // bs * kv_block
        snapshots = prefix_tokens // every * snapshot
        rows.append({"block_size": bs, "state_block_size": every, "snapshot_bytes": snapshot,
                     "kv_block_bytes": kv_block, "covered_kv_bytes": covered, "snapshot_over_kv": snapshot / covered,
                     "prefix_kv_bytes": prefix_kv, "prefix_snapshots_bytes": snapshots,
                     "snapshots_over_prefix_kv": snapshots / prefix_kv})
    if quiet:
        return rows
    print(f"\nprefix-caching snapshot overhead, hybrid Qwen3.5-27B shape: a {prefix_tokens:,}-token cached prefix")
    print("| KV block | state block | snapshot (48 state layers) | K/V of a state block | snapshot / its K/V "
          "| prefix K/V | the prefix's snapshots | / prefix K/V |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['block_size']} | {r['state_block_size']:,} | {_mib(r['snapshot_bytes'])} | "
              f"{_mib(r['covered_kv_bytes'])} | {r['snapshot_over_kv']:.2f}x | {_gib(r['prefix_kv_bytes'])} | "
              f"{_gib(r['prefix_snapshots_bytes'])} | {r['snapshots_over_prefix_kv']:.2f}x |")
    print("The state pool's block (one snapshot of every state layer) is the least multiple of the KV block at which "
          "a state layer's snapshot takes no more bytes than an attention layer's K/V of its tokens (vLLM's page "
          "alignment), so a cached prefix's snapshots cost at most 48 / 16 = 3x its K/V (what the all-attention "
          "model's K/V of the prefix would be); a hit ends at a multiple of it, and needs only the snapshot at its "
          "end (the state group's release window is 2): LRU drops the rest first.")
    return rows


def _gib(n: float) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:,.1f} MiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


# -------------------------------------------------------------------------------------------------------- speed
# The hybrid as transformers' Qwen3_5TextConfig fields (scaled from Qwen3.5: linear key heads half the width, value
# heads the width) and the full-attention model of the same width, depth, heads and MLP.
SHAPES = {
    "150m": dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=64, intermediate_size=2560, linear_num_key_heads=6,
                 linear_num_value_heads=12, linear_key_head_dim=64, linear_value_head_dim=64,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                  "mrope_section": [3, 3, 2], "mrope_interleaved": True}),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                                  "mrope_section": [2, 1, 1], "mrope_interleaved": True}),
}


def hf_fields(shape: str, max_len: int) -> dict:
    fields = dict(SHAPES[shape])
    n = fields["num_hidden_layers"]
    fields.update(layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                  linear_conv_kernel_dim=4, max_position_embeddings=max_len, tie_word_embeddings=False,
                  initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    return fields


def full_attention_config(shape: str, max_len: int) -> ModelConfig:
    f = SHAPES[shape]
    return ModelConfig(vocab_size=f["vocab_size"], hidden_size=f["hidden_size"], num_layers=f["num_hidden_layers"],
                       num_q_heads=f["num_attention_heads"], num_kv_heads=f["num_key_value_heads"],
                       head_dim=f["head_dim"], intermediate_size=f["intermediate_size"], tie_word_embeddings=False,
                       max_position_embeddings=max_len, dtype="float32")


def write_hybrid(folder: Path, shape: str, max_len: int, seed: int = 0) -> int:
    """A random Qwen3_5ForCausalLM of `shape` saved to `folder` (float32); returns its parameter count."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hf_fields(shape, max_len)))
    with torch.no_grad():  # the zero-centred norms off zero, so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(folder), safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _prompts(rng, vocab: int, batch: int, tokens: int) -> list[list[int]]:
    return [rng.integers(3, vocab, tokens).tolist() for _ in range(batch)]


class Ids:
    """Unique request ids across runs on one engine."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> str:
        self.n += 1
        return f"b{self.n}"


def engine_run(engine: LLMEngine, ids: Ids, prompts: list[list[int]], decode_steps: int) -> dict:
    """Prefill `prompts` (timed until every one has its first token) then `decode_steps` steps of all of them
    decoding (timed), then abort them. Returns wall and CPU seconds of both phases, the tokens each phase produced
    and each sequence's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 64, ignore_eos=True)
    names = [ids() for _ in prompts]
    for name, prompt in zip(names, prompts, strict=True):
        engine.add_request(name, prompt, params)
    tokens: dict[str, list[int]] = {}
    start, cpu0 = time.perf_counter(), _cpu()
    while len([n for n in names if tokens.get(n)]) < len(names):
        for out in engine.step():
            tokens[out.request_id] = list(out.output_token_ids)
    mid, cpu1 = time.perf_counter(), _cpu()
    before = sum(len(t) for t in tokens.values())
    for _ in range(decode_steps):
        for out in engine.step():
            tokens[out.request_id] = list(out.output_token_ids)
    end, cpu2 = time.perf_counter(), _cpu()
    decoded = sum(len(t) for t in tokens.values()) - before
    for name in names:
        engine.abort(name)
    while engine.has_unfinished_requests():
        engine.step()
    return {"prefill_s": mid - start, "prefill_cpu": cpu1 - cpu0, "prefill_tokens": sum(map(len, prompts)),
            "decode_s": end - mid, "decode_cpu": cpu2 - cpu1, "decode_tokens": decoded,
            "tokens": [tokens[n] for n in names]}


def best_of(runs: list[dict]) -> dict:
    """The best wall time of each phase over `runs`, with the mean CPU time per run beside it."""
    out = dict(runs[-1])
    for phase in ("prefill", "decode"):
        out[f"{phase}_s"] = min(r[f"{phase}_s"] for r in runs)
        out[f"{phase}_cpu"] = statistics.fmean(r[f"{phase}_cpu"] for r in runs)
    return out


def time_engine(engine: LLMEngine, ids: Ids, vocab: int, context: int, batch: int, decode_steps: int, repeats: int,
                seed: int) -> dict:
    rng = np.random.default_rng(seed + context)
    engine_run(engine, ids, _prompts(rng, vocab, batch, context), decode_steps)  # warm-up: compiles
    prompts = [_prompts(rng, vocab, batch, context) for _ in range(repeats)]
    runs = [engine_run(engine, ids, p, decode_steps) for p in prompts]
    out = best_of(runs)
    out["prompts"] = prompts[-1]
    return out


def load_transformers(folder: Path):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def time_transformers(model, prompts: list[list[int]], decode_steps: int, repeats: int,
                      torch_threads: tuple[int, ...] | None = None) -> dict:
    """transformers (`model`: float32, its default cache) driven greedily by hand: prefill = the forward of the
    prompts, decode = `decode_steps` forwards of one token each with the cache (generate's own overhead left out);
    with each of `torch_threads` (default: 1 and torch's default), the faster decode kept (as scripts/bench_hf.py
    does)."""
    import torch

    ids = torch.tensor(prompts, dtype=torch.long)

    def run() -> tuple[float, float, float, float, list]:
        with torch.inference_mode():
            start, cpu0 = time.perf_counter(), _cpu()
            out = model(input_ids=ids, use_cache=True)
            tokens = [out.logits[:, -1].argmax(-1)]
            mid, cpu1 = time.perf_counter(), _cpu()
            cache = out.past_key_values
            for _ in range(decode_steps):
                out = model(input_ids=tokens[-1][:, None], past_key_values=cache, use_cache=True)
                cache = out.past_key_values
                tokens.append(out.logits[:, -1].argmax(-1))
            end, cpu2 = time.perf_counter(), _cpu()
        return mid - start, cpu1 - cpu0, end - mid, cpu2 - cpu1, torch.stack(tokens, 1).tolist()

    default_threads = torch.get_num_threads()
    best = None
    # On a busy machine more torch threads can be far slower.
    for threads in dict.fromkeys(torch_threads or (1, default_threads)):
        torch.set_num_threads(threads)
        run()  # warm-up
        runs = [run() for _ in range(repeats)]
        if best is None or min(r[2] for r in runs) < min(r[2] for r in best[1]):
            best = threads, runs
    torch.set_num_threads(default_threads)
    threads, runs = best
    return {"torch_threads": threads, "prefill_s": min(r[0] for r in runs),
            "prefill_cpu": statistics.fmean(r[1] for r in runs),
            "prefill_tokens": ids.numel(), "decode_s": min(r[2] for r in runs),
            "decode_cpu": statistics.fmean(r[3] for r in runs), "decode_tokens": len(prompts) * decode_steps,
            "tokens": runs[-1][4]}


class Engines:
    """The engines of the speed and prefix tables, built once (compiling is most of a small run): the hybrid from
    its checkpoint with prefix caching off and on, and the full-attention model (caching off), all of one cache and
    scheduler shape: `max_num_seqs` sequences of up to `max_len` tokens, prefill chunks of `chunk`."""

    def __init__(self, folder: Path, shape: str, max_len: int, max_num_seqs: int, chunk: int, block_size: int,
                 seed: int, state_block_size: int | None = None) -> None:
        self.folder, self.shape, self.max_len, self.seed = folder, shape, max_len, seed
        self.sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max(chunk, max_num_seqs),
                                     max_model_len=max_len)
        self.blocks = (max_num_seqs + 1) * cdiv(max_len, block_size) + 8
        self.block_size, self.state_block_size = block_size, state_block_size
        self._built: dict[str, LLMEngine] = {}
        self.ids: dict[str, Ids] = {}

    def cache(self, caching: bool) -> CacheConfig:
        return CacheConfig(block_size=self.block_size, num_blocks=self.blocks, enable_prefix_caching=caching,
                           state_block_size=self.state_block_size)

    def __getitem__(self, name: str) -> LLMEngine:
        """"hybrid", "hybrid cached" or "full"."""
        if name not in self._built:
            if name == "full":
                engine = LLMEngine(model_config=full_attention_config(self.shape, self.max_len),
                                   cache_config=self.cache(False), scheduler_config=self.sched, backend="xla",
                                   seed=self.seed)
            else:
                engine = LLMEngine.from_pretrained(self.folder, dtype="float32", cache_config=self.cache(
                    name == "hybrid cached"), scheduler_config=self.sched, backend="xla", seed=self.seed)
            self._built[name], self.ids[name] = engine, Ids()
        return self._built[name]


def speed_table(engines: Engines, contexts: tuple[int, ...], batch: int, decode_steps: int, repeats: int,
                params: int, with_transformers: bool, torch_threads: tuple[int, ...] | None = None) -> list[dict]:
    shape, folder, seed = engines.shape, engines.folder, engines.seed
    vocab = SHAPES[shape]["vocab_size"]
    full_params = count_params(full_attention_config(shape, engines.max_len))
    chunk = engines.sched.max_num_batched_tokens
    rows = []
    hf_model = load_transformers(folder) if with_transformers else None
    for context in contexts:
        h = time_engine(engines["hybrid"], engines.ids["hybrid"], vocab, context, batch, decode_steps, repeats, seed)
        f = time_engine(engines["full"], engines.ids["full"], vocab, context, batch, decode_steps, repeats, seed)
        row = {"context": context, "batch": batch, "hybrid": h, "full": f, "hybrid_params": params,
               "full_params": full_params}
        if with_transformers:
            t = time_transformers(hf_model, h["prompts"], decode_steps, repeats, torch_threads)
            row["transformers"] = t
            n = min(len(t["tokens"][0]), len(h["tokens"][0]))
            row["same_tokens"] = float(np.mean([a[:n] == b[:n] for a, b in zip(h["tokens"], t["tokens"],
                                                                                 strict=True)]))
        for r in (h, f, row.get("transformers")):
            if r is not None:
                r["prefill_tok_s"] = r["prefill_tokens"] / r["prefill_s"]
                r["decode_tok_s"] = r["decode_tokens"] / r["decode_s"]
                r.pop("prompts", None)
        rows.append(row)
    layers = SHAPES[shape]["num_hidden_layers"]
    print(f"\nspeed on this CPU (XLA backend, float32): hybrid {params / 1e6:.1f}M parameters ({layers} layers 3:1 "
          f"gated DeltaNet:full) vs full attention {full_params / 1e6:.1f}M (same width, depth, heads, MLP), "
          f"batch {batch}, prefill chunks of {chunk}, {decode_steps} decode steps, best wall of {repeats} "
          "(tokens per CPU second in parentheses)")
    hf = " | transformers prefill tok/s | transformers decode tok/s | pagedjax / transformers decode | same tokens" \
        if with_transformers else ""
    print(f"| context | hybrid prefill tok/s | full prefill tok/s | hybrid / full prefill | hybrid decode tok/s "
          f"| full decode tok/s | hybrid / full decode{hf} |")
    print("|---:|" + "---:|" * (6 + 4 * with_transformers))
    for r in rows:
        h, f = r["hybrid"], r["full"]
        r["prefill_ratio"] = h["prefill_tok_s"] / f["prefill_tok_s"]
        r["decode_ratio"] = h["decode_tok_s"] / f["decode_tok_s"]
        cells = [f"{r['context']:,}", _rate(h, "prefill"), _rate(f, "prefill"), f"{r['prefill_ratio']:.2f}x",
                 _rate(h, "decode"), _rate(f, "decode"), f"{r['decode_ratio']:.2f}x"]
        if with_transformers:
            t = r["transformers"]
            r["vs_transformers_decode"] = h["decode_tok_s"] / t["decode_tok_s"]
            cells += [_rate(t, "prefill"), _rate(t, "decode"), f"{r['vs_transformers_decode']:.2f}x",
                      f"{100 * r['same_tokens']:.0f}%"]
        print("| " + " | ".join(cells) + " |")
    first = rows[0]
    for name in ("hybrid", "full"):  # the decode curve: tokens/s at each context over the first context's
        curve = ", ".join(f"{r['context']:,}: {r[name]['decode_tok_s'] / first[name]['decode_tok_s']:.2f}"
                          for r in rows)
        print(f"{name} decode tok/s relative to context {first['context']:,}: {curve}")
    print("tok/s: wall (per CPU second in parentheses); decode tok/s relative: the decode curve over context; "
          "transformers: its modeling code driven by hand (a prefill forward, then one-token forwards with its "
          "cache), the fastest of its torch thread counts ("
          + ", ".join(f"{r['context']:,}: {r['transformers']['torch_threads']}" for r in rows if "transformers" in r)
          + "); same tokens: sequences whose greedy tokens equal transformers' (random weights: near ties may "
          "differ)" if with_transformers else "tok/s: wall (per CPU second in parentheses)")
    return rows


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the built-in model of `cfg` (its abstract structure: nothing allocated)."""
    import jax
    from flax import nnx

    from pagedjax.model.llama import abstract_model

    return sum(a.size for a in jax.tree.leaves(nnx.state(abstract_model(cfg), nnx.Param)))


def _rate(r: dict, phase: str) -> str:
    tokens = r[f"{phase}_tokens"]
    cpu = r[f"{phase}_cpu"]
    return f"{tokens / r[f'{phase}_s']:,.1f} ({tokens / cpu:,.1f})" if cpu > 0 else f"{tokens / r[f'{phase}_s']:,.1f}"


# ------------------------------------------------------------------------------------------------------- prefix
def prefix_run(engine: LLMEngine, ids: Ids, system: list[int], suffixes: list[list[int]], max_tokens: int) -> dict:
    """All requests queued at once, the engine stepped until they finish: each one's TTFT (queueing to its first
    token), the total time, the hit rate of these requests, their tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    before = engine.stats().scheduler
    names = [ids() for _ in suffixes]
    start, cpu0 = time.perf_counter(), _cpu()
    for name, suffix in zip(names, suffixes, strict=True):
        engine.add_request(name, system + suffix, params)
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.output_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id] = list(out.output_token_ids)
    total, cpu = time.perf_counter() - start, _cpu() - cpu0
    after = engine.stats().scheduler
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    ttft = np.array([first[n] for n in names])
    return {"ttft": ttft, "total_s": total, "cpu_s": cpu, "hit_rate": hits / queries if queries else 0.0,
            "hit_tokens": hits, "query_tokens": queries, "tokens": [tokens[n] for n in names]}


def prefix_table(engines: Engines, num_requests: int, system_tokens: int, suffix_tokens: int, max_tokens: int,
                 repeats: int) -> list[dict]:
    vocab = SHAPES[engines.shape]["vocab_size"]
    rows = []
    for caching in (False, True):
        name = "hybrid cached" if caching else "hybrid"
        engine, ids, rng = engines[name], engines.ids[name], np.random.default_rng(engines.seed)
        runs = []
        for i in range(repeats + 1):  # the first a warm-up (its own system prompt: the timed ones miss it)
            system = rng.integers(3, vocab, system_tokens).tolist()
            suffixes = [rng.integers(3, vocab, suffix_tokens).tolist() for _ in range(num_requests)]
            run = prefix_run(engine, ids, system, suffixes, max_tokens)
            if i:
                runs.append(run)
        best = min(runs, key=lambda r: r["total_s"])
        rows.append({"caching": caching, **best, "ttft_mean": float(best["ttft"].mean()),
                     "ttft_p50": float(np.percentile(best["ttft"], 50)),
                     "ttft_p90": float(np.percentile(best["ttft"], 90)), "all_tokens": [r["tokens"] for r in runs]})
    off, on = rows
    # Exactness: caching changes no token (the same prompts, greedy, run by run).
    for a, b in zip(off["all_tokens"], on["all_tokens"], strict=True):
        assert a == b, "prefix caching changed the tokens"
    print(f"\nprefix cache: {num_requests} requests of a shared {system_tokens:,}-token system prompt + "
          f"{suffix_tokens} distinct tokens, {max_tokens} tokens each, all queued at once; hybrid, "
          f"max_num_seqs {engines.sched.max_num_seqs}, chunks of {engines.sched.max_num_batched_tokens}, block "
          f"{engines.block_size}, a state snapshot per {engines['hybrid cached'].pool_block_sizes[1]} tokens (hits "
          f"end at its multiples); best total of {repeats}")
    print("| prefix caching | hit rate | TTFT mean | TTFT p50 | TTFT p90 | total | CPU |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {'on' if r['caching'] else 'off'} | {100 * r['hit_rate']:.1f}% | {r['ttft_mean'] * 1e3:,.0f} ms | "
              f"{r['ttft_p50'] * 1e3:,.0f} ms | {r['ttft_p90'] * 1e3:,.0f} ms | {r['total_s']:,.2f} s | "
              f"{r['cpu_s']:,.2f} s |")
    print(f"off / on: TTFT mean {off['ttft_mean'] / on['ttft_mean']:.2f}x, total "
          f"{off['total_s'] / on['total_s']:.2f}x; "
          "tokens identical with caching on and off (asserted); hit rate: prompt tokens served from the cache over "
          "prompt tokens of the run's admissions")
    for r in rows:
        r["ttft"] = r["ttft"].tolist()
    return rows


# --------------------------------------------------------------------------------------------------------- main
def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return n


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", nargs="+", choices=TABLES, default=list(TABLES), help="which tables (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds (the smoke test)")
    p.add_argument("--block-size", type=_positive, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=_positive, default=2, help="timed runs (best wall kept) after a warm-up")
    g = p.add_argument_group("memory")
    g.add_argument("--memory-contexts", type=_positive, nargs="+", default=[4096, 32768, 131072])
    g.add_argument("--pool-gib", type=float, default=64.0, help="KV + state pool of the sequences column")
    g.add_argument("--memory-chunk", type=_positive, default=512,
                   help="prefill chunk (max_num_batched_tokens; 512: SchedulerConfig's default)")
    g.add_argument("--snapshot-block-sizes", type=_positive, nargs="+", default=[16, 64, 256, 1024])
    g.add_argument("--prefix-tokens", type=_positive, default=32768, help="cached prefix of the snapshot table")
    g = p.add_argument_group("speed")
    g.add_argument("--shape", choices=sorted(SHAPES), default="150m")
    g.add_argument("--contexts", type=_positive, nargs="+", default=[512, 2048, 8192])
    g.add_argument("--batch", type=_positive, default=1)
    g.add_argument("--decode-steps", type=_positive, default=16)
    g.add_argument("--chunk", type=_positive, default=1024, help="prefill chunk (max_num_batched_tokens)")
    g.add_argument("--no-transformers", action="store_true", help="leave transformers out of the speed table")
    g.add_argument("--torch-threads", type=_positive, nargs="+",
                   help="torch thread counts transformers is timed with, the fastest kept (default: 1 and torch's)")
    g.add_argument("--hf-dir", type=Path, help="where the hybrid's checkpoint is written (default: a temp dir)")
    g = p.add_argument_group("prefix")
    g.add_argument("--prefix-requests", type=_positive, default=32)
    g.add_argument("--system-tokens", type=_positive, default=2048)
    g.add_argument("--suffix-tokens", type=_positive, default=32)
    g.add_argument("--max-tokens", type=_positive, default=8, help="tokens each prefix request generates")
    g.add_argument("--max-num-seqs", type=_positive, default=8, help="of the prefix table's engine")
    g.add_argument("--state-block-size", type=_positive, default=None,
                   help="the hybrid's tokens per state snapshot (CacheConfig.state_block_size; default: the engine's "
                        "choice, the least multiple of --block-size whose K/V takes a snapshot's bytes)")
    args = p.parse_args(argv)
    if args.pool_gib <= 0:
        p.error(f"--pool-gib must be positive, got {args.pool_gib}")
    if args.quick:
        args.memory_contexts, args.snapshot_block_sizes = [4096, 32768], [16, 256]
        args.shape, args.contexts, args.decode_steps, args.chunk, args.repeats = "tiny", [64, 256], 4, 128, 1
        args.prefix_requests, args.system_tokens, args.suffix_tokens, args.max_tokens = 4, 96, 8, 2
        args.max_num_seqs, args.block_size = 4, 16
    if args.memory_chunk % args.block_size:
        p.error(f"--memory-chunk ({args.memory_chunk}) must be a multiple of --block-size ({args.block_size})")

    result: dict = {"args": vars(args)}
    start = time.perf_counter()
    if "memory" in args.tables:
        result["memory"] = memory_table(args.pool_gib, args.block_size, tuple(args.memory_contexts), args.memory_chunk)
        result["snapshots"] = snapshot_table(tuple(args.snapshot_block_sizes), args.prefix_tokens)
    if "speed" in args.tables or "prefix" in args.tables:
        with tempfile.TemporaryDirectory(prefix="bench_hybrid_") as tmp:
            folder = args.hf_dir or Path(tmp) / "hybrid"
            need = []
            if "speed" in args.tables:
                need.append(max(args.contexts) + args.decode_steps + 64 + 8)  # engine_run's max_tokens
            if "prefix" in args.tables:
                need.append(args.system_tokens + args.suffix_tokens + args.max_tokens + 8)
            params = write_hybrid(folder, args.shape, max(need), args.seed)
            engines = Engines(folder, args.shape, max(need), max(args.batch, args.max_num_seqs), args.chunk,
                              args.block_size, args.seed, args.state_block_size)
            if "speed" in args.tables:
                result["speed"] = speed_table(engines, tuple(args.contexts), args.batch, args.decode_steps,
                                              args.repeats, params, not args.no_transformers,
                                              tuple(args.torch_threads) if args.torch_threads else None)
            if "prefix" in args.tables:
                result["prefix"] = prefix_table(engines, args.prefix_requests, args.system_tokens,
                                                args.suffix_tokens, args.max_tokens, args.repeats)
    print(f"\n(bench_hybrid: {time.perf_counter() - start:.1f} s)")
    if "speed" in args.tables or "prefix" in args.tables:
        for name, engine in engines._built.items():
            logger.info("%s engine: %d compilations, %.1f s compiling", name, engine.stats().compilations,
                        engine.stats().compile_s)
    return result


if __name__ == "__main__":
    main()
