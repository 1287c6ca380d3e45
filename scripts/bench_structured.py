"""Structured output: which grammar library, and what a constraint costs the engine.

    python scripts/bench_structured.py           # both tables (a few minutes on 2 CPU cores)
    python scripts/bench_structured.py --quick   # seconds: a small vocabulary and model (the smoke test)

Table 1 compares the grammar libraries pagedjax could use, on a 32k-token byte-level BPE vocabulary (trained
here on Python's own library sources) and a nested JSON schema: the time to compile the schema for that
vocabulary, and the time per token to compute the next-token mask while walking a valid document's tokens.
Table 2 runs the engine (a random model of the 156M shape over that vocabulary) at batch 1 and 16, the same
number of tokens per request unconstrained and under a JSON schema that cannot complete within them, one step
per device call for both (constrained batches are never fused), and reports tokens/s, their ratio, and the
host time spent on masks per step. xgrammar is not measured: its wheel requires torch, transformers and triton
at run time.
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

    from pagedjax.engine.structured import JSON_STYLE

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


def library_table(vocab_size: int) -> list[dict]:
    tok = train_tokenizer(vocab_size)
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


def engine_table(vocab_size: int, shape: str, max_tokens: int, batches: list[int]) -> list[dict]:
    import pagedjax.engine.inputs as inputs
    from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig
    from pagedjax.core.request import StructuredOutput
    from pagedjax.model.hf_tokenizer import HFTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from bench_engine import SHAPES

    tok = train_tokenizer(vocab_size)
    cfg = SHAPES[shape].replace(vocab_size=tok.get_vocab_size(), eos_token_ids=(0,))
    # No prefix caching: every run of a workload is the same steps, so a run after the first compiles nothing.
    engine = LLMEngine(cfg, CacheConfig(block_size=16, num_blocks=max(batches) * (max_tokens // 16 + 4),
                                        enable_prefix_caching=False),
                       SchedulerConfig(max_num_seqs=max(batches), max_model_len=max_tokens + 64),
                       tokenizer=HFTokenizer(tok, eos_token_ids=(0,)))
    # A schema that cannot complete within max_tokens: every request runs exactly max_tokens tokens.
    long = StructuredOutput(json={"type": "object", "required": ["text"], "additionalProperties": False,
                                  "properties": {"text": {"type": "string", "minLength": 100_000}}})
    mask_s = []
    real = inputs.token_masks

    def timed(*args):
        start = time.perf_counter()
        out = real(*args)
        if out is not None:
            mask_s.append(time.perf_counter() - start)
        return out

    inputs.token_masks = timed
    rows = []
    prompt = "def main(argv):\n    "
    for batch in batches:
        for constrained in (False, True):
            params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True,
                                    structured=long if constrained else None)
            for _ in range(4):  # until a run compiles nothing: that one is timed
                compiled = engine.stats().compilations
                mask_s.clear()
                start = time.perf_counter()
                outs = engine.generate([prompt] * batch, params, use_tqdm=False)
                wall = time.perf_counter() - start
                if engine.stats().compilations == compiled:
                    break
            generated = sum(len(o.output_token_ids) for o in outs)
            rows.append({"batch": batch, "constrained": constrained, "tokens": generated,
                         "tokens_per_s": generated / wall,
                         "mask_ms_per_step": 1e3 * statistics.mean(mask_s) if mask_s else 0.0})
    inputs.token_masks = real
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small vocabulary and model, few tokens")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    vocab, shape, max_tokens, batches = (2048, "tiny", 8, [1]) if args.quick else (32000, "156m", 64, [1, 16])
    libs = library_table(vocab)
    print(f"grammar libraries: nested JSON schema, {libs[0]['vocab']}-token BPE, a {libs[0]['tokens']}-token "
          "document")
    print(f"{'library':<14} {'compile ms':>11} {'mask us (median)':>17} {'mask us (p99)':>14}")
    for r in libs:
        print(f"{r['library']:<14} {r['compile_ms']:>11.1f} {r['mask_us_median']:>17.1f} {r['mask_us_p99']:>14.1f}")
    rows = engine_table(vocab, shape, max_tokens, batches)
    print(f"\nengine ({shape} model, {max_tokens} tokens per request, one step per device call)")
    print(f"{'batch':>5} {'unconstrained tok/s':>20} {'constrained tok/s':>18} {'ratio':>6} {'mask ms/step':>13}")
    for b in batches:
        free = next(r for r in rows if r["batch"] == b and not r["constrained"])
        con = next(r for r in rows if r["batch"] == b and r["constrained"])
        print(f"{b:>5} {free['tokens_per_s']:>20.1f} {con['tokens_per_s']:>18.1f} "
              f"{con['tokens_per_s'] / free['tokens_per_s']:>6.2f} {con['mask_ms_per_step']:>13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
