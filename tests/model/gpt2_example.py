"""A GPT-2-style model written outside pagedjax and served by it through the public model contract
(`pagedjax.model.api`): LayerNorm, learned absolute positions, a fused QKV projection, a GELU MLP, multi-head
attention, tied embeddings. Parameter names follow Hugging Face's GPT-2, so `load_hf_gpt2` reads its folders.

docs/models.md's "Bring your own model" section is this file (a test checks that they agree).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

from pagedjax.model.api import TP, ModelRegistry, ModelSpec, PagedAttention, PagedKVCache


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 259
    n_positions: int = 256
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = None


class Attention(nnx.Module):
    def __init__(self, cfg: GPT2Config, index: int, rngs: nnx.Rngs):
        self.n_head, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
        self.c_attn = nnx.Linear(cfg.n_embd, 3 * cfg.n_embd, rngs=rngs)  # q, k and v in one projection
        self.c_proj = nnx.Linear(cfg.n_embd, cfg.n_embd, rngs=rngs)
        self.paged = PagedAttention(index, num_q_heads=cfg.n_head, num_kv_heads=cfg.n_head, head_dim=self.head_dim)

    def qkv(self, x):  # [..., n_embd] -> three [..., n_head, head_dim]
        return [t.reshape(*t.shape[:-1], self.n_head, self.head_dim) for t in jnp.split(self.c_attn(x), 3, -1)]

    def __call__(self, x, cache: PagedKVCache):  # the serving path: x [T, n_embd]
        q, k, v = self.qkv(x)
        o, cache = self.paged(q, k, v, cache)
        return self.c_proj(o.reshape(x.shape)), cache

    def dense(self, x):  # the reference: whole sequences x [B, S, n_embd], causal, no cache
        q, k, v = self.qkv(x)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), -1), v)
        return self.c_proj(o.reshape(x.shape))


class MLP(nnx.Module):
    def __init__(self, cfg: GPT2Config, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(cfg.n_embd, 4 * cfg.n_embd, rngs=rngs)
        self.c_proj = nnx.Linear(4 * cfg.n_embd, cfg.n_embd, rngs=rngs)

    def __call__(self, x):
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


class Block(nnx.Module):
    def __init__(self, cfg: GPT2Config, index: int, rngs: nnx.Rngs):
        self.ln_1 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.attn = Attention(cfg, index, rngs)
        self.ln_2 = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        self.mlp = MLP(cfg, rngs)

    def __call__(self, x, cache: PagedKVCache):
        h, cache = self.attn(self.ln_1(x), cache)
        x = x + h
        return x + self.mlp(self.ln_2(x)), cache

    def dense(self, x):
        x = x + self.attn.dense(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nnx.Module):
    def __init__(self, cfg: GPT2Config, *, rngs: nnx.Rngs):
        self.wte = nnx.Embed(cfg.vocab_size, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.h = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.n_embd, epsilon=cfg.layer_norm_epsilon, rngs=rngs)
        # What the engine sizes its KV pool by.
        self.spec = ModelSpec(vocab_size=cfg.vocab_size, num_layers=cfg.n_layer, num_q_heads=cfg.n_head,
                              num_kv_heads=cfg.n_head, head_dim=cfg.n_embd // cfg.n_head,
                              max_position_embeddings=cfg.n_positions, hidden_size=cfg.n_embd,
                              eos_token_ids=() if cfg.eos_token_id is None else (cfg.eos_token_id,))

    def __call__(self, token_ids, positions, cache: PagedKVCache):  # int32 [T] each -> ([T, n_embd], cache)
        x = self.wte(token_ids) + self.wpe(positions)
        for block in self.h:
            x, cache = block(x, cache)
        return self.ln_f(x), cache

    def param_partition(self, names, tp):  # tensor parallelism: the MLP Megatron-style, the rest replicated
        if names[-2] == "c_fc":
            return PartitionSpec(None, TP) if names[-1] == "kernel" else PartitionSpec(TP)
        if names[-3:] == ("mlp", "c_proj", "kernel"):
            return PartitionSpec(TP, None)
        return None

    def compute_logits(self, hidden):  # tied embeddings
        return self.wte.attend(hidden).astype(jnp.float32)

    def forward_dense(self, token_ids):  # int32 [B, S] -> float32 logits [B, S, vocab]
        x = self.wte(token_ids) + self.wpe(jnp.arange(token_ids.shape[1]))
        for block in self.h:
            x = block.dense(x)
        return self.compute_logits(self.ln_f(x))


def load_hf_gpt2(folder) -> GPT2:
    """A Hugging Face GPT-2 folder (config.json, model.safetensors): HF's Conv1D weights are already [in, out]."""
    from safetensors.numpy import load_file

    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    cfg = GPT2Config(vocab_size=hf["vocab_size"], n_positions=hf["n_positions"], n_embd=hf["n_embd"],
                     n_layer=hf["n_layer"], n_head=hf["n_head"], layer_norm_epsilon=hf["layer_norm_epsilon"],
                     eos_token_id=hf.get("eos_token_id"))
    tensors = load_file(folder / "model.safetensors")
    model = nnx.eval_shape(lambda: GPT2(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    leaf_name = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}
    for path, var in nnx.to_flat_state(state):
        name = "transformer." + ".".join(map(str, path[:-1])) + "." + leaf_name[path[-1]]
        var.set_value(jnp.asarray(np.asarray(tensors[name], np.float32)))
    return nnx.merge(graphdef, state)


def load(path=None):
    """The `--model-class` factory: a Hugging Face GPT-2 folder, or (None) a small random model of bytes."""
    from pagedjax.model.tokenizer import ByteTokenizer

    if path is not None:
        return load_hf_gpt2(path)
    return GPT2(GPT2Config(eos_token_id=257), rngs=nnx.Rngs(0)), ByteTokenizer()


def from_hf_folder(folder: Path, dtype: str | None):
    """The factory `ModelRegistry` calls for a folder of model_type "gpt2": (its float32 model, None: the
    folder's tokenizer.json, if any, is the tokenizer)."""
    if dtype not in (None, "float32"):
        raise ValueError(f"this GPT-2 computes in float32, not {dtype}")
    return load_hf_gpt2(folder), None


ModelRegistry.register_model("gpt2", from_hf_folder)  # LLMEngine.from_pretrained / --model DIR of GPT-2 folders
