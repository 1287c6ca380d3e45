"""Weight-only quantization (`pagedjax.model.layers.quant`): decode throughput and weight bytes of float32 vs int8 vs
int4 vs fp8, all in one run.

    python scripts/bench_quant.py                   # the 156M shape, batch 1 and 16
    python scripts/bench_quant.py --quick           # a tiny model (seconds): the smoke test
    python scripts/bench_quant.py --schemes float32,int8,int4:32,int8-head,int4-head
    python scripts/bench_quant.py --chain           # 8 layers of linears alone: each scheme's products, GB/s
    python scripts/bench_quant.py --schemes float32,int8,int4,int4:32,fp8 --decode-steps 1,8 --repeats 5
                                                    # the fused decode (8 steps a call) against single steps
    python scripts/bench_quant.py --llama-python /work/peers/llama/bin/python \
        --llama-cpp-dir /work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp     # + llama.cpp f32 / Q8_0 / Q4_0

Speed: one engine per scheme over the same random model (`bench_engine.SHAPES`), greedy, fixed lengths; every
engine is warmed up (compiled) first, then timed in interleaved rounds (one run of each per round, so machine
noise hits all rows alike); a row's time is its best round, its ratio is against float32 in the same run.
"weight MB/step" is what one decode step reads (`bench_engine.decode_weight_bytes`: every parameter but the
input embedding table). A scheme name with "-head" also quantizes the LM head (kept float by default).

With `--decode-steps 1,8` every scheme runs one engine per `decode_steps_per_call` (1: a device call per decode
step; 8: the fused decode, eight steps in one `lax.while_loop`), all in the same rounds, and a second table
gives each scheme's and batch's median tokens/s per value and the last value's speed over the first's (the median
of the ratio of the two runs of each round).

With `--llama-python` (a Python whose venv has llama-cpp-python, `scripts/bench_peers.py` says how to build
it) and `--llama-cpp-dir` (its llama.cpp sources), every row runs the random Hugging Face checkpoint of
`bench_peers` (`build_checkpoint`, same shape) instead, and llama.cpp rows join the same rounds: its f32 GGUF
(converted by llama.cpp's own `convert_hf_to_gguf.py`) and the Q8_0 / Q4_0 GGUFs its `llama_model_quantize`
makes of it, decoded by `bench_peers`' driver (greedy, float32 KV cache, `--llama-threads` threads, its extra
weight buffer types - AMX, repacked layouts - off: with them, llama_decode of Q8_0 / Q4_0 segfaulted on this
AMX machine), the same prompts and lengths, timed inside the driver (prefill included, as the engine rows are).

Accuracy and memory (held-out bits per byte, top-1 agreement with float32, parameter bytes and the KV blocks
they leave room for): `scripts/bench_quant_accuracy.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_engine import SHAPES, decode_weight_bytes
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.quant import QuantConfig
from pagedjax.model.llama import init_model, model_from_state, quantize_params

DEFAULT_SCHEMES = "float32,int8,int4,fp8"
LLAMA_TYPES = {"llama.cpp f32": None, "llama.cpp Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
               "llama.cpp Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}  # row name -> llama_cpp's file type (None: as converted)


def quant_config(scheme: str) -> QuantConfig | None:
    """"float32" -> None; "int8", "int4:32", ... -> QuantConfig; a "-head" suffix quantizes the LM head too."""
    if scheme == "float32":
        return None
    name, head = scheme.removesuffix("-head"), scheme.endswith("-head")
    quant = QuantConfig.parse(name)
    return dataclasses.replace(quant, keep_float=()) if head else quant


def quantized(cfg: ModelConfig, state, scheme: str):
    quant = quant_config(scheme)
    return (cfg, state) if quant is None else quantize_params(cfg, state, quant)


def speed(cfg: ModelConfig, state, schemes: list[str], batches: list[int], prompt_len: int, max_tokens: int,
          repeats: int, peers: tuple = (), decode_steps: tuple[int, ...] = (1,)) -> list[dict]:
    """Rows of tokens/s (best and median round): one engine per scheme and `decode_steps_per_call` of
    `decode_steps` over `state` (float parameters of `cfg`), then `peers` ((name, bench_peers.Subprocess, weight
    bytes) of llama.cpp GGUFs), each batch size, all timed in the same rounds."""
    total, block = prompt_len + max_tokens, 16
    rng = np.random.default_rng(0)
    prompts = {batch: rng.integers(3, cfg.vocab_size, (batch, prompt_len)) for batch in batches}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    for scheme in schemes:
        qcfg, qstate = quantized(cfg, state, scheme)
        weight_bytes = decode_weight_bytes(model_from_state(qcfg, qstate))
        for steps in decode_steps:
            num_blocks = max(batches) * -(-total // block) + 8
            engine = LLMEngine(model_config=qcfg, cache_config=CacheConfig(block_size=block, num_blocks=num_blocks,
                                                                           enable_prefix_caching=False),
                               scheduler_config=SchedulerConfig(max_num_seqs=max(batches),
                                                                max_num_batched_tokens=max(batches) * prompt_len,
                                                                max_model_len=total), params=qstate,
                               decode_steps_per_call=steps)
            for batch in batches:
                def go(engine=engine, batch=batch) -> float:
                    start = time.perf_counter()
                    engine.generate(prompts[batch].tolist(), params, use_tqdm=False)
                    return time.perf_counter() - start
                go()  # warm-up: compiles this batch's shapes
                rows.append(dict(scheme=scheme, batch=batch, steps=steps, go=go, times=[], weight_bytes=weight_bytes))
    for name, peer, weight_bytes in peers:
        for batch in batches:
            go = lambda peer=peer, batch=batch: peer.run(prompts[batch], max_tokens)[0]  # noqa: E731
            go()  # warm-up
            rows.append(dict(scheme=name, batch=batch, steps=decode_steps[0], go=go, times=[],
                             weight_bytes=weight_bytes))
    for _ in range(repeats):
        for r in rows:
            r["times"].append(r["go"]())
    for r in rows:
        r["tokens_per_s"] = r["batch"] * max_tokens / min(r["times"])
        r["median_tokens_per_s"] = r["batch"] * max_tokens / float(np.median(r["times"]))
    return rows


def print_fused(rows: list[dict], decode_steps: tuple[int, ...]) -> None:
    """Per scheme and batch, median tokens/s at each `decode_steps_per_call` of `decode_steps` (and against float32's
    at the same batch and steps), and the last value's speed over the first's: the median over rounds of the two
    runs' ratio in the same round (a load that changes between rounds moves both alike)."""
    first, last = decode_steps[0], decode_steps[-1]
    by_key = {(r["scheme"], r["batch"], r["steps"]): r for r in rows}
    rate = {key: r["median_tokens_per_s"] for key, r in by_key.items()}
    header = "".join(f"{f'{n} step(s)':>12}{'x f32':>7}" for n in decode_steps)
    print("\nmedian tokens/s by decode_steps_per_call (x f32: against float32 at the same batch and steps; "
          f"{last} / {first}: median of the rounds' ratios)")
    print(f"{'scheme':<10}{'batch':>6}{header}{f'{last} / {first}':>9}")
    for scheme in dict.fromkeys(r["scheme"] for r in rows if (r["scheme"], r["batch"], last) in rate):
        for batch in sorted({r["batch"] for r in rows}):
            cells = "".join(f"{rate[scheme, batch, n]:>12.1f}{rate[scheme, batch, n] / rate['float32', batch, n]:>7.2f}"
                            for n in decode_steps)
            ratio = np.median(np.array(by_key[scheme, batch, first]["times"]) / by_key[scheme, batch, last]["times"])
            print(f"{scheme:<10}{batch:>6}{cells}{ratio:>9.2f}")


