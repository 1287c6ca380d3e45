"""The command line of `pagedjax-generate`: its options, their types and ranges, and `--help`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pagedjax.cli.sizes import parse_size
from pagedjax.config.cache import KV_DTYPES, CacheConfig
from pagedjax.config.engine import BACKENDS, EngineConfig
from pagedjax.config.lora import LoRAConfig
from pagedjax.config.parallel import ParallelConfig
from pagedjax.config.scheduler import SchedulerConfig
from pagedjax.config.speculative import SPECULATIVE_METHODS, SpeculativeConfig

PROG = "pagedjax-generate"


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
        flag = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)  # --no-prefix-caching
        if "default" in text or action.default is None or action.default is False \
                or action.default is argparse.SUPPRESS or flag:
            return text
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with short errors (both CLIs): the usage line, the error, and where the options are.
    argparse's own usage block lists every option, some 22 lines in which the one line that matters got lost."""

    def error(self, message: str):
        self.exit(2, f"usage: {self.prog} [options]\n{self.prog}: error: {message}\n"
                     f"(run '{self.prog} --help' for every option)\n")


ENGINE_GROUP = "model and engine"


def add_field_option(group, cls, name: str, *flags: str, default=dataclasses.MISSING, **kwargs) -> None:
    """A flag (`--field-name` unless `flags` are given) of the config field `cls.name`: its help text and its
    default are the field's (`pagedjax.config.fields.option`), the one definition Python's `EngineConfig` and both
    command lines read. A front end may give another `default` (its help then says so; None: unset, the field's
    default applies and the help names it)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    text = f.metadata["help"]
    if default is dataclasses.MISSING:
        default = f.default
    elif default is None and f.default is not None and "default" not in text:
        text = f"{text} (default {f.default})"
    group.add_argument(*(flags or ("--" + name.replace("_", "-"),)), default=default, help=text, **kwargs)


def add_engine_options(parser: argparse.ArgumentParser, **front_end_defaults) -> None:
    """The model and engine options, shared by `pagedjax-generate` and `pagedjax-serve`: what
    `engine_setup.engine_config_of` reads. Their defaults and help are the config fields' (`add_field_option`);
    `front_end_defaults` (by field name: `decode_steps_per_call`, `compile_in_background`) are a front end's own
    choices, said where it calls this."""
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
                   help="quantized linear layers, quantized at load (names in any case): int8 (per channel), int4 "
                        "(groups of 128 inputs; int4:N for groups of an even N, e.g. int4:32) or fp8 (e4m3, per "
                        "channel), activations in the model's dtype; or w8a8 (int8 weights, each token's "
                        "activations quantized to int8: integer products). Default: the checkpoint's weights as "
                        "stored")
    g.add_argument("--classifier-from-tokens", nargs=2, default=None, metavar=("NO", "YES"),
                   help="serve a causal LM as a one-label classifier judged by these two tokens' logits (a "
                        "Qwen3-Reranker: no yes): the probability of YES over the two, for /v1/score and /v1/rerank; "
                        "the model then serves pooling requests only")
    add_field_option(g, EngineConfig, "backend", choices=BACKENDS)
    add_field_option(g, EngineConfig, "seed", type=int_at_least(0))
    add_field_option(g, CacheConfig, "block_size", type=int_at_least(1))
    kv = g.add_mutually_exclusive_group()
    add_field_option(kv, CacheConfig, "num_blocks", type=int_at_least(1))
    add_field_option(kv, CacheConfig, "kv_memory_bytes", "--kv-memory", type=parse_size, metavar="SIZE")
    add_field_option(g, CacheConfig, "kv_host_memory_bytes", "--kv-host-memory", type=parse_size, metavar="SIZE")
    add_field_option(g, CacheConfig, "kv_disk_dir", "--kv-disk-dir", metavar="DIR")
    add_field_option(g, CacheConfig, "kv_disk_bytes", "--kv-disk-bytes", type=parse_size, metavar="SIZE")
    add_field_option(g, CacheConfig, "kv_dtype", choices=KV_DTYPES)
    add_field_option(g, EngineConfig, "decode_steps_per_call", type=int_at_least(1), metavar="N",
                     default=front_end_defaults.get("decode_steps_per_call", dataclasses.MISSING))
    add_field_option(g, CacheConfig, "enable_prefix_caching", "--no-prefix-caching", dest="enable_prefix_caching",
                     action="store_false")
    add_field_option(g, EngineConfig, "max_compiled_programs", type=int_at_least(1), metavar="N")
    warmup = front_end_defaults.get("compile_in_background", False)
    add_field_option(g, EngineConfig, "compile_in_background", "--warmup", dest="warmup",
                     action=argparse.BooleanOptionalAction, default=warmup)
    cc = g.add_mutually_exclusive_group()
    add_field_option(cc, EngineConfig, "compile_cache", type=Path, default=None, metavar="DIR")
    cc.add_argument("--no-compile-cache", action="store_true",
                    help="compile every program afresh and save none (JAX's persistent compilation cache off)")
    add_field_option(g, ParallelConfig, "tensor_parallel_size", "--tensor-parallel-size", "-tp",
                     type=int_at_least(1), metavar="N")
    add_field_option(g, ParallelConfig, "data_parallel_size", "--data-parallel-size", "-dp",
                     type=int_at_least(1), metavar="N")
    add_field_option(g, SchedulerConfig, "max_num_seqs", type=int_at_least(1))
    add_field_option(g, SchedulerConfig, "max_num_batched_tokens", type=int_at_least(1))
    add_field_option(g, SchedulerConfig, "max_model_len", type=int_at_least(1))
    add_field_option(g, SpeculativeConfig, "method", "--speculative-method", choices=SPECULATIVE_METHODS,
                     default=None)
    for name, flag, parse, metavar in SPECULATIVE_FLAGS:
        add_field_option(g, SpeculativeConfig, name, flag, type=parse, default=None, metavar=metavar)
    add_multihost_options(parser)


MULTIHOST_GROUP = "several hosts (docs/parallel.md#several-hosts)"


def add_multihost_options(parser: argparse.ArgumentParser) -> None:
    """One engine over several processes (`pagedjax.cli.multihost`), for `pagedjax-generate` and `pagedjax-serve`."""
    g = parser.add_argument_group(MULTIHOST_GROUP)
    g.add_argument("--nnodes", type=int_at_least(1), default=1, metavar="N",
                   help="processes (one per host) running this same command; process 0 takes the requests")
    g.add_argument("--node-rank", type=int_at_least(0), default=0, metavar="I", help="this process's index, 0..N-1")
    g.add_argument("--dist-init-addr", default=None, metavar="HOST:PORT",
                   help="process 0's host and a free port there (JAX's coordinator), the same on every process; "
                        "'auto': JAX detects the cluster (SLURM, Open MPI, Cloud TPU, GKE)")
    g.add_argument("--dist-timeout", type=float_in(0.0, 86400.0, lo_open=True), default=60.0, metavar="SECONDS",
                   help="how long process 0 waits for the others in a step (compiles not counted) before it "
                        "fails every request and exits (default 60)")
    g.add_argument("--dist-join-timeout", type=float_in(0.0, 86400.0, lo_open=True), default=300.0,
                   metavar="SECONDS", help="how long a process waits at start for process 0's coordinator and the "
                                           "others to join (default 300)")
    parser.set_defaults(processes=1)  # how many there are: set by `pagedjax.cli.multihost.start`


# The --speculative-* flags past --speculative-method: (SpeculativeConfig's field, flag, type, metavar).
SPECULATIVE_FLAGS = (("num_speculative_tokens", "--speculative-num-tokens", _int_in(1, 64), "K"),
                     ("prompt_lookup_min", "--speculative-prompt-lookup-min", int_at_least(1), "N"),
                     ("prompt_lookup_max", "--speculative-prompt-lookup-max", int_at_least(1), "N"),
                     ("draft_model", "--speculative-draft-model", None, "PATH"))


LORA_GROUP = "LoRA adapters"
LORA_FIELDS = ("max_loras", "max_lora_rank", "max_cpu_loras")  # LoRAConfig's, each a --max-* flag


def add_lora_options(parser: argparse.ArgumentParser):
    """The engine's LoRA options (`LLMEngine(lora_config=LoRAConfig(...))`; what `engine_setup.engine_config_of`
    reads); returns their argument group, for a front end's own LoRA options."""
    g = parser.add_argument_group(LORA_GROUP, "serve PEFT LoRA adapters of the model, many per step "
                                  "(docs/serving.md#lora-adapters)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (a built-in dense model on one device)")
    for name in LORA_FIELDS:
        add_field_option(g, LoRAConfig, name, type=int_at_least(1), default=None,
                         metavar="R" if name == "max_lora_rank" else "N")
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
    add_engine_options(p, decode_steps_per_call=8)
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
