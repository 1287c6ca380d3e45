"""Paged KV memory vs contiguous reservation, measured on a synthetic ShareGPT-like workload.

Three allocators get the same KV budget (in token slots) and the same continuous-batching timeline
(per step a token budget; decodes first, then prefill chunks; FIFO admission while memory allows):

  paged        the real `pagedjax.core.Scheduler` (blocks of --block-size tokens, preemption by recompute)
  max-length   a contiguous range of max_model_len slots per request (what pre-paging servers reserved)
  exact        a contiguous range of the request's exact final length (an oracle that knows the output
               length), first-fit, so external fragmentation shows

Reported per allocator: concurrent requests (mean while requests were waiting, i.e. at capacity; and
peak), KV slots wasted (reserved but not holding a computed token, summed over steps), allocation
failures despite enough total free memory, and steps to finish the workload. A PNG plots pool occupancy
over time. Then the scheduler is timed: microseconds per `schedule()` with 256 running requests.

Then sharing: KV blocks held by parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6) on the real
scheduler, with forks sharing blocks, against each fork holding a private copy of its history (the sum of every
request's block count, which is what the same requests would hold without sharing), on a ShareGPT-like and an
Alpaca-like (short prompts and outputs) length spread; the vLLM paper's savings printed beside ours. Beam
search picks its surviving candidates at random (the real search picks the most likely ones): the sharing
depends only on which beams survive, not why.

Then attention kinds: KV bytes per token and how many 4k-token sequences one fixed pool holds for a
DeepSeek-V3-shaped model (61 layers, 128 query heads) whose layers cache MLA latent entries (kv_lora_rank 512 +
rope 64), against the same model caching GQA-8 or MHA K/V heads of 128, in bfloat16 and fp8 pages: from the
layer specs (`ModelSpec.kv_layers`, `CacheConfig`), each checked against the bytes of the pool the engine
allocates for it (its arrays' shapes, traced without allocating).

Then KV cache groups: KV bytes one sequence holds at 8k / 32k / 128k tokens and how many such sequences one
fixed pool holds for a Gemma-3-27B shape (52 local layers of window 1024, 10 global) and a gpt-oss-120b shape (18
window-128 layers, 18 full), under the one-table rule (every layer in one block table: a global layer keeps every
block, so nothing is released) and under KV cache groups (`pagedjax.config.kv_layout`: a window group holds its
window's blocks, a full group every block, and one block serves a layer of each group); from the specs, checked
against the real scheduler's blocks (a request of that many tokens, run to the end of its prefill) and against the
bytes of the pool the engine allocates (its arrays traced, nothing allocated).

Then KV dtypes: one KV memory budget (by default what --kv-slots tokens take in bfloat16) split into blocks of
float32, bfloat16, int8 and fp8 pages (8-bit pages carry a float32 scale per token and KV head, counted) for a
Llama-3-8B-shaped model (32 layers, 8 KV heads of 128), and the same workload on the real scheduler: KV bytes
per token, token slots, concurrency and waste per dtype.

    python scripts/bench_memory.py                 # full run, plot in out/bench_memory.png
    python scripts/bench_memory.py --quick         # seconds; used by the smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax.config import (  # noqa: E402
    CacheConfig,
    FullAttention,
    LatentAttention,
    ModelConfig,
    ModelSpec,
    SchedulerConfig,
)
from pagedjax.core.kv_cache_manager import KVCacheManager, cdiv  # noqa: E402
from pagedjax.core.memory_stats import ContiguousAllocator, kv_memory_stats  # noqa: E402
from pagedjax.core.request import Request  # noqa: E402
from pagedjax.core.scheduler import Scheduler  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Workload:
    prompt_lens: np.ndarray
    output_lens: np.ndarray

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)


def sharegpt_like(num_requests: int, seed: int, lo: int = 4, hi: int = 1024) -> Workload:
    """Log-normal prompt and output lengths clipped to [lo, hi] (ShareGPT: inputs average ~160 tokens,
    outputs ~340, both long-tailed)."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(110), 1.0, num_requests), lo, hi).astype(int)
    outputs = np.clip(rng.lognormal(np.log(220), 0.9, num_requests), lo, hi).astype(int)
    return Workload(prompts, outputs)


