"""Nemotron-H (`model_type` "nemotron_h", transformers' `NemotronHForCausalLM`): a hybrid decoder whose every layer is
ONE mixer, a Mamba-2 layer, an attention layer or a plain MLP (`layers_block_type`, or the legacy
`hybrid_override_pattern` string of "M", "*", "-"). A model of the public contract (`pagedjax.model.api`): the
Mamba-2 layers keep their SSM state and conv window as `RecurrentState` snapshots in the paged cache (a pool of
their own, snapshots valid at block boundaries: prefix hits, chunked prefill, preemption and forks stay exact, as
Qwen3-Next's DeltaNet layers), the attention layers K/V pages as any `FullAttention` layer; MLP layers hold no
cache (the spec's `kv_layers` are the Mamba-2 and attention layers, in order). What is here: the config
(`NemotronHConfig`, mapped from config.json by `config_from_hf`), the model (`NemotronH`) and its checkpoint names
(`tensor_names`); the weights are read by `load`.

The model, as transformers computes it (transformers 5.x, `models/nemotron_h/modeling_nemotron_h.py`, the PyTorch
path of the Mamba-2 mixer, not the CUDA kernels):
  - every layer: x += mixer(norm(x)), norm an RMSNorm `w * normed` with the product in float32, rounded once
    (`NemotronHRMSNorm`, w around 1); the final `norm_f` likewise; `embeddings`, then `lm_head` (or the tied
    embedding table);
  - "linear_attention" ("M"), the Mamba-2 mixer with H = `mamba_num_heads` heads of P = `mamba_head_dim`, state
    size N = `ssm_state_size`, G = `n_groups` groups of B / C, I = H * P: `in_proj` (bias: `use_bias`) gives
    [z `[I]` | xBC `[I + 2 G N]` | dt `[H]`]; xBC passes a causal depthwise conv1d of `conv_kernel` taps with a
    bias (`use_conv_bias`) and SiLU (`pagedjax.device.recurrent.causal_conv1d`), and splits into x `[H, P]`, B, C
    `[G, N]`; dt = softplus(dt + dt_bias) (float32 here), A = -exp(A_log); the SSD scan per head h (group
    h // (H / G)), state S `[P, N]` float32: S <- exp(dt A_h) S + dt x B^T, y = S C + D_h x
    (`pagedjax.device.recurrent.mamba2_ssd`); then the gated norm with the gate BEFORE the norm
    (`norm_before_gate=False`): y * silu(z) in float32, an RMSNorm over each of the G groups of I / G channels,
    times w (rounded to y's dtype first); `out_proj` (bias: `use_bias`);
  - "full_attention" ("*"): q / k / v / o projections without bias, GQA, scale head_dim^-0.5, causal, and no
    positional encoding at all (no RoPE: the Mamba-2 layers carry position);
  - "mlp" ("-"): `down_proj(relu(up_proj(x))^2)` (non-gated, relu2; bias: `mlp_bias`).
In 16-bit the scan's output is taken in x's dtype before the gated norm (transformers' chunked and one-token paths
differ there; in float32 they agree, and so does this).

Refused with a ValueError naming the field: "moe" ("E") layers, a model without an attention layer (the Mamba-2
layers learn the block size from an attention layer's pages), `mlp_hidden_act` other than relu2,
`mamba_hidden_act` other than silu, `time_step_limit` other than (0, inf) (transformers clamps dt in its chunked
scan but not in its one-token step), `mamba_ssm_cache_dtype` other than float32, `attention_bias` /
`mamba_proj_bias` true (transformers' layers have no such biases: it would drop the checkpoint's), `sliding_window`,
`quantization_config`, heads not a multiple of their groups, fields of the wrong type.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelSpec
from pagedjax.config.kv_spec import FullAttention, RecurrentState, StatePages
from pagedjax.config.parallel import TP
from pagedjax.device.recurrent import causal_conv1d, mamba2_ssd
from pagedjax.model.api import PagedAttention, PagedKVCache, forward_on_fresh_pages
from pagedjax.model.families import model_types_of
from pagedjax.model.layers.conv import Conv1d
from pagedjax.model.layers.linear import apply_linear
from pagedjax.model.llama import Linear
from pagedjax.model.loading.hf_fields import (
    checkpoint_dtype,
    flag,
    id_list,
    load_folder_config,
    number,
    optional_id,
    positive_int,
)
from pagedjax.model.loading.hf_loader import (
    IGNORED_SUFFIXES,
    fill_state,
    folder_tokenizer,
    hf_names,
    safetensors_files,
    tensor_headers,
)
from pagedjax.parallel.recurrent import over_heads

MODEL_TYPES = model_types_of(__name__)
LAYER_TYPES = ("linear_attention", "full_attention", "mlp")
# The legacy `hybrid_override_pattern`'s letters (NemotronHConfig._pattern_to_list); "E" (moe) is refused.
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
# Legacy names NemotronHConfig still reads (its __post_init__), new name -> old.
_ALIASES = dict(n_groups="mamba_n_groups", conv_kernel="mamba_d_conv", time_step_limit="mamba_dt_limit",
                use_conv_bias="mamba_conv_bias")
# NemotronHConfig's defaults of the fields a config.json may leave out.
_DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=4096, intermediate_size=21504, ssm_state_size=128, mamba_num_heads=128,
    mamba_head_dim=64, n_groups=8, conv_kernel=4, use_conv_bias=True, use_bias=False, mlp_bias=False,
    layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    layers_block_type=("linear_attention", "moe", "full_attention", "mlp"))


@dataclass(frozen=True)
class NemotronHConfig:
    """A Nemotron-H decoder (module docstring). `layer_types[i]`: "linear_attention" (Mamba-2), "full_attention"
    or "mlp"."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    layer_norm_epsilon: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_dim(self) -> int:
        """I: the scan's channels, H * P."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: [x | B | C]."""
        return self.mamba_dim + 2 * self.n_groups * self.ssm_state_size

    @property
    def state_spec(self) -> RecurrentState:
        """A Mamba-2 layer's snapshot: the SSM state `[H, P, N]` and the conv window `[conv_dim, K - 1]`."""
        return RecurrentState((self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size),
                              (self.conv_dim, self.conv_kernel - 1))

    @property
    def cache_layers(self) -> tuple[int, ...]:
        """The layers that hold a cache (Mamba-2 and attention), in order: the spec's `kv_layers`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t != "mlp")

    @property
    def spec(self) -> ModelSpec:
        attention = FullAttention(self.num_kv_heads, self.head_dim)
        layers = tuple(attention if self.layer_types[i] == "full_attention" else self.state_spec
                       for i in self.cache_layers)
        return ModelSpec(vocab_size=self.vocab_size, num_layers=len(layers), num_q_heads=self.num_heads,
                         kv_layers=layers, dtype=self.dtype, max_position_embeddings=self.max_position_embeddings,
                         eos_token_ids=self.eos_token_ids, bos_token_id=self.bos_token_id,
                         hidden_size=self.hidden_size)

    def replace(self, **changes) -> NemotronHConfig:
        return dataclasses.replace(self, **changes)


# ------------------------------------------------------------------------------------------------ config.json
def config_from_hf(hf: dict, dtype: str | None, gen_bos: int | None, gen_eos: tuple[int, ...]) -> NemotronHConfig:
    """The `NemotronHConfig` of a parsed nemotron_h `config.json` (the module docstring says what it maps and
    refuses); `dtype` overrides the checkpoint's, `gen_bos` / `gen_eos` (generation_config.json's) its stop tokens.
    ValueError naming the field."""
    hf = {**{new: hf[old] for new, old in _ALIASES.items() if old in hf and new not in hf}, **hf}
    d = _DEFAULTS
    if hf.get("quantization_config") is not None:
        raise ValueError("field 'quantization_config': pre-quantized nemotron_h checkpoints are not supported (load "
                         "a float one; quantization= quantizes it)")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu"), ("mamba_ssm_cache_dtype", "float32")):
        value = hf.get(key, want)
        if value != want:
            raise ValueError(f"field {key!r} = {value!r}: only {want!r} is supported for nemotron_h")
    for key in ("attention_bias", "mamba_proj_bias"):
        if flag(hf, key, False):
            raise ValueError(f"field {key!r} = true is not supported for nemotron_h (transformers' layers have no "
                             "such bias)")
    if hf.get("sliding_window") is not None:
        raise ValueError(f"field 'sliding_window' = {hf['sliding_window']!r}: nemotron_h's attention is full "
                         "(null only)")
    _time_step_limit(hf.get("time_step_limit"))
    kinds = _layer_types(hf)
    num_heads = positive_int(hf, "num_attention_heads", d["num_attention_heads"])
    num_kv = hf.get("num_key_value_heads")
    num_kv = num_heads if num_kv is None else positive_int(hf, "num_key_value_heads")
    if num_heads % num_kv:
        raise ValueError(f"'num_attention_heads' ({num_heads}) is not a multiple of 'num_key_value_heads' ({num_kv})")
    mamba_heads = positive_int(hf, "mamba_num_heads", d["mamba_num_heads"])
    groups = positive_int(hf, "n_groups", d["n_groups"])
    if mamba_heads % groups:
        raise ValueError(f"field 'n_groups' ({groups}) does not divide 'mamba_num_heads' ({mamba_heads})")
    kernel = positive_int(hf, "conv_kernel", d["conv_kernel"])
    if kernel < 2:
        raise ValueError(f"field 'conv_kernel' = {kernel}: a conv of one tap keeps no state (>= 2)")
    bos = gen_bos if gen_bos is not None else optional_id(hf.get("bos_token_id"), "bos_token_id")
    eos = gen_eos or id_list(hf.get("eos_token_id"), "eos_token_id")
    return NemotronHConfig(
        vocab_size=positive_int(hf, "vocab_size", d["vocab_size"]),
        hidden_size=positive_int(hf, "hidden_size", d["hidden_size"]), layer_types=kinds, num_heads=num_heads,
        num_kv_heads=num_kv, head_dim=positive_int(hf, "head_dim", d["head_dim"]),
        intermediate_size=positive_int(hf, "intermediate_size", d["intermediate_size"]),
        mamba_num_heads=mamba_heads, mamba_head_dim=positive_int(hf, "mamba_head_dim", d["mamba_head_dim"]),
        ssm_state_size=positive_int(hf, "ssm_state_size", d["ssm_state_size"]), n_groups=groups,
        conv_kernel=kernel, use_conv_bias=flag(hf, "use_conv_bias", d["use_conv_bias"]),
        use_bias=flag(hf, "use_bias", d["use_bias"]), mlp_bias=flag(hf, "mlp_bias", d["mlp_bias"]),
        layer_norm_epsilon=number(hf, "layer_norm_epsilon", d["layer_norm_epsilon"]),
        max_position_embeddings=positive_int(hf, "max_position_embeddings", d["max_position_embeddings"]),
        tie_word_embeddings=flag(hf, "tie_word_embeddings", d["tie_word_embeddings"]),
        dtype=checkpoint_dtype(hf, dtype), bos_token_id=bos, eos_token_ids=tuple(dict.fromkeys(eos)))


def _layer_types(hf: dict) -> tuple[str, ...]:
    """`layers_block_type` (or `layer_types`), else the legacy `hybrid_override_pattern`, else transformers'
    default; the number of layers is its length (transformers ignores `num_hidden_layers`)."""
    kinds = hf.get("layers_block_type", hf.get("layer_types"))
    field = "layers_block_type"
    if kinds is None and hf.get("hybrid_override_pattern") is not None:
        field, pattern = "hybrid_override_pattern", hf["hybrid_override_pattern"]
        if not isinstance(pattern, str) or not set(pattern) <= set(_PATTERN):
            raise ValueError(f"field 'hybrid_override_pattern': expected a string of {''.join(_PATTERN)}, got "
                             f"{pattern!r}")
        kinds = [_PATTERN[c] for c in pattern]
    if kinds is None:
        kinds = list(_DEFAULTS["layers_block_type"])
    if not isinstance(kinds, list | tuple) or not kinds or not all(isinstance(t, str) for t in kinds):
        raise ValueError(f"field {field!r}: expected a non-empty list of strings, got {kinds!r}")
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"field {field!r}: unsupported layer types {unknown} (supported: {', '.join(LAYER_TYPES)}; "
                         "pagedjax's nemotron_h has no 'moe' layers)")
    if "full_attention" not in kinds:
        raise ValueError(f"field {field!r}: no 'full_attention' layer; pagedjax's nemotron_h needs at least one")
    return tuple(kinds)


def _time_step_limit(value) -> None:
    """Only transformers' default (0, inf), as JSON writes it ([0.0, Infinity], or transformers'
    {"__float__": "Infinity"}) or absent."""
    if value is None:
        return
    as_float = lambda v: float(v["__float__"]) if isinstance(v, dict) and "__float__" in v else v  # noqa: E731
    try:
        low, high = (float(as_float(v)) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"field 'time_step_limit': expected [low, high], got {value!r}") from None
    if low > 0 or high != math.inf:
        raise ValueError(f"field 'time_step_limit' = {value!r}: only (0.0, inf) is supported for nemotron_h "
                         "(transformers clamps dt in its chunked scan but not in its one-token step)")


# ------------------------------------------------------------------------------------------------------ model
def _linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs, bias: bool = False) -> Linear:
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None  # 16-bit: accumulate in float32, round once
    return Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


class RMSNorm(nnx.Module):
    """`NemotronHRMSNorm`: `w * normed` with the product in float32, rounded to x's dtype once."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)


