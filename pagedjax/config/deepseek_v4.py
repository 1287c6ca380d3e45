"""DeepSeek V4's configuration (`DeepSeekV4Config`): compressed attention (every layer a shared-KV sliding window,
CSA and HCA layers besides it compressed entries of the whole past), manifold-constrained hyper-connections,
grouped output projections, hash-routed then top-k routed experts. The model is
`pagedjax.model.families.deepseek_v4.DeepSeekV4`; its `load_config` maps a Hugging Face `config.json`
("deepseek_v4") to this.

What each layer keeps (`spec`, `pagedjax.config.kv_spec`): every layer a `SharedKVWindow` (its K = V vectors of the
last `sliding_window` positions); a CSA layer (rate m) also `CompressedEntries` (one entry and one indexer key per m
positions, kept for the whole context) and their compressor's `CompressorState`; an HCA layer (rate m') the same
without indexer keys. A layer's KV layers are numbered as `kv_index` says: window layers first (layer i is KV layer
i), then the compressed layers' entries, then their states, so that each is its own KV layer of its own kind.

Plain Python, no JAX.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedjax.config.fields import check_choice, check_float, check_int
from pagedjax.config.kv_spec import CompressedEntries, CompressorState, KVCacheSpec, SharedKVWindow
from pagedjax.config.model import ModelSpec

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")  # the routers' score functions (transformers' `scoring_func`)


@dataclass(frozen=True)
class DeepSeekV4Config:
    """The model's shape (transformers' `DeepseekV4Config` fields, named as there where they are plain numbers).
    `layer_types[i]` one of `LAYER_TYPES`, `mlp_layer_types[i]` one of `MLP_TYPES`; `csa_rate` / `hca_rate` the
    compress rates; `rope_dim` the rotary dims at the end of each head; `compress_rope_scaling` YaRN's pairs for the
    compressed layers' rotation (None: unscaled)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    rope_theta: float
    compress_rope_theta: float
    compress_rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        owner = "DeepSeekV4Config"
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups",
                     "o_lora_rank", "sliding_window", "csa_rate", "hca_rate", "index_n_heads", "index_head_dim",
                     "index_topk", "hc_mult", "hc_sinkhorn_iters", "num_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "max_position_embeddings"):
            check_int(owner, name, getattr(self, name), lo=1)
        check_int(owner, "n_shared_experts", self.n_shared_experts, lo=0)
        check_int(owner, "rope_dim", self.rope_dim, lo=2, hi=self.head_dim)
        if self.rope_dim % 2:
            raise ValueError(f"{owner}.rope_dim must be even (rotated pairs), got {self.rope_dim}")
        if self.num_heads * self.head_dim % self.o_groups:
            raise ValueError(f"{owner}.o_groups ({self.o_groups}) must divide num_heads * head_dim")
        check_int(owner, "num_experts_per_tok", self.num_experts_per_tok, hi=self.num_experts)
        for name, kinds, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", self.mlp_layer_types, MLP_TYPES)):
            if len(kinds) != self.num_layers:
                raise ValueError(f"{owner}.{name} has {len(kinds)} entries for {self.num_layers} layers")
            for kind in kinds:
                check_choice(owner, name, kind, allowed, optional=False)
        check_choice(owner, "scoring_func", self.scoring_func, SCORING, optional=False)
        for name in ("hc_eps", "routed_scaling_factor", "swiglu_limit", "rope_theta", "compress_rope_theta",
                     "rms_norm_eps"):
            check_float(owner, name, getattr(self, name))

    def rate(self, layer: int) -> int | None:
        """Layer `layer`'s compress rate (None: a sliding-window layer only)."""
        return {SLIDING: None, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    @property
    def compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.layer_types) if kind != SLIDING)

    def kv_index(self, layer: int) -> tuple[int, int | None, int | None]:
        """Layer `layer`'s KV layers: (its window, its entries, its compressor state); None for the last two of a
        sliding-window layer."""
        compressed = self.compressed_layers
        if layer not in compressed:
            return layer, None, None
        c = compressed.index(layer)
        return layer, self.num_layers + c, self.num_layers + len(compressed) + c

    @property
    def spec(self) -> ModelSpec:
        """The KV layers (module docstring): windows, then entries, then compressor states."""
        kv: list[KVCacheSpec] = [SharedKVWindow(self.head_dim, self.sliding_window)] * self.num_layers
        for i in self.compressed_layers:
            index = self.index_head_dim if self.layer_types[i] == CSA else None
            kv.append(CompressedEntries(self.head_dim, self.rate(i), index))
        for i in self.compressed_layers:
            csa = self.layer_types[i] == CSA
            kv.append(CompressorState(self.head_dim, csa, self.index_head_dim if csa else None))
        return ModelSpec(vocab_size=self.vocab_size, num_layers=len(kv), num_q_heads=self.num_heads,
                         kv_layers=tuple(kv), dtype=self.dtype, max_position_embeddings=self.max_position_embeddings,
                         eos_token_ids=self.eos_token_ids, bos_token_id=self.bos_token_id,
                         hidden_size=self.hidden_size)

    def replace(self, **changes) -> DeepSeekV4Config:
        return dataclasses.replace(self, **changes)
