"""A Llama-family decoder in Flax NNX (Llama 2/3, Mistral, Qwen2 shapes): RMSNorm, RoPE, SwiGLU, GQA/MQA/MHA;
and its Gemma 2 variant (`ModelConfig.architecture == "gemma2"`): (1 + w) RMSNorm, GeGLU, sandwich norms, scaled
embeddings. Either may use per-layer sliding windows and soft-capped attention and output logits.

Two forwards share the same weights:
  `__call__`      the serving path: a ragged batch of tokens `[num_tokens]`, new K/V written into the paged
                  cache by slot mapping, attention through the paged kernels.
  `forward_dense` the ground truth: whole sequences `[batch, seq]`, causal attention, no cache at all.

Conventions follow Hugging Face's Llama so that its checkpoints load without permuting weights: RoPE rotates
halves (`rotate_half`), linear kernels are stored `[in, out]` (HF's weights transposed).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig, ModelSpec
from pagedjax.model.api import PagedAttention, PagedKVCache
from pagedjax.parallel.sharding import param_spec


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies `[head_dim // 2]` (float32), with "linear" or "llama3" scaling if configured."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if not cfg.rope_scaling:
        return inv_freq.astype(np.float32)
    rs = dict(cfg.rope_scaling)
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        pass
    elif kind == "linear":
        inv_freq = inv_freq / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old_len = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    else:
        raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: default, linear, llama3)")
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate `x [..., heads, head_dim]` by `positions [...]` (rotate-half convention)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., 1, D]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _apply(fn, x: jax.Array) -> jax.Array:
    """`fn(x)` for a linear map `fn` over x `[..., in]`, rounded to x's dtype.

    XLA:CPU lowers a one-row dot with 16-bit float operands to a scalar loop that reads weights at ~1 GB/s
    (two or more rows go to YNNPACK at ~15-25 GB/s; float32 one-row dots are fast either way), so on the CPU
    a single 16-bit row runs as two (the second zero) and keeps the first: batch-1 decode of a bf16 model
    10x faster on the 156M shape (`scripts/bench_engine.py`).
    """
    lead = x.shape[:-1]
    if math.prod(lead) == 1 and x.dtype in (jnp.bfloat16, jnp.float16) and jax.default_backend() == "cpu":
        x2 = jnp.concatenate([x.reshape(1, -1), jnp.zeros((1, x.shape[-1]), x.dtype)])
        y = fn(x2)[:1].astype(x.dtype)
        return y.reshape(*lead, y.shape[-1])
    return fn(x).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Llama's RMSNorm (`w * normed`, rounded to x's dtype before the product) or, with `offset`, Gemma's:
    `(1 + w) * normed` in float32, rounded once (w is stored as the offset from 1, as in Gemma checkpoints)."""

    def __init__(self, dim: int, eps: float, dtype, *, offset: bool = False):
        self.weight = nnx.Param((jnp.zeros if offset else jnp.ones)((dim,), dtype))
        self.eps = eps
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return (y * (1.0 + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return self.weight[...] * y.astype(x.dtype)


class Linear(nnx.Linear):
    """`nnx.Linear` whose output is rounded to the input's dtype through `_apply` (16-bit layers accumulate in
    float32, and a single 16-bit row runs as two on the CPU)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return _apply(super().__call__, x)


def _linear(n_in: int, n_out: int, bias: bool, dtype, rngs: nnx.Rngs) -> Linear:
    # 16-bit layers accumulate in float32 and round once (`_apply`): a bf16 x bf16 -> bf16 dot makes XLA:CPU
    # convert the whole weight to float32 on every call.
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = _linear(h, cfg.num_q_heads * d, cfg.qkv_bias, dtype, rngs)
        self.k_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.v_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs)
        self.o_proj = _linear(cfg.num_q_heads * d, h, False, dtype, rngs)
        self.num_q_heads, self.num_kv_heads, self.head_dim = cfg.num_q_heads, cfg.num_kv_heads, d
        # Static per-layer variants (None = unused: the kernels then compile their plain path).
        self.sliding_window = None if cfg.sliding_windows is None else cfg.sliding_windows[layer_index]
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.scale = cfg.attention_scale
        self.paged = PagedAttention(layer_index, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=d, scale=self.scale, sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap)

    def _qkv(self, x: jax.Array, positions: jax.Array, inv_freq: np.ndarray):
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_q_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def __call__(self, x, positions, cache: PagedKVCache, inv_freq) -> tuple[jax.Array, PagedKVCache]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's K/V written): the projections, RoPE,
        one paged attention call (`pagedjax.model.api.PagedAttention`), the output projection."""
        q, k, v = self._qkv(x, positions, inv_freq)
        o, cache = self.paged(q, k, v, cache)
        return self.o_proj(o.reshape(x.shape[0], -1)), cache

    def dense(self, x: jax.Array, inv_freq: np.ndarray) -> jax.Array:
        """Causal attention over whole sequences (within the layer's window, soft-capped if configured), no
        cache. x `[B, S, hidden]` -> `[B, S, hidden]`."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q, k, v = self._qkv(x, positions, inv_freq)
        g = self.num_q_heads // self.num_kv_heads
        qg = q.reshape(b, s, self.num_kv_heads, g, self.head_dim).astype(jnp.float32)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32))
        scores = scores / math.sqrt(self.head_dim) if self.scale is None else scores * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * jnp.tanh(scores / self.logits_soft_cap)
        query, key = np.arange(s)[:, None], np.arange(s)[None, :]
        visible = key <= query
        if self.sliding_window is not None:
            visible &= key > query - self.sliding_window
        probs = jax.nn.softmax(jnp.where(visible, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(o.reshape(b, s, -1))


class MLP(nnx.Module):
    """SwiGLU (Llama) or, with `gelu`, GeGLU with the tanh approximation of gelu (Gemma 2)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, gelu: bool = False):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, False, dtype, rngs)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False, dtype, rngs)
        self.gelu = gelu

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = self.gate_proj(x)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Llama: x += attn(norm(x)); x += mlp(norm(x)). Gemma 2 also normalizes each sub-block's output
    ("sandwich" norms): x += norm(attn(norm(x))); x += norm(mlp(norm(x))). The parameter names are Hugging
    Face's for either (Gemma 2's post_attention_layernorm is the norm after attention, not the one before the
    MLP)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        gemma = cfg.architecture == "gemma2"
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=gemma)
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer_index, dtype, rngs)
        self.post_attention_layernorm = norm()
        self.mlp = MLP(cfg, dtype, rngs, gelu=gemma)
        self.sandwich = gemma
        if gemma:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def __call__(self, x: jax.Array, attend) -> tuple[jax.Array, object]:
        """One block around `attend`, the paged or dense attention: normalized x -> (attention output, what
        else it returns: the cache). Returns (x, that)."""
        h, extra = attend(self.input_layernorm(x))
        if self.sandwich:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), extra
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), extra