class GroupedGatedRMSNorm(nnx.Module):
    """`NemotronHRMSNormGated` (`norm_before_gate=False`): y * silu(z) in float32, an RMSNorm over each group of
    `dim / groups` channels, rounded to y's dtype, times w."""

    def __init__(self, dim: int, groups: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.groups, self.eps = groups, eps

    def __call__(self, y: jax.Array, z: jax.Array) -> jax.Array:
        h = y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        g = h.reshape(*h.shape[:-1], self.groups, -1)
        g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * g.reshape(h.shape).astype(y.dtype)


class Mamba2Mixer(nnx.Module):
    """A "linear_attention" layer (module docstring), its state in cache layer `cache_index`'s snapshots."""

    def __init__(self, cfg: NemotronHConfig, cache_index: int, dtype, rngs: nnx.Rngs):
        self.cache_index = cache_index
        self.h, self.p, self.n, self.g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size, cfg.n_groups
        dim = cfg.mamba_dim
        self.in_proj = _linear(cfg.hidden_size, dim + cfg.conv_dim + self.h, dtype, rngs, cfg.use_bias)
        self.conv1d = Conv1d(cfg.conv_dim, cfg.conv_kernel, dtype, rngs)
        if cfg.use_conv_bias:
            self.conv1d.bias = nnx.Param(jnp.zeros((cfg.conv_dim,), dtype))
        self.dt_bias = nnx.Param(jnp.ones((self.h,), dtype))
        self.A_log = nnx.Param(jnp.log(jnp.arange(1, self.h + 1, dtype=jnp.float32)).astype(dtype))
        self.D = nnx.Param(jnp.ones((self.h,), dtype))
        self.norm = GroupedGatedRMSNorm(dim, self.g, cfg.layer_norm_epsilon, dtype)
        self.out_proj = _linear(dim, cfg.hidden_size, dtype, rngs, cfg.use_bias)

    def _conv_params(self) -> tuple:
        """The conv's taps `[conv_dim, K]` and bias `[conv_dim]` (or None) as the channels of each head and group:
        x's `[H, P, ...]`, B's and C's `[G, N, ...]`."""
        dim, gn = self.h * self.p, self.g * self.n
        w = self.conv1d.weight[...][:, 0, :]
        bias = getattr(self.conv1d, "bias", None)
        parts = lambda a: (a[:dim].reshape(self.h, self.p, *a.shape[1:]),  # noqa: E731
                           a[dim:dim + gn].reshape(self.g, self.n, *a.shape[1:]),
                           a[dim + gn:].reshape(self.g, self.n, *a.shape[1:]))
        return (*parts(w), *((None,) * 3 if bias is None else parts(bias[...])))

    def __call__(self, x: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """x `[T, hidden]` -> (`[T, hidden]`, the cache with this layer's snapshots written). Under tensor
        parallelism the conv, the scan and the snapshots run per device over its heads and groups (`over_heads`),
        in_proj split by columns, the gated norm by groups and out_proj by rows (`NemotronH.param_partition`)."""
        t, i = x.shape[0], self.cache_index
        dim, gn = self.h * self.p, self.g * self.n
        z, xs, b, c, dt = jnp.split(self.in_proj(x), [dim, 2 * dim, 2 * dim + gn, 2 * dim + 2 * gn], axis=-1)
        core = functools.partial(_mamba2_core, block_size=cache.block_size_of(i), backend=cache.backend,
                                 decode_only=cache.decode_only)
        split = (xs.reshape(t, self.h, self.p), b.reshape(t, self.g, self.n), c.reshape(t, self.g, self.n), dt,
                 *self._conv_params(), self.dt_bias[...], self.A_log[...], self.D[...])
        if cache.mesh is None:
            y, pages = core(*split, cache.layer(i), cache.meta_of(i))
        else:
            y, pages = over_heads(core, cache.mesh, split, (1, 1, 1, 1) + (0,) * 9, (), cache.layer(i),
                                  cache.meta_of(i))
        return self.out_proj(self.norm(y.reshape(t, dim), z).astype(x.dtype)), cache.with_layer(i, pages)


def _mamba2_core(xs, b, c, dt, w_x, w_b, w_c, bias_x, bias_b, bias_c, dt_bias, A_log, D, pages: StatePages, meta, *,
                 block_size: int, backend: str, decode_only: bool) -> tuple[jax.Array, StatePages]:
    """The Mamba-2 mixer of the heads and groups given (all, or one device's): the causal conv over their
    [x | B | C] channels with bias and SiLU, dt = softplus(dt + dt_bias), A = -exp(A_log), the SSD scan with D;
    -> (y `[T, H, P]`, the pages with this step's snapshots written)."""
    t, h, p = xs.shape
    g, n = b.shape[1:]
    mixed = jnp.concatenate([xs.reshape(t, -1), b.reshape(t, -1), c.reshape(t, -1)], axis=-1)
    kernel = w_x.shape[-1]
    weight = jnp.concatenate([w.reshape(-1, kernel) for w in (w_x, w_b, w_c)])
    bias = None if bias_x is None else jnp.concatenate([a.reshape(-1) for a in (bias_x, bias_b, bias_c)])
    mixed, conv_pages = causal_conv1d(mixed, weight, pages.conv, meta, block_size=block_size, backend=backend,
                                      decode_only=decode_only, activation="silu", bias=bias)
    xs, b, c = jnp.split(mixed, [h * p, h * p + g * n], axis=-1)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    a = -jnp.exp(A_log.astype(jnp.float32))
    y, state = mamba2_ssd(xs.reshape(t, h, p), dt, a, b.reshape(t, g, n), c.reshape(t, g, n), pages.recurrent, meta,
                          block_size=block_size, backend=backend, decode_only=decode_only, D=D)
    return y, StatePages(state, conv_pages)


class Attention(nnx.Module):
    """A "full_attention" layer (module docstring): GQA without positional encoding."""

    def __init__(self, cfg: NemotronHConfig, cache_index: int, dtype, rngs: nnx.Rngs):
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = _linear(h, cfg.num_heads * d, dtype, rngs)
        self.k_proj = _linear(h, cfg.num_kv_heads * d, dtype, rngs)
        self.v_proj = _linear(h, cfg.num_kv_heads * d, dtype, rngs)
        self.o_proj = _linear(cfg.num_heads * d, h, dtype, rngs)
        self.paged = PagedAttention(cache_index, num_q_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                                    head_dim=d)

    def __call__(self, x: jax.Array, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        t, d = x.shape[0], self.head_dim
        q = self.q_proj(x).reshape(t, self.num_heads, d)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, d)
        v = self.v_proj(x).reshape(t, self.num_kv_heads, d)
        o, cache = self.paged(q, k, v, cache)
        return self.o_proj(o.reshape(t, -1)), cache


class ReluSquaredMLP(nnx.Module):
    """An "mlp" layer: `down_proj(relu(up_proj(x))^2)`."""

    def __init__(self, cfg: NemotronHConfig, dtype, rngs: nnx.Rngs):
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs, cfg.mlp_bias)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs, cfg.mlp_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jnp.square(jax.nn.relu(self.up_proj(x))))


