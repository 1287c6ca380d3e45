"""The DeepSeek V2 / V3 / V3.2 family's configuration (`DeepSeekConfig`, with `DeepSeekMoEConfig` for its
routed experts and `DeepSeekIndexerConfig` for V3.2's sparse attention): multi-head latent attention (MLA), YaRN
RoPE, shared + routed experts with DeepSeek's routers, and in V3.2 a lightning indexer choosing which earlier
tokens each query attends to (DeepSeek Sparse Attention, DSA). The model is `pagedjax.model.families.deepseek.DeepSeek`;
`pagedjax.model.families.deepseek.load_config` maps a Hugging Face `config.json` ("deepseek_v2",
"deepseek_v3", "deepseek_v32") to it.

Plain Python, no JAX (`pagedjax.config` imports it, and the host side imports that).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

from pagedjax.config.fields import DTYPE_BYTES, check_bool, check_choice, check_float, check_int, describe, from_fields
from pagedjax.config.kv_spec import IndexedSparse, LatentAttention
from pagedjax.config.model import ROPE_OPTIONAL_PARAMS, ROPE_SCALING_PARAMS, ModelSpec

# How router logits `[T, E]` become each token's k experts and their weights (`pagedjax.model.layers.moe.route`),
# named as transformers' `topk_method`:
#   "greedy"                softmax over every expert, the k largest probabilities (DeepSeek V2).
#   "group_limited_greedy"  softmax; the experts split into `num_groups` groups, only the `topk_groups` groups
#                           with the largest best probability eligible, then the k largest of those (DeepSeek V2).
#   "noaux_tc"              sigmoid scores; the experts are chosen by score + `e_score_correction_bias` within the
#                           `topk_groups` groups of largest top-2 sum, weighted by their plain scores (DeepSeek V3).
# Every router's weights are then (with `norm_topk_prob`, "noaux_tc" only) renormalized to sum to 1 and
# multiplied by `routed_scaling_factor`.
DEEPSEEK_ROUTERS: tuple[str, ...] = ("greedy", "group_limited_greedy", "noaux_tc")
# The one RoPE scaling besides none: YaRN, with the parameters transformers reads (`ROPE_YARN_PARAMS`; "factor"
# and "original_max_position_embeddings" required).
ROPE_YARN_PARAMS: tuple[str, ...] = ROPE_SCALING_PARAMS["yarn"] + ROPE_OPTIONAL_PARAMS["yarn"]
# The RMSNorm epsilon of the q / kv latents (`q_a_layernorm`, `kv_a_layernorm`): transformers builds them with its
# RMSNorm's default, not `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6
# The LayerNorm epsilon of V3.2's indexer key (`indexer.k_norm`): transformers' fixed 1e-6.
INDEXER_NORM_EPS = 1e-6


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction of a context stretched `factor` times: 0.1 * mscale * ln(factor) + 1 (1 for
    factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_field(value, owner: str) -> tuple[tuple[str, float | bool], ...] | None:
    """None or YaRN's parameters (a dict or pairs) -> sorted pairs, each a number ("truncate" a bool)."""
    if value is None:
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, tuple | list) and all(isinstance(p, tuple | list) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise TypeError(f"{owner} must be None, a dict or (name, value) pairs of YaRN parameters, got "
                        f"{describe(value)}")
    params: dict[str, float | bool] = {}
    for key, v in items:
        if key not in ROPE_YARN_PARAMS:
            raise ValueError(f"{owner}: unknown YaRN parameter {key!r} (known: {', '.join(ROPE_YARN_PARAMS)})")
        if key == "truncate":
            params[key] = check_bool(owner, key, v)
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{owner}.{key} must be a number, got {describe(v)}")
        else:
            params[key] = check_float(owner, key, v, positive=key != "mscale_all_dim" and key != "mscale")
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise ValueError(f"{owner}: YaRN needs {key!r}")
    return tuple(sorted(params.items()))


@dataclass(frozen=True)
class DeepSeekMoEConfig:
    """The mixture-of-experts MLPs of a DeepSeek model: every layer from `first_k_dense_replace` on has
    `num_experts` routed SwiGLU experts of width `intermediate_size`, `num_experts_per_tok` of them per token
    (exactly: no capacity limit), plus `num_shared_experts` experts every token goes through (one SwiGLU MLP of
    width `num_shared_experts * intermediate_size`; 0: none). The layers before are dense MLPs of
    `DeepSeekConfig.intermediate_size`.

    Routing (`DEEPSEEK_ROUTERS`): `router`, the groups (`num_groups` of E / num_groups experts each, of which the
    `topk_groups` best are eligible: "group_limited_greedy" and "noaux_tc"), `norm_topk_prob` ("noaux_tc" only)
    and `routed_scaling_factor`.

    Invariants (checked on construction, a TypeError / ValueError naming the field): 1 <= num_experts_per_tok <=
    num_experts; num_groups divides num_experts; 1 <= topk_groups <= num_groups; "greedy" has one group; a group
    router's eligible experts (topk_groups * E / num_groups) are at least num_experts_per_tok; "noaux_tc" groups
    hold at least 2 experts (their score is the sum of their best two).
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    num_shared_experts: int = 0
    first_k_dense_replace: int = 0
    router: str = "greedy"
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        owner = "DeepSeekConfig.moe"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("num_experts", check_int(owner, "num_experts", self.num_experts, lo=1))
        fix("num_experts_per_tok", check_int(owner, "num_experts_per_tok", self.num_experts_per_tok, lo=1,
                                             hi=self.num_experts))
        fix("intermediate_size", check_int(owner, "intermediate_size", self.intermediate_size, lo=1))
        fix("num_shared_experts", check_int(owner, "num_shared_experts", self.num_shared_experts, lo=0))
        fix("first_k_dense_replace", check_int(owner, "first_k_dense_replace", self.first_k_dense_replace, lo=0))
        check_choice(owner, "router", self.router, DEEPSEEK_ROUTERS, optional=False)
        fix("num_groups", check_int(owner, "num_groups", self.num_groups, lo=1))
        fix("topk_groups", check_int(owner, "topk_groups", self.topk_groups, lo=1, hi=self.num_groups))
        check_bool(owner, "norm_topk_prob", self.norm_topk_prob)
        fix("routed_scaling_factor", check_float(owner, "routed_scaling_factor", self.routed_scaling_factor,
                                                 positive=True))
        if self.num_experts % self.num_groups:
            raise ValueError(f"{owner}.num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        per_group = self.num_experts // self.num_groups
        if self.router == "greedy" and self.num_groups != 1:
            raise ValueError(f"{owner}.num_groups must be 1 for router 'greedy' (it picks among every expert), got "
                             f"{self.num_groups}")
        if self.topk_groups * per_group < self.num_experts_per_tok:
            raise ValueError(f"{owner}: the {self.topk_groups} eligible groups of {per_group} experts hold fewer than "
                             f"num_experts_per_tok ({self.num_experts_per_tok}) experts")
        if self.router == "noaux_tc" and per_group < 2:
            raise ValueError(f"{owner}: router 'noaux_tc' scores a group by its best two experts, so groups need at "
                             f"least 2 experts (num_experts {self.num_experts} / num_groups {self.num_groups})")
        if self.norm_topk_prob and self.router != "noaux_tc":
            raise ValueError(f"{owner}.norm_topk_prob applies to router 'noaux_tc' only (transformers' DeepSeek V2 "
                             f"routers never renormalize), got router {self.router!r}")

    def is_moe_layer(self, layer_index: int) -> bool:
        return layer_index >= self.first_k_dense_replace

    @classmethod
    def coerce(cls, value) -> DeepSeekMoEConfig | None:
        """None, a DeepSeekMoEConfig, or its fields as a mapping -> a DeepSeekMoEConfig or None."""
        if value is None or isinstance(value, cls):
            return value
        return from_fields(cls, value, "DeepSeekConfig.moe")


@dataclass(frozen=True)
class DeepSeekIndexerConfig:
    """DeepSeek V3.2's lightning indexer (DSA; GLM-5's too): `num_heads` indexer heads of `head_dim` (HF's
    `index_n_heads`, `index_head_dim`) score each earlier token, and attention reads the `topk` (`index_topk`)
    best only (every earlier token while there are no more than `topk`).

    Per token t: the key k_I[t] = LayerNorm(wk x[t]) (`head_dim`, one for all heads). Per query s: the queries
    q_I[s, h] = wq_b q_resid[s] (q_resid: MLA's normalized query latent, so the model has a `q_lora_rank`) and
    the head weights w[s] = weights_proj(x[s]) / sqrt(num_heads); queries and keys rotate their first
    `qk_rope_head_dim` dims by the model's RoPE, in the halves layout (V3.2, whatever MLA's `rope_interleave`) or
    in interleaved pairs with `rope_interleave` (GLM-5). Score index[s, t] = sum_h w[s, h] relu(q_I[s, h] .
    k_I[t] / sqrt(head_dim)) for t <= s.

    `shared_layers` (GLM-5's "shared" `indexer_types`): layers with no indexer of their own, whose attention
    reads the positions the last layer before them with an indexer selected for the same query. Every other layer
    scores and selects its own.

    Invariants (checked on construction, TypeError / ValueError naming the field): num_heads, head_dim, topk
    ints >= 1; shared_layers distinct ints >= 1 in increasing order (layer 0 has nothing to share); `DeepSeekConfig`
    checks head_dim >= qk_rope_head_dim, that q_lora_rank is set and shared_layers < num_layers."""

    num_heads: int
    head_dim: int
    topk: int
    rope_interleave: bool = False
    shared_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "DeepSeekConfig.indexer"
        for name in ("num_heads", "head_dim", "topk"):
            object.__setattr__(self, name, check_int(owner, name, getattr(self, name), lo=1))
        check_bool(owner, "rope_interleave", self.rope_interleave)
        shared = self.shared_layers
        if isinstance(shared, str) or not isinstance(shared, tuple | list):
            raise TypeError(f"{owner}.shared_layers must be a tuple of layer indices, got {describe(shared)}")
        shared = tuple(check_int(owner, "shared_layers", i, lo=1) for i in shared)
        if list(shared) != sorted(set(shared)):
            raise ValueError(f"{owner}.shared_layers must be distinct and increasing, got {shared}")
        object.__setattr__(self, "shared_layers", shared)

    @property
    def scale(self) -> float:
        """What each head's query . key product is scaled by: head_dim ** -0.5."""
        return self.head_dim ** -0.5

    @property
    def weight_scale(self) -> float:
        """What weights_proj's per-head weights are scaled by: num_heads ** -0.5."""
        return self.num_heads ** -0.5

    @classmethod
    def coerce(cls, value) -> DeepSeekIndexerConfig | None:
        """None, a DeepSeekIndexerConfig, or its fields as a mapping -> a DeepSeekIndexerConfig or None."""
        if value is None or isinstance(value, cls):
            return value
        return from_fields(cls, value, "DeepSeekConfig.indexer")

    def is_shared(self, layer: int) -> bool:
        """Whether layer `layer` reads the previous indexed layer's selection instead of scoring its own."""
        return layer in self.shared_layers


@dataclass(frozen=True)
class DeepSeekConfig:
    """A DeepSeek V2 / V3 / V3.2 decoder: pre-norm blocks of multi-head latent attention and a dense or
    mixture-of-experts SwiGLU MLP; with `indexer` (V3.2), every layer's attention is sparse: MLA over the
    positions its lightning indexer selects (`DeepSeekIndexerConfig`).

    Attention (MLA) of `num_heads` heads: the query is `hidden -> q_lora_rank -> heads` (`q_a_proj`,
    `q_a_layernorm`, `q_b_proj`) or, with `q_lora_rank` None, one projection (`q_proj`); each head's query is
    `qk_nope_head_dim` numbers compared with the up-projected latent and `qk_rope_head_dim` rotated ones compared
    with one rotary key shared by every head. Per token the KV cache holds the `kv_lora_rank` latent and that
    rotary key only (`spec`: `LatentAttention` layers). Values are `v_head_dim` per head.

    RoPE over the `qk_rope_head_dim` dims by `rope_theta`; `rope_scaling` None or YaRN's parameters
    (`ROPE_YARN_PARAMS`); `rope_interleave`: the rotated pairs are adjacent dims (2i, 2i + 1), DeepSeek's own
    layout (V2 always), else the halves (i, i + d/2). `softmax_scale`: qk_head_dim ** -0.5, times YaRN's
    mscale(factor, mscale_all_dim) squared when mscale_all_dim is set.

    Every field is type-checked on construction (TypeError / ValueError naming it); dicts and lists are stored
    as tuples so that the config stays hashable.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float | bool], ...] | None = None
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: DeepSeekMoEConfig | None = None
    indexer: DeepSeekIndexerConfig | None = None

    def __post_init__(self) -> None:
        owner = "DeepSeekConfig"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "kv_lora_rank",
                     "qk_rope_head_dim", "v_head_dim", "max_position_embeddings"):
            fix(name, check_int(owner, name, getattr(self, name), lo=1))
        # A head may compare the latent through rotary dims only (qk_nope_head_dim 0).
        fix("qk_nope_head_dim", check_int(owner, "qk_nope_head_dim", self.qk_nope_head_dim, lo=0))
        fix("q_lora_rank", check_int(owner, "q_lora_rank", self.q_lora_rank, lo=1, optional=True))
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{owner}.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        fix("rope_theta", check_float(owner, "rope_theta", self.rope_theta, positive=True))
        fix("rope_scaling", _yarn_field(self.rope_scaling, f"{owner}.rope_scaling"))
        check_bool(owner, "rope_interleave", self.rope_interleave)
        fix("rms_norm_eps", check_float(owner, "rms_norm_eps", self.rms_norm_eps))
        check_bool(owner, "tie_word_embeddings", self.tie_word_embeddings)
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:
            raise (TypeError if not isinstance(self.dtype, str) else ValueError)(
                f"{owner}.dtype must be one of {sorted(DTYPE_BYTES)}, got {describe(self.dtype)}")
        fix("bos_token_id", check_int(owner, "bos_token_id", self.bos_token_id, lo=0, optional=True))
        eos = self.eos_token_ids
        if isinstance(eos, str) or not isinstance(eos, tuple | list):
            raise TypeError(f"{owner}.eos_token_ids must be a tuple of ints, got {describe(eos)}")
        fix("eos_token_ids", tuple(check_int(owner, "eos_token_ids", t, lo=0, hi=self.vocab_size - 1) for t in eos))
        fix("moe", DeepSeekMoEConfig.coerce(self.moe))
        if self.moe is not None and self.moe.first_k_dense_replace > self.num_layers:
            raise ValueError(f"{owner}.moe.first_k_dense_replace ({self.moe.first_k_dense_replace}) exceeds "
                             f"num_layers ({self.num_layers})")
        fix("indexer", DeepSeekIndexerConfig.coerce(self.indexer))
        if self.indexer is not None:
            if self.q_lora_rank is None:
                raise ValueError(f"{owner}.indexer needs q_lora_rank: the indexer's queries come from the "
                                 "normalized query latent")
            if self.indexer.head_dim < self.qk_rope_head_dim:
                raise ValueError(f"{owner}.indexer.head_dim ({self.indexer.head_dim}) must be at least "
                                 f"qk_rope_head_dim ({self.qk_rope_head_dim}): its first qk_rope_head_dim dims rotate")
            if self.indexer.shared_layers and self.indexer.shared_layers[-1] >= self.num_layers:
                raise ValueError(f"{owner}.indexer.shared_layers {self.indexer.shared_layers} must be layers of the "
                                 f"{self.num_layers}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The attention scores' scale: qk_head_dim ** -0.5, with YaRN's mscale_all_dim correction squared (as
        transformers' `yarn_apply_mscale`)."""
        scale = self.qk_head_dim ** -0.5
        yarn = dict(self.rope_scaling or ())
        if yarn.get("mscale_all_dim"):
            scale *= yarn_mscale(yarn["factor"], yarn["mscale_all_dim"]) ** 2
        return scale

    @property
    def spec(self) -> ModelSpec:
        """What the engine needs to know of the model: every layer caches one MLA latent entry per token
        (`LatentAttention`), and with `indexer` the token's indexer key beside it (`IndexedSparse`), but for the
        indexer's shared layers, which keep no key."""
        latent = LatentAttention(self.kv_lora_rank, self.qk_rope_head_dim)
        layers = (latent,) * self.num_layers
        if self.indexer is not None:
            ix = self.indexer
            indexed = IndexedSparse(self.kv_lora_rank, self.qk_rope_head_dim, ix.head_dim, ix.topk)
            layers = tuple(latent if ix.is_shared(i) else indexed for i in range(self.num_layers))
        return ModelSpec(vocab_size=self.vocab_size, num_layers=self.num_layers, num_q_heads=self.num_heads,
                         kv_layers=layers,
                         dtype=self.dtype, max_position_embeddings=self.max_position_embeddings,
                         eos_token_ids=self.eos_token_ids, bos_token_id=self.bos_token_id,
                         hidden_size=self.hidden_size)

    def replace(self, **changes) -> DeepSeekConfig:
        return dataclasses.replace(self, **changes)
