"""What a run prints besides completions: the header (model and engine), and the statistics table or `--json`."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from pagedjax.cli.generation import Generation, Peak
from pagedjax.cli.warm_start import CompileCache


def stats_summary(stats, peak: Peak, wall_s: float, num_requests: int,
                  compile_cache: CompileCache) -> dict[str, int | float]:
    """The run's statistics as numbers, each key naming its unit (`_s` seconds, `_pct` percent, ...)."""
    num_blocks = stats.scheduler.memory.num_blocks
    return {
        "requests": num_requests,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": stats.tokens_per_s,  # generated tokens over step time, compilation excluded
        "step_time_s": stats.step_s,  # inside engine steps, compilation excluded
        "elapsed_s": stats.elapsed_s,  # inside engine steps, compilation included
        "compile_s": stats.compile_s,  # steps' waits for programs (compiled or loaded): a draft's, the encoder's too
        "warmup_s": stats.warmup_s,  # --warmup's compiles and runs (in neither of the above)
        # Programs, counted one way (the target's steps, a draft model's, the image encoder's; the warm-up's included):
        "compilations": stats.compilations,  # obtained: compiled, or loaded from the persistent compilation cache
        "programs_compiled": stats.programs_compiled,
        "programs_loaded": stats.programs_loaded,
        "compile_cache_hits": stats.programs_loaded,  # = programs_loaded (0 with the cache off)
        "compile_cache_misses": stats.programs_compiled if compile_cache.folder is not None else 0,  # compiled and
        #                                                                      saved to the cache
        "engine_steps": stats.steps,
        "kv_blocks": num_blocks,
        "kv_blocks_used_peak": peak.blocks_used,
        "kv_blocks_used_peak_pct": 100.0 * peak.blocks_used / num_blocks if num_blocks else 0.0,
        "kv_waste_pct": peak.kv_waste_pct,  # unfilled slots of held blocks, at the peak
        "kv_bytes_per_token": stats.kv_bytes_per_token,  # per device, 8-bit pages' scales included
        "prefix_cache_hit_pct": 100.0 * stats.scheduler.prefix_cache_hit_rate,
        "preemptions": stats.scheduler.num_preemptions,
        "running_peak": peak.running,
        "wall_s": wall_s,
        "spec_proposed_tokens": stats.spec_proposed_tokens,  # speculative proposals verified (0: speculation off)
        "spec_accepted_tokens": stats.spec_accepted_tokens,
    }


def stats_rows(s: dict[str, int | float], compile_cache: CompileCache) -> list[tuple[str, str]]:
    """`stats_summary` as the table's (label, text) rows."""
    spec = [("speculative proposals", f"{s['spec_accepted_tokens']:,} of {s['spec_proposed_tokens']:,} accepted")
            ] if s["spec_proposed_tokens"] else []
    return [
        ("requests", f"{s['requests']:,}"),
        ("prompt tokens", f"{s['prompt_tokens']:,}"),
        ("generated tokens", f"{s['generated_tokens']:,}"),
        ("tokens/s", f"{s['tokens_per_s']:,.1f} (generated, over {s['step_time_s']:.2f} s of steps, compiles "
                     "excluded)"),
        ("KV blocks used", f"{s['kv_blocks_used_peak']:,} of {s['kv_blocks']:,} (peak), "
                           f"{s['kv_blocks_used_peak_pct']:.1f} %"),
        ("KV waste", f"{s['kv_waste_pct']:.1f} % (unfilled slots of held blocks, at peak)"),
        ("KV bytes per token", f"{s['kv_bytes_per_token']:,}"),
        ("prefix-cache hit rate", f"{s['prefix_cache_hit_pct']:.1f} %"),
        ("preemptions", f"{s['preemptions']:,}"),
        ("step programs", f"{s['compilations']:,}: {s['programs_compiled']:,} compiled, {s['programs_loaded']:,} "
                          "loaded from the compile cache"),
        ("compile time", f"{s['compile_s']:.2f} s waited for in steps"
                         + (f", {s['warmup_s']:.2f} s warm-up" if s["warmup_s"] else "")),
        ("compile cache", compile_cache.describe(s["compilations"], s["programs_loaded"])),
        ("engine steps", f"{s['engine_steps']:,}"),
        *spec,
        ("wall time", f"{s['wall_s']:.2f} s"),
    ]


def print_table(rows: list[tuple[str, str]], out: TextIO, title: str = "statistics") -> None:
    width = max(len(k) for k, _ in rows)
    rule = "-" * (width + 40)
    print(rule, file=out)
    print(title, file=out)
    print(rule, file=out)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=out)
    print(rule, file=out)