def llama_ggufs(folder: Path, llama_python: str, llama_cpp_dir: Path, pythonpath: str | None,
                vocab_size: int) -> dict[str, Path]:
    """Row name -> GGUF file per `LLAMA_TYPES`: the f32 GGUF llama.cpp's converter makes of `folder`, and its
    quantizations by llama.cpp itself (files reused when present)."""
    from bench_peers import convert_to_gguf

    f32 = convert_to_gguf(folder, llama_cpp_dir, vocab_size, pythonpath)
    paths = {}
    for name, ftype in LLAMA_TYPES.items():
        path = paths[name] = f32 if ftype is None else folder / f"model-{name.split()[-1].lower()}.gguf"
        if not path.is_file():
            script = ("import ctypes, sys, llama_cpp as L\np = L.llama_model_quantize_default_params()\n"
                      f"p.ftype = L.{ftype}\nsys.exit(L.llama_model_quantize({str(f32)!r}.encode(), "
                      f"{str(path)!r}.encode(), ctypes.byref(p)))")
            subprocess.run([llama_python, "-c", script], check=True, capture_output=True, timeout=1800)
    return paths


def gguf_bytes(path: Path, llama_cpp_dir: Path, skip: tuple[str, ...] = ()) -> int:
    """Bytes of a GGUF's tensors but those named in `skip`, read by llama.cpp's own gguf-py (from its sources)."""
    import sys

    gguf_py = str(llama_cpp_dir / "gguf-py")
    if gguf_py not in sys.path:
        sys.path.insert(0, gguf_py)
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors if t.name not in skip)


