#!/usr/bin/env python
"""Train a multi-token-prediction head (`pagedjax.spec_decode.mtp_head`) for the bundled model, on the text the
model was trained on (the Python standard library's sources: `scripts/train_tiny.py`'s corpus and split), and save
it where `SpeculativeConfig(method="mtp")` finds it (the model folder's `mtp/`).

The target is frozen. For random windows of the train split, the target's final hidden states f_p and its
next-token distributions are computed once per batch (no gradient); the head reads (embed(t_{p+1}), f_p) and
learns the target's distribution of the token after next (soft cross-entropy against the target's softmax at
p + 1: verification accepts what the target would draw, not what the corpus says). With `--unroll 2` (the default)
the head is also trained on its own output as the feature, as its chained proposals use it: the second pass reads
(embed(t_{p+2}), h_p) and learns the target's distribution at p + 2 (a causal pass over those rows, where at
serving time a chained row attends to the first pass's keys: an approximation). The loss of pass j is weighted
`--decay`^(j-1). AdamW with a warmup + cosine schedule, as the model's own training. Evaluation: the head's
top-1 agreement with the target's greedy token, per pass, on held-out windows.

    python scripts/train_mtp.py                        # the bundled model's head (pagedjax/assets/tiny/mtp)
    python scripts/train_mtp.py --steps 50 --out /tmp/mtp   # a quick try
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import eval_windows, load_corpus, make_optimizer, model_dir_corpus_tokenizer, train_batch  # noqa: E402

from pagedjax.model.llama import model_from_state  # noqa: E402
from pagedjax.model.loading.checkpoint import bundled_model_path, load_checkpoint  # noqa: E402
from pagedjax.spec_decode.mtp_head import init_head, save_head  # noqa: E402

logger = logging.getLogger("train_mtp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=bundled_model_path(), help="the target's folder (pagedjax format)")
    p.add_argument("--out", type=Path, default=None, help="where to save the head (default: MODEL/mtp)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--unroll", type=int, default=2, help="passes trained: 1 = the target's features only")
    p.add_argument("--decay", type=float, default=0.5, help="weight of pass j's loss: decay^(j-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=32)
    return p.parse_args(argv)


def soft_cross_entropy(logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """Mean over rows of -sum_v softmax(target)_v log softmax(logits)_v."""
    return -jnp.mean(jnp.sum(jax.nn.softmax(target_logits, -1) * jax.nn.log_softmax(logits, -1), -1))


def head_passes(head, target, tokens: jax.Array, unroll: int):
    """tokens int32 [B, S] -> per pass j (1-based) the head's logits [B, S - 1 - j, V] and the target's logits
    they are held to. Pass j's row p reads (embed(t_{p+j}), feature_p) with feature the target's f_p (j = 1) or
    pass j - 1's output at p, and guesses t_{p+j+1}, whose distribution under the target is its logits at p + j."""
    feats = jax.lax.stop_gradient(target.hidden_dense(tokens))  # [B, S, H]
    target_logits = jax.lax.stop_gradient(target.compute_logits(feats))  # [B, S, V]
    embeds = jax.lax.stop_gradient(target.embed(tokens))
    s = tokens.shape[1]
    out, h = [], feats
    for j in range(1, unroll + 1):
        n = s - j  # rows p = 0 .. s - j - 1 have t_{p+j}; their label is the target at p + j
        h = head.dense(embeds[:, j:], h[:, :n])
        out.append((head.logits(target, h), target_logits[:, j:]))
    return out


def main(argv=None) -> int:
    # force: absl's handler may be there first; INFO for this script only (orbax logs every save at INFO)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", force=True)
    logger.setLevel(logging.INFO)
    args = parse_args(argv)
    cfg, state = load_checkpoint(args.model)
    target = model_from_state(cfg, state)
    tok = model_dir_corpus_tokenizer(args.model, cfg)
    start = time.perf_counter()
    corpus = load_corpus(tokenizer=tok)
    logger.info("corpus: %d train / %d held-out tokens (%.1f s)", len(corpus.train), len(corpus.heldout),
                time.perf_counter() - start)
    head = init_head(cfg, seed=args.seed)
    graphdef, params = nnx.split(head, nnx.Param)
    tx, _ = make_optimizer(args.lr, args.warmup, args.steps, 0.1, 0.0, 1.0)
    opt_state = tx.init(params)
    weights = [args.decay ** j for j in range(args.unroll)]

    def loss_fn(params, batch):
        passes = head_passes(nnx.merge(graphdef, params), target, batch, args.unroll)
        losses = jnp.stack([soft_cross_entropy(lg, t) for lg, t in passes])
        return jnp.sum(jnp.asarray(weights) * losses) / sum(weights), losses

    @partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        (loss, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, losses

    @jax.jit
    def agreement(params, batch):
        passes = head_passes(nnx.merge(graphdef, params), target, batch, args.unroll)
        return jnp.stack([jnp.mean(jnp.argmax(lg, -1) == jnp.argmax(t, -1)) for lg, t in passes])

    heldout = eval_windows(corpus.heldout, args.eval_windows, args.seq_len)[:, :-1]
    history = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = train_batch(corpus.train, args.batch_size, args.seq_len, args.seed, step)[:, :-1]
        params, opt_state, losses = train_step(params, opt_state, jnp.asarray(batch))
        if step % args.eval_every == 0 or step == args.steps:
            agree = np.asarray(agreement(params, jnp.asarray(heldout))).tolist()
            entry = {"step": step, "elapsed_s": round(time.perf_counter() - start, 1),
                     "loss": [round(float(x), 4) for x in np.asarray(losses)],
                     "heldout_top1": [round(a, 4) for a in agree]}
            history.append(entry)
            logger.info("step %d (%.0f s): loss per pass %s, held-out top-1 agreement with the target per pass %s",
                        step, entry["elapsed_s"], entry["loss"], entry["heldout_top1"])
    head = nnx.merge(graphdef, params)
    out = args.out if args.out is not None else args.model / "mtp"
    save_head(out, head, extra={"trained_by": "scripts/train_mtp.py", "argv": sys.argv[1:] if argv is None else argv,
                                "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                                "unroll": args.unroll, "history": history,
                                "wall_s": round(time.perf_counter() - start, 1)})
    logger.info("saved the head to %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
