"""The command line of `pagedjax-generate`: its options, their types and ranges, and `--help`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedjax.cli.sizes import parse_size
from pagedjax.config.cache import KV_DTYPES
from pagedjax.config.speculative import SPECULATIVE_METHODS

PROG = "pagedjax-generate"
DEFAULT_NUM_BLOCKS = 512  # CacheConfig's default when neither --num-blocks nor --kv-memory is given


def int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = "int"
    return parse


def _int_in(lo: int, hi: int):
    def parse(text: str) -> int:
        value = int_at_least(lo)(text)
        if value > hi:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {hi}], got {text}")
        return value

    return parse


def float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
        if not (lo < v if lo_open else lo <= v) or not v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
        return v

    parse.__name__ = "float"
    return parse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" once: not to flags or options without a default, nor where the help says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with short errors (both CLIs): the usage line, the error, and where the options are.
    argparse's own usage block lists every option, some 22 lines in which the one line that matters got lost."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [options]\n{self.prog}: error: {message}\n"
                     f"(run '{self.prog} --help' for every option)\n")


ENGINE_GROUP = "model and engine"


class _Deprecated(argparse.Action):
    """A deprecated spelling of another option: stores into its `dest`, with a warning naming the new one."""

    def __call__(self, parser, namespace, values, option_string=None):
        replacement = "--" + self.dest.replace("_", "-")
        print(f"{parser.prog}: warning: {option_string} is deprecated; use {replacement}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def add_engine_options(parser: argparse.ArgumentParser, *, decode_steps_per_call: int, warmup: bool) -> None:
    """The model and engine options, shared by `pagedjax-generate` and `pagedjax-serve` (each with its own
    defaults for `--decode-steps-per-call` and `--warmup`): what `engine_setup.build_engine` reads."""
    g = parser.add_argument_group(ENGINE_GROUP)
    g.add_argument("--model", default=None, metavar="PATH",
                   help="a pagedjax checkpoint folder or a Hugging Face folder (config.json + *.safetensors); "
                        "default: the bundled model")
    g.add_argument("--model-class", default=None, metavar="MODULE:FACTORY",
                   help="serve a model of your own (pagedjax.model.api): FACTORY(path) is called with --model "
                        "(or None) and returns the model, or (model, tokenizer); the module must be importable "
                        "(installed, on PYTHONPATH, or in the current folder)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="parameter dtype (default: the checkpoint's)")
    g.add_argument("--quantization", type=_quantization, default=None, metavar="SCHEME",
                   help="weight-only quantized linear layers, quantized at load (names in any case): int8 (per "
                        "channel), int4 (groups of 128 inputs; int4:N for groups of an even N, e.g. int4:32) or fp8 "
                        "(e4m3, per channel); activations stay in the model's dtype. Default: the checkpoint's "
                        "weights as stored")
    g.add_argument("--backend", choices=["auto", "pallas", "xla"], default="auto",
                   help="attention backend: auto = Pallas on GPU, XLA elsewhere")
    g.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV block")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--num-blocks", type=int_at_least(1), default=None,
                    help=f"KV blocks in the pool (default: {DEFAULT_NUM_BLOCKS})")
    kv.add_argument("--kv-memory", type=parse_size, default=None, metavar="SIZE",
                    help="size the KV pool by memory instead, e.g. 64MiB")
    g.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto",
                   help="KV cache dtype: auto = the model's; int8 / fp8 (float8_e4m3fn) store K/V in 8 bits with "
                        "a float32 scale per token and KV head, about half the bytes per token of bfloat16")
    g.add_argument("--decode-steps-per-call", type=int_at_least(1), default=decode_steps_per_call, metavar="N",
                   help="decode iterations per device call when every sequence is decoding (fused decode: one "
                        "host round trip per call; tokens stream in bursts of up to N)")
    g.add_argument("--num-steps", type=int_at_least(1), dest="decode_steps_per_call", action=_Deprecated,
                   help=argparse.SUPPRESS)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--max-compiled-programs", type=int_at_least(1), default=64, metavar="N",
                   help="compiled step programs kept; past N the least recently used is dropped (and compiled "
                        "again, or loaded from the compile cache, if needed again): bounds memory")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=warmup,
                   help="compile programs that can run every step (pagedjax-generate: before the first step; "
                        "pagedjax-serve: in the background from start-up, answering at once): a step whose own "
                        "program is new then runs on one of them while its own compiles in the background, instead "
                        f"of waiting for it (default: {'on' if warmup else 'off'})")
    cc = g.add_mutually_exclusive_group()
    cc.add_argument("--compile-cache", type=Path, default=None, metavar="DIR",
                    help="keep compiled programs in DIR, so that the next run loads them instead of compiling "
                         "(a warm start) (default: $PAGEDJAX_COMPILE_CACHE, else ${XDG_CACHE_HOME:-~/.cache}"
                         "/pagedjax/jax)")
    cc.add_argument("--no-compile-cache", action="store_true",
                    help="compile every program afresh and save none (JAX's persistent compilation cache off)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int_at_least(1), default=1, metavar="N",
                   help="shard the model and its KV cache over N devices (on CPU: XLA_FLAGS="
                        "--xla_force_host_platform_device_count=N); --kv-memory is then per device")
    g.add_argument("--data-parallel-size", "-dp", type=int_at_least(1), default=1, metavar="N",
                   help="N independent replicas (each --tensor-parallel-size devices, its own KV pool of "
                        "--num-blocks / --kv-memory); requests go to the least loaded")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=64, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512, help="tokens per step")
    g.add_argument("--max-model-len", type=int_at_least(1), default=None,
                   help="longest prompt + completion (default: the model's max_position_embeddings, as in Python)")
    g.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=None,
                   help="speculative decoding (exact: the same output): 'ngram' proposes what followed the last "
                        "tokens' earlier occurrence in the prompt and output, 'draft' a draft model's greedy tokens "
                        "(--speculative-draft-model; default: off)")
    g.add_argument("--speculative-num-tokens", type=_int_in(1, 64), default=None, metavar="K",
                   help="tokens proposed and verified per request per step (default 4)")
    g.add_argument("--speculative-prompt-lookup-min", type=int_at_least(1), default=None, metavar="N",
                   help="ngram: the shortest suffix looked up (default 2)")
    g.add_argument("--speculative-prompt-lookup-max", type=int_at_least(1), default=None, metavar="N",
                   help="ngram: the longest suffix looked up, tried first (default 4)")
    g.add_argument("--speculative-draft-model", default=None, metavar="PATH",
                   help="draft: the draft model's folder (as --model reads it), of the model's vocabulary")


LORA_GROUP = "LoRA adapters"


def add_lora_options(parser: argparse.ArgumentParser):
    """The engine's LoRA options (`LLMEngine(enable_lora=True, max_loras=..., max_lora_rank=..., max_cpu_loras=...)`;
    what `engine_setup.build_engine` reads); returns their argument group, for a front end's own LoRA options."""
    g = parser.add_argument_group(LORA_GROUP, "serve PEFT LoRA adapters of the model, many per step "
                                  "(docs/serving.md#lora-adapters)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (a built-in dense model on one device)")
    g.add_argument("--max-loras", type=int_at_least(1), default=None, metavar="N",
                   help="device slots for adapters: the most distinct adapters one step runs (default 4)")
    g.add_argument("--max-lora-rank", type=int_at_least(1), default=None, metavar="R",
                   help="every slot's rank: adapters of a higher rank are refused (default 16)")
    g.add_argument("--max-cpu-loras", type=int_at_least(1), default=None, metavar="N",
                   help="adapters kept in host memory, at least --max-loras (default: --max-loras); the least "
                        "recently used one past it is read from its folder again when next needed")
    return g


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG,
        description="Generate text with pagedjax's paged-attention engine (default model: the bundled "
                    "2.4M-parameter model trained on Python's standard library).",
        formatter_class=HelpFormatter)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt (repeatable); without any, a few built-in prompts are used")
    g.add_argument("--prompts-file", type=Path, default=None, metavar="FILE",
                   help="one prompt per line ('-' reads stdin); a line that is a JSON string is decoded, so "
                        "\"def f():\\n\" gives a multi-line prompt")
    g.add_argument("--demo", action="store_true",
                   help="several prompts sharing a long prefix: shows prefix-cache hits")
    g.add_argument("--image", action="append", type=Path, default=None, metavar="FILE",
                   help="an image file for the one --prompt (repeatable, in the order of the prompt's image "
                        "placeholders: '<image>' for LLaVA, '<start_of_image>' for Gemma 3); needs a "
                        "vision-language --model folder")
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int_at_least(1), default=None,
                   help="tokens to generate per prompt (default: until the model stops or the context is full, the "
                        "rule of every entry point: SamplingParams, generate, pagedjax-serve; the built-in prompts, "
                        "--demo's or those used when none is given, stop at 64); a prompt and its --max-tokens past "
                        "--max-model-len are refused, as pagedjax-serve refuses them")
    model_default = ("(default: the model's, from its folder's generation_config.json, else vLLM's: {}; "
                     "the bundled model's: {})")
    g.add_argument("--temperature", type=float_in(0.0, 100.0), default=None,
                   help="0 = greedy " + model_default.format("1.0", "0.8"))
    g.add_argument("--top-k", type=int_at_least(0), default=None, help="0 = off " + model_default.format("0", "0"))
    g.add_argument("--top-p", type=float_in(0.0, 1.0, lo_open=True), default=None,
                   help="1 = off " + model_default.format("1.0", "0.95"))
    g.add_argument("--seed", type=int_at_least(0), default=0,
                   help="sampling seed: prompt i uses seed + i, so runs are reproducible")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--n", type=int_at_least(1), default=1,
                   help="samples per prompt (one prefill; the samples share its KV blocks)")
    g.add_argument("--logprobs", type=_int_in(0, 20), default=None, metavar="K",
                   help="show each generated token's log-probability (its K most likely alternatives in --json)")
    g.add_argument("--beam-width", type=int_at_least(1), default=None, metavar="W",
                   help="beam search with W beams (greedy scores; ignores the sampling flags)")
    # 8: on the bundled model the fused loop decodes 1.2x faster (634 vs 519 tokens/s for --demo) and compiles
    # fewer programs (4 vs 6: 6.5 s vs 8.6 s cold) than one step per call; tokens stream in bursts of up to 8.
    # No warm-up: a one-off run compiles what its prompts need, and no stream waits on another's compile.
    add_engine_options(p, decode_steps_per_call=8, warmup=False)
    g = p.add_argument_group("output")
    g.add_argument("--no-stream", action="store_true", help="print a single prompt's completion at the end")
    g.add_argument("--json", action="store_true",
                   help="print completions and statistics as one JSON object (units in the key names)")
    return p


def _quantization(text: str):
    """--quantization's value as a `QuantConfig` (argparse reports the ValueError's message after the flag: it
    lists every accepted name)."""
    from pagedjax.config.quant import QuantConfig

    try:
        return QuantConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
