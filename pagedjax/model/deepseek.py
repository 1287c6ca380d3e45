"""The DeepSeek V2 / V3 / V3.2 decoder in Flax NNX (`pagedjax.config.deepseek.DeepSeekConfig`): multi-head
latent attention (MLA), YaRN RoPE over the rotary dims, dense SwiGLU MLPs in the first layers and mixtures of
shared and routed experts after them; in V3.2 (`DeepSeekConfig.indexer`) each layer's MLA is sparse, over the
positions its lightning indexer selects (DeepSeek Sparse Attention). A model of the public contract
(`pagedjax.model.api`).

MLA per layer and token: the query's heads come from `hidden` directly or through a normalized low-rank latent
(`q_lora_rank`); keys and values come from one compressed latent c_kv (`kv_lora_rank`, normalized) and one rotary
key k_rope (`qk_rope_head_dim`) shared by every head; `kv_b_proj` (W_UK | W_UV per head) lifts c_kv to each head's
key part (`qk_nope_head_dim`) and value (`v_head_dim`). Two forwards share the weights:
  `__call__`       the serving path, absorbed: the cache holds only [c_kv | k_rope] per token (the model's spec
                   declares `LatentAttention` layers). Each head's query part for c_kv is folded through W_UK into
                   latent space, q_latent[h] = q_nope[h] @ W_UK[h]^T, attention runs over the latent pages as
                   stored (`PagedLatentAttention`: score = scale * (q_latent . c_kv + q_rope . k_rope)) and returns
                   sum_t p_t c_kv[t] per head, which W_UV lifts to the head's value. q_nope . (W_UK c) equals
                   (W_UK^T q_nope) . c, so this is the same function as:
  `forward_dense`  the ground truth: whole sequences, K and V expanded per head as transformers does, causal
                   softmax, no cache; mixture-of-experts layers by their reference computation.

DeepSeek Sparse Attention (V3.2, `LightningIndexer`): per token an indexer key k_I (one `index_head_dim` vector,
cached beside the latent entry: `IndexedSparse` layers); per query indexer queries q_I from the query latent and
per-head weights w; query s scores each earlier token t as sum_h w[s, h] relu(q_I[s, h] . k_I[t] / sqrt(
index_head_dim)) and attends to its `index_topk` best only (all of t <= s while s < index_topk). `forward_dense`
computes every score, takes the top k and masks dense MLA to them (`MLAttention.dense_index_scores` gives the
scores, for checking that a test's data has no ties at the k-th); `__call__` hands the indexer's q_I, w and k_I
to `PagedSparseAttention`, which scores the paged keys, selects and attends over the selection.

Parameter names mirror transformers' `DeepseekV2ForCausalLM` / `DeepseekV3ForCausalLM` /
`DeepseekV32ForCausalLM` (minus `model.`); linear kernels are `[in, out]` (HF's weights transposed). The router
(`mlp.gate`) and the indexer's `weights_proj` are float32 whatever the model's dtype, as in transformers (it keeps
`gate.weight`, `e_score_correction_bias` and `indexer.weights_proj` in float32). `kv_b_proj` and the router
are not `nnx.Linear`s: `quantize_model` leaves them float (the absorbed path reads `kv_b_proj`'s kernel by head).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.config.deepseek import INDEXER_NORM_EPS, LATENT_NORM_EPS, DeepSeekConfig
from pagedjax.model.api import (
    TP,
    PagedKVCache,
    PagedLatentAttention,
    PagedSharedSparseAttention,
    PagedSparseAttention,
)
from pagedjax.model.layers.linear import apply_linear
from pagedjax.model.layers.moe import Experts, combine_experts, per_expert_params, route
from pagedjax.model.layers.norm import LayerNorm
from pagedjax.model.layers.rope import RoPE
from pagedjax.model.llama import Linear, RMSNorm


def _linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs) -> Linear:
    # 16-bit layers accumulate in float32 and round once (`pagedjax.model.llama.Linear`).
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


def _matmul(subscripts: str, a: jax.Array, b: jax.Array, dtype) -> jax.Array:
    """An einsum accumulated in float32, rounded once to `dtype`."""
    return jnp.einsum(subscripts, a, b, preferred_element_type=jnp.float32).astype(dtype)


class LatentUpProjection(nnx.Module):
    """`kv_b_proj`: c_kv `[..., kv_lora_rank]` -> every head's key part and value, kernel `[kv_lora_rank,
    heads * (qk_nope_head_dim + v_head_dim)]` (per head: W_UK's columns, then W_UV's, as transformers lays them
    out). The absorbed path reads it by head (`key_weights`, `value_weights`)."""

    def __init__(self, rank: int, heads: int, nope_dim: int, v_dim: int, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (rank, heads * (nope_dim + v_dim)),
                                                                dtype))
        self.heads, self.nope_dim, self.v_dim = heads, nope_dim, v_dim

    def _per_head(self) -> jax.Array:
        return self.kernel[...].reshape(self.kernel.shape[0], self.heads, self.nope_dim + self.v_dim)

    def key_weights(self) -> jax.Array:
        """W_UK `[rank, heads, qk_nope_head_dim]`."""
        return self._per_head()[..., :self.nope_dim]

    def value_weights(self) -> jax.Array:
        """W_UV `[rank, heads, v_head_dim]`."""
        return self._per_head()[..., self.nope_dim:]

    def __call__(self, c: jax.Array) -> tuple[jax.Array, jax.Array]:
        """c `[..., rank]` -> (keys' latent part `[..., heads, qk_nope_head_dim]`, values `[..., heads,
        v_head_dim]`), in c's dtype."""
        kernel = self.kernel[...]
        kv = apply_linear(lambda x: jnp.matmul(x, kernel, preferred_element_type=jnp.float32), c)
        kv = kv.reshape(*c.shape[:-1], self.heads, self.nope_dim + self.v_dim)
        return kv[..., :self.nope_dim], kv[..., self.nope_dim:]


class LightningIndexer(nnx.Module):
    """`self_attn.indexer`: DeepSeek V3.2's lightning indexer (`DeepSeekIndexerConfig`). Projects a layer's input
    to what scoring needs; `index_scores` is the dense definition of the scores."""

    def __init__(self, cfg: DeepSeekConfig, dtype, rngs: nnx.Rngs):
        ix = cfg.indexer
        self.heads, self.head_dim, self.rope_dim = ix.num_heads, ix.head_dim, cfg.qk_rope_head_dim
        self.topk, self.scale, self.weight_scale = ix.topk, ix.scale, ix.weight_scale
        self.wq_b = _linear(cfg.q_lora_rank, ix.num_heads * ix.head_dim, dtype, rngs)
        self.wk = _linear(cfg.hidden_size, ix.head_dim, dtype, rngs)
        self.k_norm = LayerNorm(ix.head_dim, INDEXER_NORM_EPS, dtype)
        self.weights_proj = _linear(cfg.hidden_size, ix.num_heads, jnp.float32, rngs)  # float32, as transformers
        scaling = None if cfg.rope_scaling is None else (("rope_type", "yarn"), *cfg.rope_scaling)
        # The model's rotation, in the halves layout whatever MLA's `rope_interleave` (transformers' V3.2 indexer)
        # or in interleaved pairs (GLM-5's): the indexer's own `rope_interleave`.
        self.rope = RoPE(cfg.qk_rope_head_dim, cfg.rope_theta, scaling, interleaved=ix.rope_interleave)

    def __call__(self, x: jax.Array, q_resid: jax.Array, positions: jax.Array):
        """x `[..., hidden]` (the layer's normalized input), q_resid `[..., q_lora_rank]` (MLA's normalized query
        latent) -> (queries `[..., heads, head_dim]`, head weights float32 `[..., heads]` (already times
        heads ** -0.5), key `[..., head_dim]`), queries and key rotated over their first qk_rope_head_dim dims."""
        dr = self.rope_dim
        q = self.wq_b(q_resid).reshape(*q_resid.shape[:-1], self.heads, self.head_dim)
        q = jnp.concatenate([self.rope(q[..., :dr], positions), q[..., dr:]], axis=-1)
        k = self.k_norm(self.wk(x))
        k = jnp.concatenate([self.rope(k[..., None, :dr], positions)[..., 0, :], k[..., dr:]], axis=-1)
        weights = self.weights_proj(x.astype(jnp.float32)) * self.weight_scale
        return q, weights, k

    def index_scores(self, q: jax.Array, weights: jax.Array, k: jax.Array) -> jax.Array:
        """The dense scores: q `[B, S, heads, head_dim]`, weights `[B, S, heads]`, k `[B, S, head_dim]` -> float32
        `[B, S, S]`, sum_h weights[s, h] relu(scale * q[s, h] . k[t]), -inf where t > s."""
        hi = jax.lax.Precision.HIGHEST  # the selection is discrete: no reduced-precision passes
        dots = jnp.einsum("bshd,btd->bsht", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi)
        scores = jnp.einsum("bsh,bsht->bst", weights, jax.nn.relu(dots * self.scale), precision=hi)
        s = q.shape[1]
        return jnp.where(np.arange(s)[None, :] <= np.arange(s)[:, None], scores, -jnp.inf)


def top_k_mask(scores: jax.Array, k: int) -> jax.Array:
    """Causally masked scores `[..., S, S]` (-inf where t > s) -> bool `[..., S, S]`: each query's k best
    positions among t <= s (all of them while s < k). Ties at the k-th are broken towards the lower position
    (`jax.lax.top_k`); transformers' torch.topk leaves them unspecified, so parity needs tie-free scores."""
    s = scores.shape[-1]
    _, chosen = jax.lax.top_k(scores, min(k, s))
    selected = jnp.any(chosen[..., None] == jnp.arange(s), axis=-2)
    return selected & (np.arange(s)[None, :] <= np.arange(s)[:, None])


class MLAttention(nnx.Module):
    """One layer's multi-head latent attention (module docstring)."""

    def __init__(self, cfg: DeepSeekConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        h, heads = cfg.hidden_size, cfg.num_heads
        self.heads, self.nope_dim, self.rope_dim = heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.rank, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        q_out = heads * cfg.qk_head_dim
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = _linear(h, cfg.q_lora_rank, dtype, rngs)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = _linear(cfg.q_lora_rank, q_out, dtype, rngs)
        else:
            self.q_proj = _linear(h, q_out, dtype, rngs)
        self.kv_a_proj_with_mqa = _linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype, rngs)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(cfg.kv_lora_rank, heads, cfg.qk_nope_head_dim, cfg.v_head_dim, dtype,
                                            rngs)
        self.o_proj = _linear(heads * cfg.v_head_dim, h, dtype, rngs)
        scaling = None if cfg.rope_scaling is None else (("rope_type", "yarn"), *cfg.rope_scaling)
        self.rope = RoPE(cfg.qk_rope_head_dim, cfg.rope_theta, scaling, interleaved=cfg.rope_interleave)
        self.scale = cfg.softmax_scale
        # GLM-5's shared layers (`DeepSeekIndexerConfig.shared_layers`) attend over the previous indexed layer's
        # selection, with no indexer of their own.
        self.shared = cfg.indexer is not None and cfg.indexer.is_shared(layer_index)
        self.indexer = None if cfg.indexer is None or self.shared else LightningIndexer(cfg, dtype, rngs)
        latent = dict(num_heads=heads, kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim, scale=self.scale)
        if cfg.indexer is None:
            self.paged = PagedLatentAttention(layer_index, **latent)
        elif self.shared:
            self.paged = PagedSharedSparseAttention(layer_index, **latent)
        else:
            ix = cfg.indexer
            self.paged = PagedSparseAttention(layer_index, **latent, index_n_heads=ix.num_heads,
                                              index_head_dim=ix.head_dim, index_topk=ix.topk, index_scale=ix.scale)

    def _project(self, x: jax.Array, positions: jax.Array):
        """x `[..., hidden]` -> (q_nope `[..., H, nope]`, q_rope `[..., H, rope]` rotated, c_kv `[..., rank]`
        normalized, k_rope `[..., rope]` rotated, the normalized query latent `[..., q_lora_rank]` or None)."""
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_resid) if self.q_lora else self.q_proj(x)
        q = q.reshape(*x.shape[:-1], self.heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q[..., :self.nope_dim], q[..., self.nope_dim:]
        ckv = self.kv_a_proj_with_mqa(x)
        c_kv, k_rope = self.kv_a_layernorm(ckv[..., :self.rank]), ckv[..., self.rank:]
        q_rope = self.rope(q_rope, positions)
        k_rope = self.rope(k_rope[..., None, :], positions)[..., 0, :]
        return q_nope, q_rope, c_kv, k_rope, q_resid

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache,
                 selected: jax.Array | None = None) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's latent entries (and indexer keys)
        written, the selection the next layers share): absorbed MLA, over the indexer's selection when there is
        one, or over `selected` (the previous indexed layer's, int32 `[T, index_topk]`) in a shared layer."""
        q_nope, q_rope, c_kv, k_rope, q_resid = self._project(x, positions)
        q_latent = _matmul("thd,rhd->thr", q_nope, self.kv_b_proj.key_weights(), x.dtype)
        if self.shared:
            o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, selected, cache)
        elif self.indexer is None:
            o_latent, cache = self.paged(q_latent, q_rope, c_kv, k_rope, cache)
        else:  # the indexer's queries, head weights and key; the layer scores, selects and attends
            o_latent, cache, selected = self.paged(q_latent, q_rope, c_kv, k_rope, *self.indexer(x, q_resid, positions),
                                                   cache, return_selection=True)
        o = _matmul("thr,rhv->thv", o_latent, self.kv_b_proj.value_weights(), x.dtype)
        return self.o_proj(o.reshape(x.shape[0], -1)), cache, selected

    def dense_index_scores(self, x: jax.Array) -> jax.Array:
        """The indexer's dense scores of x `[B, S, hidden]` (the layer's normalized input): float32 `[B, S, S]`,
        -inf where t > s (`LightningIndexer.index_scores`). Only for a layer with an indexer."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        return self.indexer.index_scores(*self.indexer(x, q_resid, positions))

    def dense(self, x: jax.Array, visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        """Causal attention over whole sequences with K / V expanded per head, no cache; with an indexer, each
        query attends to its top `index_topk` positions only (a shared layer: to the previous indexed layer's,
        `visible` bool `[B, 1, S, S]`). x `[B, S, hidden]` -> (`[B, S, hidden]`, the mask the next layers share)."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q_nope, q_rope, c_kv, k_rope, _ = self._project(x, positions)
        k_nope, v = self.kv_b_proj(c_kv)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        scores = (jnp.einsum("bqhd,bkhd->bhqk", f32(q_nope), f32(k_nope))
                  + jnp.einsum("bqhd,bkd->bhqk", f32(q_rope), f32(k_rope))) * self.scale
        if self.indexer is not None:
            visible = top_k_mask(self.dense_index_scores(x), self.indexer.topk)[:, None]  # [B, 1, S, S]
        mask = visible if self.indexer is not None or self.shared else np.arange(s)[None, :] <= np.arange(s)[:, None]
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bkhv->bqhv", probs, f32(v)).astype(x.dtype)
        return self.o_proj(o.reshape(b, s, -1)), visible


class SwiGLU(nnx.Module):
    """A dense MLP: down_proj(silu(gate_proj(x)) * up_proj(x)) (the first layers' MLP, and the shared experts)."""

    def __init__(self, hidden: int, width: int, dtype, rngs: nnx.Rngs):
        self.gate_proj = _linear(hidden, width, dtype, rngs)
        self.up_proj = _linear(hidden, width, dtype, rngs)
        self.down_proj = _linear(width, hidden, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nnx.Module):
    """`mlp.gate`: router logits `[N, E]` = x @ kernel in float32 (the kernel float32 whatever the model's dtype:
    transformers computes them so), and for "noaux_tc" the float32 `e_score_correction_bias` `[E]` added to the
    scores when choosing experts (not when weighting them)."""

    def __init__(self, hidden: int, num_experts: int, correction_bias: bool, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (hidden, num_experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32)) if correction_bias else None

    def __call__(self, rows: jax.Array) -> jax.Array:
        return jnp.matmul(rows.astype(jnp.float32), self.kernel[...], precision=jax.lax.Precision.HIGHEST)

    def bias(self) -> jax.Array | None:
        return None if self.e_score_correction_bias is None else self.e_score_correction_bias[...]


class DeepSeekMoE(nnx.Module):
    """A mixture-of-experts MLP (`DeepSeekConfig.moe`): routed experts (`Experts`, through the shared
    computations of `pagedjax.model.layers.moe.combine_experts`) plus the shared experts every token takes."""

    def __init__(self, cfg: DeepSeekConfig, dtype, rngs: nnx.Rngs):
        moe = cfg.moe
        self.moe = moe
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.router == "noaux_tc", rngs)
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size, dtype, rngs)
        self.shared_experts = (SwiGLU(cfg.hidden_size, moe.intermediate_size * moe.num_shared_experts, dtype, rngs)
                               if moe.num_shared_experts else None)

    def routing(self, rows: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Rows `[N, hidden]` -> (weights float32 `[N, k]`, experts int32 `[N, k]`)."""
        m = self.moe
        return route(self.gate(rows), m.num_experts_per_tok, m.router, m.norm_topk_prob, num_groups=m.num_groups,
                     topk_groups=m.topk_groups, correction_bias=self.gate.bias(),
                     scaling_factor=m.routed_scaling_factor)

    def __call__(self, x: jax.Array, method: str | None = None) -> jax.Array:
        """x `[..., hidden]` -> `[..., hidden]`; `method`: `combine_experts`' (None: the backend's; "every": the
        reference)."""
        weights, experts = self.routing(x.reshape(-1, x.shape[-1]))
        y = combine_experts(self.experts, x, weights, experts, method)
        return y if self.shared_experts is None else y + self.shared_experts(x)

    def dense(self, x: jax.Array) -> jax.Array:
        return self(x, "every")


class DecoderLayer(nnx.Module):
    """x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))."""

    def __init__(self, cfg: DeepSeekConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = MLAttention(cfg, layer_index, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.moe = cfg.moe is not None and cfg.moe.is_moe_layer(layer_index)
        self.mlp = DeepSeekMoE(cfg, dtype, rngs) if self.moe else SwiGLU(cfg.hidden_size, cfg.intermediate_size,
                                                                         dtype, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache, selected: jax.Array | None = None
                 ) -> tuple[jax.Array, PagedKVCache, jax.Array | None]:
        """(x, cache, the sparse selection the next layers share: `MLAttention.__call__`)."""
        h, cache, selected = self.self_attn(self.input_layernorm(x), positions, cache, selected)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache, selected

    def dense(self, x: jax.Array, visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        h, visible = self.self_attn.dense(self.input_layernorm(x), visible)
        x = x + h
        h = self.post_attention_layernorm(x)
        return x + (self.mlp.dense(h) if self.moe else self.mlp(h)), visible


class DeepSeek(nnx.Module):
    """DeepSeek V2 / V3 / V3.2 (module docstring): `spec` declares one `LatentAttention` KV layer per decoder
    layer, or with an indexer one `IndexedSparse` layer."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int) -> P | None:
        """Tensor parallelism over heads: the query projection (`q_proj` / `q_b_proj`) and `kv_b_proj` split by
        their output columns, whole heads each ([.., heads * per_head] is head-major), `o_proj` by its input rows,
        so a device computes its heads' queries, latent up-projections and output share (all-reduced by XLA);
        the latent projections (`kv_a_proj_with_mqa`, `q_a_proj`) stay whole, as the latent pages do (every head
        reads them), and so does V3.2's indexer (the default rule replicates its `wq_b` / `wk` / `weights_proj`:
        every device scores every position alike and selects the same ones). 8-bit leaves of these modules stay
        replicated; the MLPs and experts take the default rule."""
        module, leaf = str(names[-2]), str(names[-1])
        if module in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj"):
            if leaf != "kernel" or self.config.num_heads % tp:
                return P()
            return P(TP, None) if module == "o_proj" else P(None, TP)
        return None

    def single_device_params(self, state: nnx.State) -> nnx.State:
        """On one CPU device, every routed expert as its own array (`per_expert_params`: why); else `state`."""
        if self.config.moe is None or jax.default_backend() != "cpu":
            return state
        return per_expert_params(state)

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward. token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache)."""
        x, selected = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, cache, selected = layer(x, positions, cache, selected)
        return self.norm(x), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., hidden]` -> float32 logits `[..., vocab]`."""
        if self.lm_head is None:
            return apply_linear(self.embed_tokens.attend, hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def forward_dense(self, token_ids: jax.Array) -> jax.Array:
        """Ground truth: token_ids `[B, S]` -> float32 logits `[B, S, vocab]`, causal, no cache, K / V expanded per
        head (with an indexer: every score computed, attention masked to each query's top k), mixture-of-experts
        layers by every expert on every token."""
        x, visible = self.embed_tokens(token_ids), None
        for layer in self.layers:
            x, visible = layer.dense(x, visible)
        return self.compute_logits(self.norm(x))


def init_deepseek(cfg: DeepSeekConfig, seed: int = 0) -> DeepSeek:
    """A randomly initialised model (deterministic in `seed`)."""
    return DeepSeek(cfg, rngs=nnx.Rngs(seed))


def abstract_deepseek(cfg: DeepSeekConfig) -> DeepSeek:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: init_deepseek(cfg))


def deepseek_from_state(cfg: DeepSeekConfig, state: nnx.State) -> DeepSeek:
    """A `DeepSeek` holding `state` (e.g. loaded weights) without first initialising random weights."""
    graphdef, _ = nnx.split(abstract_deepseek(cfg))
    return nnx.merge(graphdef, state)


__all__ = ["DeepSeek", "abstract_deepseek", "deepseek_from_state", "init_deepseek"]
