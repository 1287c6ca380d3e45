"""DeepSeek V4 (`model_type` "deepseek_v4", transformers' `DeepseekV4ForCausalLM`) in Flax NNX, a model of the
public contract (`pagedjax.model.api`) over the compressed-attention pages of `pagedjax.config.deepseek_v4`.

Per layer, as transformers computes it:
  - attention: a low-rank query (`wq_a`, RMSNorm `q_norm`, `wq_b`, then an unweighted RMSNorm per head), one
    shared K = V vector per token (`wkv`, RMSNorm `norm`), RoPE on the last `rope_dim` dims of each head in
    interleaved pairs (base `rope_theta` in sliding-window layers; `compress_rope_theta`, YaRN-scaled where
    configured, in compressed ones); each query reads its window's last `sliding_window` vectors and, in a CSA
    layer, the compressed entries its lightning indexer picks (top `index_topk`), in an HCA layer every entry its
    position has closed, in one softmax with a learned sink per head (`attn_sink`); the output's rotary dims are
    rotated back by the query's position, then the grouped output projection (`wo_a` per group of heads, `wo_b`);
  - the compressor (`attn.compressor`): per token `wkv` and `wgate` projections (two series in CSA), the gate plus
    a learned bias per window slot (`ape`), pooled per window by a softmax over its slots, RMSNorm'd and rotated
    at the window's first position (`pagedjax.device.compressed`, `pallas_kernels.compressed`); a CSA layer's
    indexer (`attn.indexer`) has a compressor of its own for its keys, queries from the query latent (`wq_b`) and
    per-head weights (`weights_proj`);
  - hyper-connections: `hc_mult` residual streams; before each sub-block `hc_attn` / `hc_ffn` compute from the
    streams (unweighted RMSNorm, one linear map) a collapse, an expansion and a Sinkhorn-normalised mixing matrix;
    the final `hc_head` collapses the streams before the last norm;
  - the MLP: routed experts (clamped SwiGLU) chosen by `tid2eid[token]` in "hash_moe" layers and by the top k of
    score + bias in "moe" layers, scores `scoring_func` of the router logits, weights the chosen scores
    normalized and times `routed_scaling_factor`, plus a shared expert.

Parameter names are the released checkpoint's (what transformers' `save_pretrained` writes): `layers.{i}.attn.wq_a`,
`ffn.experts.{e}.w1`, `hc_attn_fn`, `head`, ...; linear kernels are `[in, out]`. Refused with the field named:
another `num_key_value_heads` than 1, biases, quantizations other than V3's block-scaled FP8 (dequantized at load;
FP4 experts are not read yet).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.config.deepseek_v4 import CSA, HCA, LAYER_TYPES, MLP_TYPES, SLIDING, DeepSeekV4Config
from pagedjax.config.parallel import TP
from pagedjax.device import compressed as dev
from pagedjax.model.api import PagedKVCache
from pagedjax.model.errors import read_json
from pagedjax.model.families import model_types_of
from pagedjax.model.layers.linear import apply_linear
from pagedjax.model.layers.moe import GLU, Experts, combine_experts, per_expert_params
from pagedjax.model.layers.rope import RoPE
from pagedjax.model.llama import Linear, RMSNorm
from pagedjax.model.loading import hf_fp8
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    load_folder_config,
    number,
    optional_id,
    positive_int,
)
from pagedjax.model.loading.hf_loader import IGNORED_SUFFIXES, fill_state, folder_tokenizer
from pagedjax.parallel.attention import sharded_compressed_attend

HIGHEST = jax.lax.Precision.HIGHEST


def _linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs) -> Linear:
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=False, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


def _param(rngs: nnx.Rngs, shape, dtype=jnp.float32, scale: float = 0.02) -> nnx.Param:
    return nnx.Param(scale * jax.random.normal(rngs.params(), shape, dtype))


def _rms(x: jax.Array, eps: float) -> jax.Array:
    """transformers' unweighted RMSNorm: x * rsqrt(mean(x^2) + eps), the factor in float32 rounded to x's dtype."""
    xf = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps).astype(x.dtype)


def rotate(x: jax.Array, positions: jax.Array, rope: RoPE) -> jax.Array:
    """x `[T, ..., D]` with its last `rope.head_dim` dims rotated in interleaved pairs (2i, 2i + 1) by `positions`
    `[T]` (negative: the inverse rotation), as transformers' V4 `apply_rotary_pos_emb`: cos and sin rounded to x's
    dtype, the product in float32."""
    rd = rope.head_dim
    freqs = positions.astype(jnp.float32)[:, None] * rope.inv_freq()  # [T, rd / 2]
    factor = rope.attention_factor()
    cos = (jnp.cos(freqs) * factor).astype(x.dtype).astype(jnp.float32)
    sin = (jnp.sin(freqs) * factor).astype(x.dtype).astype(jnp.float32)
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rd,)
    cos, sin = jnp.repeat(cos, 2, axis=-1).reshape(shape), jnp.repeat(sin, 2, axis=-1).reshape(shape)
    r = x[..., -rd:].astype(jnp.float32)
    turned = jnp.stack([-r[..., 1::2], r[..., 0::2]], axis=-1).reshape(r.shape)
    return jnp.concatenate([x[..., :-rd], (r * cos + turned * sin).astype(x.dtype)], axis=-1)


class Compressor(nnx.Module):
    """`attn.compressor` (or an indexer's): pools every `rate` tokens into one entry of `width` (module
    docstring); `overlap`: CSA's two series."""

    def __init__(self, cfg: DeepSeekV4Config, width: int, rate: int, overlap: bool, rope: RoPE, dtype,
                 rngs: nnx.Rngs):
        series = 2 if overlap else 1
        self.wkv = _linear(cfg.hidden_size, series * width, dtype, rngs)
        self.wgate = _linear(cfg.hidden_size, series * width, dtype, rngs)
        self.ape = _param(rngs, (rate, series * width))
        self.norm = RMSNorm(width, cfg.rms_norm_eps, jnp.float32)
        self.rate, self.rope = rate, rope

    def __call__(self, x: jax.Array, positions: jax.Array, state_pages: jax.Array, meta, *, block_size: int,
                 backend: str, decode_only: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x `[T, hidden]` -> (entries `[T, width]` in x's dtype at the rows closing a window, normed and rotated at
        the window's first position; closes bool `[T]`; the state pages)."""
        kv = self.wkv(x).astype(jnp.float32)
        gate = self.wgate(x).astype(jnp.float32) + self.ape[...][jnp.maximum(positions, 0) % self.rate]
        pooled, closes, state_pages = dev.compress(kv, gate, state_pages, meta, block_size=block_size,
                                                   compress_rate=self.rate, backend=backend, decode_only=decode_only)
        entries = self.norm(pooled.astype(x.dtype))
        first = positions - (self.rate - 1)  # the window's first position, at the row that closes it
        return rotate(entries, first, self.rope), closes, state_pages


class Indexer(nnx.Module):
    """`attn.indexer`: a CSA layer's lightning indexer (its own compressor for keys of `index_head_dim`)."""

    def __init__(self, cfg: DeepSeekV4Config, rope: RoPE, dtype, rngs: nnx.Rngs):
        self.heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = _linear(cfg.q_lora_rank, self.heads * self.head_dim, dtype, rngs)
        self.weights_proj = _linear(cfg.hidden_size, self.heads, dtype, rngs)
        self.compressor = Compressor(cfg, self.head_dim, cfg.csa_rate, True, rope, dtype, rngs)
        self.rope = rope

    def queries(self, x: jax.Array, q_latent: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(queries `[T, Hi, Di]` rotated, per-head weights float32 `[T, Hi]` times Hi ** -0.5)."""
        q = self.wq_b(q_latent).reshape(x.shape[0], self.heads, self.head_dim)
        weights = self.weights_proj(x).astype(jnp.float32) * self.heads ** -0.5
        return rotate(q, positions, self.rope), weights


class Attention(nnx.Module):
    """`layers.{i}.attn` (module docstring)."""

    def __init__(self, cfg: DeepSeekV4Config, layer: int, dtype, rngs: nnx.Rngs):
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        h, d = cfg.num_heads, cfg.head_dim
        self.wq_a = _linear(cfg.hidden_size, cfg.q_lora_rank, dtype, rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, jnp.float32)
        self.wq_b = _linear(cfg.q_lora_rank, h * d, dtype, rngs)
        self.wkv = _linear(cfg.hidden_size, d, dtype, rngs)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, jnp.float32)
        self.wo_a = _linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype, rngs)
        self.wo_b = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype, rngs)
        self.attn_sink = _param(rngs, (h,))
        if self.kind == SLIDING:
            self.rope = RoPE(cfg.rope_dim, cfg.rope_theta)
        else:
            self.rope = RoPE(cfg.rope_dim, cfg.compress_rope_theta, cfg.compress_rope_scaling)
        rate = cfg.rate(layer)
        self.compressor = None if rate is None else Compressor(cfg, d, rate, self.kind == CSA, self.rope, dtype, rngs)
        self.indexer = Indexer(cfg, self.rope, dtype, rngs) if self.kind == CSA else None

    def __call__(self, x: jax.Array, positions: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        cfg, t = self.cfg, x.shape[0]
        window, entries_kv, state_kv = cfg.kv_index(self.layer)
        q_latent = self.q_norm(self.wq_a(x))
        q = _rms(self.wq_b(q_latent).reshape(t, cfg.num_heads, cfg.head_dim), cfg.rms_norm_eps)
        q = rotate(q, positions, self.rope)
        kv = rotate(self.norm(self.wkv(x)), positions, self.rope)
        window_meta = cache.meta_of(window)
        window_pages = dev.write_rows(cache.layer(window).pages, kv, window_meta.slot_mapping)
        cache = cache.with_layer(window, cache.layer(window)._replace(pages=window_pages))
        entry_pages = entry_meta = selected = None
        if self.compressor is not None:
            options = dict(backend=cache.backend, decode_only=cache.decode_only,
                           block_size=cache.block_size_of(state_kv))
            states, layer = cache.layer(state_kv), cache.layer(entries_kv)
            entry_meta = cache.meta_of(entries_kv)
            state_meta = cache.meta_of(state_kv)
            e, closes, compressor = self.compressor(x, positions, states.compressor, state_meta, **options)
            slots = dev.entry_slots(entry_meta.slot_mapping, closes, self.compressor.rate)
            entry_pages = dev.write_rows(layer.entries, e, slots)
            index_keys, indexer = layer.index_keys, states.indexer
            if self.indexer is not None:
                keys, _, indexer = self.indexer.compressor(x, positions, indexer, state_meta, **options)
                index_keys = dev.write_rows(index_keys, keys, slots)
                q_index, weights = self.indexer.queries(x, q_latent, positions)
                selected, ties = dev.select_entries(q_index, weights, index_keys, entry_meta,
                                                    scale=cfg.index_head_dim ** -0.5, index_topk=cfg.index_topk,
                                                    compress_rate=cfg.csa_rate, backend=cache.backend)
                cache = cache.with_indexer_ties(ties)
            cache = cache.with_layer(entries_kv, layer._replace(entries=entry_pages, index_keys=index_keys))
            cache = cache.with_layer(state_kv, states._replace(compressor=compressor, indexer=indexer))
        args = (q, window_pages, window_meta, entry_pages, entry_meta, selected, self.attn_sink[...])
        options = dict(scale=cfg.head_dim ** -0.5, sliding_window=cfg.sliding_window,
                       compress_rate=cfg.rate(self.layer), backend=cache.backend)
        if cache.mesh is None:
            o = dev.attend(*args, **options)
        else:  # query heads split over the devices (`DeepSeekV4.param_partition`), the pages whole on each
            o = sharded_compressed_attend(*args, mesh=cache.mesh, **options)
        o = rotate(o, -positions, self.rope).reshape(t, cfg.o_groups, -1)
        kernel = self.wo_a.kernel[...].reshape(o.shape[-1], cfg.o_groups, cfg.o_lora_rank)
        grouped = jnp.einsum("tgi,igr->tgr", o, kernel, preferred_element_type=jnp.float32).astype(x.dtype)
        return self.wo_b(grouped.reshape(t, -1)), cache


class HyperConnection(nnx.Module):
    """`hc_attn_*` / `hc_ffn_*` (`fn` `[(2 + n) n, n hidden]`, `base`, `scale` `[3]`, float32): from the n streams,
    the collapse weights (pre), the expansion weights (post) and the Sinkhorn-normalised mixing matrix (comb)."""

    def __init__(self, cfg: DeepSeekV4Config, rngs: nnx.Rngs):
        n = cfg.hc_mult
        self.fn = _param(rngs, ((2 + n) * n, n * cfg.hidden_size))
        self.base = nnx.Param(jnp.zeros(((2 + n) * n,), jnp.float32))
        self.scale = nnx.Param(jnp.ones((3,), jnp.float32))
        self.n, self.iters, self.eps, self.norm_eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """streams `[T, n, hidden]` -> (post f32 `[T, n]`, comb f32 `[T, n, n]`, the collapsed input `[T, hidden]`)."""
        n, (t, _, _) = self.n, streams.shape
        flat = _rms(streams.reshape(t, -1).astype(jnp.float32), self.norm_eps)
        mix = jnp.matmul(flat, self.fn[...].T, precision=HIGHEST)
        base, scale = self.base[...], self.scale[...]
        pre = jax.nn.sigmoid(mix[:, :n] * scale[0] + base[:n]) + self.eps
        post = 2 * jax.nn.sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mix[:, 2 * n:].reshape(t, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + self.eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + self.eps)

        def sinkhorn(_, c):  # a loop, not unrolled: 2 x layers x (iters - 1) steps would swell every step's program
            c = c / (jnp.sum(c, axis=-1, keepdims=True) + self.eps)
            return c / (jnp.sum(c, axis=-2, keepdims=True) + self.eps)

        comb = jax.lax.fori_loop(0, self.iters - 1, sinkhorn, comb)
        return post, comb, jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)


def _expand(post: jax.Array, comb: jax.Array, out: jax.Array, streams: jax.Array) -> jax.Array:
    """The streams after a sub-block: post[k] out + sum_j comb[j, k] streams[j], in the streams' dtype."""
    dtype = streams.dtype
    return post.astype(dtype)[..., None] * out[:, None, :] + jnp.einsum("tjk,tjd->tkd", comb.astype(dtype), streams)


class SharedExpert(nnx.Module):
    """`ffn.shared_experts`: w2(silu(min(w1 x, limit)) * clip(w3 x, -limit, limit))."""

    def __init__(self, cfg: DeepSeekV4Config, dtype, rngs: nnx.Rngs):
        width = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.w1 = _linear(cfg.hidden_size, width, dtype, rngs)
        self.w3 = _linear(cfg.hidden_size, width, dtype, rngs)
        self.w2 = _linear(width, cfg.hidden_size, dtype, rngs)
        self.glu = GLU("clamped_silu", None, cfg.swiglu_limit)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w2(self.glu(self.w1(x), self.w3(x)))


class Router(nnx.Module):
    """`ffn.gate`: logits x @ weight^T (float32); "moe" layers choose the top k of score + `bias`, "hash_moe" layers
    the experts `tid2eid[token]`."""

    def __init__(self, cfg: DeepSeekV4Config, hashed: bool, rngs: nnx.Rngs):
        self.kernel = _param(rngs, (cfg.hidden_size, cfg.num_experts))
        self.bias = None if hashed else nnx.Param(jnp.zeros((cfg.num_experts,), jnp.float32))
        self.tid2eid = nnx.Param(jnp.zeros((cfg.vocab_size, cfg.num_experts_per_tok), jnp.int32)) if hashed else None
        self.k, self.scoring, self.scaling = cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(weights float32 `[T, k]`, experts int32 `[T, k]`)."""
        logits = jnp.matmul(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32), precision=HIGHEST)
        if self.scoring == "sqrtsoftplus":
            scores = jnp.sqrt(jax.nn.softplus(logits))
        elif self.scoring == "softmax":
            scores = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
        if self.tid2eid is None:
            _, experts = jax.lax.top_k(scores + self.bias[...], self.k)
        else:
            experts = self.tid2eid[...][jnp.clip(token_ids, 0, self.tid2eid.shape[0] - 1)]
        experts = experts.astype(jnp.int32)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * jnp.float32(self.scaling), experts


class MoE(nnx.Module):
    """`ffn`: routed experts plus the shared expert."""

    def __init__(self, cfg: DeepSeekV4Config, layer: int, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, cfg.mlp_layer_types[layer] == "hash_moe", rngs)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, dtype, rngs,
                               glu=GLU("clamped_silu", None, cfg.swiglu_limit))
        self.shared_experts = SharedExpert(cfg, dtype, rngs) if cfg.n_shared_experts else None

    def __call__(self, x: jax.Array, token_ids: jax.Array) -> jax.Array:
        weights, experts = self.gate(x, token_ids)
        y = combine_experts(self.experts, x, weights, experts)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class Block(nnx.Module):
    """`layers.{i}`: hyper-connected attention, then hyper-connected MoE."""

    def __init__(self, cfg: DeepSeekV4Config, layer: int, dtype, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, jnp.float32)
        self.attn = Attention(cfg, layer, dtype, rngs)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, jnp.float32)
        self.ffn = MoE(cfg, layer, dtype, rngs)
        self.hc_attn = HyperConnection(cfg, rngs)
        self.hc_ffn = HyperConnection(cfg, rngs)

    def __call__(self, streams: jax.Array, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        dtype = streams.dtype
        post, comb, x = self.hc_attn(streams)
        out, cache = self.attn(self.attn_norm(x).astype(dtype), positions, cache)
        streams = _expand(post, comb, out, streams)
        post, comb, x = self.hc_ffn(streams)
        return _expand(post, comb, self.ffn(self.ffn_norm(x).astype(dtype), token_ids), streams), cache


class HyperHead(nnx.Module):
    """`hc_head`: the final collapse of the streams (`hc_fn` `[n, n hidden]`, `hc_base` `[n]`, `hc_scale` `[1]`)."""

    def __init__(self, cfg: DeepSeekV4Config, rngs: nnx.Rngs):
        n = cfg.hc_mult
        self.hc_fn = _param(rngs, (n, n * cfg.hidden_size))
        self.hc_base = nnx.Param(jnp.zeros((n,), jnp.float32))
        self.hc_scale = nnx.Param(jnp.ones((1,), jnp.float32))
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, streams: jax.Array) -> jax.Array:
        t = streams.shape[0]
        flat = _rms(streams.reshape(t, -1).astype(jnp.float32), self.norm_eps)
        mix = jnp.matmul(flat, self.hc_fn[...].T, precision=HIGHEST)
        pre = jax.nn.sigmoid(mix * self.hc_scale[...] + self.hc_base[...]) + self.eps
        return jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)


class DeepSeekV4(nnx.Module):
    """DeepSeek V4 (module docstring); `spec` is its config's (`DeepSeekV4Config.spec`)."""

    def __init__(self, cfg: DeepSeekV4Config, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, jnp.float32)
        self.hc_head = HyperHead(cfg, rngs)
        self.head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int) -> P | None:
        """Tensor parallelism over the attention's query heads (`sharded_compressed_attend`): `wq_b` by output
        columns (whole heads), the sinks by heads, the grouped `wo_a` by its groups' columns (a device's heads are
        whole groups) and `wo_b` by input rows (its partial products summed); the query latent, the shared K = V
        projection, the compressors and the indexer whole on every device (one head's vectors and one choice of
        entries, the same everywhere). Everything else by the default rule (experts split by expert). ValueError
        unless tp divides the heads and `o_groups`."""
        if tp == 1 or "attn" not in names:
            return None
        cfg = self.config
        if cfg.num_heads % tp or cfg.o_groups % tp:
            raise ValueError(f"tensor_parallel_size {tp} must divide 'num_attention_heads' ({cfg.num_heads}) and "
                             f"'o_groups' ({cfg.o_groups}): the attention is split by query heads, in whole groups "
                             "of the grouped output projection")
        owner, leaf = str(names[-3]) if len(names) >= 3 else "", str(names[-1])
        if owner == "attn" and str(names[-2]) in ("wq_b", "wo_a") and leaf == "kernel":
            return P(None, TP)
        if owner == "attn" and str(names[-2]) == "wo_b" and leaf == "kernel":
            return P(TP, None)
        if str(names[-2]) == "attn" and leaf == "attn_sink":
            return P(TP)
        return P()

    def single_device_params(self, state: nnx.State) -> nnx.State:
        """On one CPU device, every routed expert as its own array (`per_expert_params`); else `state`."""
        return per_expert_params(state) if jax.default_backend() == "cpu" else state

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward. token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache)."""
        x = self.embed_tokens(token_ids)
        streams = jnp.broadcast_to(x[:, None, :], (x.shape[0], self.config.hc_mult, x.shape[1]))
        for layer in self.layers:
            streams, cache = layer(streams, token_ids, positions, cache)
        return self.norm(self.hc_head(streams)).astype(x.dtype), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        if self.head is None:
            return apply_linear(self.embed_tokens.attend, hidden).astype(jnp.float32)
        return self.head(hidden).astype(jnp.float32)


def init_deepseek_v4(cfg: DeepSeekV4Config, seed: int = 0) -> DeepSeekV4:
    """A randomly initialised model (deterministic in `seed`)."""
    return DeepSeekV4(cfg, rngs=nnx.Rngs(seed))


def abstract_deepseek_v4(cfg: DeepSeekV4Config) -> DeepSeekV4:
    return nnx.eval_shape(lambda: init_deepseek_v4(cfg))


def deepseek_v4_from_state(cfg: DeepSeekV4Config, state: nnx.State) -> DeepSeekV4:
    graphdef, _ = nnx.split(abstract_deepseek_v4(cfg))
    return nnx.merge(graphdef, state)


# ------------------------------------------------------------------------------------ the Hugging Face folder

MODEL_TYPES = model_types_of(__name__)
# transformers' DeepseekV4Config defaults of the fields a config.json may leave out.
_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1,
    scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0,
    compress_rope_theta=160000.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_BY_RATIO = {0: SLIDING, 4: CSA, 128: HCA}  # transformers' reading of a legacy `compress_ratios` list


def load_config(path: str | os.PathLike, dtype: str | None = None) -> DeepSeekV4Config:
    """A DeepSeek V4 folder's config.json as a `DeepSeekV4Config` (ModelLoadError naming the file and field)."""
    return load_folder_config(path, lambda hf, bos, eos: _config_from_hf(hf, dtype, bos, eos))


def _config_from_hf(hf: dict, dtype: str | None, gen_bos, gen_eos) -> DeepSeekV4Config:
    d = _DEFAULTS
    _fp8_block(hf)  # the quantization_config checked
    for name in ("attention_bias", "mlp_bias"):
        if flag(hf, name, False):
            raise ValueError(f"field {name!r}: biases are not supported for deepseek_v4")
    if positive_int(hf, "num_key_value_heads", 1) != 1:
        raise ValueError("field 'num_key_value_heads': DeepSeek V4 has one shared K = V head")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"field 'hidden_act': {hf['hidden_act']!r} is not supported (silu only)")
    num_layers = positive_int(hf, "num_hidden_layers", d["num_hidden_layers"])
    head_dim = positive_int(hf, "head_dim", d["head_dim"])
    rates = {**_RATES, **(hf.get("compress_rates") or {})}
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if hf.get(legacy) is not None:
            rates[kind] = hf[legacy]
    kinds = hf.get("layer_types")
    if kinds is None and hf.get("compress_ratios") is not None:
        kinds = [_BY_RATIO.get(r, f"compress ratio {r}") for r in hf["compress_ratios"]]
    if kinds is None:
        kinds = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    mlp = hf.get("mlp_layer_types")
    if mlp is None:
        hashed = hf.get("num_hash_layers", 3)
        mlp = ["hash_moe"] * min(num_layers, hashed) + ["moe"] * max(0, num_layers - hashed)
    for name, given, allowed in (("layer_types", kinds, LAYER_TYPES), ("mlp_layer_types", mlp, MLP_TYPES)):
        bad = sorted({k for k in given if k not in allowed}, key=str)
        if bad or len(given) < num_layers:
            raise ValueError(f"field {name!r}: {len(given)} entries, {bad or 'none'} unknown (expected "
                             f"{num_layers} of {allowed})")
    rope_dim = _rope_dim(hf, head_dim)
    main, compress = _rope(hf)
    if main is not None:
        raise ValueError("field 'rope_parameters': the sliding layers' ('main') rope must be 'default'")
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id", d["bos_token_id"]), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id", d["eos_token_id"]), "eos_token_id")
    return DeepSeekV4Config(
        vocab_size=positive_int(hf, "vocab_size", d["vocab_size"]),
        hidden_size=positive_int(hf, "hidden_size", d["hidden_size"]), num_layers=num_layers,
        num_heads=positive_int(hf, "num_attention_heads", d["num_attention_heads"]), head_dim=head_dim,
        rope_dim=rope_dim, q_lora_rank=positive_int(hf, "q_lora_rank", d["q_lora_rank"]),
        o_groups=positive_int(hf, "o_groups", d["o_groups"]), o_lora_rank=positive_int(hf, "o_lora_rank",
                                                                                     d["o_lora_rank"]),
        sliding_window=positive_int(hf, "sliding_window", d["sliding_window"]),
        layer_types=tuple(kinds[:num_layers]), mlp_layer_types=tuple(mlp[:num_layers]),
        csa_rate=rates[CSA], hca_rate=rates[HCA],
        index_n_heads=positive_int(hf, "index_n_heads", d["index_n_heads"]),
        index_head_dim=positive_int(hf, "index_head_dim", d["index_head_dim"]),
        index_topk=positive_int(hf, "index_topk", d["index_topk"]), hc_mult=positive_int(hf, "hc_mult", d["hc_mult"]),
        hc_sinkhorn_iters=positive_int(hf, "hc_sinkhorn_iters", d["hc_sinkhorn_iters"]),
        hc_eps=number(hf, "hc_eps", d["hc_eps"]),
        num_experts=positive_int(hf, "n_routed_experts", d["n_routed_experts"]),
        num_experts_per_tok=positive_int(hf, "num_experts_per_tok", d["num_experts_per_tok"]),
        moe_intermediate_size=positive_int(hf, "moe_intermediate_size", d["moe_intermediate_size"]),
        n_shared_experts=hf.get("n_shared_experts", d["n_shared_experts"]),
        routed_scaling_factor=number(hf, "routed_scaling_factor", d["routed_scaling_factor"]),
        scoring_func=hf.get("scoring_func", d["scoring_func"]),
        swiglu_limit=number(hf, "swiglu_limit", d["swiglu_limit"]),
        rope_theta=number(hf, "rope_theta", d["rope_theta"]),
        compress_rope_theta=number(hf, "compress_rope_theta", d["compress_rope_theta"]),
        compress_rope_scaling=compress, rms_norm_eps=number(hf, "rms_norm_eps", d["rms_norm_eps"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", d["tie_word_embeddings"]),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", d["max_position_embeddings"]),
        dtype=checkpoint_dtype(hf, dtype), bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)))


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    """The block of a block-scaled FP8 checkpoint's scales (V3's layout: float8 e4m3 weights, a float32
    `weight_scale_inv` per block; the compressor and indexer projections stay bfloat16, as released), None for a
    float one; ValueError naming the field for other quantizations, FP4 experts (`expert_dtype`) among them."""
    qc = hf.get("quantization_config")
    if qc is None:
        return None
    try:
        block = hf_fp8.block_size(qc)
    except ValueError as e:
        raise ValueError(f"field 'quantization_config': {e}") from None
    expert = qc.get("expert_dtype", hf.get("expert_dtype"))
    if expert not in (None, "fp8", "float8_e4m3fn", "e4m3"):
        raise ValueError(f"field 'quantization_config': expert_dtype {expert!r} is not supported (FP8 experts only: "
                         "the FP4 experts' format is not read yet)")
    return block