class Block(nnx.Module):
    """`NemotronHBlock`: x + mixer(norm(x))."""

    def __init__(self, cfg: NemotronHConfig, layer_index: int, dtype, rngs: nnx.Rngs):
        self.kind = cfg.layer_types[layer_index]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)
        cache_index = cfg.cache_layers.index(layer_index) if self.kind != "mlp" else None
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(cfg, cache_index, dtype, rngs)
        elif self.kind == "full_attention":
            self.mixer = Attention(cfg, cache_index, dtype, rngs)
        else:
            self.mixer = ReluSquaredMLP(cfg, dtype, rngs)

    def __call__(self, x, cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        h = self.norm(x)
        if self.kind == "linear_attention":
            h, cache = self.mixer(h, cache)
        elif self.kind == "full_attention":
            h, cache = self.mixer(h, cache)
        else:
            h = self.mixer(h)
        return x + h, cache


class NemotronH(nnx.Module):
    """Nemotron-H (module docstring). Parameter names mirror transformers' `NemotronHForCausalLM` (minus
    `model.`); linear kernels are `[in, out]`."""

    def __init__(self, cfg: NemotronHConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.config = cfg
        self.embeddings = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, param_dtype=dtype, rngs=rngs)
        self.layers = nnx.List([Block(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _linear(cfg.hidden_size, cfg.vocab_size, dtype, rngs)

    @property
    def spec(self) -> ModelSpec:
        return self.config.spec

    def param_partition(self, names: tuple, tp: int) -> P | None:
        """Tensor parallelism over the Mamba-2 layers' heads and groups (`pagedjax.parallel.recurrent`): `in_proj`
        split by output columns (its [z | x | B | C | dt] parts are taken by heads and groups from them), the gated
        norm's weight by groups of channels, `out_proj` by input rows, `A_log` / `D` / `dt_bias` by heads; the conv's
        taps and bias (`[conv_dim, ...]`, a few KiB, in [x | B | C] order: each device takes its heads' and groups'
        channels) whole on every device. Attention and MLP layers by the default rule. ValueError unless tp
        divides the groups (`n_groups`: each device's heads read only its own groups) and the heads."""
        if tp == 1 or "mixer" not in names:
            return None
        module, leaf = str(names[-2]), str(names[-1])
        if module not in ("in_proj", "out_proj", "conv1d", "norm") and leaf not in ("A_log", "D", "dt_bias"):
            return None  # an attention or MLP layer's
        cfg = self.config
        for field, n in (("n_groups", cfg.n_groups), ("mamba_num_heads", cfg.mamba_num_heads)):
            if n % tp:
                raise ValueError(f"tensor_parallel_size {tp} must divide {field!r} ({n}): the Mamba-2 layers are "
                                 "split by heads and groups")
        if module == "in_proj":
            return P(None, TP) if leaf == "kernel" else P(TP)
        if module == "out_proj":
            return P(TP, None) if leaf == "kernel" else P()
        if module == "norm" or leaf in ("A_log", "D", "dt_bias"):
            return P(TP)
        return P()

    def __call__(self, token_ids: jax.Array, positions: jax.Array,
                 cache: PagedKVCache) -> tuple[jax.Array, PagedKVCache]:
        """Serving forward: token_ids, positions int32 `[T]` -> (final hidden states `[T, hidden]`, cache).
        Positions are unused (no positional encoding)."""
        del positions
        x = self.embeddings(token_ids)
        for layer in self.layers:
            x, cache = layer(x, cache)
        return self.norm_f(x), cache

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        if self.lm_head is None:
            return apply_linear(self.embeddings.attend, hidden).astype(jnp.float32)
        return self.lm_head(hidden).astype(jnp.float32)

    def forward_dense(self, token_ids: jax.Array, block_size: int = 8) -> jax.Array:
        """Whole sequences token_ids `[B, S]` -> float32 logits `[B, S, vocab]` (`api.forward_on_fresh_pages`)."""
        return forward_on_fresh_pages(self, token_ids, block_size)


def init_nemotron_h(cfg: NemotronHConfig, seed: int = 0) -> NemotronH:
    return NemotronH(cfg, rngs=nnx.Rngs(seed))


def abstract_nemotron_h(cfg: NemotronHConfig) -> NemotronH:
    """The model's structure with `jax.ShapeDtypeStruct` leaves: nothing is allocated."""
    return nnx.eval_shape(lambda: init_nemotron_h(cfg))


def nemotron_h_from_state(cfg: NemotronHConfig, state: nnx.State) -> NemotronH:
    graphdef, _ = nnx.split(abstract_nemotron_h(cfg))
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------- weights
def tensor_names(path: tuple) -> list[tuple[str, bool, None]] | None:
    """A parameter's checkpoint tensor where Nemotron-H names it other than the Llama family's rule
    (`hf_loader.hf_names`): the mixer's `A_log`, `D` and `dt_bias` as stored; None for every other parameter."""
    *mods, leaf = (str(p) for p in path)
    if leaf in ("A_log", "D", "dt_bias"):
        return [("model." + ".".join(mods + [leaf]), False, None)]
    return None


def load_config(path: str | os.PathLike, dtype: str | None = None) -> NemotronHConfig:
    """Map a Nemotron-H Hugging Face folder's `config.json` (and `generation_config.json`'s stop tokens) to a
    `NemotronHConfig` (`config_from_hf`: what it maps and refuses); `dtype` overrides the checkpoint's.
    ModelLoadError naming the file and field."""
    return load_folder_config(path, lambda hf, bos, eos: config_from_hf(hf, dtype, bos, eos))


def load(path: str | os.PathLike, dtype: str | None = None):
    """(`NemotronH` holding the folder's weights, tokenizer or None) of a
    Nemotron-H Hugging Face folder (float weights, in the checkpoint's dtype or `dtype`): the built-in factory of
    `model_type` "nemotron_h" (`pagedjax.model.loading.loader.load_registered`). Tensors are named by the Llama
    family's rule (`hf_names`) and `tensor_names` (`A_log`, `D`, `dt_bias`), under `backbone.` as
    NVIDIA's checkpoints and transformers' `save_pretrained` write them, or `model.` (transformers reads both); the
    multi-token-prediction tensors (`mtp.*`) are not read, as transformers does not."""
    cfg = load_config(path, dtype)
    stored = (name for _, name, _, _ in tensor_headers(safetensors_files(path)))
    prefix = "backbone." if any(name.startswith("backbone.") for name in stored) else "model."

    def skip(name: str) -> bool:
        return name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and cfg.tie_word_embeddings) or (
            name.startswith("mtp."))

    def names(p, shape):
        return [(prefix + n.removeprefix("model.") if n.startswith("model.") else n, t, e)
                for n, t, e in tensor_names(p) or hf_names(p, shape)]

    state = fill_state(path, lambda: nnx.split(abstract_nemotron_h(cfg))[1], names, skip=skip)
    return nemotron_h_from_state(cfg, state), folder_tokenizer(path, cfg.eos_token_ids, cfg.bos_token_id)
