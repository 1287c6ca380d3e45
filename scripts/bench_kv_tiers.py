"""Multi-turn chat with and without the KV tiers (`CacheConfig.kv_host_memory_bytes`, `kv_disk_dir`): each turn of
each conversation re-sends its whole history, the conversations take turns, and the device pool holds a fraction of
what they have computed (their working set is `--pressure` times the pool), so without a tier most of each history
is evicted before its next turn and recomputed; with one, it is loaded back from host memory, or from files when the
host tier is too small (host + disk: a host tier of the device pool's size over a disk tier of twice the working
set).

    python scripts/bench_kv_tiers.py                      # the small model, pools of 1/4 and 1/10 of the working set
    python scripts/bench_kv_tiers.py --shape 156m --conversations 8 --turns 4

Prints one row per (pressure, tiers): time to first token p50 / p99 over every turn after the first, output tokens
per second over the whole run, prefix-hit tokens (all, from host or disk) and blocks moved; and whether every
configuration produced the same tokens (greedy: the tiers must not change them). Each engine first runs the same
turns over other tokens (every program compiled), then empties its prefix cache and host tier, then is measured,
then saves its device's cached blocks to the disk tier (`save_kv_tiers`, as a server does at shutdown).
Then a restart: a new engine (its programs compiled first, over other tokens) sends every conversation's whole
history once, with the disk tier the last host + disk run left (each run's files are in a folder of its own under a
temporary one, or `--disk-dir`) and without: time to first token. Last, the copy rate of the host tier's own moves
(64 blocks out, then in) against a numpy memcpy, the machine's limit.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.core.host_tier import TierMoves  # noqa: E402

SHAPES = {
    "small": ModelConfig(),
    "156m": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_q_heads=16, num_kv_heads=4,
                        head_dim=64, intermediate_size=2816, tie_word_embeddings=False),
}


def conversations(engine: LLMEngine, cfg: ModelConfig, args, seed: int
                  ) -> tuple[list[float], list, int, float, list]:
    """Every conversation's turns, round-robin: (time to first token of each turn after the first, the tokens of
    every turn, tokens generated, seconds, every conversation's final history)."""
    rng = np.random.default_rng(seed)
    histories = [rng.integers(0, cfg.vocab_size, args.system).tolist() for _ in range(args.conversations)]
    params = SamplingParams(max_tokens=args.reply, temperature=0.0, ignore_eos=True)
    ttfts, outputs, generated = [], [], 0
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            history.extend(rng.integers(0, cfg.vocab_size, args.user).tolist())
            rid = f"{c}-{turn}"
            first, tokens = ask(engine, rid, history, params)
            if turn:
                ttfts.append(first)
            history.extend(tokens)
            outputs.append(tokens)
            generated += len(tokens)
    return ttfts, outputs, generated, time.perf_counter() - start, histories


def ask(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[float, list[int]]:
    """One request alone: (seconds to its first token, its tokens)."""
    t0 = time.perf_counter()
    engine.add_request(rid, list(prompt), params)
    first, tokens = None, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.output_token_ids:
                first = time.perf_counter() - t0
            tokens = out.output_token_ids
    return first, tokens


def make_engine(cfg: ModelConfig, args, num_blocks: int, host_bytes: int | None, disk_dir: str | None,
                disk_bytes: int | None = None) -> LLMEngine:
    return LLMEngine(model_config=cfg, seed=0,
                     cache_config=CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                                              kv_host_memory_bytes=host_bytes, kv_disk_dir=disk_dir,
                                              kv_disk_bytes=disk_bytes),
                     scheduler_config=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=args.chunk,
                                                      max_model_len=args.max_len))


