"""A tiny decoder written on the public model contract whose layers declare different KV cache specs: MLA layers
(`LatentAttention`: a latent c_kv and a shared rotary key per token, attention absorbed into latent space through
`PagedLatentAttention`), DeepSeek sparse attention layers (`IndexedSparse`: MLA over the top `INDEX_TOPK`
positions a lightning indexer picks, `PagedSparseAttention`) and GQA layers (`FullAttention`), for the engine
tests of the per-layer cache spec.

`forward_dense` is the ground truth: MLA without absorption (every head's keys and values expanded from c_kv
by W_UK and W_UV), causal, no cache; a sparse layer scores every earlier position densely, keeps the top
INDEX_TOPK and masks the rest. `__call__` is the serving path: the same function with the up-projections
absorbed (q_nope W_UK into latent space, W_UV after attention), as DeepSeek serves it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.model.api import (
    FullAttention,
    IndexedSparse,
    LatentAttention,
    ModelSpec,
    PagedAttention,
    PagedKVCache,
    PagedLatentAttention,
    PagedSparseAttention,
)

VOCAB, HIDDEN, HEADS = 61, 32, 4
NOPE, ROPE, RANK, V_DIM = 8, 8, 16, 8  # MLA: q/k nope and rope dims, the latent rank, the value head dim
GQA_KV_HEADS, GQA_HEAD_DIM = 2, 16
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 2, 16, 5  # the indexer of the sparse layers


def rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotate halves of the last axis by position (x `[..., T, (H,) D]`, positions `[T]`)."""
    half = x.shape[-1] // 2
    freq = 1.0 / (100.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = positions.astype(jnp.float32)[:, None] * freq  # [T, half]
    if x.ndim == positions.ndim + 2:  # a heads axis
        angle = angle[:, None, :]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


def _param(rngs, *shape, dtype):
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) / math.sqrt(shape[0])).astype(dtype))


class LatentLayer(nnx.Module):
    def __init__(self, index: int, rngs: nnx.Rngs, dtype):
        self.wq_nope = _param(rngs, HIDDEN, HEADS * NOPE, dtype=dtype)
        self.wq_rope = _param(rngs, HIDDEN, HEADS * ROPE, dtype=dtype)
        self.wc = _param(rngs, HIDDEN, RANK, dtype=dtype)
        self.wk_rope = _param(rngs, HIDDEN, ROPE, dtype=dtype)
        self.w_uk = _param(rngs, HEADS, NOPE, RANK, dtype=dtype)  # c_kv -> each head's k_nope
        self.w_uv = _param(rngs, HEADS, RANK, V_DIM, dtype=dtype)  # c_kv -> each head's value
        self.wo = _param(rngs, HEADS * V_DIM, HIDDEN, dtype=dtype)
        self.scale = (NOPE + ROPE) ** -0.5
        self.paged = PagedLatentAttention(index, num_heads=HEADS, kv_lora_rank=RANK, rope_dim=ROPE, scale=self.scale)

    def _project(self, x, positions):
        lead = x.shape[:-1]
        q_nope = (x @ self.wq_nope[...]).reshape(*lead, HEADS, NOPE)
        q_rope = rope((x @ self.wq_rope[...]).reshape(*lead, HEADS, ROPE), positions)
        return q_nope, q_rope, x @ self.wc[...], rope(x @ self.wk_rope[...], positions)

    def __call__(self, x, positions, cache: PagedKVCache):  # x [T, HIDDEN]
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        q_latent = jnp.einsum("thd,hdr->thr", q_nope, self.w_uk[...])
        o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, cache)
        o = jnp.einsum("thr,hrv->thv", o_latent, self.w_uv[...])
        return o.reshape(x.shape[0], HEADS * V_DIM) @ self.wo[...], cache

    def dense(self, x):  # x [B, S, HIDDEN]
        return self._dense(x, jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))[None])

    def _dense(self, x, keep):  # keep: bool [B or 1, S, S], the (query, key) pairs attended
        positions = jnp.arange(x.shape[1])
        q_nope, q_rope, c_kv, k_rope = jax.vmap(lambda xb: self._project(xb, positions))(x)
        k_nope = jnp.einsum("bsr,hdr->bshd", c_kv, self.w_uk[...])
        v = jnp.einsum("bsr,hrv->bshv", c_kv, self.w_uv[...])
        scores = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope)
                  + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope)).astype(jnp.float32) * self.scale
        p = jax.nn.softmax(jnp.where(keep[:, None], scores, -jnp.inf), -1)
        o = jnp.einsum("bhqk,bkhv->bqhv", p, v.astype(jnp.float32)).astype(x.dtype)
        return o.reshape(*x.shape[:2], HEADS * V_DIM) @ self.wo[...]