def _rope_dim(hf: dict, head_dim: int) -> int:
    """The rotary dims: head_dim * `partial_rotary_factor`, else the legacy `qk_rope_head_dim`, else 64 / 512."""
    factor = hf.get("partial_rotary_factor")
    if factor is None:
        legacy = hf.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else 64 / 512
    return int(head_dim * factor)


def _rope(hf: dict) -> tuple[tuple | None, tuple | None]:
    """(the sliding layers' scaling, the compressed layers' scaling) from `rope_parameters` (nested by "main" /
    "compress", or flat: the compressed layers' YaRN), None for unscaled; YaRN's attention factor is 1 as in
    transformers' V4 (it does not scale cos and sin)."""
    rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nested = isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)
    main = rp["main"] if nested else {"rope_type": "default"}
    compress = rp["compress"] if nested else {k: v for k, v in rp.items() if k not in ("main", "compress")}

    def scaling(params: dict, which: str) -> tuple | None:
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            return None
        if kind != "yarn":
            raise ValueError(f"field 'rope_parameters': {which} rope type {kind!r} is not supported (default, yarn)")
        keep = {k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta",
                                                               "partial_rotary_factor")}
        keep.setdefault("attention_factor", 1.0)
        return tuple(sorted({"rope_type": "yarn", **keep}.items()))

    return scaling(main, "main"), scaling(compress, "compress")