def run(cfg: ModelConfig, args, num_blocks: int, host_bytes: int | None, disk_dir: str | None,
        disk_bytes: int | None) -> dict:
    engine = make_engine(cfg, args, num_blocks, host_bytes, disk_dir, disk_bytes)
    conversations(engine, cfg, args, args.seed + 1)  # other tokens, the same shapes: every program compiled
    assert engine.scheduler.reset_prefix_cache()  # the device pool and the host tier empty again
    before, stats_before = engine.stats().scheduler, engine.stats()
    ttfts, outputs, generated, seconds, histories = conversations(engine, cfg, args, args.seed)
    engine.save_kv_tiers()  # as a server does at shutdown: the blocks still on the device go to disk too
    stats = engine.stats()
    sched = stats.scheduler
    return dict(ttft_p50=statistics.median(ttfts), ttft_p99=float(np.percentile(ttfts, 99)),
                tok_s=generated / seconds, seconds=seconds, hits=sched.prefix_cache_hits - before.prefix_cache_hits,
                host_hits=sched.host_hit_tokens - before.host_hit_tokens,
                stored=sched.host_blocks_stored - before.host_blocks_stored,
                loaded=sched.host_blocks_loaded - before.host_blocks_loaded,
                disk_read=sched.disk_blocks_read - before.disk_blocks_read,
                disk_written=sched.disk_blocks_written - before.disk_blocks_written,
                disk_s=stats.disk_s - stats_before.disk_s, outputs=outputs, histories=histories)


def restart(cfg: ModelConfig, args, num_blocks: int, host_bytes: int | None, disk_dir: str | None,
            disk_bytes: int | None, histories: list) -> dict:
    """A new engine sends every conversation's whole history once (one token each): the first requests after a
    restart. Its programs are compiled first, over other tokens of the same lengths, twice: every step's own
    program, and the moves of the second pass's hits (with a disk tier, those go to the files too: twice the
    working set has room for both)."""
    engine = make_engine(cfg, args, num_blocks, host_bytes, disk_dir, disk_bytes)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(args.seed + 2)
    warm = [rng.integers(0, cfg.vocab_size, len(h)).tolist() for h in histories]
    for i, prompt in enumerate(warm + warm):
        ask(engine, f"warm-{i}", prompt, params)
    assert engine.scheduler.reset_prefix_cache()
    before = engine.stats().scheduler
    ttfts = [ask(engine, f"again-{i}", h, params)[0] for i, h in enumerate(histories)]
    sched = engine.stats().scheduler
    return dict(ttft_p50=statistics.median(ttfts), ttft_p99=float(np.percentile(ttfts, 99)),
                hits=sched.prefix_cache_hits - before.prefix_cache_hits,
                disk_read=sched.disk_blocks_read - before.disk_blocks_read)


