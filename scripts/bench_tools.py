"""Tool calling and constrained beam search: what they cost next to the plain constraint / the plain search.

    python scripts/bench_tools.py           # both tables (about a minute on 2 CPU cores)
    python scripts/bench_tools.py --quick   # seconds: a small vocabulary (the smoke test)
    python scripts/bench_tools.py --open-schema   # table 3 only (about two minutes)

Table 1: llguidance on a byte-level BPE vocabulary (`bench_structured.train_tokenizer`): the time to compile,
the first next-token mask (llguidance builds its lexer lazily, then), and the mask time per token after it while
walking a valid call's tokens (medians of 5 walks), for a function's `parameters` as a
plain JSON schema (`response_format` / `guided_json`) and as the forced tool-call grammar
(`pagedjax.serve.tools.call_grammar`: the tagged call of one function, or of one of 8), which is what
`tool_choice` "required" / a named function adds per request and per token.
Table 2: beam search on the engine (the `tiny` shape over that vocabulary, random weights), unconstrained and
under a JSON schema that cannot complete within `max_tokens` (so both run the same number of steps), in one run:
seconds per search and their ratio.
Table 3 (`--open-schema`): forced calls (tool_choice "required", up to 4 calls) of a function whose `parameters`
are an ordinary open schema (no additionalProperties, a free string) on the bundled model, 4 choices to the end
of the context: its schema as given (what the grammar held before `bounded_arguments`) against the bounded one,
each choice's tokens, finish reason and complete calls, and whether every call's arguments parse.
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_structured import _token_walk, train_tokenizer  # noqa: E402

logger = logging.getLogger("bench_tools")

PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
              "properties": {"city": {"type": "string", "maxLength": 40},
                             "days": {"type": "integer", "minimum": 1, "maximum": 14},
                             "unit": {"enum": ["celsius", "fahrenheit"]},
                             "hourly": {"type": "boolean"}}}
REPEATS = 5  # walks per constraint (medians over them)
ARGUMENTS = {"city": "San Francisco", "days": 7, "unit": "celsius"}


def _tools(count: int):
    from pagedjax.serve.protocol import ChatTool

    names = ["get_weather"] + [f"tool_{i}" for i in range(1, count)]
    return [ChatTool.model_validate({"type": "function", "function": {"name": n, "parameters": PARAMETERS}})
            for n in names]


def mask_table(tok) -> list[dict]:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from pagedjax.serve.tools import CALL_END, CALL_START, call_grammar
    from pagedjax.structured_output.compiler import JSON_STYLE

    ll_tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=0)
    arguments = json.dumps(ARGUMENTS)
    call = f"{CALL_START}{json.dumps({'name': 'get_weather', 'arguments': ARGUMENTS})}{CALL_END}"
    cases = [("json schema (arguments)", llguidance.LLMatcher.grammar_from_json_schema(PARAMETERS, defaults=JSON_STYLE),
              arguments)]
    for count in (1, 8):
        lark = call_grammar(_tools(count), max_calls=1).grammar
        cases.append((f"tool call, {count} function{'s' * (count > 1)}", llguidance.LLMatcher.grammar_from_lark(lark),
                      call))
    rows = []
    mask = allocate_token_bitmask(1, tok.get_vocab_size())
    fill_next_token_bitmask(llguidance.LLMatcher(ll_tok, cases[0][1]), mask)  # one-time work: not in any row
    for name, grammar, text in cases:
        tokens = tok.encode(text).ids
        compile_s, first, rest = [], [], []
        for _ in range(REPEATS):  # a fresh matcher each time
            start = time.perf_counter()
            matcher = llguidance.LLMatcher(ll_tok, grammar)
            compile_s.append(time.perf_counter() - start)
            assert not matcher.is_error(), matcher.get_error()

            def advance(t, matcher=matcher):
                assert matcher.consume_token(t), matcher.get_error()

            times = _token_walk(lambda matcher=matcher: fill_next_token_bitmask(matcher, mask), advance, tokens)
            # llguidance builds its lexer lazily: the first mask pays for it, so it is a column of its own.
            first.append(times[0])
            rest += times[1:]
        rows.append({"case": name, "tokens": len(tokens), "compile_ms": statistics.median(compile_s) * 1e3,
                     "first_mask_ms": statistics.median(first) * 1e3,
                     "mask_us_median": statistics.median(rest) * 1e6,
                     "mask_us_p99": float(np.percentile(rest, 99)) * 1e6})
    return rows


def beam_table(tok, width: int, max_tokens: int, prompts: int) -> list[dict]:
    from bench_engine import SHAPES

    from pagedjax import CacheConfig, LLMEngine, SchedulerConfig
    from pagedjax.model.hf_tokenizer import HFTokenizer
    from pagedjax.sampling_params import BeamSearchParams, StructuredOutput

    cfg = SHAPES["tiny"].replace(vocab_size=tok.get_vocab_size(), eos_token_ids=(0,))
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=16,
                                                                  num_blocks=prompts * width * (max_tokens // 16 + 4),
                                                                  enable_prefix_caching=False),
                       scheduler_config=SchedulerConfig(max_num_seqs=prompts * width, max_model_len=max_tokens + 64),
                       tokenizer=HFTokenizer(tok, eos_token_ids=(0,)))
    # A schema no beam completes within max_tokens (EOS never allowed): both searches run max_tokens steps.
    long = StructuredOutput(json={"type": "object", "required": ["text"], "additionalProperties": False,
                                  "properties": {"text": {"type": "string", "minLength": 100_000}}})
    texts = [f"def task_{i}(argv):\n    " for i in range(prompts)]
    rows = []
    for constrained in (False, True):
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, structured=long if constrained else None,
                                  ignore_eos=not constrained)
        for _ in range(4):  # until a run compiles nothing: that one is timed
            compiled = engine.stats().compilations
            start = time.perf_counter()
            outs = engine.beam_search(texts, params)
            wall = time.perf_counter() - start
            if engine.stats().compilations == compiled:
                break
        if constrained:
            assert all(s.text.startswith('{"text": "') for o in outs for s in o.sequences)
        rows.append({"constrained": constrained, "seconds": wall,
                     "beam_tokens_per_s": prompts * width * max_tokens / wall})
    return rows


OPEN = {"type": "object", "required": ["city"],
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}}


def open_schema_table(max_calls: int = 4, choices: int = 4) -> list[dict]:
    from pagedjax import LLMEngine, SamplingParams, StructuredOutput
    from pagedjax.serve.protocol import ChatTool
    from pagedjax.serve.tools import CALL_END, CALL_START, TOOLS_PREAMBLE, call_grammar, parse_message
    from pagedjax.structured_output.compiler import JSON_STYLE

    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": OPEN}}
    as_given = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": OPEN},
                "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_STYLE}
    lines = [f"start: call{{1,{max_calls}}}", f'call: "{CALL_START}" fn_0 "{CALL_END}"',
             f"fn_0: %json {json.dumps(as_given)}"]
    grammars = {"as given": StructuredOutput(grammar="\n".join(lines)),
                "bounded": call_grammar([ChatTool.model_validate(tool)], max_calls=max_calls)}
    engine = LLMEngine.from_pretrained()
    prompt = (f"# system:\n{TOOLS_PREAMBLE.format(tools=json.dumps(tool))}\n# user:\nWeather in Paris?\n"
              "# assistant:\n")
    room = engine.max_request_tokens - len(engine.tokenizer.encode(prompt))
    engine.generate([prompt] * choices, SamplingParams(max_tokens=8, structured=grammars["as given"]), use_tqdm=False)
    rows = []
    for name, grammar in grammars.items():
        params = [SamplingParams(max_tokens=room, temperature=1.0, seed=s, structured=grammar) for s in range(choices)]
        start = time.perf_counter()
        outs = engine.generate([prompt] * choices, params, use_tqdm=False)
        wall = time.perf_counter() - start
        for o in outs:
            _, calls = parse_message(o.text, forced=True)
            tail = o.text[o.text.rfind(CALL_END) + len(CALL_END):] if CALL_END in o.text else o.text
            rows.append({"schema": name, "seconds": wall, "tokens": len(o.output_token_ids),
                         "finish": o.finish_reason, "calls": len(calls), "cut_call": CALL_START in tail,
                         "parse": all(isinstance(json.loads(c.function.arguments), dict) for c in calls)})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small vocabulary, a short search")
    p.add_argument("--open-schema", action="store_true", help="table 3 only: forced calls of an open schema")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.open_schema:
        print("forced calls (up to 4) of an open parameters schema, bundled model, 4 choices to the end of the context")
        print(f"{'schema':<9} {'seconds (4 choices)':>19} {'tokens':>7} {'finish':>7} {'calls':>5} {'cut call':>8} "
              f"{'args parse':>10}")
        for r in open_schema_table():
            print(f"{r['schema']:<9} {r['seconds']:>19.1f} {r['tokens']:>7} {r['finish']:>7} {r['calls']:>5} "
                  f"{str(r['cut_call']):>8} {str(r['parse']):>10}")
        return 0
    vocab, width, max_tokens, prompts = (2048, 2, 8, 1) if args.quick else (32000, 4, 32, 2)
    tok = train_tokenizer(vocab)
    rows = mask_table(tok)
    print(f"llguidance, {tok.get_vocab_size()}-token BPE: one function's arguments as a JSON schema vs the forced "
          "tool-call grammar")
    print(f"{'constraint':<26} {'tokens':>6} {'compile ms':>11} {'first mask ms':>14} {'then mask us (median)':>22} "
          f"{'(p99)':>8}")
    for r in rows:
        print(f"{r['case']:<26} {r['tokens']:>6} {r['compile_ms']:>11.1f} {r['first_mask_ms']:>14.2f} "
              f"{r['mask_us_median']:>22.1f} {r['mask_us_p99']:>8.1f}")
    free, con = beam_table(tok, width, max_tokens, prompts)
    print(f"\nbeam search (tiny model, {prompts} prompts x width {width} x {max_tokens} tokens)")
    print(f"{'unconstrained s':>16} {'constrained s':>14} {'ratio':>6} {'constrained beam tok/s':>23}")
    print(f"{free['seconds']:>16.2f} {con['seconds']:>14.2f} {con['seconds'] / free['seconds']:>6.2f} "
          f"{con['beam_tokens_per_s']:>23.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