def llama_peers(folder: Path, llama_python: str, llama_cpp_dir: Path, pythonpath: str | None, threads: int,
                cfg: ModelConfig, max_batch: int, max_len: int, max_batched_tokens: int) -> list[tuple]:
    """(row name, a running bench_peers llama.cpp driver, decode weight bytes) per `LLAMA_TYPES` (`llama_ggufs`)."""
    from bench_peers import LLAMA_DRIVER, Subprocess

    peers = []
    for name, path in llama_ggufs(folder, llama_python, llama_cpp_dir, pythonpath, cfg.vocab_size).items():
        ftype = LLAMA_TYPES[name]
        # What a decode step reads: every tensor but the input embedding table (one row of it).
        weight_bytes = gguf_bytes(path, llama_cpp_dir, skip=("token_embd.weight",))
        config = dict(gguf=str(path), threads=threads, max_model_len=max_len, max_num_seqs=max_batch,
                      max_num_batched_tokens=max_batched_tokens, extra_bufts=ftype is None)  # bench_peers: driver
        peer = Subprocess(f"{name}, {threads} thread(s)", llama_python, LLAMA_DRIVER, config, {}, 900.0, 900.0)
        peer.wait_ready()
        peers.append((name, peer, weight_bytes))
    return peers


def chain(cfg: ModelConfig, schemes: list[str], batches: list[int], rounds: int = 10) -> None:
    """The linear layers alone: `cfg.num_layers` layers of q, k, v, o, gate, up, down of `cfg`'s shape, each
    layer's input an RMS norm of the last (as the model feeds them), compiled with the engine's XLA options for
    that many rows (`runner.cpu_compiler_options`), timed in interleaved rounds (best round). GB/s is of the
    stored weight bytes."""
    from pagedjax.model.layers.quant import QuantizedLinear
    from pagedjax.runner.runner import cpu_compiler_options

    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    shapes = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]
    rng = np.random.default_rng(0)
    kernels = [jnp.asarray(rng.standard_normal(shape) * 0.02, jnp.float32) for _ in range(cfg.num_layers)
               for shape in shapes]

    def forward(layers, x):
        norm = lambda v: v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-6)  # noqa: E731
        for n in range(cfg.num_layers):
            q, k, v, o, gate, up, down = layers[7 * n:7 * n + 7]
            a = norm(x)
            x = x + o(jnp.tanh(q(a)) + k(a).sum(-1, keepdims=True) + v(a).sum(-1, keepdims=True))
            a = norm(x)
            x = x + down(jax.nn.silu(gate(a)) * up(a))
        return x

    rows = []
    for scheme in schemes:
        quant = quant_config(scheme)
        layers = [nnx.Linear(*k.shape, use_bias=False, rngs=nnx.Rngs(0)) if quant is None else
                  QuantizedLinear(k, quant=quant) for k in kernels]
        if quant is None:
            for layer, k in zip(layers, kernels, strict=True):
                layer.kernel.set_value(k)
        graphdef, state = nnx.split(nnx.List(layers))
        stored = sum(x.nbytes for x in jax.tree.leaves(state))
        for b in batches:
            x = jnp.asarray(rng.standard_normal((b, h)), jnp.float32)
            options = cpu_compiler_options(cfg, b, quant is not None)
            fn = jax.jit(lambda s, x, graphdef=graphdef: forward(list(nnx.merge(graphdef, s)), x))
            exe = fn.lower(state, x).compile(options)
            exe(state, x).block_until_ready()
            rows.append(dict(scheme=scheme, batch=b, call=lambda exe=exe, state=state, x=x: exe(state, x),
                             stored=stored, times=[]))
    for _ in range(rounds):
        for r in rows:
            start = time.perf_counter()
            r["call"]().block_until_ready()
            r["times"].append(time.perf_counter() - start)
    base = {r["batch"]: min(r["times"]) for r in rows if r["scheme"] == "float32"}
    print(f"\n{cfg.num_layers} layers of linears [{h}, {i}], {jax.default_backend()}, best of {rounds} rounds")
    print(f"{'scheme':<12}{'rows':>6}{'ms':>9}{'x float32':>11}{'stored MiB':>12}{'GB/s':>8}")
    for r in rows:
        best = min(r["times"])
        print(f"{r['scheme']:<12}{r['batch']:>6}{best * 1e3:>9.2f}{base[r['batch']] / best:>11.2f}"
              f"{r['stored'] / 2**20:>12.1f}{r['stored'] / best / 1e9:>8.1f}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(SHAPES), default="156m", help="the speed rows' model shape")
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help=f"comma-separated (default: {DEFAULT_SCHEMES})")
    ap.add_argument("--batches", default="1,16", help="comma-separated batch sizes (default: 1,16)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-steps", default="1",
                    help="comma-separated decode_steps_per_call values, an engine each (default: 1); with two or "
                         "more, a table of the fused decode against the first value")
    ap.add_argument("--quick", action="store_true", help="tiny model and workload (seconds)")
    ap.add_argument("--chain", action="store_true", help="only time the model shape's linear layers (`chain`)")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python: llama.cpp f32 / Q8_0 / Q4_0 rows")
    ap.add_argument("--llama-cpp-dir", help="the llama.cpp sources it was built from (the sdist's vendor/llama.cpp)")
    ap.add_argument("--llama-pythonpath", help="extra PYTHONPATH for llama.cpp's converter (e.g. sentencepiece)")
    ap.add_argument("--llama-threads", type=int, default=2)
    args = ap.parse_args(argv)
    schemes = args.schemes.split(",")
    if schemes[0] != "float32":
        ap.error("--schemes must start with float32 (the baseline of every ratio)")
    for s in schemes:
        quant_config(s)  # a bad name fails before anything runs
    if bool(args.llama_python) != bool(args.llama_cpp_dir):
        ap.error("--llama-python and --llama-cpp-dir go together")
    cfg = SHAPES[args.model]
    batches = [int(b) for b in args.batches.split(",")]
    decode_steps = tuple(int(n) for n in args.decode_steps.split(","))
    if args.chain:
        chain(cfg, schemes, batches)
        return
    if args.quick:
        cfg = ModelConfig(vocab_size=64, hidden_size=128, num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=64,
                          intermediate_size=256, tie_word_embeddings=False)
        schemes, batches, args.prompt_len, args.max_tokens, args.repeats = schemes[:3], [1, 2], 4, 4, 1
    peers, source = (), "random pagedjax init"
    if args.llama_python:
        from bench_peers import MODELS, build_checkpoint

        from pagedjax.model.loading.hf_loader import load_hf

        folder = build_checkpoint(Path("/tmp") / f"bench-peers-{args.model}", MODELS[args.model][0])
        cfg, state, _ = load_hf(folder)
        source = f"the random Hugging Face checkpoint {folder}"
        total = args.prompt_len + args.max_tokens
        peers = llama_peers(folder, args.llama_python, Path(args.llama_cpp_dir), args.llama_pythonpath,
                            args.llama_threads, cfg, max(batches), total, max(batches) * total)
    else:
        state = nnx.state(init_model(cfg, seed=0), nnx.Param)
    load = os.getloadavg()
    print(f"{args.model if not args.quick else 'quick'} model ({source}), {jax.default_backend()}, prompt "
          f"{args.prompt_len}, {args.max_tokens} new tokens, best of {args.repeats} interleaved rounds")
    try:
        rows = speed(cfg, state, schemes, batches, args.prompt_len, args.max_tokens, args.repeats, peers,
                     decode_steps)
    finally:
        for _, peer, _ in peers:
            peer.close()
    base = {r["batch"]: r for r in rows if r["scheme"] == "float32" and r["steps"] == decode_steps[0]}
    print(f"{'scheme':<16}{'batch':>6}{'tokens/s':>11}{'x float32':>11}{'weight MiB/step':>16}{'x fewer bytes':>15}")
    for r in (r for r in rows if r["steps"] == decode_steps[0]):
        b = base[r["batch"]]
        speedup = r["tokens_per_s"] / b["tokens_per_s"]
        print(f"{r['scheme']:<16}{r['batch']:>6}{r['tokens_per_s']:>11.1f}{speedup:>11.2f}"
              f"{r['weight_bytes'] / 2**20:>16.1f}{b['weight_bytes'] / r['weight_bytes']:>15.2f}")
    if len(decode_steps) > 1:
        print_fused(rows, decode_steps)
    print(f"load average at the start {load[0]:.2f}, at the end {os.getloadavg()[0]:.2f} (1 minute)")


if __name__ == "__main__":
    main()
