#!/usr/bin/env python
"""Train pagedjax's bundled byte-level model on the Python standard library's own sources.

The corpus is on every machine and needs no download: each `.py` file under the running interpreter's
stdlib folder (`sysconfig.get_paths()["stdlib"]`; site-packages and, unless --include-tests, the test suites
excluded), in sorted path order, as
`BOS + bytes + EOS`. A file belongs to the held-out split when crc32 of its relative path is < 5 mod 100
(about 5 %), so the split does not depend on which other files exist.

Training samples random windows (the window of step n depends only on --seed and n, so a resumed run sees
exactly the batches an uninterrupted one would), optimises with optax AdamW under a linear warmup + cosine
schedule and global-norm gradient clipping, prints the loss and held-out bits per byte, and saves orbax
training-state checkpoints every --ckpt-every steps (and on Ctrl-C): `--resume` continues from the latest.
At the end the model is exported with `save_checkpoint` to --out (default: the package's bundled model).

    python scripts/train_tiny.py                     # the bundled model (see pagedjax/assets/tiny/TRAINING.md)
    python scripts/train_tiny.py --resume            # after an interruption
    python scripts/train_tiny.py --steps 50 --out /tmp/tiny --ckpt-dir /tmp/tiny-run   # a quick try
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

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx

from pagedjax.config import ModelConfig
from pagedjax.model.checkpoint import bundled_model_path, save_checkpoint
from pagedjax.model.llama import init_model
from pagedjax.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
LN2 = math.log(2.0)
HELDOUT_MOD, HELDOUT_BELOW = 100, 5


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
class Corpus:
    train: np.ndarray  # uint16 token ids: BOS + file bytes + EOS, files concatenated
    heldout: np.ndarray
    num_train_files: int
    num_heldout_files: int
    root: str


def load_corpus(root: Path | None = None, max_bytes: int | None = None, include_tests: bool = False) -> Corpus:
    """Tokenize the corpus into a train and a held-out token array (deterministic).

    `max_bytes` caps how many bytes of files are read (in file order; each split gets its share).
    """
    root = Path(root) if root is not None else stdlib_root()
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    total = 0
    for path in corpus_files(root, include_tests):
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if not data:
            continue
        ids = np.empty(len(data) + 2, np.uint16)
        ids[0], ids[-1] = TOKENIZER.bos_token_id, TOKENIZER.eos_token_id
        ids[1:-1] = np.frombuffer(data, np.uint8)
        parts[is_heldout(rel)].append(ids)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    empty = np.zeros(0, np.uint16)
    train = np.concatenate(parts[False]) if parts[False] else empty
    heldout = np.concatenate(parts[True]) if parts[True] else empty
    return Corpus(train, heldout, len(parts[False]), len(parts[True]), str(root))


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


# -------------------------------------------------------------------------------------------- loss, steps
def token_losses(model, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-target cross-entropy in nats `[B, S]` and the mask of byte targets (specials excluded from bpb)."""
    logits = model.forward_dense(batch[:, :-1])
    targets = batch[:, 1:]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return losses, (targets < TOKENIZER.num_byte_tokens)


def bits_per_byte(model, batch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum of bits over byte targets, number of byte targets) for a batch `[B, S + 1]`."""
    losses, is_byte = token_losses(model, batch)
    return jnp.sum(jnp.where(is_byte, losses, 0.0)) / LN2, jnp.sum(is_byte)


def evaluate_bpb(model, windows: np.ndarray, batch_size: int = 16) -> float:
    """Held-out bits per byte of `model` (a Llama module) over `windows` `[N, S + 1]`."""
    graphdef, params = nnx.split(model)
    fn = jax.jit(lambda p, b: bits_per_byte(nnx.merge(graphdef, p), b))
    bits, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        b, c = fn(params, jnp.asarray(windows[i:i + batch_size]))
        bits += float(b)
        count += int(c)
    return bits / max(count, 1)


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
        losses, _ = token_losses(nnx.merge(graphdef, params), batch)
        return jnp.mean(losses)

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
    """Defaults: the bundled model's recipe (about 20 minutes on 2 shared CPU cores)."""

    steps: int = 850
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 4e-3
    warmup: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b2: float = 0.95
    seed: int = 0
    # model shape: ModelConfig's defaults with a narrower MLP (2.3 M parameters, a 9 MB checkpoint)
    hidden_size: int = ModelConfig.hidden_size
    num_layers: int = ModelConfig.num_layers
    num_q_heads: int = ModelConfig.num_q_heads
    num_kv_heads: int = ModelConfig.num_kv_heads
    head_dim: int = ModelConfig.head_dim
    intermediate_size: int = 512

    def model_config(self) -> ModelConfig:
        return ModelConfig(
            vocab_size=TOKENIZER.vocab_size, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_q_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            intermediate_size=self.intermediate_size, dtype="float32", tie_word_embeddings=True,
            bos_token_id=TOKENIZER.bos_token_id, eos_token_ids=TOKENIZER.eos_token_ids)


