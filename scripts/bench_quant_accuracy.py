"""Weight-only quantization (`pagedjax.model.layers.quant`): what each scheme costs in accuracy and buys in memory.

    python scripts/bench_quant_accuracy.py                          # the bundled model and the 156M model
    python scripts/bench_quant_accuracy.py --models bundled         # the bundled model only (5 min on 2 cores)
    python scripts/bench_quant_accuracy.py --llama-python /work/peers/llama/bin/python \
        --llama-cpp-dir /work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp    # + llama.cpp's Q8_0 / Q4_0

Per scheme (float32, int8, int4 = groups of 128, int4:32, fp8; "-head": the LM head quantized too, kept float
by default; left out for a model with tied embeddings, which has no LM head layer), each quantized from the
same float32 parameters (`bench_quant.quantized`):

- **held-out bits per byte** (bundled model): `train_tiny`'s own measure over the whole held-out split of the
  corpus it was trained on (`read_corpus`, the model folder's tokenizer, `heldout_bpb_of_split` in
  `train_tiny.TrainConfig.seq_len`-token windows): what `train_tiny.py --evaluate` prints for float32.
- **teacher-forced top-1 agreement with float32**: one dense forward (`Llama.forward_dense`, no cache) over
  the token ids of `TEXT`; at every position the most likely next token is compared with float32's. Beside
  it, the **logit error**: the RMS of (logits - float32's logits) over every position and token, over the RMS
  of float32's logits about each position's mean (`logit_error`); and under the table float32's median top-1
  margin (top logit - second, in units of that position's logit standard deviation, `top1_margin`): a
  position's top-1 flips when the error there exceeds its margin.
  The 156M model is `bench_peers`' random Hugging Face checkpoint (`build_checkpoint`), its ids `TEXT` through
  the byte-fallback tokenizer llama.cpp's converter reads. Its weights are random, so its next-token
  distributions are nearly flat and their top two logits close (a small margin): its agreement measures how
  far each scheme's rounding moves the logits relative to those margins (a harsh test), not a loss of
  language-model quality; its logit error compares schemes without that threshold.
- **llama.cpp** (with `--llama-python`, a Python whose venv has llama-cpp-python, and `--llama-cpp-dir`, its
  llama.cpp sources): the 156M checkpoint's f32 GGUF (llama.cpp's converter) and the Q8_0 / Q4_0 GGUFs its
  `llama_model_quantize` makes of it (`bench_quant.llama_ggufs`), each decoding the same ids in one
  `llama_decode` with logits at every position (float32 KV cache); Q8_0 / Q4_0 are compared with llama.cpp's
  own f32, and llama.cpp's f32 with pagedjax's float32 (the same weights: what differs there is the two
  engines' float rounding). The parameter bytes of a GGUF row are its tensors' bytes.
- **memory**: the parameters' bytes (every array of the model's state: quantized kernels, their scales,
  embeddings and norms), and under a fixed budget for parameters + KV cache (`--budget-mib`, per model), the KV
  blocks the rest holds by the engine's own sizing (`CacheConfig(kv_memory_bytes=...).resolve_num_blocks`,
  the model's dtype in the pages) and the tokens they hold. The budget leaves out the engine's activations
  and step buffers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from bench_peers import DRIVER_PRELUDE, MARK, MODELS, build_checkpoint, write_byte_fallback_tokenizer
from bench_quant import gguf_bytes, llama_ggufs, quant_config, quantized
from flax import nnx
from tokenizers import Tokenizer
from train_tiny import TrainConfig, heldout_bpb_of_split, model_dir_corpus_tokenizer, read_corpus

from pagedjax import CacheConfig, ModelConfig
from pagedjax.model.llama import model_from_state
from pagedjax.model.loading.checkpoint import bundled_model_path, load_checkpoint
from pagedjax.model.loading.hf_loader import load_hf

SCHEMES = "float32,int8,int4,int4:32,fp8,int8-head,int4-head,int4:32-head,fp8-head"
BLOCK_SIZE = 16  # CacheConfig's default
TEXT = (  # a fixed text for teacher forcing: code, which the bundled model was trained on (not from its corpus)
    "import collections\n\n\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
    "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nclass Stack:\n"
    "    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def __len__(self):\n        return len(self.items)\n\n\n"
    "def word_counts(path, encoding=\"utf-8\"):\n    \"\"\"Count the words of a text file.\"\"\"\n"
    "    counts = collections.Counter()\n    with open(path, encoding=encoding) as f:\n"
    "        for line in f:\n            counts.update(line.split())\n    return counts\n\n\n"
    "def binary_search(items, target):\n    lo, hi = 0, len(items)\n    while lo < hi:\n"
    "        mid = (lo + hi) // 2\n        if items[mid] < target:\n            lo = mid + 1\n"
    "        else:\n            hi = mid\n    return lo\n\n\n"
    "class Config(dict):\n    def __getattr__(self, name):\n        try:\n            return self[name]\n"
    "        except KeyError:\n            raise AttributeError(name) from None\n\n"
    "    def __setattr__(self, name, value):\n        self[name] = value\n\n\n"
    "def main(argv=None):\n    import argparse\n    parser = argparse.ArgumentParser()\n"
    "    parser.add_argument(\"path\")\n    parser.add_argument(\"--top\", type=int, default=10)\n"
    "    args = parser.parse_args(argv)\n    for word, count in word_counts(args.path).most_common(args.top):\n"
    "        print(f\"{count:8d} {word}\")\n\n\nif __name__ == \"__main__\":\n    main()\n")


# ------------------------------------------------------------------------------------------- pagedjax rows
def param_bytes(state: nnx.State) -> int:
    """Bytes of every array of a model's state (quantized kernels and their scales as stored)."""
    return sum(x.nbytes for x in jax.tree.leaves(state))


