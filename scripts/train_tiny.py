#!/usr/bin/env python
"""Train pagedjax's bundled model (a small Llama) on the Python standard library's own sources.

The corpus is on every machine and needs no download: each `.py` file under the running interpreter's
stdlib folder (`sysconfig.get_paths()["stdlib"]`; site-packages and, unless --include-tests, the test suites
excluded), in sorted path order, as `BOS + text + EOS`. A file belongs to the held-out split when crc32 of its
relative path is < 5 mod 100 (about 5 %), so the split does not depend on which other files exist.

Tokens (`--tokenizer`): `bpe` (the default) trains a byte-level BPE vocabulary of --vocab-size tokens with the
`tokenizers` library on the train split only, and exports it beside the model as `tokenizer.json`; `byte` uses
pagedjax's ByteTokenizer (256 bytes + BOS/EOS/PAD, no vocabulary file). Either way every string round-trips
exactly, and quality is reported in bits per byte (nats over the bytes the tokens stand for / ln 2), so models
with different vocabularies compare.

Training samples random windows (the window of step n depends only on --seed and n, so a resumed run sees
exactly the batches an uninterrupted one would), optimises with optax AdamW under a linear warmup + cosine
schedule and global-norm gradient clipping, prints the loss and held-out bits per byte, and saves orbax
training-state checkpoints every --ckpt-every steps (and on Ctrl-C): `--resume` continues from the latest.
At the end the model is exported with `save_checkpoint` to --out (default: the package's bundled model).

    python scripts/train_tiny.py                     # the bundled model (see pagedjax/assets/tiny/TRAINING.md)
    python scripts/train_tiny.py --resume            # after an interruption
    python scripts/train_tiny.py --steps 50 --out /tmp/tiny --ckpt-dir /tmp/tiny-run   # a quick try
    python scripts/train_tiny.py --evaluate pagedjax/assets/tiny   # held-out bits per byte of a model folder
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import signal
import sys
import sysconfig
import threading
import time
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.llama import init_model
from pagedjax.model.loading.checkpoint import TOKENIZER_FILE, bundled_model_path, save_checkpoint
from pagedjax.model.tokenizer import ByteTokenizer

LN2 = math.log(2.0)
HELDOUT_MOD, HELDOUT_BELOW = 100, 5
# The BPE vocabulary's special tokens, first (ids 0, 1, 2), as the engine expects them: BOS starts every
# prompt (the tokenizer's post-processor adds it), EOS ends generation, PAD is never trained on.
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"


# ------------------------------------------------------------------------------------------------ corpus
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


TEST_DIRS = frozenset({"test", "tests", "idle_test"})


def corpus_files(root: Path | None = None, include_tests: bool = False) -> list[Path]:
    """Every `.py` file under `root` (default: the stdlib), sorted by relative path.

    site-packages is excluded, and so are test suites (folders named test, tests, idle_test: more than half
    of the stdlib's bytes, mostly `self.assertEqual(...)`) unless `include_tests`.
    """
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for p in root.rglob("*.py"):
        folders = p.relative_to(root).parts[:-1]
        if "site-packages" in folders or (not include_tests and TEST_DIRS.intersection(folders)):
            continue
        if p.is_file():
            files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode("utf-8", "surrogateescape")) % HELDOUT_MOD < HELDOUT_BELOW


@dataclass
class CorpusFiles:
    """The raw corpus, split: file contents in file order."""

    train: list[bytes]
    heldout: list[bytes]
    root: str


def read_corpus(root: Path | None = None, max_bytes: int | None = None, include_tests: bool = False) -> CorpusFiles:
    """The corpus files' bytes, split into train and held-out (deterministic; empty files skipped).

    `max_bytes` caps how many bytes of files are read (in file order; each split gets its share).
    """
    root = Path(root) if root is not None else stdlib_root()
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    total = 0
    for path in corpus_files(root, include_tests):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        parts[is_heldout(path.relative_to(root).as_posix())].append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return CorpusFiles(parts[False], parts[True], str(root))


# ---------------------------------------------------------------------------------------------- tokenizers
def _file_text(data: bytes) -> str:
    """A file's text for the BPE tokenizer (which takes str): UTF-8, undecodable bytes as U+FFFD (the stdlib
    has none; counted bytes are those of the text actually encoded, so bits per byte stay exact)."""
    return data.decode("utf-8", errors="replace")


@dataclass
class CorpusTokenizer:
    """What training needs of a tokenizer: a file's ids (BOS + text + EOS) and the bytes each token stands for.

    `hf` is the `tokenizers.Tokenizer` of a BPE vocabulary (None for the byte tokenizer).
    """

    kind: str  # "byte" | "bpe"
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    token_bytes: np.ndarray  # int32[vocab_size]: bytes each token decodes to; 0 for special tokens
    hf: Any = None

    def encode_files(self, files: list[bytes]) -> np.ndarray:
        """uint16 ids of the files concatenated, each as BOS + its tokens + EOS."""
        if not files:
            return np.zeros(0, np.uint16)
        if self.hf is None:
            body = [np.frombuffer(data, np.uint8) for data in files]
        else:
            encodings = self.hf.encode_batch([_file_text(d) for d in files], add_special_tokens=False)
            body = [np.asarray(e.ids, np.int64) for e in encodings]
        parts = []
        for ids in body:
            parts += [np.asarray([self.bos_token_id]), ids, np.asarray([self.eos_token_id])]
        return np.concatenate(parts).astype(np.uint16)

    def num_bytes(self, tokens: np.ndarray) -> int:
        """How many bytes of text `tokens` stand for (special tokens count 0)."""
        return int(self.token_bytes[np.asarray(tokens, np.int64)].sum())


def byte_corpus_tokenizer() -> CorpusTokenizer:
    tok = ByteTokenizer()
    token_bytes = np.zeros(tok.vocab_size, np.int32)
    token_bytes[:tok.num_byte_tokens] = 1
    return CorpusTokenizer("byte", tok.vocab_size, tok.bos_token_id, tok.eos_token_id, token_bytes)


def train_bpe(train_files: list[bytes], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` tokens, trained on `train_files`.

    Special tokens BOS, EOS, PAD take ids 0, 1, 2; all 256 bytes are in the base alphabet, so every string
    encodes, and the byte-level decoder gives it back exactly. Newlines are split off before the usual GPT-2
    pre-tokenization, so a prompt ending in "\\n" ends on the token the model saw there in training (otherwise
    "\\n" plus the next line's indentation would be one token, and a prompt could never end inside it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BOS, EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_file_text(d) for d in train_files), trainer, length=len(train_files))
    # Like a Llama tokenizer: encode(text) starts with BOS (what pagedjax's engine and CLI expect).
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 0)])
    return tok


def bpe_corpus_tokenizer(hf_tokenizer) -> CorpusTokenizer:
    """A CorpusTokenizer over a byte-level BPE `tokenizers.Tokenizer` (as `train_bpe` makes)."""
    vocab_size = hf_tokenizer.get_vocab_size(with_added_tokens=True)
    special = {i for i, t in hf_tokenizer.get_added_tokens_decoder().items() if t.special}
    token_bytes = np.zeros(vocab_size, np.int32)
    for token, i in hf_tokenizer.get_vocab(with_added_tokens=True).items():
        # A byte-level token is a string of one character per byte (GPT-2's byte-to-unicode table).
        token_bytes[i] = 0 if i in special else len(token)
    bos, eos = hf_tokenizer.token_to_id(BOS), hf_tokenizer.token_to_id(EOS)
    if bos is None or eos is None:
        raise ValueError(f"the BPE tokenizer has no {BOS} or {EOS} token")
    if vocab_size > np.iinfo(np.uint16).max:
        raise ValueError(f"a vocabulary of {vocab_size} tokens does not fit the uint16 corpus arrays")
    return CorpusTokenizer("bpe", vocab_size, bos, eos, token_bytes, hf_tokenizer)


@dataclass
class Corpus:
    train: np.ndarray  # uint16[num_train_tokens]: token ids, BOS + file + EOS, files concatenated
    heldout: np.ndarray  # uint16[num_heldout_tokens]
    num_train_files: int
    num_heldout_files: int
    root: str
    train_bytes: int  # bytes of text the train tokens stand for
    heldout_bytes: int


def load_corpus(root: Path | None = None, max_bytes: int | None = None, include_tests: bool = False,
                tokenizer: CorpusTokenizer | None = None) -> Corpus:
    """Tokenize the corpus into a train and a held-out token array (deterministic). `tokenizer` defaults to
    the byte tokenizer."""
    files = read_corpus(root, max_bytes, include_tests)
    tok = tokenizer if tokenizer is not None else byte_corpus_tokenizer()
    train, heldout = tok.encode_files(files.train), tok.encode_files(files.heldout)
    return Corpus(train, heldout, len(files.train), len(files.heldout), files.root, tok.num_bytes(train),
                  tok.num_bytes(heldout))


def sample_windows(tokens: np.ndarray, batch_size: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """`batch_size` random windows of `seq_len + 1` tokens: int32 `[B, S + 1]` (inputs and shifted targets)."""
    n = len(tokens) - seq_len - 1
    if n < 1:
        raise ValueError(f"corpus of {len(tokens)} tokens is too small for windows of {seq_len + 1}")
    starts = rng.integers(0, n, size=batch_size)
    return np.stack([tokens[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def train_batch(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, step: int) -> np.ndarray:
    """The batch of training step `step`: a function of (seed, step) only, so resuming replays exactly."""
    return sample_windows(tokens, batch_size, seq_len, np.random.default_rng([seed, step]))


def eval_windows(tokens: np.ndarray, num_windows: int, seq_len: int, seed: int = 1234) -> np.ndarray:
    """A fixed set of held-out windows (the same for every run with the same corpus)."""
    return sample_windows(tokens, num_windows, seq_len, np.random.default_rng([seed, 0xE7A1]))


def tiling_windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Windows `[N, S + 1]` with stride S: every token after the first is a target exactly once (the last
    window is padded with a repeat of the final token, whose extra targets `tiling_target_mask` drops)."""
    if len(tokens) < 2:
        raise ValueError(f"{len(tokens)} tokens have no targets to evaluate")
    n = max(1, -(-(len(tokens) - 1) // seq_len))
    padded = np.concatenate([tokens, np.full(n * seq_len + 1 - len(tokens), tokens[-1], tokens.dtype)])
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return padded[idx].astype(np.int32)


def tiling_target_mask(num_tokens: int, seq_len: int) -> np.ndarray:
    """bool `[N, S]`: the targets of `tiling_windows` that are real tokens (not the last window's padding)."""
    n = max(1, -(-(num_tokens - 1) // seq_len))
    return (np.arange(n)[:, None] * seq_len + np.arange(1, seq_len + 1)[None, :]) < num_tokens


# -------------------------------------------------------------------------------------------- loss, steps
def token_losses(model, batch: jax.Array) -> jax.Array:
    """Per-target cross-entropy in nats `[B, S]` of a batch `[B, S + 1]`."""
    logits = model.forward_dense(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:])


def bits_and_bytes(model, batch: jax.Array, token_bytes: jax.Array, mask: jax.Array | None = None):
    """(bits over the targets that stand for text, bytes of text they stand for) of a batch `[B, S + 1]`.

    token_bytes: i32[vocab]; special-token targets (0 bytes) are left out of both sums, as are targets where
    `mask` (bool[B, S]) is False."""
    losses = token_losses(model, batch)
    nbytes = token_bytes[batch[:, 1:]]
    counted = nbytes > 0 if mask is None else (nbytes > 0) & mask
    return jnp.sum(jnp.where(counted, losses, 0.0)) / LN2, jnp.sum(jnp.where(counted, nbytes, 0))


def make_bpb_evaluator(graphdef, token_bytes: np.ndarray, batch_size: int):
    """`evaluate(params, windows [N, S + 1], mask bool[N, S] | None) -> bits per byte` (one jitted shape)."""
    fn = jax.jit(lambda p, b, m, tb: bits_and_bytes(nnx.merge(graphdef, p), b, tb, m))
    table = jnp.asarray(token_bytes, jnp.int32)

    def evaluate(params, windows: np.ndarray, mask: np.ndarray | None = None) -> float:
        if mask is None:
            mask = np.ones((len(windows), windows.shape[1] - 1), bool)
        bits, nbytes = 0.0, 0
        for i in range(0, len(windows), batch_size):
            b, m = windows[i:i + batch_size], mask[i:i + batch_size]
            if len(b) < batch_size:  # pad the last batch (masked out) so one compiled shape serves all
                b = np.concatenate([b, np.repeat(b[-1:], batch_size - len(b), 0)])
                m = np.concatenate([m, np.zeros((batch_size - len(m), m.shape[1]), bool)])
            nb, nc = fn(params, jnp.asarray(b), jnp.asarray(m), table)
            bits += float(nb)
            nbytes += int(nc)
        return bits / max(nbytes, 1)

    return evaluate


def evaluate_bpb(model, windows: np.ndarray, token_bytes: np.ndarray, batch_size: int = 16,
                 mask: np.ndarray | None = None) -> float:
    """Bits per byte of `model` (a Llama module) over `windows` `[N, S + 1]`."""
    graphdef, params = nnx.split(model)
    return make_bpb_evaluator(graphdef, token_bytes, batch_size)(params, windows, mask)


def heldout_bpb_of_split(model, tokens: np.ndarray, token_bytes: np.ndarray, seq_len: int,
                         batch_size: int = 16) -> float:
    """Bits per byte over a whole split: total bits of every text token / its bytes (windows of `seq_len`)."""
    return evaluate_bpb(model, tiling_windows(tokens, seq_len), token_bytes, batch_size,
                        tiling_target_mask(len(tokens), seq_len))


def make_optimizer(lr: float, warmup: int, steps: int, min_lr_ratio: float, weight_decay: float, clip: float,
                   b2: float = 0.95) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=max(1, min(warmup, steps - 1)), decay_steps=max(steps, 2),
        end_value=lr * min_lr_ratio)
    # No weight decay on vectors (RMSNorm weights); matrices and the (tied) embedding decay.
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    tx = optax.chain(
        optax.clip_by_global_norm(clip),
        optax.adamw(schedule, b1=0.9, b2=b2, eps=1e-8, weight_decay=weight_decay, mask=decay_mask),
    )
    return tx, schedule


def make_train_step(graphdef, tx: optax.GradientTransformation):
    """The jitted update: (params, opt_state, batch int32 [B, S+1]) -> (params, opt_state, metrics).

    params and opt_state are donated, so XLA updates them in place.
    """

    def loss_fn(params, batch):
        return jnp.mean(token_losses(nnx.merge(graphdef, params), batch))

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        return params, opt_state, {"loss": loss, "grad_norm": grad_norm}

    return train_step


# ---------------------------------------------------------------------------------------------- settings
@dataclass
class TrainConfig:
    """Defaults: the bundled model's recipe (see pagedjax/assets/tiny/TRAINING.md)."""

    tokenizer: str = "bpe"  # "bpe" | "byte"
    vocab_size: int = 2048  # BPE vocabulary size, special tokens included (the byte tokenizer has 259)
    steps: int = 1500
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 4e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95
    seed: int = 0
    # model shape: ModelConfig's defaults with a narrower MLP, which pays for the 2048-token vocabulary's
    # embedding (2.36 M parameters in all: 9.4 MB of float32, an 8.9 MB folder as orbax stores it)
    hidden_size: int = ModelConfig.hidden_size
    num_layers: int = ModelConfig.num_layers
    num_q_heads: int = ModelConfig.num_q_heads
    num_kv_heads: int = ModelConfig.num_kv_heads
    head_dim: int = ModelConfig.head_dim
    intermediate_size: int = 384

    def model_config(self, tok: CorpusTokenizer) -> ModelConfig:
        return ModelConfig(
            vocab_size=tok.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, dtype="float32", tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id, eos_token_ids=(tok.eos_token_id,))


def _train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = TrainConfig()
    g = p.add_argument_group("tokens")
    g.add_argument("--tokenizer", choices=["bpe", "byte"], default=d.tokenizer,
                   help="bpe: a byte-level BPE vocabulary trained on the train split (exported as tokenizer.json); "
                        "byte: pagedjax's ByteTokenizer (vocab 259)")
    g.add_argument("--vocab-size", type=int, default=d.vocab_size,
                   help="BPE vocabulary size, 3 special tokens included (ignored with --tokenizer byte)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=d.steps, help="total optimizer steps")
    g.add_argument("--batch-size", type=int, default=d.batch_size)
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="training window length in tokens")
    g.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    g.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr (cosine)")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    g.add_argument("--b2", type=float, default=d.b2, help="Adam beta2")
    g.add_argument("--seed", type=int, default=d.seed)
    g = p.add_argument_group("model shape")
    for name in ("hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim", "intermediate_size"):
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    g = p.add_argument_group("data, evaluation, checkpoints")
    g.add_argument("--corpus-dir", type=Path, default=None,
                   help="folder of .py files to train on (default: this interpreter's stdlib)")
    g.add_argument("--max-corpus-bytes", type=int, default=None, help="read at most this many bytes of files")
    g.add_argument("--include-tests", action="store_true", help="also train on the stdlib's test suites")
    g.add_argument("--eval-every", type=int, default=100, help="held-out evaluation interval (0: only at the end)")
    g.add_argument("--eval-windows", type=int, default=32, help="held-out windows per evaluation")
    g.add_argument("--final-eval-windows", type=int, default=256,
                   help="train-split windows for the final train bits per byte (the held-out number covers the "
                        "whole held-out split)")
    g.add_argument("--log-every", type=int, default=25)
    g.add_argument("--ckpt-dir", type=Path, default=Path("runs/train_tiny"),
                   help="orbax training-state checkpoints (params, optimizer state, step)")
    g.add_argument("--ckpt-every", type=int, default=100)
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop (with a checkpoint) after this many steps in this invocation, as if interrupted")
    g.add_argument("--out", type=Path, default=None,
                   help=f"export the trained model here (default: the bundled model, {bundled_model_path()})")
    g.add_argument("--no-export", action="store_true", help="do not export the model at the end")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--evaluate", type=Path, default=None, metavar="MODEL_DIR",
                   help="train nothing: print the held-out bits per byte of this pagedjax model folder (its "
                        "tokenizer.json, or the byte tokenizer) over the whole held-out split, in --seq-len windows")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "eval_windows", "final_eval_windows", "log_every",
                 "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        p.error("--stop-after must be >= 1")
    if args.tokenizer == "bpe" and not ByteTokenizer.vocab_size <= args.vocab_size <= np.iinfo(np.uint16).max:
        p.error(f"--vocab-size must be in [{ByteTokenizer.vocab_size}, {np.iinfo(np.uint16).max}] (256 bytes and 3 "
                "special tokens at least)")
    try:
        _train_config_from_args(args).model_config(byte_corpus_tokenizer())
    except ValueError as e:
        p.error(str(e))
    return args


# ----------------------------------------------------------------------------------------- checkpointing
class TrainingCheckpoints:
    """orbax training state: {params, opt_state} per step, plus a JSON of the settings for resume checks."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    @property
    def settings_file(self) -> Path:
        return self.directory / "train_settings.json"

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params, opt_state, settings: dict) -> None:
        state = {"params": params, "opt_state": opt_state}
        self.manager.save(step, args=ocp.args.StandardSave(state), force=True)
        self.manager.wait_until_finished()
        self.settings_file.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")

    def restore(self, step: int, params, opt_state):
        """Restore into the structure, shapes and dtypes of the given (freshly initialised) state."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        restored = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        return restored["params"], restored["opt_state"]

    def close(self) -> None:
        self.manager.close()


# ----------------------------------------------------------------------------------------------- training
@dataclass
class TrainResult:
    model_config: ModelConfig
    params: nnx.State
    tokenizer: CorpusTokenizer
    corpus: Corpus
    step: int  # steps completed
    finished: bool  # reached --steps
    train_bpb: float | None
    heldout_bpb: float | None  # over the whole held-out split
    start_step: int
    wall_s: float
    history: list[dict]


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def make_tokenizer(tc: TrainConfig, files: CorpusFiles, ckpt_dir: Path, resume: bool) -> CorpusTokenizer:
    """The run's tokenizer. A BPE vocabulary is trained on the train split and kept in the run's checkpoint
    folder, so a resumed run reads the very vocabulary its checkpoints were trained with."""
    if tc.tokenizer == "byte":
        return byte_corpus_tokenizer()
    from tokenizers import Tokenizer

    saved = Path(ckpt_dir) / TOKENIZER_FILE
    if resume and saved.is_file():
        print(f"BPE vocabulary from {saved}", flush=True)
        return bpe_corpus_tokenizer(Tokenizer.from_file(str(saved)))
    t0 = time.perf_counter()
    hf = train_bpe(files.train, tc.vocab_size)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    hf.save(str(saved))
    tok = bpe_corpus_tokenizer(hf)
    print(f"trained a {tok.vocab_size}-token BPE vocabulary on the train split in {time.perf_counter() - t0:.1f} s",
          flush=True)
    return tok


def train(args: argparse.Namespace) -> TrainResult:
    tc = _train_config_from_args(args)
    t_start = time.perf_counter()
    ckpts = TrainingCheckpoints(args.ckpt_dir)
    if not args.resume and ckpts.latest_step() is not None:
        raise SystemExit(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}); "
                         "pass --resume to continue, or choose another --ckpt-dir")
    files = read_corpus(args.corpus_dir, args.max_corpus_bytes, args.include_tests)
    tok = make_tokenizer(tc, files, ckpts.directory, args.resume and ckpts.latest_step() is not None)
    train_tokens, heldout_tokens = tok.encode_files(files.train), tok.encode_files(files.heldout)
    corpus = Corpus(train_tokens, heldout_tokens, len(files.train), len(files.heldout), files.root,
                    tok.num_bytes(train_tokens), tok.num_bytes(heldout_tokens))
    if len(corpus.heldout) <= tc.seq_len + 1:  # a tiny corpus (tests): evaluate on the train split
        corpus.heldout, corpus.heldout_bytes = corpus.train, corpus.train_bytes
    print(f"corpus {corpus.root}: {corpus.num_train_files} train files ({len(corpus.train):,} tokens, "
          f"{corpus.train_bytes / max(len(corpus.train), 1):.2f} bytes per token), {corpus.num_heldout_files} "
          f"held-out files ({len(corpus.heldout):,} tokens)", flush=True)

    cfg = tc.model_config(tok)
    model = init_model(cfg, tc.seed)
    graphdef, params = nnx.split(model)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    print(f"model: {n_params:,} parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads x {cfg.head_dim}, mlp {cfg.intermediate_size}, "
          f"vocab {cfg.vocab_size} ({tok.kind})", flush=True)
    tx, schedule = make_optimizer(tc.lr, tc.warmup, tc.steps, tc.min_lr_ratio, tc.weight_decay, tc.clip, tc.b2)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx)
    eval_bpb = make_bpb_evaluator(graphdef, tok.token_bytes, tc.batch_size)

    heldout_windows = eval_windows(corpus.heldout, args.eval_windows, tc.seq_len)
    settings = {"train_config": dataclasses.asdict(tc), "model_config": cfg.to_dict(), "corpus_root": corpus.root,
                "corpus_train_tokens": int(len(corpus.train)), "max_corpus_bytes": args.max_corpus_bytes,
                "include_tests": args.include_tests}

    start_step = 0
    if args.resume:
        latest = ckpts.latest_step()
        if latest is None:
            print(f"--resume: no checkpoint in {ckpts.directory}; starting from step 0", flush=True)
        else:
            if ckpts.settings_file.is_file():
                saved = json.loads(ckpts.settings_file.read_text())
                if saved.get("train_config") != settings["train_config"]:
                    diff = {k: (saved.get("train_config", {}).get(k), v) for k, v in settings["train_config"].items()
                            if saved.get("train_config", {}).get(k) != v}
                    raise SystemExit(f"--resume: settings differ from the checkpoint's (saved, now): {diff}")
            params, opt_state = ckpts.restore(latest, params, opt_state)
            start_step = latest
            print(f"resumed from step {latest} ({ckpts.directory})", flush=True)

    stop_at = tc.steps if args.stop_after is None else min(tc.steps, start_step + args.stop_after)
    history: list[dict] = []
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=tc.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
    log = bar.write if bar is not None else (lambda s: print(s, flush=True))
    ema, step = None, start_step
    t_loop = time.perf_counter()
    last_saved = start_step
    # Ctrl-C only sets a flag: the step in flight (whose inputs are donated) completes, then we checkpoint.
    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        if interrupted:  # a second Ctrl-C: give up at once
            raise KeyboardInterrupt
        interrupted = True

    previous_handler = signal.signal(signal.SIGINT, on_sigint) if _in_main_thread() else None
    try:
        while step < stop_at and not interrupted:
            batch = jnp.asarray(train_batch(corpus.train, tc.batch_size, tc.seq_len, tc.seed, step))
            params, opt_state, metrics = train_step(params, opt_state, batch)
            step += 1
            loss = float(metrics["loss"])
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}")
            ema = loss if ema is None else 0.95 * ema + 0.05 * loss
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{ema:.3f}")
            if step % args.log_every == 0 or step == stop_at:
                rec = {"step": step, "loss": loss, "loss_ema": ema, "grad_norm": float(metrics["grad_norm"]),
                       "lr": float(schedule(step - 1)), "elapsed_s": time.perf_counter() - t_loop}
                if args.eval_every and (step % args.eval_every == 0 or step == tc.steps):
                    rec["heldout_bpb"] = eval_bpb(params, heldout_windows)
                history.append(rec)
                msg = (f"step {step:5d}  loss {loss:.4f} nats/token (ema {ema:.4f})  "
                       f"grad_norm {rec['grad_norm']:.3f}  lr {rec['lr']:.2e}  {rec['elapsed_s']:.0f} s")
                if "heldout_bpb" in rec:
                    msg += f"  held-out {rec['heldout_bpb']:.3f} bits/byte"
                log(msg)
            if step % args.ckpt_every == 0 and step < tc.steps:
                ckpts.save(step, params, opt_state, settings)
                last_saved = step
    finally:
        if bar is not None:
            bar.close()
        if previous_handler is not None:
            signal.signal(signal.SIGINT, previous_handler)
    if interrupted:
        print(f"\ninterrupted at step {step}", flush=True)
    if step != last_saved and step > 0:
        ckpts.save(step, params, opt_state, settings)
    ckpts.close()
    finished = step >= tc.steps
    if not finished:
        print(f"stopped at step {step} of {tc.steps}; checkpoint in {ckpts.directory}: continue with --resume",
              flush=True)
    train_bpb = heldout_bpb = None
    if finished:
        t_eval = time.perf_counter()
        heldout_bpb = eval_bpb(params, tiling_windows(corpus.heldout, tc.seq_len),
                               tiling_target_mask(len(corpus.heldout), tc.seq_len))
        train_bpb = eval_bpb(params, eval_windows(corpus.train, args.final_eval_windows, tc.seq_len, seed=4321))
        print(f"final: held-out {heldout_bpb:.4f} bits/byte (the whole split, {corpus.heldout_bytes:,} bytes), "
              f"train {train_bpb:.4f} bits/byte ({args.final_eval_windows} windows); evaluated in "
              f"{time.perf_counter() - t_eval:.0f} s", flush=True)
    return TrainResult(cfg, params, tok, corpus, step, finished, train_bpb, heldout_bpb, start_step,
                       time.perf_counter() - t_start, history)