@dataclass
class Trace:
    """Per-step series of one allocator's run."""

    name: str
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    used: list[int] = field(default_factory=list)
    failures_despite_free: int = 0
    preemptions: int = 0

    @property
    def steps(self) -> int:
        return len(self.running)

    def summary(self, capacity: int) -> dict:
        running = np.array(self.running)
        at_capacity = running[np.array(self.waiting) > 0]
        reserved, used = np.array(self.reserved), np.array(self.used)
        return {
            "allocator": self.name,
            "mean_concurrency": float(at_capacity.mean()) if len(at_capacity) else float(running.mean()),
            "peak_concurrency": int(running.max()),
            "waste_pct": 100.0 * float((reserved - used).sum()) / max(1, int(reserved.sum())),
            "mean_occupancy_pct": 100.0 * float(used.mean()) / capacity,
            "failures_despite_free": self.failures_despite_free,
            "preemptions": self.preemptions,
            "steps": self.steps,
        }


def run_paged(w: Workload, kv_slots: int, block_size: int, max_model_len: int, max_num_seqs: int,
              max_num_batched_tokens: int, seed: int, sliding_window: int | None = None) -> Trace:
    """`sliding_window`: the model's `kv_window` (requests release blocks that fell out of it while running)."""
    num_blocks = kv_slots // block_size
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
                      CacheConfig(block_size=block_size, enable_prefix_caching=False), num_blocks,
                      sliding_window=sliding_window)
    rng = np.random.default_rng(seed + 1)
    for i in range(w.num_requests):
        prompt = rng.integers(0, 32000, int(w.prompt_lens[i])).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(w.output_lens[i]))))
    trace = Trace(f"paged (block {block_size})")
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update(plan, np.ones(plan.num_seqs, np.int32))
        mem = kv_memory_stats(sched.kv_cache_manager, sched.running, with_free_runs=False)
        trace.running.append(len(sched.running))
        trace.waiting.append(len(sched.waiting))
        trace.reserved.append(mem.slots_reserved)
        trace.used.append(mem.slots_used)
    trace.preemptions = sched.num_preemptions
    return trace


def run_contiguous(w: Workload, kv_slots: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int, *, exact: bool) -> Trace:
    """The scheduler's timeline (same budget rule, FIFO admission, same stop rule), but each request
    reserves one contiguous range at admission: max_model_len slots, or exactly the most KV it will
    ever hold (an oracle that knows its output length)."""
    alloc = ContiguousAllocator(kv_slots)
    waiting = deque(range(w.num_requests))
    running: list[int] = []
    num_tokens = w.prompt_lens.copy()
    computed = np.zeros(w.num_requests, int)
    outputs = np.zeros(w.num_requests, int)
    final = np.minimum(w.prompt_lens + w.output_lens, max_model_len) - 1
    size = np.maximum(final, w.prompt_lens) if exact else np.full(w.num_requests, max_model_len)
    trace = Trace("exact, first-fit" if exact else "max-length")
    while waiting or running:
        budget = max_num_batched_tokens
        scheduled = []
        for i in running:  # running first, in admission order
            if budget == 0:
                break
            n = min(num_tokens[i] - computed[i], budget)
            computed[i] += n
            budget -= n
            scheduled.append(i)
        while waiting and budget > 0 and len(running) < max_num_seqs:
            i = waiting[0]
            if alloc.allocate(str(i), int(size[i])) is None:
                if alloc.num_free >= size[i]:
                    trace.failures_despite_free += 1
                break
            waiting.popleft()
            running.append(i)
            n = min(num_tokens[i], budget)
            computed[i] += n
            budget -= n
            scheduled.append(i)
        for i in scheduled:  # a sequence whose tokens are all computed samples one more
            if computed[i] == num_tokens[i]:
                outputs[i] += 1
                num_tokens[i] += 1
                if outputs[i] >= w.output_lens[i] or num_tokens[i] >= max_model_len:
                    running.remove(i)
                    alloc.free(str(i))
        trace.running.append(len(running))
        trace.waiting.append(len(waiting))
        trace.reserved.append(alloc.num_allocated)
        trace.used.append(int(computed[running].sum()) if running else 0)
    return trace