def logits(cfg: ModelConfig, state: nnx.State, ids: np.ndarray) -> np.ndarray:
    """Teacher-forced next-token logits after every position of `ids` (i32[S]): one dense forward of
    `Llama(cfg)` holding `state`. Returns f32[S, vocab]."""
    if ids.ndim != 1 or len(ids) < 1:
        raise ValueError(f"ids: a non-empty sequence of token ids, got shape {ids.shape}")
    graphdef, s = nnx.split(model_from_state(cfg, state))
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))
    return np.asarray(forward(s, jnp.asarray(ids[None], jnp.int32)))[0]


def _centered_rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x - x.mean(-1, keepdims=True)))))


def logit_error(got: np.ndarray, want: np.ndarray) -> float:
    """RMS of `got - want` (f32[S, vocab] each) over the RMS of `want` about each position's mean: 0 when equal,
    about 1.4 for unrelated logits of the same spread."""
    return float(np.sqrt(np.mean(np.square(got - want)))) / _centered_rms(want)


def top1_margin(x: np.ndarray) -> float:
    """The median over positions of (top logit - second logit) / that position's logit standard deviation, of
    logits f32[S, vocab]."""
    top2 = np.sort(x, -1)[:, -2:]  # f32[S, 2]
    return float(np.median((top2[:, 1] - top2[:, 0]) / x.std(-1)))


def kv_blocks(cfg: ModelConfig, params: int, budget: int) -> int:
    """KV blocks of `BLOCK_SIZE` tokens (the model's dtype) that fit in `budget` bytes once `params` bytes of
    parameters are in it, sized as the engine sizes its pool from `kv_memory_bytes`. ValueError naming the
    budget when the parameters leave no room for one block."""
    if params >= budget:
        raise ValueError(f"budget: {budget} bytes hold no KV block beside {params} bytes of parameters")
    return CacheConfig(block_size=BLOCK_SIZE, kv_memory_bytes=budget - params).resolve_num_blocks(cfg)