def print_header(args: argparse.Namespace, loaded, engine, load_s: float, out: TextIO) -> None:
    """The model and the engine, as the engine runs them (`pagedjax.engine.summary`: what is on, not what the
    flags asked for): parameters by storage, compute / weight / KV dtypes, speculative method, tp x dp, context
    and sampling defaults; then the attention backend and the KV pool."""
    import jax

    from pagedjax.engine.summary import summarize

    cfg = loaded.spec
    name = args.model_class if getattr(args, "model_class", None) else (args.model or "bundled tiny model")
    if cfg.num_kv_heads is not None:
        heads = f"{cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads"
    else:  # layers of other KV specs (MLA latents, ...): say which
        kinds = dict.fromkeys(type(layer).__name__ for layer in cfg.kv_layers)
        heads = f"{cfg.num_q_heads} query heads, {' + '.join(kinds)} KV layers"
    print(f"model: {name} ({cfg.num_layers} layers, {heads}; loaded in {load_s:.2f} s)", file=out)
    for line in summarize(engine).lines():
        print(f"  {line}", file=out)
    kv = engine.stats()
    print(f"engine: {engine.backend} attention on {jax.default_backend()}, {engine.num_blocks} KV blocks x "
          f"{args.block_size} tokens ({kv.kv_bytes_per_token:,} KV bytes per token), prefix caching "
          f"{'on' if args.enable_prefix_caching else 'off'}, "
          f"{args.decode_steps_per_call} decode step(s) per call", file=out)
    layout = cfg.kv_layout
    if layout.num_groups > 1:  # a block table per group; a window group's blocks go back as its window moves
        print(f"  KV cache: {layout.describe()}, a block table each ({kv.kv_bytes_per_block:,} bytes per block)",
              file=out)
    for pool, blocks in enumerate(engine.extra_pools, start=1):  # state snapshots or windows: pools of their own
        block = kv.kv_group_block_bytes[layout.group_pools.index(pool)]
        every = engine.pool_block_sizes[pool]
        if layout.pools[pool] != "state":
            print(f"  {layout.pools[pool]} pool: {blocks:,} blocks of {block:,} bytes ({every} tokens of every window "
                  "layer)", file=out)
            continue
        print(f"  {layout.pools[pool]} pool: {blocks:,} blocks of {block:,} bytes (one snapshot of every state "
              f"layer per {every} tokens, where prefix hits end; a running sequence holds 1 between steps, 2 in a "
              f"step crossing a boundary: up to {2 * block:,} bytes per sequence)", file=out)
    print(file=out)


def report(gen: Generation, wall_s: float, compile_cache: CompileCache, json_output: bool, out: TextIO) -> None:
    """The statistics table, or (`json_output`) the completions and statistics as one JSON object: `stats` holds
    numbers only (units in the key names), `kv_dtype` the KV cache's dtype, `compile_cache_dir` the compile
    cache's folder (null: off)."""
    stats = gen.engine.stats()
    gen.peak.observe(stats)
    summary = stats_summary(stats, gen.peak, wall_s, len(gen.completions), compile_cache)
    if json_output:
        completions = [{"prompt": c.prompt, "text": c.text, "num_prompt_tokens": c.num_prompt_tokens,
                        "num_tokens": c.num_tokens, "num_cached_tokens": c.num_cached_tokens,
                        "finish_reason": c.finish_reason, "error": c.error,
                        "samples": [_sample_json(s) for s in c.samples]} for c in gen.completions]
        folder = None if compile_cache.folder is None else str(compile_cache.folder)
        print(json.dumps({"completions": completions, "stats": summary, "kv_dtype": stats.kv_dtype,
                          "compile_cache_dir": folder}, indent=2), file=out)
    else:
        print_table(stats_rows(summary, compile_cache), out)


def _sample_json(s) -> dict:
    """One sample (CompletionOutput) or beam (BeamSequence) of a completion, JSON-ready."""
    d = {"text": s.text, "token_ids": list(s.token_ids), "cumulative_logprob": s.cumulative_logprob}
    if hasattr(s, "score"):
        d["score"] = s.score
    else:
        d.update(index=s.index, finish_reason=s.finish_reason)
        if s.logprobs is not None:
            d["logprobs"] = [{"token_id": t.token_id, "logprob": t.logprob,
                              "top": [{"token_id": i, "logprob": v} for i, v in t.top]} for t in s.logprobs]
    return d
