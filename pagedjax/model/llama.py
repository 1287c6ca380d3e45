"""A Llama-family decoder in Flax NNX (Llama 2/3, Mistral, Qwen2/3, Phi-3, OLMo 2 shapes): RMSNorm, RoPE,
SwiGLU, GQA/MQA/MHA; and its Gemma variant (`ModelConfig.architecture == "gemma2"`, Gemma 2 and 3): (1 + w)
RMSNorm, GeGLU, sandwich norms, scaled embeddings. Orthogonal options (`ModelConfig`): per-layer sliding windows,
soft-capped attention and output logits, q/k norms (per head or over the whole projection), where the block
normalizes (before, around or after each sub-block), a separate RoPE base for windowed layers, attention sinks and
an o_proj bias (gpt-oss), mixture-of-experts MLPs (`ModelConfig.moe`: Mixtral, Qwen3-MoE, gpt-oss;
`pagedjax.model.layers.moe`).

Two forwards share the same weights:
  `__call__`      the serving path: a ragged batch of tokens `[num_tokens]`, new K/V written into the paged
                  cache by slot mapping, attention through the paged kernels.
  `forward_dense` the ground truth: whole sequences `[batch, seq]`, causal attention, no cache at all.

Conventions follow Hugging Face's so that its checkpoints load by name without permuting weights: RoPE rotates
halves (`pagedjax.model.layers.rope`), linear kernels are stored `[in, out]` (HF's weights transposed), q/k/v and
gate/up are separate projections (fused checkpoints are split by the loader).
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config import ModelConfig, ModelSpec
from pagedjax.config.quant import QuantConfig
from pagedjax.model.api import ImageEmbeds, PagedAttention, PagedKVCache
from pagedjax.model.layers.linear import apply_linear as _apply
from pagedjax.model.layers.lora import LayerLoRA, LoRABatch, with_lora
from pagedjax.model.layers.moe import Experts, per_expert_params
from pagedjax.model.layers.moe_quant import (
    QuantizedExperts,
    check_expert_shapes,
    moe_mlp,
    quantize_experts,
    quantizes_experts,
)
from pagedjax.model.layers.quant import QuantizedLinear, quantize_model
from pagedjax.model.layers.quant import shapes as quant_shapes
from pagedjax.model.layers.rope import layer_rope
from pagedjax.parallel.sharding import param_spec


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


logger = logging.getLogger(__name__)

# What `QuantConfig.keep_float` may name in a built-in model: its linear modules' attribute names, and a MoE
# layer's experts (`pagedjax.model.layers.moe_quant`).
KEEP_FLOAT_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head",
                    "experts")


def _check_keep_float(cfg: ModelConfig) -> None:
    """A `keep_float` name that is no module of the built-in models (a typo would quantize what it meant to keep
    float) is a ValueError; asking for the LM head quantized (no "lm_head") where the head is the tied embedding
    table, which is never quantized, logs a warning."""
    quant = cfg.quantization
    if quant is None:
        return
    unknown = [name for name in quant.keep_float if name not in KEEP_FLOAT_NAMES]
    if unknown:
        raise ValueError(f"QuantConfig.keep_float names no module of the built-in models: {unknown} (the "
                         f"quantizable ones: {', '.join(KEEP_FLOAT_NAMES)})")
    if cfg.tie_word_embeddings and "lm_head" not in quant.keep_float:
        logger.warning("QuantConfig.keep_float leaves out 'lm_head', but this model's LM head is its tied embedding "
                       "table, which is never quantized: the head stays float")


def _linear(n_in: int, n_out: int, bias: bool, dtype, rngs: nnx.Rngs, quant: QuantConfig | None = None,
            name: str = "") -> Linear | QuantizedLinear:
    """A float `Linear`, or with `quant` (`ModelConfig.quantization`) unless it keeps module `name` in float, a
    `QuantizedLinear` of a random float kernel."""
    if quant is not None and name not in quant.keep_float:
        kernel = nnx.initializers.lecun_normal()(rngs.params(), (n_in, n_out), jnp.float32)
        return QuantizedLinear(kernel, jnp.zeros((n_out,), dtype) if bias else None, quant=quant, dtype=dtype,
                               name=name)
    # 16-bit layers accumulate in float32 and round once (`_apply`): a bf16 x bf16 -> bf16 dot makes XLA:CPU
    # convert the whole weight to float32 on every call.
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


def _norm_factory(cfg: ModelConfig, dtype):
    """dim -> an RMSNorm of the architecture's kind (Gemma's (1 + w) for "gemma2")."""
    return functools.partial(RMSNorm, eps=cfg.rms_norm_eps, dtype=dtype, offset=cfg.architecture == "gemma2")


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        q = cfg.quantization
        self.q_proj = _linear(h, cfg.num_q_heads * d, cfg.qkv_bias, dtype, rngs, q, "q_proj")
        self.k_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs, q, "k_proj")
        self.v_proj = _linear(h, cfg.num_kv_heads * d, cfg.qkv_bias, dtype, rngs, q, "v_proj")
        self.o_proj = _linear(cfg.num_q_heads * d, h, cfg.o_proj_bias, dtype, rngs, q, "o_proj")
        # One learned logit per query head in the softmax's denominator (`ModelConfig.attention_sinks`).
        self.sinks = nnx.Param(jnp.zeros((cfg.num_q_heads,), dtype)) if cfg.attention_sinks else None
        self.num_q_heads, self.num_kv_heads, self.head_dim = cfg.num_q_heads, cfg.num_kv_heads, d
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            norm = _norm_factory(cfg, dtype)
            per_head = cfg.qk_norm == "head"
            self.q_norm = norm(d if per_head else cfg.num_q_heads * d)
            self.k_norm = norm(d if per_head else cfg.num_kv_heads * d)
        # Static per-layer variants (None = unused: the kernels then compile their plain path).
        self.rope = layer_rope(cfg, layer_index)
        self.sliding_window = None if cfg.sliding_windows is None else cfg.sliding_windows[layer_index]
        self.logits_soft_cap = cfg.attn_logit_softcapping
        self.scale = cfg.attention_scale
        self.paged = PagedAttention(layer_index, num_q_heads=cfg.num_q_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=d, scale=self.scale, sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap, bidirectional=cfg.bidirectional)
        self.bidirectional = cfg.bidirectional

    def _qkv(self, x: jax.Array, positions: jax.Array, lora: LayerLoRA | None = None):
        lead = x.shape[:-1]
        q, k, v = (with_lora(self.q_proj, "q_proj", x, lora), with_lora(self.k_proj, "k_proj", x, lora),
                   with_lora(self.v_proj, "v_proj", x, lora))
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(*lead, self.num_q_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rope(q, positions), self.rope(k, positions), v

    def __call__(self, x, positions, cache: PagedKVCache,
                 lora: LayerLoRA | None = None) -> tuple[jax.Array, PagedKVCache]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's K/V written): the projections, q/k
        norms, RoPE, one paged attention call (`pagedjax.model.api.PagedAttention`), the output projection;
        with `lora`, each projection plus its token's adapter (`pagedjax.model.layers.lora`)."""
        q, k, v = self._qkv(x, positions, lora)
        o, cache = self.paged(q, k, v, cache, sinks=self.sinks)
        return with_lora(self.o_proj, "o_proj", o.reshape(x.shape[0], -1), lora), cache

    def dense(self, x: jax.Array, groups: jax.Array | None = None) -> jax.Array:
        """Causal attention over whole sequences (within the layer's window, soft-capped if configured, with
        the sinks' logits in the softmax's denominator if it has them), no cache. x `[B, S, hidden]` -> `[B, S,
        hidden]`. `groups` int32 `[B, S]`: tokens of one group >= 0 (an image's
        placeholders) also see each other's later positions, within the window (transformers' `token_type_ids`
        mask: (causal or same group) and in the window); -1: causal only. A bidirectional model's tokens see every
        token of their sequence (within W - 1 positions either way with a window W)."""
        b, s, _ = x.shape
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
        q, k, v = self._qkv(x, positions)
        g = self.num_q_heads // self.num_kv_heads
        qg = q.reshape(b, s, self.num_kv_heads, g, self.head_dim).astype(jnp.float32)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", qg, k.astype(jnp.float32))
        scores = scores / math.sqrt(self.head_dim) if self.scale is None else scores * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * jnp.tanh(scores / self.logits_soft_cap)
        query, key = np.arange(s)[:, None], np.arange(s)[None, :]
        visible = np.ones((s, s), bool) if self.bidirectional else key <= query
        if self.bidirectional and self.sliding_window is not None:
            visible &= key < query + self.sliding_window
        if groups is not None:  # [B, 1, 1, S, S], as scores' [B, kv heads, group, S, S]
            same = (groups[:, :, None] == groups[:, None, :]) & (groups[:, :, None] >= 0)
            visible = (visible | same)[:, None, None]
        if self.sliding_window is not None:
            visible &= key > query - self.sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        if self.sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:  # query head h = kv head * g + its index in the group: each sink a column of its own, then dropped
            sink = self.sinks[...].astype(jnp.float32).reshape(1, self.num_kv_heads, g, 1, 1)
            sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        o = jnp.einsum("bkgqs,bskd->bqkgd", probs, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(o.reshape(b, s, -1))


class MLP(nnx.Module):
    """SwiGLU (Llama) or, with `gelu`, GeGLU with the tanh approximation of gelu (Gemma)."""

    def __init__(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs, *, gelu: bool = False):
        h, w, q = cfg.hidden_size, cfg.intermediate_size, cfg.quantization
        self.gate_proj = _linear(h, w, False, dtype, rngs, q, "gate_proj")
        self.up_proj = _linear(h, w, False, dtype, rngs, q, "up_proj")
        self.down_proj = _linear(w, h, False, dtype, rngs, q, "down_proj")
        self.gelu = gelu

    def __call__(self, x: jax.Array, lora: LayerLoRA | None = None) -> jax.Array:
        gate = with_lora(self.gate_proj, "gate_proj", x, lora)
        gate = jax.nn.gelu(gate, approximate=True) if self.gelu else jax.nn.silu(gate)
        return with_lora(self.down_proj, "down_proj", gate * with_lora(self.up_proj, "up_proj", x, lora), lora)


class DecoderLayer(nnx.Module):
    """Attention and MLP sub-blocks on the residual stream, normalized as `ModelConfig.block_norms` says; only
    that placement's norms exist, under Hugging Face's names:
      "pre"       x += attn(input_layernorm(x)); x += mlp(post_attention_layernorm(x))          (Llama)
      "sandwich"  x += post_attention_layernorm(attn(input_layernorm(x)));
                  x += post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))            (Gemma 2, 3)
      "post"      x += post_attention_layernorm(attn(x)); x += post_feedforward_layernorm(mlp(x))  (OLMo 2)
    """

    def __init__(self, cfg: ModelConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        norm = functools.partial(_norm_factory(cfg, dtype), cfg.hidden_size)
        self.placement = cfg.block_norms
        if self.placement != "post":
            self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer_index, dtype, rngs)
        self.post_attention_layernorm = norm()
        if cfg.moe is None:
            self.mlp = MLP(cfg, dtype, rngs, gelu=cfg.architecture == "gemma2")
        else:
            self.mlp = moe_mlp(cfg, dtype, rngs)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm()

    def __call__(self, x: jax.Array, attend, mlp=None) -> tuple[jax.Array, object]:
        """One block around `attend`, the paged or dense attention: its input -> (attention output, what else
        it returns: the cache). Returns (x, that). `mlp`: what computes the MLP sub-block instead of `self.mlp`
        (the dense path's reference for mixture-of-experts layers)."""
        mlp = self.mlp if mlp is None else mlp
        if self.placement == "pre":
            h, extra = attend(self.input_layernorm(x))
            x = x + h
            return x + mlp(self.post_attention_layernorm(x)), extra
        h, extra = attend(x if self.placement == "post" else self.input_layernorm(x))
        x = x + self.post_attention_layernorm(h)
        h = mlp(x if self.placement == "post" else self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), extra


class Llama(nnx.Module):
    """Decoder-only transformer. Parameter names mirror Hugging Face's `LlamaForCausalLM` (and the other
    families' own: `Gemma2ForCausalLM`'s extra norms, Qwen3's q_norm / k_norm, ...). A model of the public
    contract (`pagedjax.model.api`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        _check_keep_float(cfg)
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm = _norm_factory(cfg, dtype)(cfg.hidden_size)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, False, dtype,
                                                                     rngs, cfg.quantization, "lm_head")

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def single_device_params(self, state: nnx.State) -> nnx.State:
        """The parameters `state` as this model's steps on one CPU device take them: each mixture-of-experts
        layer's experts as separate arrays (`pagedjax.model.layers.moe.per_expert_params`: from the stacked ones XLA:CPU
        copies each routed expert's weights every decode step); `state` itself for a dense model or off the CPU."""
        if self.config.moe is None or jax.default_backend() != "cpu":
            return state
        return per_expert_params(state)

    def param_partition(self, names: tuple, tp: int):
        """Megatron-style shardings by Hugging Face parameter name (`pagedjax.parallel.sharding`)."""
        return param_spec(names, self.config, tp)

    def __call__(self, token_ids: jax.Array, positions: jax.Array, cache: PagedKVCache,
                 lora: LoRABatch | None = None, images: ImageEmbeds | None = None) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward. token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache).
        `lora`: the step's adapters, each token's own on every target linear (dense MLPs only: the engine
        refuses LoRA for mixture-of-experts models). `images`: image features in place of placeholder tokens'
        embeddings (`embed`; the vision-language models, `pagedjax.model.multimodal.vlm`)."""
        x = self.embed(token_ids, images)
        for i, layer in enumerate(self.layers):
            ll = None if lora is None else lora.layer(i)
            mlp = None if ll is None else functools.partial(layer.mlp, lora=ll)
            x, cache = layer(x, lambda h, layer=layer, cache=cache, ll=ll: layer.self_attn(h, positions, cache, ll),
                             mlp)
        return self.norm(x), cache

    def embed(self, token_ids: jax.Array, images: ImageEmbeds | None = None) -> jax.Array:
        """Token embeddings; Gemma scales them by sqrt(hidden_size) rounded to the model's dtype first, as
        transformers does (in bf16 the factor is then not exactly the square root). With `images`, the rows it
        names replace their tokens' embeddings after that scaling (unscaled, as transformers' vision-language
        models put image features into the scaled input embeddings): the one place image features enter."""
        x = self.embed_tokens(token_ids)
        if self.config.architecture == "gemma2":
            x = x * jnp.asarray(np.float32(math.sqrt(self.config.hidden_size)), x.dtype)
        return x if images is None else images.merge(x)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """`[..., hidden]` -> float32 logits `[..., vocab]` (soft-capped if `final_logit_softcapping`)."""
        if self.lm_head is None:
            logits = _apply(self.embed_tokens.attend, hidden).astype(jnp.float32)
        else:
            logits = self.lm_head(hidden).astype(jnp.float32)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def forward_dense(self, token_ids: jax.Array, *, images: ImageEmbeds | None = None,
                      groups: jax.Array | None = None) -> jax.Array:
        """Ground truth: token_ids `[B, S]` -> float32 logits `[B, S, vocab]`, causal (within each layer's
        window), no cache; mixture-of-experts layers by their reference computation (`MoEMLP.dense`). `images`
        (index `[B, S]`): image features in place of their placeholders' embeddings (`embed`); `groups` int32
        `[B, S]`: tokens of one group >= 0 attend to each other both ways (`Attention.dense`)."""
        return self.compute_logits(self._dense(token_ids, None, images, groups))

    def hidden_dense(self, token_ids: jax.Array) -> jax.Array:
        """Ground truth of pooling: token_ids `[B, S]` -> the final hidden states `[B, S, hidden]` (after the final
        norm, what `__call__` returns and embeddings pool), computed as `forward_dense` computes them."""
        return self._dense(token_ids, None)

    def tokens_per_expert(self, token_ids: jax.Array) -> jax.Array:
        """Router statistics of a mixture-of-experts model: how many of `token_ids` `[B, S]` (each counted k
        times, once per slot) each layer routes to each expert, int32 `[num_layers, num_experts]`. A dense
        forward (`forward_dense`) that records the routing: for benchmarks and analysis, not the serving path."""
        if self.config.moe is None:
            raise ValueError("tokens_per_expert: this model has no mixture-of-experts layers (ModelConfig.moe)")
        counts: list[jax.Array] = []
        self._dense(token_ids, counts)
        return jnp.stack(counts)

    def _dense(self, token_ids: jax.Array, counts: list | None, images: ImageEmbeds | None = None,
               groups: jax.Array | None = None) -> jax.Array:
        x = self.embed(token_ids, images)
        for layer in self.layers:
            mlp = None if self.config.moe is None else functools.partial(layer.mlp.dense, counts=counts)
            x, _ = layer(x, lambda h, layer=layer: (layer.self_attn.dense(h, groups), None), mlp)
        return self.norm(x)


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


def quantize_params(cfg: ModelConfig, state: nnx.State, quant) -> tuple[ModelConfig, nnx.State]:
    """Float parameters of `Llama(cfg)` -> (the config with `quantization=quant`, the parameters of that model):
    each linear layer the quantized model holds as a `QuantizedLinear` quantized from its float kernel, and each
    MoE layer's experts as `QuantizedExperts` (`pagedjax.model.layers.moe_quant`) unless `keep_float` names "experts"
    (the MoE router, the embeddings and the `keep_float` layers are kept as they are). ValueError naming the
    tensor's path when int4's group size does not divide a quantized kernel's input dimension."""
    if cfg.quantization is not None:
        raise ValueError(f"quantize_params: the model is quantized already ({cfg.quantization.name})")
    qcfg = cfg.replace(quantization=quant)
    model = model_from_state(cfg, state)
    for path, node in nnx.iter_graph(model):  # errors name the whole path, not just the module
        if isinstance(node, nnx.Linear) and str(path[-1]) not in qcfg.quantization.keep_float:
            quant_shapes(qcfg.quantization, node.in_features, node.out_features, ".".join(map(str, path)))
        elif isinstance(node, Experts) and quantizes_experts(qcfg.quantization):
            check_expert_shapes(qcfg.quantization, node, ".".join(map(str, path)))
    abstract = list(nnx.iter_graph(abstract_model(qcfg)))
    model = quantize_experts(model, qcfg.quantization,
                             {tuple(p) for p, node in abstract if isinstance(node, QuantizedExperts)})
    paths = {tuple(p) for p, node in abstract if isinstance(node, QuantizedLinear)}
    model = quantize_model(model, qcfg.quantization, paths)
    return qcfg, nnx.state(model, nnx.Param)
