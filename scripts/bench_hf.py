"""pagedjax vs transformers on the same local Hugging Face model and batch, on the CPU, in one run.

    python scripts/bench_hf.py --model PATH [--batch 8] [--prompt-len 32] [--max-tokens 32]
    python scripts/bench_hf.py --make-tiny /tmp/tiny-llama      # write a random tiny Llama folder first, then bench it

Both sides generate greedily the same number of new tokens (EOS ignored) for the same random prompts of equal
length, in float32, timed (best of --repeats) after a warm-up run that compiles everything. transformers runs
`generate(do_sample=False)` with its default KV cache, once with 1 torch thread and once with torch's default
(on a busy machine extra torch threads can be many times slower; the faster row is the baseline). pagedjax
runs `LLMEngine.generate` with 1-step decode and with fused N-step decode. "same tokens" is the fraction of
sequences whose continuation equals the baseline's. Nothing is downloaded: PATH is a local folder
(config.json + *.safetensors).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax.config import CacheConfig, SchedulerConfig  # noqa: E402
from pagedjax.engine import LLMEngine  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf_config, load_hf_params, model_from_state  # noqa: E402
from pagedjax.sampling_params import SamplingParams  # noqa: E402


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _load_transformers(path: str | Path):
    import torch
    import transformers

    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype": torch.float32} if major >= 5 else {"torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **dtype_kw).eval()
    model.generation_config.eos_token_id = None  # a fixed number of new tokens, as pagedjax's ignore_eos
    return model


def run_hf_benchmark(path: str | Path, batch_size: int, max_tokens: int, *, prompt_len: int = 32,
                     num_steps: int = 8, repeats: int = 2, block_size: int = 16, seed: int = 0,
                     torch_threads: tuple[int, ...] | None = None) -> list[dict]:
    """Rows (dicts: name, seconds, tokens_per_s, ms_per_step, vs_transformers, same_tokens, tokens) for
    transformers' generate (once per torch thread count: default 1 and torch's default, since on a busy
    machine extra torch threads can be far slower) and pagedjax's engine (1-step and `num_steps`-step decode)
    on the same prompts. vs_transformers and same_tokens compare with the fastest transformers row."""
    import torch

    cfg = load_hf_config(path, dtype="float32")
    params = model_from_state(cfg, load_hf_params(path, cfg))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, cfg.vocab_size, (batch_size, prompt_len))
    total = prompt_len + max_tokens
    rows: list[dict] = []

    hf = _load_transformers(path)
    gen_kw = dict(max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    ids = torch.from_numpy(prompts).long()
    default_threads = torch.get_num_threads()
    for threads in dict.fromkeys(torch_threads or (1, default_threads)):
        torch.set_num_threads(threads)
        hf_out: dict[str, np.ndarray] = {}

        def hf_go(hf_out=hf_out):
            with torch.inference_mode():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), **gen_kw)
            hf_out["tokens"] = out[:, prompt_len:].numpy()

        hf_go()  # warm-up
        rows.append(dict(name=f"transformers {_version('transformers')} generate, {threads} torch thread(s)",
                         seconds=_best_time(hf_go, repeats), tokens=hf_out["tokens"]))
    torch.set_num_threads(default_threads)
    num_hf = len(rows)

    num_blocks = batch_size * -(-total // block_size) + 8
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=False)
    sched = SchedulerConfig(max_num_seqs=batch_size, max_num_batched_tokens=max(batch_size * prompt_len, 64),
                            max_model_len=total)
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for steps in dict.fromkeys((1, num_steps)):
        engine = LLMEngine(model_config=cfg, cache_config=cache, scheduler_config=sched, params=params,
                           decode_steps_per_call=steps)
        out: dict[str, np.ndarray] = {}

        def go(engine=engine, out=out):
            outs = engine.generate([p.tolist() for p in prompts], sampling, use_tqdm=False)
            out["tokens"] = np.array([o.output_token_ids for o in outs])

        go()  # compile
        rows.append(dict(name=f"pagedjax engine, num_steps={steps} ({engine.backend})",
                         seconds=_best_time(go, repeats), tokens=out["tokens"]))

    ref = min(rows[:num_hf], key=lambda r: r["seconds"])  # the fastest transformers setting
    for r in rows:
        r["tokens_per_s"] = batch_size * max_tokens / r["seconds"]
        r["ms_per_step"] = 1000 * r["seconds"] / max_tokens
        r["vs_transformers"] = ref["seconds"] / r["seconds"]
        r["same_tokens"] = float(np.mean([np.array_equal(a, b) for a, b in zip(r["tokens"], ref["tokens"],
                                                                                 strict=True)]))
    return rows


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def print_table(rows: list[dict], path: str | Path, batch_size: int, prompt_len: int, max_tokens: int) -> None:
    print(f"\nHF model {path}: batch {batch_size}, prompt {prompt_len} tokens, {max_tokens} new tokens each, "
          "float32, CPU")
    print(f"{'implementation':58s} {'time s':>8s} {'tok/s':>9s} {'ms/step':>9s} {'vs transformers':>16s} "
          f"{'same tokens':>12s}")
    for r in rows:
        print(f"{r['name']:58s} {r['seconds']:8.3f} {r['tokens_per_s']:9.1f} {r['ms_per_step']:9.2f} "
              f"{r['vs_transformers']:15.2f}x {100 * r['same_tokens']:11.0f}%")


def make_tiny_llama(path: str | Path, seed: int = 0) -> Path:
    """Write a random tiny Llama (transformers' own classes, GQA, untied) to `path`; returns the folder."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, intermediate_size=704, max_position_embeddings=2048,
                                      tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)
    return Path(path)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", metavar="PATH", help="local Hugging Face folder (config.json + *.safetensors)")
    ap.add_argument("--make-tiny", metavar="DIR", help="write a random tiny Llama to DIR and benchmark it")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-steps", type=int, default=8, help="fused decode steps for the fused-decode row")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, nargs="+", help="torch thread counts to time (default: 1 and "
                    "torch's default)")
    args = ap.parse_args(argv)
    if args.make_tiny:
        path = make_tiny_llama(args.make_tiny)
    elif args.model:
        path = Path(args.model)
    else:
        ap.error("give --model PATH or --make-tiny DIR")
    rows = run_hf_benchmark(path, args.batch, args.max_tokens, prompt_len=args.prompt_len, num_steps=args.num_steps,
                            repeats=args.repeats, block_size=args.block_size,
                            torch_threads=tuple(args.torch_threads) if args.torch_threads else None)
    print_table(rows, path, args.batch, args.prompt_len, args.max_tokens)
    return rows


if __name__ == "__main__":
    main()