@dataclass
class Row:
    """One scheme's (or GGUF's) measurements against its baseline; `param_bytes`, `bpb` and `blocks` where
    measured."""

    scheme: str
    top1: np.ndarray  # i32[S]: teacher-forced top-1 token after each position of the text
    agreement: float  # share of positions whose top-1 is the baseline's
    logit_error: float  # `logit_error` against the baseline's logits
    param_bytes: int
    bpb: float | None = None
    blocks: int | None = None


def compare(scheme: str, got: np.ndarray, want: np.ndarray, nbytes: int) -> Row:
    """The row of logits `got` against the baseline's `want` (f32[S, vocab] each)."""
    top1 = got.argmax(-1)
    return Row(scheme, top1, float((top1 == want.argmax(-1)).mean()), logit_error(got, want), nbytes)


def measure(cfg: ModelConfig, state: nnx.State, schemes: list[str], ids: np.ndarray, budget: int | None = None,
            heldout: tuple[np.ndarray, np.ndarray, int] | None = None) -> tuple[list[Row], np.ndarray]:
    """A row per scheme of the float parameters `state` of `cfg`, against the first scheme (which must be
    float32): teacher-forced top-1 and logits over `ids`, parameter bytes, KV blocks under `budget` bytes, and
    with `heldout` = (tokens u16[N], bytes per token id i32[vocab], window length) its bits per byte
    (`train_tiny.heldout_bpb_of_split`). Returns (the rows, float32's logits f32[S, vocab])."""
    if schemes[0] != "float32":
        raise ValueError(f"schemes: the first is the float32 baseline, got {schemes[0]!r}")
    rows, want = [], None
    for scheme in schemes:
        qcfg, qstate = quantized(cfg, state, scheme)
        got = logits(qcfg, qstate, ids)
        want = got if want is None else want
        row = compare(scheme, got, want, param_bytes(qstate))
        if budget is not None:
            row.blocks = kv_blocks(qcfg, row.param_bytes, budget)
        if heldout is not None:
            row.bpb = heldout_bpb_of_split(model_from_state(qcfg, qstate), *heldout)
        rows.append(row)
    return rows, want


# ------------------------------------------------------------------------------------------------ llama.cpp
# Runs under llama-cpp-python's Python (its low-level API, as bench_peers' LLAMA_DRIVER): argv[1] is
# {"ggufs": {name: path}, "ids": [...], "threads": n, "out": folder}; writes each GGUF's logits after every
# position to out/<i>.npy (i: its index in ggufs), then replies {}.
LLAMA_LOGITS_DRIVER = r"""
import numpy as np
import llama_cpp as L


def main():
    cfg = json.loads(sys.argv[1])
    ids = cfg["ids"]
    L.llama_backend_init()
    for index, path in enumerate(cfg["ggufs"].values()):
        model_params = L.llama_model_default_params()
        model_params.use_extra_bufts = False  # as bench_quant: with them, Q8_0 / Q4_0 segfaulted on an AMX CPU
        model = L.llama_model_load_from_file(path.encode(), model_params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = len(ids)
        params.n_threads = params.n_threads_batch = cfg["threads"]
        params.type_k = params.type_v = L.GGML_TYPE_F32  # float32 KV, as pagedjax's float32 model
        # Its CPU flash attention rounds to float16 on the way (logits 1e-3 off pagedjax float32's, measured on
        # bench_peers' tiny model; 1e-6 without it): off, so that f32 is a float reference like pagedjax's.
        params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        ctx = L.llama_init_from_model(model, params)
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        batch = L.llama_batch_init(len(ids), 0, 1)
        batch.n_tokens = len(ids)
        for i, token in enumerate(ids):  # one sequence, logits wanted at every position
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
            batch.seq_id[i][0] = 0
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError(f"llama_decode failed on {path}")
        out = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                        for i in range(len(ids))]).astype(np.float32)
        np.save(f"{cfg['out']}/{index}.npy", out)
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    reply({})


main()
"""