class Llama(nnx.Module):
    """Decoder-only transformer. Parameter names mirror Hugging Face's `LlamaForCausalLM` (`Gemma2ForCausalLM`
    for `architecture="gemma2"`). A model of the public contract (`pagedjax.model.api`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, offset=cfg.architecture == "gemma2")
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype,
                                                                     rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int):
        """Megatron-style shardings by Hugging Face parameter name (`pagedjax.parallel.sharding`)."""
        return param_spec(names, self.config, tp)

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward. token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache)."""
        inv_freq = rope_inv_freq(self.config)
        x = self.embed(token_ids)
        for layer in self.layers:
            x, cache = layer(x, lambda h, layer=layer, cache=cache: layer.self_attn(h, positions, cache, inv_freq))
        return self.norm(x), cache

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """Token embeddings; Gemma 2 scales them by sqrt(hidden_size) rounded to the model's dtype first, as
        transformers does (in bf16 the factor is then not exactly the square root)."""
        x = self.embed_tokens(token_ids)
        if self.config.architecture == "gemma2":
            x = x * jnp.asarray(np.float32(math.sqrt(self.config.hidden_size)), x.dtype)
        return x

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., hidden]` -> float32 logits `[..., vocab]` (soft-capped if `final_logit_softcapping`)."""
        if self.lm_head is None:
            logits = _apply(self.embed_tokens.attend, hidden).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def forward_dense(self, token_ids: jax.Array) -> jax.Array:
        """Ground truth: token_ids `[B, S]` -> float32 logits `[B, S, vocab]`, causal (within each layer's
        window), no cache."""
        inv_freq = rope_inv_freq(self.config)
        x = self.embed(token_ids)
        for layer in self.layers:
            x, _ = layer(x, lambda h, layer=layer: (layer.self_attn.dense(h, inv_freq), None))
        return self.compute_logits(self.norm(x))


def init_model(cfg: ModelConfig, seed: int = 0) -> Llama:
    """A randomly initialised model (deterministic in `seed`)."""
    return Llama(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Llama:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: init_model(cfg))


def model_from_state(cfg: ModelConfig, state: nnx.State) -> Llama:
    """A `Llama` holding `state` (e.g. loaded weights) without first initialising random weights."""
    graphdef, _ = nnx.split(abstract_model(cfg))
    return nnx.merge(graphdef, state)
