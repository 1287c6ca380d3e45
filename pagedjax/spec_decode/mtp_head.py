"""A multi-token-prediction (MTP) head: one decoder layer that predicts the token after next from the target
model's final hidden state and the next token's embedding (DeepSeek-V3's MTP module, whose shape EAGLE's draft
head shares); the proposer of `SpeculativeConfig(method="mtp")` (`pagedjax.spec_decode.mtp`).

    x_p  = eh_proj([enorm(embed(t_{p+1})); hnorm(f_p)])     f_p: the target's final hidden state at position p
    h_p  = layer(x_p)                                        a decoder layer of the target's family, causal
    logits_p = target.compute_logits(norm(h_p))              the head's guess of t_{p+2}

`embed` and the LM head are the target's own (nothing duplicated). Chained proposals feed h_p back as the next
position's f (what the head has instead of the target's hidden state there). `__call__` is the paged, ragged
forward (its one layer's K/V in a `PagedKVCache` of the head's own `spec`, addressed like the target's);
`dense` is the same computation over whole sequences, no cache: the reference the tests hold the paged one to and
what `scripts/train_mtp.py` trains.

Checkpoints: `save_head` / `load_head`, a folder with `mtp_config.json` (the head's `ModelConfig`) and the
parameters under `params/` (orbax), as `pagedjax/assets/tiny/mtp/` ships for the bundled model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from pagedjax.config import ModelConfig, ModelSpec
from pagedjax.model.llama import DecoderLayer, RMSNorm

HEAD_CONFIG_FILE = "mtp_config.json"
HEAD_FORMAT = "pagedjax-mtp-head"
PARAMS_DIR = "params"


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's config for a target of `target`'s config: its one layer has the target's attention and MLP
    shapes, in floating point (a quantized target's head stays float). ValueError for a target whose layers the head
    does not build (mixture of experts, sliding windows, attention sinks, Gemma's norms: the head is a Llama-style
    layer), naming what it has."""
    if not isinstance(target, ModelConfig):
        raise TypeError(f"an MTP head is built for a built-in model's ModelConfig, got {type(target).__name__}")
    unsupported = [name for name, on in (("mixture-of-experts layers", target.moe is not None),
                                         ("sliding windows", target.sliding_windows is not None),
                                         ("attention sinks", target.attention_sinks),
                                         (f"architecture {target.architecture!r}", target.architecture != "llama"))
                   if on]
    if unsupported:
        raise ValueError(f"an MTP head is a Llama-style decoder layer; this target has {', '.join(unsupported)}")
    return target.replace(num_layers=1, quantization=None)


class MTPHead(nnx.Module):
    """The head (see the module's docstring). `config`: `head_config(target's config)`."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        if cfg.num_layers != 1:
            raise ValueError(f"an MTP head has one layer, its config says {cfg.num_layers}: use head_config(target)")
        dtype = jnp.dtype(cfg.dtype)
        h = cfg.hidden_size
        self.config = cfg
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.eh_proj = nnx.Linear(2 * h, h, use_bias=False, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layer = DecoderLayer(cfg, 0, dtype, rngs)
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    @property
    def spec(self) -> ModelSpec:
        """The head's KV: one full-attention layer of the target's heads (what each block holds for it)."""
        return self.config.spec

    def _fuse(self, embeds: jax.Array, features: jax.Array) -> jax.Array:
        return self.eh_proj(jnp.concatenate([self.enorm(embeds), self.hnorm(features.astype(embeds.dtype))], -1))

    def __call__(self, embeds: jax.Array, features: jax.Array, positions: jax.Array, cache):
        """Paged forward. embeds `[T, hidden]` (the target's embeddings of t_{p+1}), features `[T, hidden]` (f_p),
        positions int32 `[T]` (p) -> (h `[T, hidden]`, the cache with the layer's K/V written)."""
        x = self._fuse(embeds, features)
        return self.layer(x, lambda y: self.layer.self_attn(y, positions, cache))

    def dense(self, embeds: jax.Array, features: jax.Array) -> jax.Array:
        """Causal forward over whole sequences, no cache: `[B, S, hidden]` twice -> h `[B, S, hidden]`."""
        x, _ = self.layer(self._fuse(embeds, features), lambda y: (self.layer.self_attn.dense(y), None))
        return x

    def logits(self, target, hidden: jax.Array) -> jax.Array:
        """float32 logits `[..., vocab]` of the head's hidden states, through the target's LM head."""
        return target.compute_logits(self.norm(hidden))


def init_head(target: ModelConfig, seed: int = 0) -> MTPHead:
    """A head of random weights for a target of config `target`."""
    return MTPHead(head_config(target), rngs=nnx.Rngs(seed))


def save_head(path: str | os.PathLike, head: MTPHead, *, extra: dict | None = None) -> Path:
    """Write `head` to the folder `path` (created; parameters replaced): its config and its parameters.
    `extra`: JSON-serialisable notes kept beside the config (how it was trained)."""
    path = Path(path).absolute()
    meta = {"format": HEAD_FORMAT, "model_config": head.config.to_dict(), "extra": extra or {}}
    text = json.dumps(meta, indent=2, sort_keys=True) + "\n"  # before touching the folder: `extra` must serialise
    path.mkdir(parents=True, exist_ok=True)
    (path / HEAD_CONFIG_FILE).unlink(missing_ok=True)  # no head until both parts are written
    params = nnx.to_pure_dict(nnx.state(head, nnx.Param))
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path / PARAMS_DIR, jax.tree.map(np.asarray, params), force=True)
        ckptr.wait_until_finished()
    finally:
        ckptr.close()
    (path / HEAD_CONFIG_FILE).write_text(text)
    return path


def load_head(path: str | os.PathLike, target: ModelConfig) -> MTPHead:
    """The head saved in the folder `path`, for a target of config `target`. FileNotFoundError for a folder
    without a head; ValueError for a head of another target shape (hidden size, heads, vocabulary...) or a file
    that is not a head's config."""
    path = Path(path)
    cfg_file = path / HEAD_CONFIG_FILE
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no MTP head in {path} ({HEAD_CONFIG_FILE} is missing)")
    meta = json.loads(cfg_file.read_text())
    if not isinstance(meta, dict) or meta.get("format") != HEAD_FORMAT:
        raise ValueError(f"{cfg_file} is not an MTP head's config (format {HEAD_FORMAT!r})")
    cfg = ModelConfig.from_dict(meta["model_config"])
    expected = head_config(target)
    if cfg.replace(dtype=expected.dtype, eos_token_ids=expected.eos_token_ids, bos_token_id=expected.bos_token_id,
                   max_position_embeddings=expected.max_position_embeddings) != expected:
        raise ValueError(f"the MTP head in {path} was built for another target: its config {cfg}, this target's "
                         f"head {expected}")
    abstract = nnx.eval_shape(lambda: MTPHead(expected.replace(dtype=cfg.dtype), rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    ckptr = ocp.StandardCheckpointer()
    try:
        restored = ckptr.restore(path / PARAMS_DIR, nnx.to_pure_dict(state))
    finally:
        ckptr.close()
    nnx.replace_by_pure_dict(state, restored)
    head = nnx.merge(graphdef, state)
    if cfg.dtype != expected.dtype:  # served in the target's dtype
        head = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(expected.dtype), state))
        head.config = expected
    return head