def llama_logits(llama_python: str, ggufs: dict[str, Path], ids: np.ndarray, threads: int) -> dict[str, np.ndarray]:
    """Each GGUF's teacher-forced logits after every position of `ids` (i32[S]) as f32[S, vocab], computed by
    llama.cpp in a subprocess of `llama_python`. RuntimeError with the driver's last output lines when it
    fails."""
    with tempfile.TemporaryDirectory(prefix="bench_quant_accuracy_") as out:
        config = json.dumps({"ggufs": {k: str(v) for k, v in ggufs.items()}, "ids": ids.tolist(),
                             "threads": threads, "out": out})
        r = subprocess.run([llama_python, "-c", DRIVER_PRELUDE + LLAMA_LOGITS_DRIVER, config], capture_output=True,
                           text=True, timeout=1800)
        if r.returncode != 0 or not any(line.startswith(MARK) for line in r.stdout.splitlines()):
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"llama.cpp driver failed (exit code {r.returncode}):\n{tail}")
        return {name: np.load(Path(out) / f"{i}.npy") for i, name in enumerate(ggufs)}


# ---------------------------------------------------------------------------------------------------- tables
def table(rows: list[Row], budget: int | None) -> str:
    """A markdown table of `rows`, the first the baseline ("-" where a row has no such measurement)."""
    base = rows[0]
    head = ["scheme", "top-1 = baseline", "logit error", "params MiB", "x fewer bytes"]
    if base.bpb is not None:
        head[1:1] = ["held-out bits/byte", "vs float32"]
    if budget is not None:
        head += [f"KV blocks in {budget / 2**20:g} MiB", "KV tokens", "x float32 tokens"]
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        cells = [r.scheme, f"{r.agreement:.2%}", f"{r.logit_error:.4f}", f"{r.param_bytes / 2**20:.2f}",
                 f"{base.param_bytes / r.param_bytes:.2f}"]
        if base.bpb is not None:
            cells[1:1] = ["-", "-"] if r.bpb is None else [f"{r.bpb:.4f}", f"{r.bpb - base.bpb:+.4f}"]
        if budget is not None:
            cells += ["-"] * 3 if r.blocks is None else [str(r.blocks), str(r.blocks * BLOCK_SIZE),
                                                         f"{r.blocks / base.blocks:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bundled(schemes: list[str], budget: int, corpus_dir: Path | None, max_corpus_bytes: int | None) -> str:
    """The bundled model's table: held-out bits per byte, top-1 agreement over `TEXT`, memory."""
    cfg, state = load_checkpoint(bundled_model_path())
    note = ""
    if cfg.tie_word_embeddings:  # no lm_head layer: a "-head" scheme is the same model as the one without
        note = f"; {', '.join(s for s in schemes if s.endswith('-head'))} left out: tied embeddings, no LM head layer"
        schemes = [s for s in schemes if not s.endswith("-head")]
    tok = model_dir_corpus_tokenizer(bundled_model_path(), cfg)
    files = read_corpus(corpus_dir, max_corpus_bytes)
    if not files.heldout:
        raise SystemExit(f"the corpus under {files.root} has no held-out files")
    heldout = tok.encode_files(files.heldout)
    ids = tok.encode_files([TEXT.encode()])[:-1].astype(np.int32)  # BOS + TEXT, as the corpus is tokenized
    rows, want = measure(cfg, state, schemes, ids, budget, (heldout, tok.token_bytes, TrainConfig.seq_len))
    return (f"bundled model ({bundled_model_path()}): held-out split of {files.root}: {len(files.heldout)} files, "
            f"{tok.num_bytes(heldout):,} bytes, {len(heldout):,} tokens in windows of {TrainConfig.seq_len}; "
            f"top-1 over {len(ids)} positions of TEXT{note}\n\n" + table(rows, budget)
            + f"\n\nfloat32's median top-1 margin: {top1_margin(want):.3f} logit standard deviations")


def model_156m(schemes: list[str], budget: int, max_positions: int, llama: argparse.Namespace) -> str:
    """The 156M random model's table: top-1 agreement over `TEXT`'s first `max_positions` byte-fallback ids,
    memory, and llama.cpp's rows (against its own f32) when `llama.llama_python` is set."""
    folder = build_checkpoint(Path("/tmp/bench-peers-156m"), MODELS["156m"][0])
    cfg, state, _ = load_hf(folder)
    if not (folder / "tokenizer.json").is_file():
        write_byte_fallback_tokenizer(folder, cfg.vocab_size)
    ids = np.asarray(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT).ids[:max_positions])
    rows, want = measure(cfg, state, schemes, ids, budget)
    note = f"\n\nfloat32's median top-1 margin: {top1_margin(want):.3f} logit standard deviations"
    if llama.llama_python:
        llama_cpp_dir = Path(llama.llama_cpp_dir)
        ggufs = llama_ggufs(folder, llama.llama_python, llama_cpp_dir, llama.llama_pythonpath, cfg.vocab_size)
        got = llama_logits(llama.llama_python, ggufs, ids, llama.llama_threads)
        f32 = got["llama.cpp f32"]
        rows += [compare(name, x, f32, gguf_bytes(ggufs[name], llama_cpp_dir)) for name, x in got.items()]
        same = (f32.argmax(-1) == want.argmax(-1)).mean()
        note += (f"; llama.cpp rows against llama.cpp f32, which against pagedjax float32 has top-1 "
                 f"{same:.2%} the same and logit error {logit_error(f32, want):.2e}")
    return (f"156M random model ({folder}): top-1 over {len(ids)} positions of TEXT (byte-fallback ids)\n\n"
            + table(rows, budget) + note)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="bundled,156m", help="comma-separated: bundled, 156m")
    ap.add_argument("--schemes", default=SCHEMES, help=f"comma-separated, float32 first (default: {SCHEMES})")
    ap.add_argument("--budget-mib", type=float, default=1024.0, help="156M model: parameters + KV cache, MiB")
    ap.add_argument("--bundled-budget-mib", type=float, default=16.0, help="bundled model: parameters + KV, MiB")
    ap.add_argument("--max-positions", type=int, default=512, help="156M model: teacher-forced positions of TEXT")
    ap.add_argument("--corpus-dir", type=Path, help="train_tiny's corpus folder (default: this Python's stdlib)")
    ap.add_argument("--max-corpus-bytes", type=int, help="read at most this many bytes of corpus files")
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python: llama.cpp f32 / Q8_0 / Q4_0 rows")
    ap.add_argument("--llama-cpp-dir", help="the llama.cpp sources it was built from (the sdist's vendor/llama.cpp)")
    ap.add_argument("--llama-pythonpath", help="extra PYTHONPATH for llama.cpp's converter (e.g. sentencepiece)")
    ap.add_argument("--llama-threads", type=int, default=2)
    args = ap.parse_args(argv)
    schemes, models = args.schemes.split(","), args.models.split(",")
    if schemes[0] != "float32":
        ap.error("--schemes must start with float32 (the baseline of every comparison)")
    for s in schemes:
        quant_config(s)  # a bad name fails before anything runs
    if set(models) - {"bundled", "156m"}:
        ap.error(f"--models: unknown {sorted(set(models) - {'bundled', '156m'})}; expected bundled, 156m")
    if bool(args.llama_python) != bool(args.llama_cpp_dir):
        ap.error("--llama-python and --llama-cpp-dir go together")
    print(f"{jax.default_backend()}, load average {os.getloadavg()[0]:.1f} at the start")
    if "bundled" in models:
        print("\n" + bundled(schemes, int(args.bundled_budget_mib * 2**20), args.corpus_dir, args.max_corpus_bytes))
    if "156m" in models:
        print("\n" + model_156m(schemes, int(args.budget_mib * 2**20), args.max_positions, args))
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
