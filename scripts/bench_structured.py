"""Structured output: which grammar library, and what a constraint costs the engine.

    python scripts/bench_structured.py           # all tables (several minutes on 2 CPU cores)
    python scripts/bench_structured.py --quick   # seconds: a small vocabulary and model (the smoke test)
    python scripts/bench_structured.py --new-request   # table 4 only (seconds)

Table 1 compares the grammar libraries pagedjax could use, on a 32k-token byte-level BPE vocabulary (trained
here on Python's own library sources) and a nested JSON schema: the time to compile the schema for that
vocabulary, and the time per token to compute the next-token mask while walking a valid document's tokens.
Table 2 is the engine thread's share, before and after in one run: a batch of 16 masks filled row by row
(`Constraint.fill`, as steps did) against one parallel call (`token_masks`), and a request's constraint compiled
afresh against copied from the compiler's kept matcher (`ConstraintCompiler`). Table 3 runs the engine (a random
model of the 156M shape over that vocabulary) at batch 1 and 16, the same number of tokens per request
unconstrained and under a JSON schema that cannot complete within them, in interleaved rounds (the machine may be
shared): unconstrained with the fused decode (8 steps per device call, the server's default), unconstrained one
step per call, and constrained (always one step per call: its masks come from the host before each token). It
reports the median tokens/s of each, the median of the rounds' constrained / unconstrained ratios, and the host
time spent on masks per step. xgrammar is not measured: its wheel requires torch, transformers and triton at run
time.
Table 4 (`--new-request`) is the engine thread's work when a server request brings a costly constraint the
grammar pool has compiled (the bundled model's tokenizer; medians of 5): before, the engine thread checked the
constraint's limits again, copied the kept matcher and built its lexer in the request's first mask; now the
compile stage builds it (`ConstraintCompiler`) and the engine thread only copies and masks.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger("bench_structured")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "items", "meta"],
          "properties": {
              "name": {"type": "string", "maxLength": 40},
              "items": {"type": "array", "maxItems": 8, "items": {
                  "type": "object", "additionalProperties": False, "required": ["id", "kind", "tags"],
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10000},
                                 "kind": {"enum": ["file", "dir", "link"]},
                                 "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                          "maxItems": 4}}}},
              "meta": {"type": "object", "additionalProperties": False, "required": ["ok", "score"],
                       "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}}}}}
DOCUMENT = {"name": "parse_config", "items": [
    {"id": i * 37, "kind": ["file", "dir", "link"][i % 3], "tags": ["alpha", "beta gamma"][: i % 3]}
    for i in range(6)], "meta": {"ok": True, "score": 0.875}}


def train_tokenizer(vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens trained on the Python standard library's sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(str(p) for p in Path(json.__file__).parents[1].glob("*.py"))[:120]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def _token_walk(fill, advance, tokens: list[int]) -> list[float]:
    times = []
    for t in tokens:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        advance(t)
    return times


def bench_llguidance(tok, tokens: list[int]) -> tuple[float, list[float]]:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from pagedjax.structured_output.compiler import JSON_STYLE

    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=0)
    matcher = llguidance.LLMatcher(ll_tok, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_STYLE))
    compile_s = time.perf_counter() - start
    mask = allocate_token_bitmask(1, tok.get_vocab_size())

    def advance(t):
        assert matcher.consume_token(t), matcher.get_error()

    return compile_s, _token_walk(lambda: fill_next_token_bitmask(matcher, mask), advance, tokens)


def bench_outlines_core(tok, tokens: list[int]) -> tuple[float, list[float]]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    pieces: dict[bytes, list[int]] = {}
    for i in range(1, tok.get_vocab_size()):
        pieces.setdefault(tok.decode([i]).encode(), []).append(i)
    regex = build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?")
    guide = Guide(Index(regex, Vocabulary(0, pieces)))
    compile_s = time.perf_counter() - start
    mask = np.zeros(-(-tok.get_vocab_size() // 32), np.int32)
    return compile_s, _token_walk(lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4),
                                  lambda t: guide.advance(t, return_tokens=False), tokens)


def library_table(tok) -> list[dict]:
    tokens = tok.encode(json.dumps(DOCUMENT)).ids
    rows = []
    for name, fn in (("llguidance", bench_llguidance), ("outlines-core", bench_outlines_core)):
        try:
            compile_s, times = fn(tok, tokens)
        except ImportError as e:
            logger.warning("%s not installed: %s", name, e)
            continue
        rows.append({"library": name, "vocab": tok.get_vocab_size(), "tokens": len(tokens),
                     "compile_ms": compile_s * 1e3, "mask_us_median": statistics.median(times) * 1e6,
                     "mask_us_p99": float(np.percentile(times, 99)) * 1e6})
    return rows


def engine_share(tok, batch: int) -> dict:
    """Median ms of the engine thread's structured-output work (table 2). Masks: two batches of `batch` matchers
    of the nested schema (each batch its own compile), row i at token i * len / (2 * batch) of the document,
    walk the document's first half in step; at each step one batch is filled row by row and the other in one
    call (who goes first alternates), so that every fill is of a state not filled before, as in an engine.
    Compiles: afresh (a new compiler's, over the vocabulary built beforehand, as an engine builds it once)
    against a kept matcher's copy."""
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.sampling_params import StructuredOutput
    from pagedjax.structured_output.compiler import ConstraintCompiler
    from pagedjax.structured_output.masks import mask_words, token_masks

    hf = HFTokenizer(tok, eos_token_ids=(0,))
    structured = StructuredOutput(json=SCHEMA)
    kept = ConstraintCompiler(hf, tok.get_vocab_size(), (0,))
    # StructuredOutput keeps the schema as canonical JSON (sorted keys): properties come in that order.
    document = tok.encode(json.dumps(DOCUMENT, sort_keys=True)).ids
    offsets = [i * len(document) // (2 * batch) for i in range(batch)]

    def fresh():
        compiler = ConstraintCompiler(hf, tok.get_vocab_size(), (0,))
        compiler._ll_tokenizer = kept._llg_tokenizer()
        return compiler.compile(structured)

    by_rows, by_call = [fresh() for _ in range(batch)], [fresh() for _ in range(batch)]
    matchers = [c.matcher for c in by_call]
    masks = np.zeros((batch, mask_words(tok.get_vocab_size())), np.int32)

    def row_by_row():
        for i, constraint in enumerate(by_rows):
            constraint.fill(masks[i])

    times: dict[str, list[float]] = {"fill_rows": [], "fill_par": [], "compile_fresh": [], "compile_kept": []}
    fills = (("fill_rows", row_by_row), ("fill_par", lambda: token_masks(matchers, tok.get_vocab_size())))
    for step in range(len(document) // 2):
        for i, offset in enumerate(offsets):  # each matcher at token offset + step of the document
            for constraint in (by_rows[i], by_call[i]):
                assert constraint.advance(document[:offset + step]) is None
        for name, fn in fills if step % 2 == 0 else fills[::-1]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    for name, fn in (("compile_fresh", fresh), ("compile_kept", lambda: kept.compile(structured))) * 20:
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
    return {name: statistics.median(v) * 1e3 for name, v in times.items()}


def new_request_table(repeats: int = 5) -> list[dict]:
    """Engine-thread ms (medians) for a new request of each costly constraint (table 4): before, the limits'
    check, a copy and the first mask of a matcher whose lexer is not built yet (a fresh compile's); now a copy
    and the first mask of a copy of the kept, already masked, matcher."""
    import random

    import llguidance

    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.model.loading.checkpoint import bundled_model_path
    from pagedjax.sampling_params import StructuredOutput
    from pagedjax.serve.protocol import ChatTool
    from pagedjax.serve.tools import call_grammar
    from pagedjax.structured_output.compiler import ConstraintCompiler
    from pagedjax.structured_output.isolation import grammar_of
    from pagedjax.structured_output.limits import DEFAULT_LIMITS, check_structured
    from pagedjax.structured_output.masks import token_masks

    tok = HFTokenizer.from_pretrained(bundled_model_path(), eos_token_ids=(1,))
    vocab = tok.vocab_size
    rng = random.Random(0)

    def words(n: int) -> str:
        return "|".join("".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 9))) for _ in range(n))

    cases = {"500-rule chain": StructuredOutput(grammar="start: r0\n" + "\n".join(
                 f'r{i}: "x{i}" r{i + 1}' for i in range(499)) + '\nr499: "end"'),
             "1,024 choices": StructuredOutput(choice=tuple(f"option number {i} " * 3 for i in range(1024))),
             "64 KiB of alternations": StructuredOutput(grammar="start: (" + " | ".join(f"r{i}" for i in range(14))
                                                        + ")+\n" + "\n".join(f"r{i}: /({words(420)})/"
                                                                              for i in range(14))),
             "128 tools, forced call": call_grammar([ChatTool.model_validate({"type": "function", "function": {
                 "name": f"tool_{i}", "parameters": {"type": "object", "required": ["query"], "properties": {
                     "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 50},
                     "mode": {"enum": ["fast", "exact", "fuzzy"]}}}}}) for i in range(128)], max_calls=4)}
    rows = []
    for name, structured in cases.items():
        compiler = ConstraintCompiler(tok, vocab, (1,))
        compiler.compile(structured)  # the grammar pool's compile: kept, its first mask built
        grammar = grammar_of(structured.kind, getattr(structured, structured.kind))
        before, after = [], []
        for _ in range(repeats):
            unbuilt = llguidance.LLMatcher(compiler._llg_tokenizer(), grammar)  # as the kept one was before
            start = time.perf_counter()
            check_structured(structured, DEFAULT_LIMITS)
            token_masks([unbuilt.deep_copy()], vocab)
            before.append(time.perf_counter() - start)
            start = time.perf_counter()
            token_masks([compiler.compile(structured).matcher], vocab)
            after.append(time.perf_counter() - start)
        rows.append({"constraint": name, "before_ms": statistics.median(before) * 1e3,
                     "after_ms": statistics.median(after) * 1e3})
    return rows


