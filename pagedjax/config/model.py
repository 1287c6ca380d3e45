"""The model's configuration: `ModelSpec` (what the engine needs of any model) and `ModelConfig` (the
built-in decoders' shape).

Plain Python, no JAX: the host side (`pagedjax.core`) imports this too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass

from pagedjax.config.fields import DTYPE_BYTES, check_bool, check_choice, check_float, check_int, describe
from pagedjax.config.kv_layout import KVCacheLayout, kv_cache_layout
from pagedjax.config.kv_spec import FullAttention, KVCacheSpec, KVLayerSpec
from pagedjax.config.moe import MoEConfig
from pagedjax.config.multimodal import ImageSpec
from pagedjax.config.quant import QuantConfig

# RoPE scaling types pagedjax computes exactly, each with the parameters it needs (besides "rope_type"). This is
# the one list: `ModelConfig` checks `rope_scaling` against it and the Hugging Face loader maps configs by it.
# "longrope" is LongRoPE (Phi-3) within its original context: frequencies divided by the per-frequency
# `short_factor`, cos and sin scaled by `attention_factor`. Its long factors, which transformers switches to once a
# sequence outgrows `original_max_position_embeddings`, are not implemented, so `ModelConfig` requires
# max_position_embeddings <= original_max_position_embeddings: no position pagedjax serves would need them.
# "yarn" is YaRN as transformers computes it for the Llama-shaped families (`pagedjax.model.layers.yarn`: blended
# frequencies, cos and sin scaled by its attention factor; the attention scores' scale unchanged), with its optional
# parameters in `ROPE_OPTIONAL_PARAMS`.
ROPE_SCALING_PARAMS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "attention_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}
ROPE_TYPES: tuple[str, ...] = tuple(ROPE_SCALING_PARAMS)
# The parameters a type may have besides those it needs, each defaulted as transformers does when absent
# ("yarn": `pagedjax.model.layers.yarn`; "truncate" is a bool, true when absent); any other is a ValueError.
ROPE_OPTIONAL_PARAMS: dict[str, tuple[str, ...]] = {
    "yarn": ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"),
}
_ROPE_VECTOR_PARAMS = ("short_factor",)  # one number per rotated frequency; every other parameter is one number
_ROPE_BOOL_PARAMS = ("truncate",)


def _dtype_field(owner: str, name: str, value, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{owner}.{name} must be a dtype name such as 'float32', got {describe(value)}")
    if value not in DTYPE_BYTES:
        raise ValueError(f"{owner}.{name}: unsupported dtype {value!r}; expected one of {sorted(DTYPE_BYTES)}")
    return value


def _rope_scaling_field(value) -> tuple[tuple[str, float | str], ...] | None:
    """None, a dict or pairs -> a sorted tuple of pairs (hashable), checked against `ROPE_SCALING_PARAMS`."""
    owner = "ModelConfig.rope_scaling"
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, tuple | list) and all(isinstance(p, tuple | list) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise TypeError(f"{owner} must be None, a dict or (name, value) pairs, got {describe(value)}")
    if not items:
        return None
    params: dict[str, float | str] = {}
    for key, v in items:
        if not isinstance(key, str):
            raise TypeError(f"{owner}: keys must be strings, got {describe(key)}")
        if key in ("rope_type", "type"):
            if not isinstance(v, str):
                raise TypeError(f"{owner}.{key} must be a string, got {describe(v)}")
        elif key in _ROPE_BOOL_PARAMS:
            v = check_bool(owner, key, v)
        elif key in _ROPE_VECTOR_PARAMS:
            if isinstance(v, str) or not isinstance(v, tuple | list) or not v:
                raise TypeError(f"{owner}.{key} must be a non-empty list of numbers, got {describe(v)}")
            v = tuple(check_float(owner, f"{key}[{i}]", x, positive=True) for i, x in enumerate(v))
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{owner}.{key} must be a number, got {describe(v)}")
        params[key] = v
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_SCALING_PARAMS:
        raise ValueError(f"{owner}: rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    missing = [k for k in ROPE_SCALING_PARAMS[kind] if k not in params]
    if missing:
        raise ValueError(f"{owner}: rope type {kind!r} needs {', '.join(map(repr, missing))}")
    if kind in ROPE_OPTIONAL_PARAMS:
        known = {"rope_type", "type", *ROPE_SCALING_PARAMS[kind], *ROPE_OPTIONAL_PARAMS[kind]}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"{owner}: rope type {kind!r} has no parameters {unknown} (it takes "
                             f"{', '.join(ROPE_SCALING_PARAMS[kind] + ROPE_OPTIONAL_PARAMS[kind])})")
    return tuple(sorted(params.items()))


# Decoder architectures `pagedjax.model.llama` computes. "llama": RMSNorm scaled by w, SwiGLU, pre-norm blocks
# (Llama 2/3, Mistral, Qwen2/3, Phi-3, OLMo 2). "gemma2": RMSNorm scaled by (1 + w) in float32, GeGLU (tanh gelu),
# a norm after attention and around the MLP too ("sandwich" norms), embeddings scaled by sqrt(hidden_size)
# (Gemma 2 and 3).
ARCHITECTURES: tuple[str, ...] = ("llama", "gemma2")
# Where a decoder block normalizes (`ModelConfig.norm_placement`; `pagedjax.model.llama.DecoderLayer` has the
# formulas): before each sub-block (Llama), before and after each (Gemma 2 and 3), after each (OLMo 2).
NORM_PLACEMENTS: tuple[str, ...] = ("pre", "sandwich", "post")
_ARCHITECTURE_NORMS = {"llama": "pre", "gemma2": "sandwich"}
# RMSNorm of queries and keys before RoPE (`ModelConfig.qk_norm`): "head" over each head's head_dim (Qwen3,
# Gemma 3), "full" over the whole projection, num_heads * head_dim (OLMo 2).
QK_NORMS: tuple[str, ...] = ("head", "full")


def _sliding_windows_field(value, num_layers: int, owner: str = "ModelConfig") -> tuple[int | None, ...] | None:
    """None, or one window (an int >= 1, or None for a global layer) per layer, as a tuple. A list of only
    Nones is stored as None: "no window anywhere" has one spelling, so such a config compiles the plain step."""
    owner = f"{owner}.sliding_windows"
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise TypeError(f"{owner} must be None or one window (int or None) per layer, got {describe(value)}")
    if len(value) != num_layers:
        raise ValueError(f"{owner} must have one entry per layer ({num_layers}), got {len(value)}")
    windows = tuple(check_int(owner.split(".")[0], f"sliding_windows[{i}]", w, lo=1, optional=True)
                    for i, w in enumerate(value))
    return None if all(w is None for w in windows) else windows


def _kv_window(sliding_windows: tuple[int | None, ...] | None) -> int | None:
    if sliding_windows is None or None in sliding_windows:
        return None
    return max(sliding_windows)


@dataclass(frozen=True)
class ModelSpec:
    """What the engine must know of a model to serve it (`pagedjax.model.api`): its vocabulary, what each layer's
    paged KV cache holds, its context length and stop tokens. The engine sizes the KV pool, the prefix cache and
    the release of blocks out of sliding windows from this declaration alone, never from the model's code.

    KV layout, one of two spellings:
      - `kv_layers`: one `KVLayerSpec` per layer (`pagedjax.config.kv_spec`: `FullAttention` K/V heads with an
        optional sliding window, `LatentAttention` MLA entries), any mix;
      - the shorthand for a model whose every layer is `FullAttention`: `num_kv_heads` heads of `head_dim`, and
        `sliding_windows` None or one entry per layer, W (the query at p reads keys in (p - W, p]) or None.
    Either way the spec holds both afterwards: `kv_layers` is always the tuple, and `num_kv_heads`, `head_dim`
    and `sliding_windows` describe it where every layer is `FullAttention` of one shape (else `num_kv_heads` and
    `head_dim` are None; `sliding_windows` lists every layer's window, None for latent layers). `num_q_heads`
    query heads read each layer; pages are stored in the model's `dtype` (or `CacheConfig.kv_dtype`). Every field
    is checked on construction (TypeError / ValueError naming it). `hidden_size` only tunes CPU compile options.

    `images`: None for a text-only model, else an `ImageSpec` (`pagedjax.config.multimodal`): the placeholder token
    whose embeddings an image's features replace (one of the vocabulary), how many one image takes, the pixel
    size the model encodes, and whether an image's placeholders attend to each other both ways. A model declaring
    it has `encode_images` and takes `images=` in its call (`pagedjax.model.api`).

    `bidirectional`: every token of a prompt attends to every token of it, later ones too (with a window W, to those
    within W - 1 positions either way): an encoder, such as EmbeddingGemma. The engine then computes each prompt in
    one step (a token needs the keys of those after it), sets every token's `AttentionMetadata.attend_until` to its
    prompt's last position, serves pooling requests only (there is no next token to sample) and takes no prefix-cache
    hits (a block's KV depends on the tokens after it).
    """

    vocab_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    dtype: str = "float32"
    max_position_embeddings: int = 4096
    sliding_windows: tuple[int | None, ...] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_size: int | None = None
    kv_layers: tuple[KVLayerSpec, ...] | None = None
    images: ImageSpec | None = None
    bidirectional: bool = False

    def __post_init__(self) -> None:
        owner = "ModelSpec"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        for name in ("vocab_size", "num_layers", "num_q_heads", "max_position_embeddings"):
            fix(name, check_int(owner, name, getattr(self, name), lo=1))
        for name in ("num_kv_heads", "head_dim", "hidden_size"):
            fix(name, check_int(owner, name, getattr(self, name), lo=1, optional=True))
        _dtype_field(owner, "dtype", self.dtype)
        fix("bos_token_id", check_int(owner, "bos_token_id", self.bos_token_id, lo=0, optional=True))
        eos = self.eos_token_ids
        if isinstance(eos, str) or not isinstance(eos, tuple | list):
            raise TypeError(f"{owner}.eos_token_ids must be a tuple of ints, got {describe(eos)}")
        fix("eos_token_ids", tuple(check_int(owner, "eos_token_ids", t, lo=0, hi=self.vocab_size - 1)
                                   for t in eos))
        windows = _sliding_windows_field(self.sliding_windows, self.num_layers, owner)
        if self.kv_layers is None:
            if self.num_kv_heads is None or self.head_dim is None:
                raise TypeError(f"{owner}: declare the KV layout, either kv_layers (one KVLayerSpec per layer) or "
                                "num_kv_heads and head_dim (every layer full attention)")
            fix("kv_layers", tuple(FullAttention(self.num_kv_heads, self.head_dim, None if windows is None else w)
                                   for w in (windows or (None,) * self.num_layers)))
        else:
            self._check_kv_layers(windows)
        fix("sliding_windows", _sliding_windows_field([layer.sliding_window for layer in self.kv_layers],
                                                      self.num_layers, owner))
        for i, layer in enumerate(self.kv_layers):
            why = layer.check_query_heads(self.num_q_heads)
            if why is not None:
                where = "" if self.num_kv_heads is not None else f" (kv_layers[{i}])"
                raise ValueError(f"{owner}: {why}{where}")
        check_bool(owner, "bidirectional", self.bidirectional)
        if self.bidirectional:
            other = sorted({layer.kind for layer in self.kv_layers} - {FullAttention.kind})
            if other or self.images is not None:
                raise ValueError(f"{owner}.bidirectional: attention both ways is for text models of K/V layers "
                                 f"(FullAttention), not {'images' if self.images is not None else other}")
        if self.images is not None:
            if not isinstance(self.images, ImageSpec):
                raise TypeError(f"{owner}.images must be None or a pagedjax.ImageSpec, got {describe(self.images)}")
            if self.images.image_token_id >= self.vocab_size:
                raise ValueError(f"{owner}.images.image_token_id ({self.images.image_token_id}) must be a token of the "
                                 f"vocabulary (< vocab_size = {self.vocab_size})")

    def _check_kv_layers(self, windows) -> None:
        """`kv_layers` given: one spec per layer, and the shorthand fields, where given, agreeing with it (set
        from it where every layer is full attention of one shape)."""
        owner = "ModelSpec.kv_layers"
        layers = self.kv_layers
        if isinstance(layers, str) or not isinstance(layers, tuple | list):
            raise TypeError(f"{owner} must be a tuple of one KVLayerSpec per layer, got {describe(layers)}")
        layers = tuple(layers)
        if len(layers) != self.num_layers:
            raise ValueError(f"{owner} must have one entry per layer ({self.num_layers}), got {len(layers)}")
        for i, layer in enumerate(layers):
            if not isinstance(layer, KVCacheSpec):
                raise TypeError(f"{owner}[{i}] must be a KV cache spec such as FullAttention or LatentAttention "
                                f"(pagedjax.config.kv_spec.KVCacheSpec), got {describe(layer)}")
        object.__setattr__(self, "kv_layers", layers)
        if windows is not None:
            raise ValueError("ModelSpec: give sliding windows in kv_layers (FullAttention.sliding_window), not also "
                             "as sliding_windows")
        shapes = {layer.kv_heads_shape for layer in layers}
        uniform = shapes.pop() if len(shapes) == 1 else None
        for name, index in (("num_kv_heads", 0), ("head_dim", 1)):
            given = getattr(self, name)
            if given is None:
                object.__setattr__(self, name, None if uniform is None else uniform[index])
            elif uniform is None or given != uniform[index]:
                raise ValueError(f"ModelSpec.{name}={given} disagrees with kv_layers (give it only for a model "
                                 "whose every layer is FullAttention of that shape, or leave it out)")

    @property
    def kv_window(self) -> int | None:
        """How far back any layer reads: positions before `p - kv_window` (p the newest) are read by no layer,
        so their KV blocks may be freed. None when some layer attends globally (or none has a window)."""
        return _kv_window(self.sliding_windows)

    @property
    def block_multiple(self) -> int:
        """What every KV cache group's block size must be a multiple of (`KVCacheSpec.block_multiple`: 1 but for
        compressed entries, whose blocks hold whole entries)."""
        return math.lcm(*(layer.block_multiple for layer in self.kv_layers))

    @property
    def has_latent_layers(self) -> bool:
        """Whether some layer caches MLA latent entries (`LatentAttention`)."""
        return any(layer.kind == "latent" for layer in self.kv_layers)

    @functools.cached_property
    def kv_layout(self) -> KVCacheLayout:
        """The KV cache groups of `kv_layers` and the page arrays backing them (`pagedjax.config.kv_layout`)."""
        return kv_cache_layout(self.kv_layers)

    def replace(self, **changes) -> ModelSpec:
        """This spec with `changes`. Changing the shorthand (num_layers, num_kv_heads, head_dim, sliding_windows)
        of a spec written in it re-derives `kv_layers`; a spec declared by `kv_layers` changes through them."""
        shorthand = {"num_layers", "num_kv_heads", "head_dim", "sliding_windows"}
        if "kv_layers" not in changes and shorthand & set(changes) and self.num_kv_heads is not None:
            changes = {"kv_layers": None, **changes}
        elif "kv_layers" in changes:
            changes = {"num_kv_heads": None, "head_dim": None, "sliding_windows": None, **changes}
        else:  # the layers kept as they are: their windows are declared there, not again as sliding_windows
            changes = {"sliding_windows": None, **changes}
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, OLMo 2 shapes) or a Gemma one
    (`architecture="gemma2"`: Gemma 2 and 3).

    Every field is type-checked on construction (a TypeError or ValueError names the field): ints are ints
    (not bools), floats accept ints, `dtype` is one of "float32" | "bfloat16" | "float16", `eos_token_ids`,
    `rope_scaling` and `sliding_windows` accept lists and dicts and are stored as tuples so the config stays
    hashable.

    Attention variants (any architecture; None = not used, and the compiled step is the plain one):
      sliding_windows         one entry per layer: W (the query at position p attends to keys in (p - W, p])
                              or None (that layer attends to everything before it). `kv_window` is what the
                              cache must keep.
      attn_logit_softcapping  c: attention scores (after scaling) become c * tanh(s / c).
      final_logit_softcapping c: output logits become c * tanh(logits / c).
      query_pre_attn_scalar   attention scores are scaled by query_pre_attn_scalar ** -0.5 instead of
                              head_dim ** -0.5.
      qk_norm                 "head" | "full" (`QK_NORMS`): RMSNorm of q and k (parameters q_norm, k_norm, of
                              the architecture's norm kind) after the projections, before RoPE.
      rope_local_theta        the RoPE base of the layers with a sliding window, which then rotate without
                              `rope_scaling` (Gemma 3's local layers); the other layers keep rope_theta and
                              rope_scaling. None: every layer uses rope_theta and rope_scaling.
    and (False = not used): `attention_sinks`, a learned logit per query head (parameter `sinks` `[num_q_heads]`)
    in each attention softmax's denominator that gives no value (gpt-oss); `o_proj_bias`, a bias on the attention
    output projection (q/k/v's is `qkv_bias`); `bidirectional`, attention both ways (`ModelSpec.bidirectional`:
    an encoder such as EmbeddingGemma; in a layer of window W, the query at p attends to keys within W - 1
    positions either way).

    Mixture of experts: `moe` (a `pagedjax.config.moe.MoEConfig`, or its fields as a dict): every layer's MLP is
    routed over experts of width `moe.intermediate_size` (`intermediate_size` is then unused). None: dense MLPs.

    Quantized weights: `quantization` (a `pagedjax.config.quant.QuantConfig`, its name such as "int8", or its
    fields as a dict): linears and MoE experts are weight-only quantized (`pagedjax.model.layers.quant`). None: float.

    Block layout: `norm_placement` (one of `NORM_PLACEMENTS`; None = the architecture's own, "pre" for llama,
    "sandwich" for gemma2: what configs saved before the field existed mean), resolved by `block_norms`.
    """

    vocab_size: int = 259
    hidden_size: int = 256
    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 704
    rope_theta: float = 10000.0
    # RoPE scaling: None or (name, value) pairs with "rope_type" (one of ROPE_TYPES) and the parameters that
    # type needs (ROPE_SCALING_PARAMS), e.g. Llama 3's factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings (a tuple of pairs so the config stays hashable; LongRoPE's short_factor is
    # a tuple of floats).
    rope_scaling: tuple[tuple[str, float | str | tuple[float, ...]], ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    qkv_bias: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"  # parameter and activation dtype
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"  # one of ARCHITECTURES
    sliding_windows: tuple[int | None, ...] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    qk_norm: str | None = None  # one of QK_NORMS
    norm_placement: str | None = None  # one of NORM_PLACEMENTS; None: the architecture's own
    rope_local_theta: float | None = None
    attention_sinks: bool = False
    o_proj_bias: bool = False
    bidirectional: bool = False
    moe: MoEConfig | None = None
    quantization: QuantConfig | None = None

    def __post_init__(self) -> None:
        owner = "ModelConfig"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        for name in ("vocab_size", "hidden_size", "num_layers", "num_q_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            fix(name, check_int(owner, name, getattr(self, name), lo=1))
        fix("rope_theta", check_float(owner, "rope_theta", self.rope_theta, positive=True))
        fix("rms_norm_eps", check_float(owner, "rms_norm_eps", self.rms_norm_eps))
        fix("rope_scaling", _rope_scaling_field(self.rope_scaling))
        check_bool(owner, "tie_word_embeddings", self.tie_word_embeddings)
        for name in ("qkv_bias", "o_proj_bias", "attention_sinks", "bidirectional"):
            check_bool(owner, name, getattr(self, name))
        _dtype_field(owner, "dtype", self.dtype)
        fix("bos_token_id", check_int(owner, "bos_token_id", self.bos_token_id, lo=0, optional=True))
        eos = self.eos_token_ids
        if isinstance(eos, str) or not isinstance(eos, tuple | list):
            raise TypeError(f"{owner}.eos_token_ids must be a tuple of ints, got {describe(eos)}")
        fix("eos_token_ids", tuple(check_int(owner, "eos_token_ids", t, lo=0) for t in eos))
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        check_choice(owner, "architecture", self.architecture, ARCHITECTURES, optional=False)
        fix("sliding_windows", _sliding_windows_field(self.sliding_windows, self.num_layers))
        for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                     "rope_local_theta"):
            value = getattr(self, name)
            fix(name, None if value is None else check_float(owner, name, value, positive=True))
        fix("qk_norm", check_choice(owner, "qk_norm", self.qk_norm, QK_NORMS))
        fix("norm_placement", check_choice(owner, "norm_placement", self.norm_placement, NORM_PLACEMENTS))
        fix("moe", MoEConfig.coerce(self.moe))
        fix("quantization", QuantConfig.coerce(self.quantization))
        if self.moe is not None and self.architecture != "llama":
            raise ValueError(f"ModelConfig.moe: the experts are SwiGLU MLPs, for architecture 'llama' only, not "
                             f"{self.architecture!r}")
        self._check_rope_scaling()

    def _check_rope_scaling(self) -> None:
        """What `_rope_scaling_field` cannot check alone: YaRN's factor and original context > 0; LongRoPE's factors
        against head_dim and its context."""
        rs = dict(self.rope_scaling or ())
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "yarn":
            for key in ROPE_SCALING_PARAMS["yarn"]:
                check_float("ModelConfig.rope_scaling", key, rs[key], positive=True)
        if kind != "longrope":
            return
        check_float("ModelConfig.rope_scaling", "attention_factor", rs["attention_factor"], positive=True)
        if len(rs["short_factor"]) != self.head_dim // 2:
            raise ValueError(f"ModelConfig.rope_scaling.short_factor must have head_dim // 2 = {self.head_dim // 2} "
                             f"entries, got {len(rs['short_factor'])}")
        if self.max_position_embeddings > rs["original_max_position_embeddings"]:
            raise ValueError(f"ModelConfig.rope_scaling: longrope's long factors are not implemented, so "
                             f"max_position_embeddings ({self.max_position_embeddings}) must not exceed "
                             f"original_max_position_embeddings ({rs['original_max_position_embeddings']:g})")

    @property
    def kv_window(self) -> int | None:
        """How far back any layer reads (`ModelSpec.kv_window`)."""
        return _kv_window(self.sliding_windows)

    @property
    def kv_layers(self) -> tuple[KVLayerSpec, ...]:
        """Each layer's KV cache spec (`ModelSpec.kv_layers`)."""
        return self.spec.kv_layers

    @property
    def kv_layout(self) -> KVCacheLayout:
        """The KV cache groups and page arrays (`ModelSpec.kv_layout`)."""
        return self.spec.kv_layout

    @property
    def spec(self) -> ModelSpec:
        """What the engine needs to know of a model of this config (`ModelSpec`)."""
        return ModelSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, num_q_heads=self.num_q_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype,
                         max_position_embeddings=self.max_position_embeddings, sliding_windows=self.sliding_windows,
                         eos_token_ids=self.eos_token_ids, bos_token_id=self.bos_token_id,
                         hidden_size=self.hidden_size, bidirectional=self.bidirectional)

    @property
    def block_norms(self) -> str:
        """`norm_placement`, or the architecture's own when None (one of `NORM_PLACEMENTS`)."""
        return self.norm_placement or _ARCHITECTURE_NORMS[self.architecture]

    @property
    def attention_scale(self) -> float | None:
        """The attention score scale when it is not head_dim ** -0.5 (`query_pre_attn_scalar`), else None."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar ** -0.5

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["rope_scaling"] = ({k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_scaling}
                             if self.rope_scaling else None)
        d["sliding_windows"] = None if self.sliding_windows is None else list(self.sliding_windows)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """The inverse of `to_dict` (e.g. parsed JSON). Unknown fields are a ValueError, wrong types a TypeError,
        each naming the field."""
        if not isinstance(d, dict):
            raise TypeError(f"a model config must be a mapping of field names to values, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**d)