class SparseLayer(LatentLayer):
    """MLA over the INDEX_TOPK earlier positions (itself included) a lightning indexer scores highest."""

    def __init__(self, index: int, rngs: nnx.Rngs, dtype, index_topk: int = INDEX_TOPK):
        super().__init__(index, rngs, dtype)
        self.index_topk = index_topk
        # The indexer draws from its own stream: the model's other weights are those of the all-MLA model.
        own = nnx.Rngs(1000 + index)
        self.wq_index = _param(own, HIDDEN, INDEX_HEADS * INDEX_DIM, dtype=dtype)
        self.w_weights = _param(own, HIDDEN, INDEX_HEADS, dtype=dtype)
        self.wk_index = _param(own, HIDDEN, INDEX_DIM, dtype=dtype)
        self.index_scale = INDEX_DIM ** -0.5
        self.paged = PagedSparseAttention(index, num_heads=HEADS, kv_lora_rank=RANK, rope_dim=ROPE, scale=self.scale,
                                          index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=index_topk,
                                          index_scale=self.index_scale)

    def _indexer(self, x, positions):
        q = rope((x @ self.wq_index[...]).reshape(*x.shape[:-1], INDEX_HEADS, INDEX_DIM), positions)
        weights = (x @ self.w_weights[...]).astype(jnp.float32) * INDEX_HEADS ** -0.5
        return q, weights, rope(x @ self.wk_index[...], positions)

    def __call__(self, x, positions, cache: PagedKVCache):
        q_nope, q_rope, c_kv, k_rope = self._project(x, positions)
        q_index, weights, k_index = self._indexer(x, positions)
        q_latent = jnp.einsum("thd,hdr->thr", q_nope, self.w_uk[...])
        o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, q_index, weights, k_index, cache)
        o = jnp.einsum("thr,hrv->thv", o_latent, self.w_uv[...])
        return o.reshape(x.shape[0], HEADS * V_DIM) @ self.wo[...], cache

    def index_scores(self, x):  # x [B, S, HIDDEN] -> f32 [B, S, S], -inf where not causal
        positions = jnp.arange(x.shape[1])
        q, weights, k = jax.vmap(lambda xb: self._indexer(xb, positions))(x)
        dots = jnp.einsum("bqhd,bkd->bqhk", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = jnp.einsum("bqh,bqhk->bqk", weights, jax.nn.relu(dots)) * self.index_scale
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        return jnp.where(causal[None], scores, -jnp.inf)

    def dense(self, x):
        scores = self.index_scores(x)
        k = min(self.index_topk, x.shape[1])
        # The k best positions of each query, ties to the lower position (lax.top_k's order, the engine's rule:
        # the relu makes exact ties at 0 common), never one it cannot see.
        _, chosen = jax.lax.top_k(scores, k)
        keep = jnp.zeros(scores.shape, bool).at[
            jnp.arange(scores.shape[0])[:, None, None], jnp.arange(scores.shape[1])[None, :, None], chosen].set(True)
        return self._dense(x, keep & jnp.isfinite(scores))


class GQALayer(nnx.Module):
    def __init__(self, index: int, rngs: nnx.Rngs, dtype):
        self.wq = _param(rngs, HIDDEN, HEADS * GQA_HEAD_DIM, dtype=dtype)
        self.wk = _param(rngs, HIDDEN, GQA_KV_HEADS * GQA_HEAD_DIM, dtype=dtype)
        self.wv = _param(rngs, HIDDEN, GQA_KV_HEADS * GQA_HEAD_DIM, dtype=dtype)
        self.wo = _param(rngs, HEADS * GQA_HEAD_DIM, HIDDEN, dtype=dtype)
        self.paged = PagedAttention(index, num_q_heads=HEADS, num_kv_heads=GQA_KV_HEADS, head_dim=GQA_HEAD_DIM)

    def _project(self, x, positions):
        lead = x.shape[:-1]
        q = rope((x @ self.wq[...]).reshape(*lead, HEADS, GQA_HEAD_DIM), positions)
        k = rope((x @ self.wk[...]).reshape(*lead, GQA_KV_HEADS, GQA_HEAD_DIM), positions)
        return q, k, (x @ self.wv[...]).reshape(*lead, GQA_KV_HEADS, GQA_HEAD_DIM)

    def __call__(self, x, positions, cache: PagedKVCache):
        q, k, v = self._project(x, positions)
        o, cache = self.paged(q, k, v, cache)
        return o.reshape(x.shape[0], -1) @ self.wo[...], cache

    def dense(self, x):
        positions = jnp.arange(x.shape[1])
        q, k, v = jax.vmap(lambda xb: self._project(xb, positions))(x)
        group = HEADS // GQA_KV_HEADS
        k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * GQA_HEAD_DIM ** -0.5
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        p = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), -1)
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(x.dtype)
        return o.reshape(*x.shape[:2], -1) @ self.wo[...]