# Our parameter paths -> the checkpoint's names where they differ from "model." + the path.
_LEAVES = {"kernel": ("weight", True), "weight": ("weight", False), "embedding": ("weight", False),
           "bias": ("bias", False)}


def _names(path: tuple, shape: tuple) -> list[tuple[str, bool, int | None]]:
    """A `DeepSeekV4` parameter -> its checkpoint tensors (the released names, module docstring)."""
    *mods, leaf = (str(p) for p in path)
    if mods and mods[-1] in ("hc_attn", "hc_ffn"):  # hc_attn_fn, hc_attn_base, hc_attn_scale
        return [("model." + ".".join(mods[:-1] + [f"{mods[-1]}_{leaf}"]), False, None)]
    if mods and mods[-1] == "experts":  # w1 = gate (out, in), w3 = up, w2 = down (out, in): ours (in, out)
        w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[leaf]
        prefix = "model." + ".".join(mods)
        return [(f"{prefix}.{e}.{w}.weight", leaf == "down_proj", e) for e in range(shape[0])]
    if leaf in ("attn_sink", "ape", "tid2eid") or mods == ["hc_head"]:
        return [("model." + ".".join(mods + [leaf]), False, None)]
    if mods and mods[-1] == "gate" and leaf == "kernel":
        return [("model." + ".".join(mods + ["weight"]), True, None)]
    name, transposed = _LEAVES[leaf]
    prefix = "" if mods[0] == "head" else "model."
    return [(prefix + ".".join(mods + [name]), transposed, None)]