def time_scheduler(num_running: int, iters: int, block_size: int, seed: int) -> dict:
    """Microseconds per schedule() (and update()) with `num_running` requests decoding."""
    max_model_len = 2048
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=max(4096, num_running),
                                      max_model_len=max_model_len),
                      CacheConfig(block_size=block_size),
                      num_running * (max_model_len // block_size))
    rng = np.random.default_rng(seed)
    for i in range(num_running):
        sched.add_request(Request(f"t{i}", rng.integers(0, 32000, int(rng.integers(16, 256))).tolist(),
                                  SamplingParams(temperature=0.0, max_tokens=max_model_len - 256)))
    while sched.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sched.running):
        plan = sched.schedule()
        sched.update(plan, np.ones(plan.num_seqs, np.int32))
    assert len(sched.running) == num_running
    sched_us, update_us = [], []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        plan = sched.schedule()
        t1 = time.perf_counter_ns()
        sched.update(plan, np.ones(plan.num_seqs, np.int32))
        t2 = time.perf_counter_ns()
        assert plan.num_seqs == num_running
        sched_us.append((t1 - t0) / 1e3)
        update_us.append((t2 - t1) / 1e3)
    return {"num_running": num_running, "schedule_us_median": statistics.median(sched_us),
            "schedule_us_mean": statistics.fmean(sched_us), "update_us_median": statistics.median(update_us)}