def _train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = TrainConfig()
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
    g.add_argument("--final-eval-windows", type=int, default=256, help="held-out windows for the final numbers")
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
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "eval_windows", "final_eval_windows", "log_every",
                 "ckpt_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.eval_every < 0:
        p.error("--eval-every must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        p.error("--stop-after must be >= 1")
    try:
        _train_config_from_args(args).model_config()
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
    step: int  # steps completed
    finished: bool  # reached --steps
    train_bpb: float | None
    heldout_bpb: float | None
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


def train(args: argparse.Namespace) -> TrainResult:
    tc = _train_config_from_args(args)
    cfg = tc.model_config()
    t_start = time.perf_counter()
    corpus = load_corpus(args.corpus_dir, args.max_corpus_bytes, args.include_tests)
    if len(corpus.heldout) <= tc.seq_len + 1:  # a tiny corpus (tests): evaluate on the train split
        corpus.heldout = corpus.train
    print(f"corpus {corpus.root}: {corpus.num_train_files} train files ({len(corpus.train):,} tokens), "
          f"{corpus.num_heldout_files} held-out files ({len(corpus.heldout):,} tokens)", flush=True)

    model = init_model(cfg, tc.seed)
    graphdef, params = nnx.split(model)
    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    print(f"model: {n_params:,} parameters, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.num_q_heads}q/{cfg.num_kv_heads}kv heads x {cfg.head_dim}, mlp {cfg.intermediate_size}", flush=True)
    tx, schedule = make_optimizer(tc.lr, tc.warmup, tc.steps, tc.min_lr_ratio, tc.weight_decay, tc.clip, tc.b2)
    opt_state = tx.init(params)
    train_step = make_train_step(graphdef, tx)
    eval_fn = jax.jit(lambda p, b: bits_per_byte(nnx.merge(graphdef, p), b))

    def eval_bpb(p, windows: np.ndarray) -> float:
        bits, count = 0.0, 0
        for i in range(0, len(windows), tc.batch_size):
            b, c = eval_fn(p, jnp.asarray(windows[i:i + tc.batch_size]))
            bits += float(b)
            count += int(c)
        return bits / max(count, 1)

    heldout_windows = eval_windows(corpus.heldout, args.eval_windows, tc.seq_len)
    settings = {"train_config": dataclasses.asdict(tc), "model_config": cfg.to_dict(), "corpus_root": corpus.root,
                "corpus_train_tokens": int(len(corpus.train)), "max_corpus_bytes": args.max_corpus_bytes,
                "include_tests": args.include_tests}

    ckpts = TrainingCheckpoints(args.ckpt_dir)
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
    elif ckpts.latest_step() is not None:
        raise SystemExit(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}); "
                         "pass --resume to continue, or choose another --ckpt-dir")

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
                bar.set_postfix(loss=f"{ema:.3f}", bpb=f"{ema / LN2:.3f}")
            if step % args.log_every == 0 or step == stop_at:
                rec = {"step": step, "loss": loss, "loss_ema": ema, "train_bpb_ema": ema / LN2,
                       "grad_norm": float(metrics["grad_norm"]), "lr": float(schedule(step - 1)),
                       "elapsed_s": time.perf_counter() - t_loop}
                if args.eval_every and (step % args.eval_every == 0 or step == tc.steps):
                    rec["heldout_bpb"] = eval_bpb(params, heldout_windows)
                history.append(rec)
                msg = (f"step {step:5d}  loss {loss:.4f}  (ema {ema:.4f} = {ema / LN2:.3f} bits/byte)  "
                       f"grad_norm {rec['grad_norm']:.3f}  lr {rec['lr']:.2e}")
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
        final_windows = args.final_eval_windows
        heldout_bpb = eval_bpb(params, eval_windows(corpus.heldout, final_windows, tc.seq_len))
        train_bpb = eval_bpb(params, eval_windows(corpus.train, final_windows, tc.seq_len, seed=4321))
        print(f"final: train {train_bpb:.4f} bits/byte, held-out {heldout_bpb:.4f} bits/byte "
              f"({final_windows} windows of {tc.seq_len} tokens each)", flush=True)
    return TrainResult(cfg, params, step, finished, train_bpb, heldout_bpb, start_step,
                       time.perf_counter() - t_start, history)