def model_dir_corpus_tokenizer(model_dir: Path, cfg: ModelConfig) -> CorpusTokenizer:
    """The CorpusTokenizer of a saved model folder (its tokenizer.json, or the byte tokenizer); SystemExit when
    the folder has no tokenizer pagedjax knows."""
    from pagedjax.model.loading.checkpoint import load_checkpoint_tokenizer

    hf = load_checkpoint_tokenizer(model_dir, cfg)
    if hf is None:
        raise SystemExit(f"{model_dir} has no tokenizer pagedjax knows")
    return byte_corpus_tokenizer() if isinstance(hf, ByteTokenizer) else bpe_corpus_tokenizer(hf.tokenizer)


def evaluate_model_dir(args: argparse.Namespace) -> float:
    """Held-out bits per byte of a saved model over the whole held-out split (--evaluate)."""
    from pagedjax.model.llama import model_from_state
    from pagedjax.model.loading.checkpoint import load_checkpoint

    cfg, state = load_checkpoint(args.evaluate)
    tok = model_dir_corpus_tokenizer(args.evaluate, cfg)
    files = read_corpus(args.corpus_dir, args.max_corpus_bytes, args.include_tests)
    if not files.heldout:
        raise SystemExit(f"--evaluate: the corpus under {files.root} has no held-out files")
    tokens = tok.encode_files(files.heldout)
    t0 = time.perf_counter()
    bpb = heldout_bpb_of_split(model_from_state(cfg, state), tokens, tok.token_bytes, args.seq_len)
    print(f"{args.evaluate}: held-out {bpb:.4f} bits/byte over {len(files.heldout)} files "
          f"({tok.num_bytes(tokens):,} bytes, {len(tokens):,} {tok.kind} tokens, windows of {args.seq_len}) "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return bpb


def write_training_md(out: Path, args: argparse.Namespace, argv: list[str], result: TrainResult) -> None:
    tc = _train_config_from_args(args)
    cfg, tok, corpus = result.model_config, result.tokenizer, result.corpus
    n_params = sum(int(x.size) for x in jax.tree.leaves(result.params))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    cmd = "python scripts/train_tiny.py " + " ".join(argv)
    vocab = ("256 bytes + BOS/EOS/PAD" if tok.kind == "byte" else
             f"byte-level BPE trained on the train split, `tokenizer.json`; BOS/EOS/PAD are ids "
             f"{tok.bos_token_id}/{tok.eos_token_id}/{tok.hf.token_to_id(PAD)}")
    shape = (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_q_heads} query / {cfg.num_kv_heads} KV "
             f"heads x {cfg.head_dim} (GQA), SwiGLU {cfg.intermediate_size}, tied embeddings, vocab "
             f"{cfg.vocab_size} ({vocab})")
    tokens = tc.steps * tc.batch_size * tc.seq_len
    bytes_per_token = corpus.train_bytes / max(len(corpus.train), 1)
    recipe = (f"{tc.steps} steps x {tc.batch_size} windows x {tc.seq_len} tokens = {tokens / 1e6:.2f} M tokens "
              f"(about {tokens * bytes_per_token / 1e6:.1f} MB of text); AdamW (b2 {tc.b2}, weight decay "
              f"{tc.weight_decay}), peak lr {tc.lr:g}, {tc.warmup} warmup steps + cosine to {tc.min_lr_ratio:g} x "
              f"peak, gradient clip {tc.clip:g}, seed {tc.seed}")
    corpus_note = (f"{corpus.num_train_files} train files ({corpus.train_bytes / 1e6:.1f} MB, "
                   f"{len(corpus.train) / 1e6:.2f} M tokens, {bytes_per_token:.2f} bytes per token) and "
                   f"{corpus.num_heldout_files} held-out files ({corpus.heldout_bytes / 1e6:.2f} MB) under "
                   f"`{corpus.root}` (Python {platform.python_version()}), test suites "
                   f"{'included' if args.include_tests else 'excluded'}")
    wall = f"{result.wall_s / 60:.1f} min" + (" (this resumed invocation only)" if result.start_step else "")
    rows = [
        ("held-out bits per byte", f"**{result.heldout_bpb:.3f}** (the whole held-out split; a uniform guess "
                                   "costs 8)"),
        ("train bits per byte", f"{result.train_bpb:.3f} ({args.final_eval_windows} random windows)"),
        ("parameters", f"{n_params:,} (float32); checkpoint {size / 1e6:.1f} MB"),
        ("shape", shape),
        ("training", recipe),
        ("corpus", corpus_note),
        ("wall time", wall),
        ("machine", f"{_machine()}; Python {platform.python_version()}, JAX {jax.__version__} "
                    f"({jax.default_backend()})"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    text = f"""# The bundled model: `pagedjax/assets/tiny`

A Llama-family decoder trained from scratch by `scripts/train_tiny.py` on the Python standard library's own
`.py` sources (read from the running interpreter, nothing downloaded).

| | |
|---|---|
{table}

Bits per byte are total bits over the text tokens (BOS/EOS excluded) divided by the bytes those tokens stand
for, so byte-level and BPE models compare. The held-out number covers every token of the held-out split once,
in {tc.seq_len}-token windows; the held-out split is every file whose path relative to the stdlib folder has
`crc32(path) % {HELDOUT_MOD} < {HELDOUT_BELOW}`. `python scripts/train_tiny.py --evaluate MODEL_DIR` measures
a saved model the same way.

Command:

```
{cmd}
```
"""
    (out / "TRAINING.md").write_text(text)


def export(out: Path, args: argparse.Namespace, argv: list[str], result: TrainResult) -> None:
    """The model folder: `save_checkpoint`, the BPE vocabulary as tokenizer.json, TRAINING.md."""
    tc = _train_config_from_args(args)
    extra = {
        "trained_by": "scripts/train_tiny.py",
        "train_config": dataclasses.asdict(tc),
        "train_bpb": result.train_bpb,
        "heldout_bpb": result.heldout_bpb,
        "wall_s": result.wall_s,
        "tokenizer": result.tokenizer.kind,
        "machine": _machine(),
        "jax_version": jax.__version__,
        "history": result.history,
    }
    tokenizer_file = out / TOKENIZER_FILE
    # A byte model's folder must not keep an older export's vocabulary (the loader would use it).
    tokenizer_file.unlink(missing_ok=True)
    save_checkpoint(out, result.model_config, result.params, extra=extra)
    if result.tokenizer.hf is not None:
        result.tokenizer.hf.save(str(tokenizer_file))
    write_training_md(out, args, argv, result)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s)); {_machine()}",
          flush=True)
    if args.evaluate is not None:
        evaluate_model_dir(args)
        return 0
    result = train(args)
    if not result.finished:
        return 130 if args.stop_after is None else 0
    if args.no_export:
        return 0
    out = Path(args.out) if args.out is not None else bundled_model_path()
    export(out, args, argv, result)
    print(f"exported the model to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