def plot(traces: list[Trace], capacity: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(9, 7), sharex=False)
    for t in traces:
        line, = ax0.plot(100 * np.array(t.used) / capacity, label=f"{t.name}: KV in use", lw=1.2)
        ax0.plot(100 * np.array(t.reserved) / capacity, ls="--", color=line.get_color(), lw=0.8,
                 label=f"{t.name}: reserved")
        ax1.plot(t.running, color=line.get_color(), label=t.name, lw=1.2)
    ax0.set_ylabel("pool occupancy (% of KV slots)")
    ax0.set_title("KV pool occupancy over time (same budget, same workload)")
    ax0.legend(fontsize=7, ncol=2)
    ax1.set_xlabel("step")
    ax1.set_ylabel("running requests")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def alpaca_like(num_requests: int, seed: int) -> Workload:
    """Short instructions and answers (Alpaca: inputs average ~19 tokens, outputs ~58)."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(16), 0.6, num_requests), 4, 256).astype(int)
    outputs = np.clip(rng.lognormal(np.log(45), 0.7, num_requests), 4, 512).astype(int)
    return Workload(prompts, outputs)


def _sharing_scheduler(block_size: int, max_num_seqs: int) -> Scheduler:
    # Room for every fork at once, and a pool big enough that nothing is preempted: the comparison is of what
    # the same requests hold.
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=1 << 16, max_model_len=4096),
                     CacheConfig(block_size=block_size, enable_prefix_caching=False), 1 << 18)


def _held(sched: Scheduler) -> tuple[int, int]:
    """(physical blocks held, blocks the same requests would hold with private copies)."""
    kv = sched.kv_cache_manager
    return kv.block_pool.num_used, sum(kv.num_held_blocks(r.request_id) for r in sched.running)


def sharing_parallel(w: Workload, n: int, block_size: int, seed: int) -> dict:
    """Every request asks for n samples (one prefill, forked); blocks held summed over the steps."""
    sched = _sharing_scheduler(block_size, w.num_requests * n)
    rng = np.random.default_rng(seed)
    for i in range(w.num_requests):
        prompt = rng.integers(0, 32000, int(w.prompt_lens[i])).tolist()
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(temperature=0.0,
                                                                  max_tokens=int(w.output_lens[i]), n=n)))
    shared = private = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update(plan, rng.integers(0, 32000, plan.num_seqs).astype(np.int32))
        used, alone = _held(sched)
        shared, private = shared + used, private + alone
    return {"shared": shared, "private": private}


def sharing_beam(w: Workload, width: int, block_size: int, seed: int) -> dict:
    """Every request runs a beam search of `width` beams for its output length: each step keeps `width`
    candidates drawn at random from the live beams (a beam carries on with its first candidate, forks for the
    others, and is dropped without one), as `pagedjax.engine.beam_search` does with the most likely ones."""
    sched = _sharing_scheduler(block_size, w.num_requests * width)
    rng = np.random.default_rng(seed)
    live: dict[str, list[Request]] = {}
    for i in range(w.num_requests):
        prompt = rng.integers(0, 32000, int(w.prompt_lens[i])).tolist()
        r = Request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=int(w.output_lens[i])), hold=True)
        sched.add_request(r)
        live[r.request_id] = [r]
    shared = private = 0
    forks = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        sched.update(plan, rng.integers(0, 32000, plan.num_seqs).astype(np.int32))
        used, alone = _held(sched)
        shared, private = shared + used, private + alone
        for key, beams in live.items():
            if not beams or any(not b.paused and not b.is_finished for b in beams):
                continue  # still computing (or done)
            if beams[0].is_finished:
                live[key] = []
                continue
            picks = sorted(rng.integers(0, len(beams), width).tolist())
            for i, b in enumerate(beams):
                if i not in picks:
                    sched.abort(b.request_id)
            kept, seen = [], set()
            for i in picks:
                b = beams[i]
                if i in seen:
                    forks += 1
                    child = Request(f"{b.request_id}.{forks}", b.prompt_token_ids, b.sampling_params,
                                    output_token_ids=b.output_token_ids[:-1] + [int(rng.integers(0, 32000))],
                                    hold=True)
                    sched.fork(b.request_id, child)
                    b = child
                seen.add(i)
                kept.append(b)
            for b in kept:
                sched.resume(b.request_id)
            live[key] = kept
    return {"shared": shared, "private": private}


# Memory saving of sharing reported by the vLLM paper (Kwon et al., SOSP 2023, section 6.3, Alpaca).
VLLM_PAPER_SAVING = {"parallel sampling": "6.1-9.8%", "beam search": "37.6-55.2%"}


def sharing_table(num_requests: int, block_size: int, seed: int) -> list[dict]:
    rows = []
    workloads = (("ShareGPT-like", sharegpt_like(num_requests, seed)), ("Alpaca-like", alpaca_like(num_requests, seed)))
    for name, w in workloads:
        for kind, run, sizes in (("parallel sampling", sharing_parallel, (2, 4, 6)),
                                 ("beam search", sharing_beam, (2, 4, 6))):
            for k in sizes:
                r = run(w, k, block_size, seed)
                saving = 1.0 - r["shared"] / r["private"]
                rows.append({"workload": name, "kind": kind, "k": k, "saving_pct": 100.0 * saving,
                             "capacity_gain": r["private"] / r["shared"]})
    print(f"\n{'workload':<15}{'sharing':<19}{'n/width':>8}{'KV saved':>10}{'fits x':>8}   vLLM paper (Alpaca)")
    for r in rows:
        print(f"{r['workload']:<15}{r['kind']:<19}{r['k']:>8}{r['saving_pct']:>9.1f}%{r['capacity_gain']:>8.2f}"
              f"   {VLLM_PAPER_SAVING[r['kind']]}")
    print("KV saved: 1 - blocks held with sharing / blocks the same requests hold with private copies, summed "
          "over steps;\nfits x: how many more such requests the same pool holds at once (an estimate of the "
          "throughput gain where KV memory is the limit)")
    return rows


# The model shape the KV dtype table sizes pages for: Llama 3 8B (GQA, 32 layers x 8 KV heads x 128 dims).
LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                        head_dim=128, intermediate_size=14336, dtype="bfloat16")
KV_DTYPES = ("float32", "bfloat16", "int8", "fp8")


def kv_dtype_table(w: Workload, kv_memory_bytes: int, block_size: int, max_model_len: int, max_num_seqs: int,
                   max_num_batched_tokens: int, seed: int, model: ModelConfig = LLAMA3_8B,
                   known: dict[int, dict] | None = None) -> list[dict]:
    """The same KV memory budget in each KV dtype: how many token slots it holds, and what the scheduler runs
    concurrently on it (the workload and timeline of `run_paged`; `known`: summaries of runs already made, by token
    slots)."""
    rows = []
    runs = dict(known or {})  # token slots -> the run's summary (int8 and fp8 pages hold the same: one run)
    for kv_dtype in KV_DTYPES:
        cache = CacheConfig(block_size=block_size, kv_memory_bytes=kv_memory_bytes, kv_dtype=kv_dtype)
        num_blocks = cache.resolve_num_blocks(model)
        slots = num_blocks * block_size
        if slots not in runs:
            runs[slots] = run_paged(w, slots, block_size, max_model_len, max_num_seqs, max_num_batched_tokens,
                                    seed).summary(slots)
        r = runs[slots]
        rows.append({"kv_dtype": kv_dtype, "bytes_per_token": cache.kv_bytes_per_token(model),
                     "kv_slots": num_blocks * block_size, "mean_concurrency": r["mean_concurrency"],
                     "peak_concurrency": r["peak_concurrency"], "waste_pct": r["waste_pct"],
                     "preemptions": r["preemptions"], "steps": r["steps"]})
    base = next(r for r in rows if r["kv_dtype"] == "bfloat16")
    print(f"\nKV dtypes: {kv_memory_bytes / 2**30:.2f} GiB of KV for a Llama-3-8B shape ({model.num_layers} layers x "
          f"{model.num_kv_heads} KV heads x {model.head_dim}), block {block_size}, the workload above")
    header = f"{'kv_dtype':<10}{'bytes/token':>12}{'token slots':>13}{'concurrency':>13}{'vs bf16':>9}{'peak':>6}" \
             f"{'KV waste':>10}{'preempt':>9}{'steps':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["concurrency_vs_bf16"] = r["mean_concurrency"] / base["mean_concurrency"]
        print(f"{r['kv_dtype']:<10}{r['bytes_per_token']:>12,}{r['kv_slots']:>13,}{r['mean_concurrency']:>13.1f}"
              f"{r['concurrency_vs_bf16']:>8.2f}x{r['peak_concurrency']:>6}{r['waste_pct']:>9.2f}%"
              f"{r['preemptions']:>9}{r['steps']:>7}")
    print("concurrency: mean running requests while others waited (the pool full); 8-bit bytes/token include "
          "the float32 scales")
    return rows


# DeepSeek V3's attention shape: 61 layers, 128 query heads; MLA caches a latent of 512 and a rotary key of 64
# per token and layer. The GQA-8 and MHA rows keep everything but what a token slot holds.
DEEPSEEK_V3_LAYERS, DEEPSEEK_V3_HEADS = 61, 128
ATTENTION_KINDS = {
    "MLA (512 + 64)": LatentAttention(kv_lora_rank=512, rope_dim=64),
    "GQA-8 x 128": FullAttention(num_kv_heads=8, head_dim=128),
    "MHA 128 x 128": FullAttention(num_kv_heads=128, head_dim=128),
}


def allocated_pool_bytes(spec: ModelSpec, cache: CacheConfig) -> int:
    """Bytes of the KV pool the engine allocates for `spec` under `cache` (`init_kv_cache`'s arrays, traced
    abstractly: nothing is allocated)."""
    import jax

    from pagedjax.device.kv_cache import init_kv_cache

    dtype = cache.kv_array_dtype(spec)
    pool = jax.eval_shape(lambda: init_kv_cache(spec.kv_layout, cache.resolve_num_blocks(spec), cache.block_size,
                                                dtype))
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(pool))


def attention_kind_table(kv_memory_bytes: int, block_size: int, seq_len: int = 4096) -> list[dict]:
    """One KV budget for a DeepSeek-V3-shaped model caching MLA latents, GQA-8 or MHA heads: bytes per token and
    the `seq_len`-token sequences the pool holds, from the specs and checked against the allocated pool."""
    rows = []
    blocks_per_seq = -(-seq_len // block_size)
    for kv_dtype in ("bfloat16", "fp8"):
        for name, layer in ATTENTION_KINDS.items():
            spec = ModelSpec(vocab_size=129280, num_layers=DEEPSEEK_V3_LAYERS, num_q_heads=DEEPSEEK_V3_HEADS,
                             kv_layers=(layer,) * DEEPSEEK_V3_LAYERS, dtype="bfloat16")
            cache = CacheConfig(block_size=block_size, kv_memory_bytes=kv_memory_bytes, kv_dtype=kv_dtype)
            allocated = allocated_pool_bytes(spec, cache)
            assert allocated == cache.pool_bytes(spec), (name, kv_dtype, allocated, cache.pool_bytes(spec))
            rows.append({"kind": name, "kv_dtype": kv_dtype, "bytes_per_token": cache.kv_bytes_per_token(spec),
                         "sequences": cache.resolve_num_blocks(spec) // blocks_per_seq, "allocated_bytes": allocated})
    mla = rows[0]
    print(f"\nattention kinds: {kv_memory_bytes / 2**30:.0f} GiB of KV for a DeepSeek-V3 shape "
          f"({DEEPSEEK_V3_LAYERS} layers, {DEEPSEEK_V3_HEADS} query heads), block {block_size}, {seq_len}-token "
          "sequences")
    header = f"{'KV per layer':<16}{'pages':<10}{'bytes/token':>12}{f'{seq_len}-token seqs':>17}{'vs MLA bf16':>13}" \
             f"{'allocated (checked)':>21}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["sequences_vs_mla"] = r["sequences"] / mla["sequences"]
        print(f"{r['kind']:<16}{r['kv_dtype']:<10}{r['bytes_per_token']:>12,}{r['sequences']:>17,}"
              f"{r['sequences_vs_mla']:>12.3f}x{r['allocated_bytes'] / 2**30:>17.2f} GiB")
    print("bytes/token: every layer's slot (fp8 pages with their float32 scale per vector); allocated: the bytes of "
          "the arrays the engine's pool has for that spec, equal to the spec's arithmetic")
    return rows


# The hybrid shapes of the groups table (bfloat16 KV): Gemma 3 27B (62 layers, every 6th global, window 1024; 16
# KV heads of 128) and gpt-oss-120b (36 layers alternating window 128 and full; 8 KV heads of 64).
HYBRIDS = {
    "gemma3-27b": ModelSpec(vocab_size=262208, num_layers=62, num_q_heads=32, dtype="bfloat16",
                            kv_layers=tuple(FullAttention(16, 128, 1024 if (i + 1) % 6 else None) for i in range(62))),
    "gpt-oss-120b": ModelSpec(vocab_size=201088, num_layers=36, num_q_heads=64, dtype="bfloat16",
                              kv_layers=tuple(FullAttention(8, 64, 128 if i % 2 == 0 else None) for i in range(36))),
}


def held_after_prefill(spec: ModelSpec, block_size: int, tokens: int, chunk: int, one_table: bool) -> int:
    """Blocks the real scheduler holds for one request of `tokens` prompt tokens at the end of its prefill: with
    the model's KV cache groups, or (`one_table`) every layer in one table that keeps every block."""
    windows = (None,) if one_table else spec.kv_layout.windows
    blocks = len(windows) * (tokens // block_size + 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=chunk, max_model_len=tokens + 2),
                      CacheConfig(block_size=block_size, enable_prefix_caching=False), blocks,
                      group_windows=windows)
    request = Request("r", list(range(tokens)), SamplingParams(temperature=0.0, max_tokens=2))
    sched.add_request(request)
    while not request.output_token_ids:
        plan = sched.schedule()
        sched.update(plan, np.ones(plan.num_seqs, np.int32))
    return sum(kv_memory_stats(sched.kv_cache_manager, sched.running, with_free_runs=False).group_blocks)


