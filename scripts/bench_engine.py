"""Engine throughput on the CPU: pagedjax (1-step and N-step decode) vs a plain contiguous-KV-cache loop.

    python scripts/bench_engine.py                 # default workload
    python scripts/bench_engine.py --quick         # seconds; used by the smoke test
    python scripts/bench_engine.py --hf PATH       # also: pagedjax vs transformers' generate on a HF folder
    python scripts/bench_engine.py --model 156m --batch 1 --prompt-len 32 --max-tokens 128 --hlo-stats

All rows come from one run on the same random model and batch (greedy, fixed lengths), timed after a
warm-up run that compiles everything, so ratios between rows are meaningful even on a noisy machine.
The baseline is what a user would write without paging: a `[layers, batch, kv_heads, max_len, head_dim]`
cache, a jitted decode step called from Python per token (donated cache), and the same step fused into a
`lax.fori_loop`.
"""

from __future__ import annotations

import argparse
import functools
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.cache import kv_cache_bytes
from pagedjax.config.fields import dtype_bytes
from pagedjax.model.llama import Llama, init_model


# ------------------------------------------------------------------------------------- contiguous baseline
def _contiguous_forward(model: Llama, tokens, positions, k_cache, v_cache, valid_len):
    """tokens `[B, S]` at `positions [S]` (same for every row); caches `[L, B, Hkv, T, D]`."""
    cfg = model.config
    x = model.embed_tokens(tokens)
    b, s, _ = x.shape
    g = cfg.num_q_heads // cfg.num_kv_heads
    t_max = k_cache.shape[3]
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.q_proj(h).reshape(b, s, cfg.num_q_heads, cfg.head_dim)
        k = attn.k_proj(h).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        v = attn.v_proj(h).reshape(b, s, cfg.num_kv_heads, cfg.head_dim)
        q, k = attn.rope(q, positions[None, :]), attn.rope(k, positions[None, :])
        start = positions[0]
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 1, 3)[None].astype(k_cache.dtype),
                                               (i, 0, 0, start, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3)[None].astype(v_cache.dtype),
                                               (i, 0, 0, start, 0))
        qg = q.reshape(b, s, cfg.num_kv_heads, g, cfg.head_dim).astype(jnp.float32)
        scores = jnp.einsum("bskgd,bktd->bkgst", qg, k_cache[i].astype(jnp.float32)) * cfg.head_dim ** -0.5
        keep = (jnp.arange(t_max)[None, :] <= positions[:, None]) & (jnp.arange(t_max)[None, :] < valid_len)
        probs = jax.nn.softmax(jnp.where(keep, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgst,bktd->bskgd", probs, v_cache[i].astype(jnp.float32)).astype(x.dtype)
        x = x + attn.o_proj(o.reshape(b, s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = model.compute_logits(model.norm(x[:, -1]))
    return jnp.argmax(logits, -1).astype(jnp.int32), k_cache, v_cache


class ContiguousBaseline:
    def __init__(self, model: Llama, batch: int, max_len: int):
        cfg = model.config
        self.graphdef, self.state = nnx.split(model)
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.shape, self.dtype = shape, jnp.dtype(cfg.dtype)
        gd = self.graphdef

        @functools.partial(jax.jit, donate_argnums=(2, 3))
        def prefill(state, tokens, k, v):
            positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
            return _contiguous_forward(nnx.merge(gd, state), tokens, positions, k, v, tokens.shape[1])

        @functools.partial(jax.jit, donate_argnums=(2, 3))
        def decode(state, tokens, k, v, pos):
            return _contiguous_forward(nnx.merge(gd, state), tokens[:, None], pos[None], k, v, pos + 1)

        @functools.partial(jax.jit, donate_argnums=(2, 3), static_argnums=(5,))
        def decode_loop(state, tokens, k, v, pos, n):
            def body(i, carry):
                tok, k, v, out = carry
                tok, k, v = _contiguous_forward(nnx.merge(gd, state), tok[:, None], (pos + i)[None], k, v,
                                                pos + i + 1)
                return tok, k, v, out.at[:, i].set(tok)
            out = jnp.zeros((tokens.shape[0], n), jnp.int32)
            _, k, v, out = jax.lax.fori_loop(0, n, body, (tokens, k, v, out))
            return out, k, v

        self._prefill, self._decode, self._loop = prefill, decode, decode_loop

    def generate(self, prompts: np.ndarray, max_tokens: int, fused: bool) -> np.ndarray:
        k = jnp.zeros(self.shape, self.dtype)
        v = jnp.zeros(self.shape, self.dtype)
        tok, k, v = self._prefill(self.state, jnp.asarray(prompts), k, v)
        pos = prompts.shape[1]
        if fused:
            out, k, v = self._loop(self.state, tok, k, v, jnp.int32(pos), max_tokens - 1)
            return np.concatenate([np.asarray(tok)[:, None], np.asarray(out)], axis=1)
        out = [tok]
        for i in range(max_tokens - 1):
            tok, k, v = self._decode(self.state, tok, k, v, jnp.int32(pos + i))
            out.append(tok)
        return np.asarray(jnp.stack(out, axis=1))


SHAPES = {
    "small": ModelConfig(),
    "tiny": ModelConfig(hidden_size=64, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=16,
                        intermediate_size=128),
    # The real-size shape of the peer comparison: 156M parameters, 623 MB of float32 weights.
    "156m": ModelConfig(vocab_size=32000, hidden_size=1024, num_layers=8, num_q_heads=16, num_kv_heads=4,
                        head_dim=64, intermediate_size=2816, tie_word_embeddings=False),
}


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """The machine's memory bandwidth in bytes/s, measured now: a large numpy copy moves 2x its size
    (read + write); best of `repeats`."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    return 2 * nbytes / _time(lambda: np.copyto(dst, src), repeats)


_HLO_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w\-]*)\(")


def hlo_stats(hlo_text: str) -> dict[str, int]:
    """Instruction counts by opcode over every computation of an optimized HLO module."""
    counts: dict[str, int] = {}
    for line in hlo_text.splitlines():
        if m := _HLO_INSTRUCTION.match(line):
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def print_hlo_stats(engine: LLMEngine) -> None:
    """The compiled programs of an engine's 1-step decode (and fused decode), by opcode."""
    print("\nHLO of the compiled steps (all computations):")
    print(f"{'program':54s} {'instructions':>12s} {'fusion':>7s} {'dot':>5s} {'copy':>5s} {'scatter':>8s} "
          f"{'gather':>7s} {'transpose':>10s}")
    for key, exe in engine.runner.programs.executables.items():
        c = hlo_stats(exe.as_text())
        print(f"{str(key)[:54]:54s} {sum(c.values()):12d} {c.get('fusion', 0):7d} {c.get('dot', 0):5d} "
              f"{c.get('copy', 0):5d} {c.get('scatter', 0):8d} {c.get('gather', 0):7d} {c.get('transpose', 0):10d}")


def decode_weight_bytes(model: Llama) -> int:
    """Bytes of the weights one decode step reads: every parameter but the input embedding table (a step reads
    one row of it), unless the embeddings are tied to the output projection (then the LM head reads it all)."""
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    return total if model.config.tie_word_embeddings else total - model.embed_tokens.embedding[...].nbytes


# ------------------------------------------------------------------------------------------------ runner
def _time(fn, repeats: int) -> float:
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(cfg: ModelConfig, batch: int, prompt_len: int, max_tokens: int, block_size: int, repeats: int,
        fused_steps: int, hlo: bool = False) -> list[dict]:
    """Every implementation is warmed up (compiled) first, then timed in interleaved rounds (one run of
    each per round, so machine noise hits all rows alike); a row's time is its best round."""
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    total = prompt_len + max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    num_blocks = batch * -(-total // block_size) + 8
    rows: list[dict] = []
    engines: dict[str, LLMEngine] = {}

    def engine_row(num_steps: int) -> None:
        name = f"pagedjax engine, num_steps={num_steps}"
        engine = engines[name] = LLMEngine(
            model_config=cfg, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                       enable_prefix_caching=False),
            scheduler_config=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                                             max_model_len=total), params=model, decode_steps_per_call=num_steps)
        row = dict(name=name, host_share=None)

        def go():
            outs = engine.generate([p.tolist() for p in prompts], params, use_tqdm=False)
            row["tokens"] = np.array([o.output_token_ids for o in outs])

        rows.append(dict(row, go=go, row=row))

    engine_row(1)
    engine_row(fused_steps)
    base = ContiguousBaseline(model, batch, total)
    for fused in (False, True):
        row = dict(name="contiguous cache, " + ("fori_loop decode" if fused else "python loop decode"),
                   host_share=None)

        def go(fused=fused, row=row):
            row["tokens"] = base.generate(prompts, max_tokens, fused)

        rows.append(dict(row, go=go, row=row))
    for r in rows:
        r["go"]()  # warm-up: compiles every shape
    before = {name: e.stats() for name, e in engines.items()}
    times: dict[str, list[float]] = {r["name"]: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            start = time.perf_counter()
            r["go"]()
            times[r["name"]].append(time.perf_counter() - start)
    out = []
    for r in rows:
        share = None
        if r["name"] in engines:
            after, b = engines[r["name"]].stats(), before[r["name"]]
            share = ((after.elapsed_s - b.elapsed_s) - (after.device_s - b.device_s)) / (after.elapsed_s - b.elapsed_s)
            if hlo:
                print(f"\n{r['name']}:", end="")
                print_hlo_stats(engines[r["name"]])
        out.append(dict(name=r["name"], seconds=min(times[r["name"]]), host_share=share, tokens=r["row"]["tokens"]))
    return out


def print_table(rows: list[dict], batch: int, max_tokens: int, cfg: ModelConfig, total: int,
                bandwidth: float, weight_bytes: int) -> None:
    base = next(r for r in rows if r["name"].endswith("python loop decode"))
    one = rows[0]
    print(f"\nbatch {batch}, {max_tokens} new tokens each, model {cfg.num_layers}L h{cfg.hidden_size} "
          f"q{cfg.num_q_heads}/kv{cfg.num_kv_heads}, backend {jax.default_backend()}")
    print(f"{'implementation':42s} {'time s':>8s} {'tok/s':>9s} {'ms/token-step':>14s} {'vs 1-step':>10s} "
          f"{'vs contiguous':>14s} {'host share':>11s} {'same tokens':>12s}")
    for r in rows:
        tps = batch * max_tokens / r["seconds"]
        same = bool(np.array_equal(r["tokens"], base["tokens"]))
        host = "-" if r["host_share"] is None else f"{100 * r['host_share']:.0f}%"
        print(f"{r['name']:42s} {r['seconds']:8.3f} {tps:9.1f} {1000 * r['seconds'] / max_tokens:14.2f} "
              f"{one['seconds'] / r['seconds']:9.2f}x {base['seconds'] / r['seconds']:13.2f}x {host:>11s} "
              f"{str(same):>12s}")
    print(f"\nmemory bandwidth (numpy copy of 256 MiB, read + write, this run): {bandwidth / 1e9:.1f} GB/s; a decode "
          f"step reads {weight_bytes / 1e6:.0f} MB of weights (all but an untied input embedding table), so at batch "
          f"{batch} the weight-read rate (those bytes / ms per token-step, prefill included) is:")
    for r in rows:
        rate = weight_bytes * max_tokens / r["seconds"]
        print(f"  {r['name']:42s} {rate / 1e9:6.1f} GB/s = {100 * rate / bandwidth:5.1f}% of the bandwidth")
    per_token = kv_cache_bytes(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, dtype_bytes(cfg.dtype))
    budget = 64 * 2**20
    print(f"\nconcurrency in a {budget >> 20} MiB KV budget ({per_token} B/token): contiguous reserving "
          f"max_model_len={4 * total} per request: {budget // (per_token * 4 * total)} requests; "
          f"paged holding the {total} tokens actually used: {budget // (per_token * total)} requests")


def run_parallel_sampling(cfg: ModelConfig, n: int, prompt_len: int, max_tokens: int, block_size: int,
                          repeats: int, fused_steps: int) -> list[dict]:
    """One prompt, n samples (temperature 1, seeds s..s+n-1): one request with `SamplingParams(n=n)` (one
    prefill, forked KV) against n single requests (prefix caching off, then on). Interleaved rounds; a row's
    time is its best round. The samples must equal the single requests token for token."""
    model = init_model(cfg, seed=0)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, prompt_len).tolist()
    total = prompt_len + max_tokens
    num_blocks = n * -(-total // block_size) + 8
    sampled = dict(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)

    def engine(caching: bool) -> LLMEngine:
        return LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                                                    enable_prefix_caching=caching),
                         scheduler_config=SchedulerConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=max(n,
                                                                                                             prompt_len),
                                                          max_model_len=total), params=model,
                         decode_steps_per_call=fused_steps)

    rows = []
    for name, caching, forked in ((f"1 request, n={n} (forked KV)", False, True),
                                  (f"{n} requests, prefix caching off", False, False),
                                  (f"{n} requests, prefix caching on", True, False)):
        e = engine(caching)
        row = dict(name=name, engine=e, peak=0)

        def go(e=e, forked=forked, row=row):
            e.scheduler.reset_prefix_cache()
            if forked:
                e.add_request("r", prompt, SamplingParams(n=n, seed=1, **sampled))
            else:
                for i in range(n):
                    e.add_request(f"r{i}", prompt, SamplingParams(seed=1 + i, **sampled))
            done = {}
            before = e.stats().prefill_tokens_computed
            while e.has_unfinished_requests():
                for o in e.step():
                    if o.finished:
                        done[o.request_id] = o
                row["peak"] = max(row["peak"], e.scheduler.kv_cache_manager.block_pool.num_used)
            row["prefill"] = e.stats().prefill_tokens_computed - before
            row["tokens"] = ([c.token_ids for c in done["r"].outputs] if forked
                             else [done[f"r{i}"].output_token_ids for i in range(n)])

        row["go"] = go
        rows.append(row)
    for r in rows:
        r["go"]()  # warm-up: compiles every shape
    times: dict[str, list[float]] = {r["name"]: [] for r in rows}
    for _ in range(repeats):
        for r in rows:
            start = time.perf_counter()
            r["go"]()
            times[r["name"]].append(time.perf_counter() - start)
    print(f"\nparallel sampling: prompt {prompt_len} tokens, n={n} samples x {max_tokens} tokens, "
          f"{fused_steps} fused decode steps, model {cfg.num_layers}L h{cfg.hidden_size}")
    print(f"{'run':36s} {'time s':>8s} {'tok/s':>8s} {'vs n requests':>14s} {'prefill tokens':>15s} "
          f"{'peak KV blocks':>15s} {'same tokens':>12s}")
    base = min(times[rows[1]["name"]])
    for r in rows:
        t = min(times[r["name"]])
        print(f"{r['name']:36s} {t:8.3f} {n * max_tokens / t:8.1f} {base / t:13.2f}x {r['prefill']:15d} "
              f"{r['peak']:15d} {str(r['tokens'] == rows[1]['tokens']):>12s}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-steps", type=int, default=8, help="fused decode steps for the fused-decode row")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=sorted(SHAPES), default="small",
                    help="model shape: small = ModelConfig() (4 layers, hidden 256), tiny = 2 layers, hidden 64, "
                         "156m = hidden 1024, 8 layers, vocab 32000")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="the model's dtype (default: float32)")
    ap.add_argument("--hlo-stats", action="store_true",
                    help="print the compiled steps' HLO instruction counts (fusions, dots, copies, ...)")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    ap.add_argument("--hf", metavar="PATH", help="also compare with transformers on this local HF folder")
    ap.add_argument("--n", type=int, default=None,
                    help="parallel sampling instead: one prompt of --prompt-len tokens, N samples, forked KV vs N "
                         "separate requests")
    args = ap.parse_args(argv)
    cfg = SHAPES[args.model]
    if args.dtype:
        cfg = cfg.replace(dtype=args.dtype)
    if args.quick:
        cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=16,
                          intermediate_size=64)
        args.batch, args.prompt_len, args.max_tokens, args.repeats = 2, 8, 6, 1
    if args.n is not None:
        run_parallel_sampling(cfg, args.n, args.prompt_len, args.max_tokens, args.block_size, args.repeats,
                              args.num_steps)
        return
    bandwidth = copy_bandwidth()
    rows = run(cfg, args.batch, args.prompt_len, args.max_tokens, args.block_size, args.repeats, args.num_steps,
               hlo=args.hlo_stats)
    weight_bytes = decode_weight_bytes(init_model(cfg, seed=0))
    print_table(rows, args.batch, args.max_tokens, cfg, args.prompt_len + args.max_tokens, bandwidth, weight_bytes)
    if args.hf:
        from bench_hf import main as hf_main

        hf_main(["--model", args.hf, "--batch", str(args.batch), "--max-tokens", str(args.max_tokens)])


if __name__ == "__main__":
    main()