# The engine table's workloads: (name, constrained, decode steps per device call).
WORKLOADS = (("free, fused", False, 8), ("free", False, 1), ("constrained", True, 1))


def engine_table(tok, shape: str, max_tokens: int, batches: list[int], rounds: int) -> list[dict]:
    from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.sampling_params import StructuredOutput

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import SHAPES

    cfg = SHAPES[shape].replace(vocab_size=tok.get_vocab_size(), eos_token_ids=(0,))
    # No prefix caching: every run of a workload is the same steps, so a run after the first compiles nothing.
    # One engine serves every workload: its decode_steps_per_call is set per run (fused, or one step per call).
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16,
                                                                  num_blocks=max(batches) * (max_tokens // 16 + 4),
                                                                  enable_prefix_caching=False),
                       scheduler_config=SchedulerConfig(max_num_seqs=max(batches), max_model_len=max_tokens + 64),
                       tokenizer=HFTokenizer(tok, eos_token_ids=(0,)))
    # A schema that cannot complete within max_tokens: every request runs exactly max_tokens tokens.
    long = StructuredOutput(json={"type": "object", "required": ["text"], "additionalProperties": False,
                                  "properties": {"text": {"type": "string", "minLength": 100_000}}})
    mask_s = []
    real = engine.structured.masks

    def timed(*args):
        start = time.perf_counter()
        out = real(*args)
        if out is not None:
            mask_s.append(time.perf_counter() - start)
        return out

    def run(batch: int, constrained: bool, steps: int) -> float:
        """Tokens/s of one generate call."""
        engine.decode_steps_per_call = steps
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True,
                                structured=long if constrained else None)
        start = time.perf_counter()
        outs = engine.generate(["def main(argv):\n    "] * batch, params, use_tqdm=False)
        return sum(len(o.output_token_ids) for o in outs) / (time.perf_counter() - start)

    engine.structured.masks = timed
    rows = []
    for batch in batches:
        for _, constrained, steps in WORKLOADS:
            for _ in range(4):  # until a run compiles nothing
                compiled = engine.stats().compilations
                run(batch, constrained, steps)
                if engine.stats().compilations == compiled:
                    break
        mask_s.clear()
        runs: dict[str, list[float]] = {name: [] for name, _, _ in WORKLOADS}
        for r in range(rounds):  # interleaved, every other round reversed: a change of load hits every workload
            for name, constrained, steps in WORKLOADS if r % 2 == 0 else WORKLOADS[::-1]:
                runs[name].append(run(batch, constrained, steps))
        ratio = statistics.median(c / f for c, f in zip(runs["constrained"], runs["free"], strict=True))
        ratio_fused = statistics.median(c / f for c, f in zip(runs["constrained"], runs["free, fused"], strict=True))
        rows.append({"batch": batch, **{name: statistics.median(v) for name, v in runs.items()}, "ratio": ratio,
                     "ratio_fused": ratio_fused, "mask_ms_per_step": 1e3 * statistics.mean(mask_s)})
    engine.structured.masks = real
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small vocabulary and model, few tokens")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the engine table (default 3)")
    p.add_argument("--new-request", action="store_true", help="table 4 only: a costly constraint's new request")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.new_request:
        print("engine thread, ms (median of 5): a new request of a constraint the grammar pool compiled")
        print(f"{'constraint':<24} {'before':>7} {'after':>7}")
        for r in new_request_table():
            print(f"{r['constraint']:<24} {r['before_ms']:>7.2f} {r['after_ms']:>7.2f}")
        return 0
    vocab, shape, max_tokens, batches = (2048, "tiny", 8, [1, 4]) if args.quick else (32000, "156m", 64, [1, 16])
    tok = train_tokenizer(vocab)
    libs = library_table(tok)
    print(f"grammar libraries: nested JSON schema, {libs[0]['vocab']}-token BPE, a {libs[0]['tokens']}-token "
          "document")
    print(f"{'library':<14} {'compile ms':>11} {'mask us (median)':>17} {'mask us (p99)':>14}")
    for r in libs:
        print(f"{r['library']:<14} {r['compile_ms']:>11.1f} {r['mask_us_median']:>17.1f} {r['mask_us_p99']:>14.1f}")
    share = engine_share(tok, max(batches))
    print(f"\nengine thread, ms (median): {max(batches)} masks filled row by row / in one parallel call; a "
          "constraint compiled afresh / copied from the kept one")
    print(f"{'fill rows':>10} {'fill par':>9} {'ratio':>6} {'compile':>8} {'copy':>7}")
    print(f"{share['fill_rows']:>10.3f} {share['fill_par']:>9.3f} {share['fill_rows'] / share['fill_par']:>6.1f} "
          f"{share['compile_fresh']:>8.3f} {share['compile_kept']:>7.3f}")
    rows = engine_table(tok, shape, max_tokens, batches, args.rounds)
    print(f"\nengine ({shape} model, {max_tokens} tokens per request, medians of {args.rounds} interleaved rounds; "
          "ratio = constrained / unconstrained one step per call, vs fused = / unconstrained fused)")
    print(f"{'batch':>5} {'free fused tok/s':>17} {'free tok/s':>11} {'constrained tok/s':>18} {'ratio':>6} "
          f"{'vs fused':>9} {'mask ms/step':>13}")
    for r in rows:
        print(f"{r['batch']:>5} {r['free, fused']:>17.1f} {r['free']:>11.1f} {r['constrained']:>18.1f} "
              f"{r['ratio']:>6.2f} {r['ratio_fused']:>9.2f} {r['mask_ms_per_step']:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