class LatentToy(nnx.Module):
    """Layers by `kinds`: "mla", "dsa" or "gqa" each."""

    def __init__(self, kinds: tuple[str, ...] = ("mla", "gqa", "dsa"), *, seed: int = 0, dtype=jnp.float32,
                 index_topk: int = INDEX_TOPK):
        rngs = nnx.Rngs(seed)
        self.embed = _param(rngs, VOCAB, HIDDEN, dtype=dtype)
        layer = {"mla": LatentLayer, "dsa": functools.partial(SparseLayer, index_topk=index_topk), "gqa": GQALayer}
        self.layers = nnx.List([layer[kind](i, rngs, dtype) for i, kind in enumerate(kinds)])
        self.head = _param(rngs, HIDDEN, VOCAB, dtype=dtype)
        spec = {"mla": LatentAttention(kv_lora_rank=RANK, rope_dim=ROPE),
                "dsa": IndexedSparse(kv_lora_rank=RANK, rope_dim=ROPE, index_head_dim=INDEX_DIM, index_topk=index_topk),
                "gqa": FullAttention(GQA_KV_HEADS, GQA_HEAD_DIM)}
        specs = tuple(spec[kind] for kind in kinds)
        self.spec = ModelSpec(vocab_size=VOCAB, num_layers=len(kinds), num_q_heads=HEADS, kv_layers=specs,
                              dtype=jnp.dtype(dtype).name, max_position_embeddings=256, hidden_size=HIDDEN)

    @staticmethod
    def _norm(x):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(x.dtype)

    def __call__(self, token_ids, positions, cache: PagedKVCache):
        x = self.embed[...][token_ids]
        for layer in self.layers:
            h, cache = layer(self._norm(x), positions, cache)
            x = x + h
        return self._norm(x), cache

    def compute_logits(self, hidden):
        return (hidden @ self.head[...]).astype(jnp.float32)

    def forward_dense(self, token_ids):  # int32 [B, S] -> float32 logits [B, S, VOCAB]
        return self.compute_logits(self._norm(self._dense_layers(token_ids)[-1]))

    def _dense_layers(self, token_ids) -> list[jax.Array]:
        """The residual stream before each layer and after the last, `[B, S, HIDDEN]` each."""
        xs = [self.embed[...][token_ids]]
        for layer in self.layers:
            xs.append(xs[-1] + layer.dense(self._norm(xs[-1])))
        return xs

    def dense_index_scores(self, token_ids) -> list[jax.Array]:
        """Each sparse layer's indexer scores `[B, S, S]` in the dense forward (for tests to rule out near ties)."""
        xs = self._dense_layers(token_ids)
        return [layer.index_scores(self._norm(x)) for layer, x in zip(self.layers, xs, strict=False)
                if isinstance(layer, SparseLayer)]