def groups_table(kv_memory_bytes: int, block_size: int, contexts=(8192, 32768, 131072), chunk: int = 8192,
                 measure: bool = True) -> list[dict]:
    """Per hybrid shape and context: KV bytes a sequence holds and sequences per pool, one table vs groups."""
    rows = []
    for name, spec in HYBRIDS.items():
        cache = CacheConfig(block_size=block_size, kv_memory_bytes=kv_memory_bytes, kv_dtype="bfloat16")
        grouped_block = cache.block_bytes(spec)
        one_block = block_size * cache.kv_bytes_per_token(spec)  # every layer in one block
        allocated = allocated_pool_bytes(spec, cache)
        assert allocated == cache.pool_bytes(spec), (name, allocated, cache.pool_bytes(spec))
        windows = spec.kv_layout.windows
        for tokens in contexts:
            # Held while decoding, from the specs: a full group every block, a window group those its window reads.
            held = sum(cdiv(tokens, block_size) - (0 if w is None else max(0, (tokens - w + 1) // block_size))
                       for w in windows)
            one = cdiv(tokens, block_size)
            if measure:  # the real scheduler at the end of the prefill
                assert held_after_prefill(spec, block_size, tokens, chunk, one_table=False) == held, (name, tokens)
                assert held_after_prefill(spec, block_size, tokens, chunk, one_table=True) == one, (name, tokens)
            # A request's peak (while its prefill chunk is computed, before the window groups release): what
            # admission checks fits the pool alone.
            peak = KVCacheManager(1, block_size, group_windows=windows).max_blocks_held(tokens, chunk)
            rows.append({"model": name, "tokens": tokens, "groups": spec.kv_layout.num_groups,
                         "one_table_bytes": one * one_block, "grouped_bytes": held * grouped_block,
                         "grouped_peak_bytes": peak * grouped_block,
                         "one_table_sequences": kv_memory_bytes // one_block // one,
                         "grouped_sequences": cache.resolve_num_blocks(spec) // held})
    print(f"\nKV cache groups: {kv_memory_bytes / 2**30:.0f} GiB of bfloat16 KV, block {block_size}, prefill chunks "
          f"of {chunk}")
    header = f"{'model':<14}{'tokens':>9}{'KV/seq one table':>18}{'KV/seq groups':>15}{'saving':>8}" \
             f"{'peak groups':>13}{'seqs one table':>16}{'seqs groups':>13}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["saving"] = r["one_table_bytes"] / r["grouped_bytes"]
        print(f"{r['model']:<14}{r['tokens']:>9,}{r['one_table_bytes'] / 2**30:>14.2f} GiB"
              f"{r['grouped_bytes'] / 2**30:>11.2f} GiB{r['saving']:>7.2f}x{r['grouped_peak_bytes'] / 2**30:>9.2f} GiB"
              f"{r['one_table_sequences']:>16,}{r['grouped_sequences']:>13,}")
    print("KV/seq: what a request of that many tokens holds while it decodes (checked against the scheduler's blocks "
          "after its prefill); peak: the most it holds at once, during a prefill chunk before its window groups "
          "release (what admission checks fits the pool); seqs: such requests decoding at once in the pool; the "
          "pool's arrays checked against the specs' bytes")
    print("layouts: " + "; ".join(f"{n}: {s.kv_layout.describe()}" for n, s in HYBRIDS.items()))
    return rows


MISTRAL_7B = ModelConfig(vocab_size=32000, hidden_size=4096, num_layers=32, num_q_heads=32, num_kv_heads=8,
                         head_dim=128, intermediate_size=14336, dtype="bfloat16", max_position_embeddings=32768,
                         sliding_windows=[4096] * 32)


def window_table(num_requests: int, prompt_len: int, output_len: int, kv_slots: int, block_size: int,
                 max_num_seqs: int, max_num_batched_tokens: int, seed: int, window: int = 4096) -> list[dict]:
    """Long generations on a sliding-window model (a Mistral-7B shape with `window` on every layer): the
    scheduler with and without releasing the blocks that fell out of every layer's window, on the same KV budget
    and workload."""
    model = MISTRAL_7B.replace(sliding_windows=[window] * MISTRAL_7B.num_layers)
    w = Workload(np.full(num_requests, prompt_len), np.full(num_requests, output_len))
    max_model_len = prompt_len + output_len
    bytes_per_token = CacheConfig(kv_dtype="bfloat16").kv_bytes_per_token(model)
    rows = []
    for name, window in (("keep every block", None), (f"release out of window {model.kv_window}", model.kv_window)):
        t = run_paged(w, kv_slots, block_size, max_model_len, max_num_seqs, max_num_batched_tokens, seed,
                      sliding_window=window)
        r = t.summary(kv_slots)
        rows.append({"policy": name, "mean_concurrency": r["mean_concurrency"],
                     "peak_concurrency": r["peak_concurrency"],
                     "peak_kv_tokens_per_request": max(u / max(n, 1) for u, n in zip(t.used, t.running, strict=True)),
                     "preemptions": r["preemptions"], "steps": r["steps"]})
    print(f"\nsliding window: {num_requests} requests of {prompt_len} + {output_len} tokens on a Mistral-7B shape "
          f"(window {model.kv_window}), {kv_slots} KV slots ({kv_slots * bytes_per_token / 2**30:.1f} GiB of bf16 KV), "
          f"block {block_size}")
    header = f"{'policy':<30}{'concurrency':>12}{'peak':>6}{'KV tokens/request':>19}{'preempt':>9}{'steps':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['policy']:<30}{r['mean_concurrency']:>12.1f}{r['peak_concurrency']:>6}"
              f"{r['peak_kv_tokens_per_request']:>19.0f}{r['preemptions']:>9}{r['steps']:>7}")
    print("KV tokens/request: the most cached tokens per running request at any step")
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--kv-slots", type=int, default=65536, help="KV budget in token slots")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--timing-requests", type=int, default=256)
    p.add_argument("--timing-iters", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("out/bench_memory.png"))
    p.add_argument("--quick", action="store_true", help="small workload and few timing iterations")
    p.add_argument("--sharing-requests", type=int, default=200, help="requests per sharing workload")
    p.add_argument("--window-requests", type=int, default=64, help="requests of the sliding-window table")
    p.add_argument("--window-output-len", type=int, default=12288, help="tokens each of them generates")
    p.add_argument("--window", type=int, default=4096, help="the sliding window of the window table's model")
    p.add_argument("--kv-memory", type=int, default=None, metavar="BYTES",
                   help="KV budget of the KV dtype table (default: --kv-slots tokens of bfloat16 KV)")
    p.add_argument("--attention-kv-memory", type=int, default=64 * 2**30, metavar="BYTES",
                   help="KV budget of the attention-kind table (default 64 GiB)")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.kv_slots, args.timing_iters, args.sharing_requests = 120, 16384, 10, 12
        args.window_requests, args.window_output_len, args.window = 6, 1500, 512

    w = sharegpt_like(args.num_requests, args.seed)
    print(f"workload: {w.num_requests} requests; prompt tokens mean {w.prompt_lens.mean():.0f} "
          f"(p50 {np.median(w.prompt_lens):.0f}, max {w.prompt_lens.max()}), output tokens mean "
          f"{w.output_lens.mean():.0f} (p50 {np.median(w.output_lens):.0f}, max {w.output_lens.max()})")
    print(f"KV budget {args.kv_slots} slots, max_model_len {args.max_model_len}, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}\n")
    common = (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens)
    traces = [
        run_paged(w, args.kv_slots, args.block_size, *common, seed=args.seed),
        run_contiguous(w, args.kv_slots, *common, exact=False),
        run_contiguous(w, args.kv_slots, *common, exact=True),
    ]
    rows = [t.summary(args.kv_slots) for t in traces]
    header = f"{'allocator':<18}{'concurrency':>12}{'peak':>6}{'KV waste':>10}{'occupancy':>11}" \
             f"{'fail|free':>10}{'preempt':>9}{'steps':>7}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['allocator']:<18}{r['mean_concurrency']:>12.1f}{r['peak_concurrency']:>6}"
              f"{r['waste_pct']:>9.2f}%{r['mean_occupancy_pct']:>10.1f}%{r['failures_despite_free']:>10}"
              f"{r['preemptions']:>9}{r['steps']:>7}")
    ratio = rows[0]["mean_concurrency"] / max(rows[1]["mean_concurrency"], 1e-9)
    print(f"\npaged / max-length concurrency: {ratio:.1f}x   (targets: paged waste < 4%, "
          f"ideally < 2% at block 16; >= 3x concurrency)")
    plot(traces, args.kv_slots, args.plot)
    print(f"occupancy plot: {args.plot}")

    timing = time_scheduler(args.timing_requests, args.timing_iters, args.block_size, args.seed)
    print(f"\nscheduler: {timing['schedule_us_median']:.0f} us median per schedule() "
          f"(mean {timing['schedule_us_mean']:.0f}), {timing['update_us_median']:.0f} us per update(), "
          f"with {timing['num_running']} running requests")
    sharing = sharing_table(args.sharing_requests, args.block_size, args.seed)
    kv_memory = args.kv_memory or args.kv_slots * CacheConfig(kv_dtype="bfloat16").kv_bytes_per_token(LLAMA3_8B)
    kv_dtypes = kv_dtype_table(w, kv_memory, args.block_size, *common, seed=args.seed,
                               known={args.kv_slots: rows[0]})  # the paged run above, of the same slots
    attention_kinds = attention_kind_table(args.attention_kv_memory, args.block_size)
    groups = groups_table(args.attention_kv_memory, args.block_size, contexts=(8192,) if args.quick else
                          (8192, 32768, 131072))
    windows = window_table(args.window_requests, 256 if args.quick else 1024, args.window_output_len,
                           4096 if args.quick else args.kv_slots, args.block_size,
                           args.max_num_seqs, args.max_num_batched_tokens, args.seed, args.window)
    return {"rows": rows, "concurrency_ratio": ratio, "timing": timing, "sharing": sharing, "kv_dtypes": kv_dtypes,
            "windows": windows, "attention_kinds": attention_kinds, "groups": groups}


if __name__ == "__main__":
    main()