def load_params(path: str | os.PathLike, cfg: DeepSeekV4Config,
                fp8_block: tuple[int, int] | None = None) -> nnx.State:
    """The folder's weights as `DeepSeekV4(cfg)`'s parameters (`fp8_block`: an FP8 checkpoint's scale block, its
    weights dequantized to the model's dtype, `hf_fp8`); the multi-token-prediction layers (`mtp.*`) are not
    read. ModelLoadError naming missing, unexpected or mis-shaped tensors."""

    def skip(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or name.startswith("mtp.") or (
            name == "head.weight" and cfg.tie_word_embeddings)

    return fill_state(path, lambda: nnx.split(abstract_deepseek_v4(cfg))[1], _names, skip=skip, fp8_block=fp8_block)


def load(path: str | os.PathLike, dtype: str | None = None):
    """(`DeepSeekV4` holding the folder's weights, its tokenizer or None): the `ModelRegistry` factory of
    "deepseek_v4"."""
    cfg = load_config(path, dtype)  # the quantization_config checked too
    block = _fp8_block(read_json(Path(path) / "config.json"))
    return deepseek_v4_from_state(cfg, load_params(path, cfg, block)), folder_tokenizer(path, cfg.eos_token_ids,
                                                                                       cfg.bos_token_id)


__all__ = ["DeepSeekV4", "abstract_deepseek_v4", "deepseek_v4_from_state", "init_deepseek_v4", "load", "load_config",
           "load_params", "rotate"]