def _best(fn, repeats: int = 5) -> float:
    fn()  # compiled, caches warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_rates(cfg: ModelConfig, args, num_blocks: int = 64) -> tuple[float, float, float, int]:
    """(store, load, numpy memcpy bytes/s, bytes per block): `num_blocks` blocks moved out to the host tier and
    back in by the runner's own moves, against one large numpy copy (read + write) on this machine."""
    block_bytes = CacheConfig(block_size=args.block_size).block_bytes(cfg)
    engine = LLMEngine(model_config=cfg, seed=0, cache_config=CacheConfig(
        block_size=args.block_size, num_blocks=num_blocks, kv_host_memory_bytes=num_blocks * block_bytes))
    runner = engine.runner
    pairs = [(b, b) for b in range(num_blocks)]

    def move(moves: TierMoves) -> None:
        runner.kv_cache = runner.host_blocks.move(runner.kv_cache, (moves,))
        runner.kv_cache.layers[0][0].block_until_ready()

    nbytes = num_blocks * block_bytes
    store = nbytes / _best(lambda: move(TierMoves(stores=pairs)))
    load = nbytes / _best(lambda: move(TierMoves(loads=pairs)))
    src = np.ones(max(nbytes, 64 * 2**20) // 8)
    dst = np.empty_like(src)
    memcpy = 2 * src.nbytes / _best(lambda: np.copyto(dst, src))
    return store, load, memcpy, block_bytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="small")
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=96, help="tokens each conversation starts with")
    p.add_argument("--user", type=int, default=32, help="tokens each turn adds before the reply")
    p.add_argument("--reply", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens: the prefill chunk")
    p.add_argument("--pressure", type=float, nargs="+", default=[4.0, 10.0],
                   help="working set (every conversation's final history) over the device pool")
    p.add_argument("--host-factor", type=float, default=2.0, help="host tier bytes over the working set's")
    p.add_argument("--disk-dir", default=None, help="the disk tier's folder (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    cfg = SHAPES[args.shape]
    final = args.system + args.turns * (args.user + args.reply)
    args.max_len = final + args.block_size
    working_blocks = args.conversations * -(-final // args.block_size)
    block_bytes = CacheConfig(block_size=args.block_size).block_bytes(cfg)
    longest = -(-args.max_len // args.block_size)
    disk_bytes = 2 * working_blocks * block_bytes
    folder = tempfile.TemporaryDirectory() if args.disk_dir is None else None
    disk_dir = args.disk_dir or folder.name
    rows, first, last_disk = [], None, None
    for pressure in args.pressure:
        num_blocks = max(longest, int(working_blocks / pressure))
        big_host = int(args.host_factor * working_blocks * block_bytes)
        # Each run's disk tier in a folder of its own: none finds what an earlier run computed.
        run_dir = str(Path(disk_dir, f"pressure-{pressure}"))
        for host, disk in ((None, None), (big_host, None), (num_blocks * block_bytes, run_dir)):
            r = run(cfg, args, num_blocks, host, disk, None if disk is None else disk_bytes)
            same = first is None or r["outputs"] == first
            first = first or r["outputs"]
            rows.append((num_blocks, host, disk, r, same))
            if disk is not None:
                last_disk = (num_blocks, host, disk, r["histories"])
    print(f"{args.shape} model, {args.conversations} conversations x {args.turns} turns (system {args.system}, "
          f"+{args.user} user, {args.reply} reply tokens), blocks of {args.block_size} ({block_bytes} bytes), "
          f"working set {working_blocks} blocks")
    print("| working set / pool | pool blocks | tiers | TTFT p50 ms | TTFT p99 ms | output tok/s | "
          "hit tokens (host / disk blocks) | host blocks stored / loaded | disk blocks written / read (s) | "
          "same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for num_blocks, host, disk, r, same in rows:
        tier = "none" if host is None else f"host {host / 2**20:.1f} MiB"
        tier += "" if disk is None else f" + disk {disk_bytes / 2**20:.1f} MiB"
        print(f"| {working_blocks / num_blocks:.1f}x | {num_blocks} | {tier} | {1e3 * r['ttft_p50']:.1f} | "
              f"{1e3 * r['ttft_p99']:.1f} | {r['tok_s']:.1f} | {r['hits']} ({r['host_hits']} / {r['disk_read']}) | "
              f"{r['stored']} / {r['loaded']} | {r['disk_written']} / {r['disk_read']} ({r['disk_s']:.3f}) | "
              f"{'yes' if same else 'NO'} |")
    num_blocks, host, run_dir, histories = last_disk
    print(f"\nrestart: a new engine ({num_blocks} pool blocks) sends each of the {len(histories)} final histories "
          f"({sum(map(len, histories))} tokens) once")
    print("| tiers | TTFT p50 ms | TTFT p99 ms | hit tokens | disk blocks read |")
    print("|---|---|---|---|---|")
    for disk in (None, run_dir):
        r = restart(cfg, args, num_blocks, host, disk, None if disk is None else disk_bytes, histories)
        tier = f"host {host / 2**20:.1f} MiB" + ("" if disk is None else f" + disk {disk_bytes / 2**20:.1f} MiB")
        print(f"| {tier} | {1e3 * r['ttft_p50']:.1f} | {1e3 * r['ttft_p99']:.1f} | {r['hits']} | "
              f"{r['disk_read']} |")
    if folder is not None:
        folder.cleanup()
    store, load, memcpy, block_bytes = copy_rates(cfg, args)
    print(f"\nmoves of 64 blocks of {block_bytes / 2**10:.0f} KiB: store (device to host) {store / 1e9:.2f} GB/s, "
          f"load (host to device) {load / 1e9:.2f} GB/s; numpy memcpy (read + write) {memcpy / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