def write_training_md(out: Path, args: argparse.Namespace, argv: list[str], result: TrainResult,
                      corpus_note: str) -> None:
    tc = _train_config_from_args(args)
    cfg = result.model_config
    n_params = sum(int(x.size) for x in jax.tree.leaves(result.params))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    cmd = "python scripts/train_tiny.py " + " ".join(argv)
    shape = (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_q_heads} query / {cfg.num_kv_heads} KV "
             f"heads x {cfg.head_dim} (GQA), SwiGLU {cfg.intermediate_size}, tied embeddings, vocab "
             f"{cfg.vocab_size} (256 bytes + BOS/EOS/PAD)")
    tokens = tc.steps * tc.batch_size * tc.seq_len
    recipe = (f"{tc.steps} steps x {tc.batch_size} windows x {tc.seq_len} tokens = {tokens / 1e6:.2f} M tokens; "
              f"AdamW (b2 {tc.b2}, weight decay {tc.weight_decay}), peak lr {tc.lr:g}, {tc.warmup} warmup steps "
              f"+ cosine to {tc.min_lr_ratio:g} x peak, gradient clip {tc.clip:g}, seed {tc.seed}")
    wall = f"{result.wall_s / 60:.1f} min" + (" (this resumed invocation only)" if result.start_step else "")
    rows = [
        ("final train bits per byte", f"**{result.train_bpb:.3f}**"),
        ("final held-out bits per byte", f"**{result.heldout_bpb:.3f}** (a uniform guess costs 8)"),
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

A byte-level Llama-family decoder trained from scratch by `scripts/train_tiny.py` on the Python standard
library's own `.py` sources (read from the running interpreter, nothing downloaded).

| | |
|---|---|
{table}

Bits per byte are measured on {args.final_eval_windows} random {tc.seq_len}-token windows of each split (byte
targets only; BOS/EOS excluded). The held-out split is every file whose path relative to the stdlib folder has
`crc32(path) % {HELDOUT_MOD} < {HELDOUT_BELOW}`.

Command:

```
{cmd}
```
"""
    (out / "TRAINING.md").write_text(text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    print(f"JAX {jax.__version__} on {jax.default_backend()} ({jax.device_count()} device(s)); {_machine()}",
          flush=True)
    result = train(args)
    if not result.finished:
        return 130 if args.stop_after is None else 0
    if args.no_export:
        return 0
    out = Path(args.out) if args.out is not None else bundled_model_path()
    tc = _train_config_from_args(args)
    extra = {
        "trained_by": "scripts/train_tiny.py",
        "train_config": dataclasses.asdict(tc),
        "train_bpb": result.train_bpb,
        "heldout_bpb": result.heldout_bpb,
        "wall_s": result.wall_s,
        "tokenizer": "byte",
        "machine": _machine(),
        "jax_version": jax.__version__,
        "history": result.history,
    }
    save_checkpoint(out, result.model_config, result.params, extra=extra)
    corpus = load_corpus(args.corpus_dir, args.max_corpus_bytes, args.include_tests)
    note = (f"{corpus.num_train_files} train files ({len(corpus.train) / 1e6:.1f} M tokens) and "
            f"{corpus.num_heldout_files} held-out files ({len(corpus.heldout) / 1e6:.2f} M tokens) under "
            f"`{corpus.root}` (Python {platform.python_version()}), test suites "
            f"{'included' if args.include_tests else 'excluded'}")
    write_training_md(out, args, argv, result, note)
    print(f"exported the model to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
