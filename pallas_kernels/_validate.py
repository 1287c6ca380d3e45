"""Argument checks shared by every entry point, platform-free (no Triton, no Mosaic): the common arguments
(shapes, dtypes, head_dim, int32 tables and vectors), the variants (sliding window, soft cap, 8-bit pages with
their scales, attention sinks, the ragged calls' `attend_until`), the scale and the tuning options' ints, those
of the MLA entry points (`validate_mla`) and those of the DeepSeek sparse attention entry points
(`validate_indexer`, `validate_selection`).

Nothing here is public API; `pallas_kernels.paged_attention` / `ragged_paged_attention` and the MLA entry
points (`mla_paged_attention` / `ragged_mla_paged_attention`) are.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import QUANTIZED_DTYPES, SCALE_DTYPES, is_quantized

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_HEAD_DIM = 256


def resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    try:
        return float(scale)
    except TypeError as e:  # a traced value cannot be a static kernel constant
        raise ValueError(f"scale must be a Python float (a static constant), got {scale!r}") from e


def check_pow2_option(name: str, value: int | None) -> None:
    if value is None:
        return
    if not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value!r}")


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def check_positive_option(name: str, value: int | None) -> None:
    """`None` (pick a default) or a positive int."""
    if value is not None:
        check_positive_int(name, value)


def _check_int32(name: str, x: jax.Array, ndim: int) -> None:
    if x.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {x.shape}")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32, got {x.dtype}")


def validate_qkv(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, block_tables: jax.Array,
                 num_q_rows: int | None = None) -> tuple[int, int, int, int, int, int]:
    """Checks the common arguments; returns (num_q_heads, head_dim, num_kv_heads, num_blocks, block_size,
    max_blocks_per_seq)."""
    for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages), ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(
            f"k_pages must be 4-D [num_kv_heads, num_blocks, block_size, head_dim], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and {v_pages.shape}")
    if is_quantized(k_pages.dtype) or is_quantized(v_pages.dtype):
        # 8-bit pages are dequantized inside the kernel; q keeps its own float dtype (and sets the output's).
        if jnp.dtype(k_pages.dtype) != jnp.dtype(v_pages.dtype):
            raise ValueError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}")
        if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"q's dtype must be one of float32, bfloat16, float16 (with {k_pages.dtype} pages); "
                             f"got {q.dtype}")
    else:
        dtypes = {jnp.dtype(q.dtype), jnp.dtype(k_pages.dtype), jnp.dtype(v_pages.dtype)}
        if len(dtypes) != 1:
            raise ValueError(
                f"q, k_pages and v_pages must share one dtype (or the pages be int8 / float8_e4m3fn), got "
                f"{q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
        if jnp.dtype(q.dtype) not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be one of float32, bfloat16, float16; got {q.dtype}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads, num_blocks, block_size, head_dim_kv = k_pages.shape
    if head_dim_kv != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and of k_pages/v_pages ({head_dim_kv}) differ")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim}")
    if num_kv_heads < 1 or num_q_heads < 1:
        raise ValueError(f"need at least one head, got num_q_heads={num_q_heads}, num_kv_heads={num_kv_heads}")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(
            f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    return num_q_heads, head_dim, num_kv_heads, num_blocks, block_size, block_tables.shape[1]


def check_sliding_window(sliding_window) -> int | None:
    """`None` (no window) or a Python int >= 1 (a static constant: it sizes the kernels' page ranges)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
        raise ValueError(f"sliding_window must be None or an int >= 1 (a static constant), got {sliding_window!r}")
    return int(sliding_window)


def check_soft_cap(logits_soft_cap) -> float | None:
    """`None` (no cap) or a finite Python float > 0 (a static constant)."""
    if logits_soft_cap is None:
        return None
    if (isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, numbers.Real)
            or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
        raise ValueError(
            f"logits_soft_cap must be None or a finite float > 0 (a static constant), got {logits_soft_cap!r}")
    return float(logits_soft_cap)


def check_scales(k_pages: jax.Array, v_pages: jax.Array, k_scales, v_scales) -> bool:
    """Scales come with 8-bit pages and only with them: both k_scales and v_scales, each
    `[num_kv_heads, num_blocks, block_size]` float32 or bfloat16. Returns whether the pages are quantized."""
    quantized = is_quantized(k_pages.dtype)
    if quantized != is_quantized(v_pages.dtype) or (quantized and k_pages.dtype != v_pages.dtype):
        raise ValueError(f"k_pages and v_pages must share one dtype, got {k_pages.dtype} and {v_pages.dtype}")
    names = ", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if not quantized:
            if scales is not None:
                raise ValueError(f"{name} is only for 8-bit pages ({names}); k_pages/v_pages are {k_pages.dtype}")
            continue
        if scales is None:
            raise ValueError(f"{name} is required with {k_pages.dtype} pages (one scale per token and KV head)")
        if not hasattr(scales, "shape") or not hasattr(scales, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(scales).__name__}")
        if tuple(scales.shape) != tuple(k_pages.shape[:3]):
            raise ValueError(f"{name} must have shape [num_kv_heads, num_blocks, block_size] = "
                             f"{tuple(k_pages.shape[:3])}, got {tuple(scales.shape)}")
        if jnp.dtype(scales.dtype) not in SCALE_DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {scales.dtype}")
    return quantized


def validate_variants(k_pages: jax.Array, v_pages: jax.Array, *, sliding_window, logits_soft_cap, k_scales,
                      v_scales) -> tuple[int | None, float | None, bool]:
    """Checks the variant arguments; returns (sliding_window, logits_soft_cap, quantized) normalised."""
    return (check_sliding_window(sliding_window), check_soft_cap(logits_soft_cap),
            check_scales(k_pages, v_pages, k_scales, v_scales))


def check_sinks(sinks, num_q_heads: int) -> None:
    """`None` (no sinks) or float32 `[num_q_heads]`: one logit per query head that joins each softmax's
    denominator (gpt-oss), an array (traced or not: the kernels take it as an input, so learned sinks change no
    compiled program). Float32 only, so no silent rounding of a bfloat16 parameter happens here: the caller casts.
    Finite: +inf would make every output NaN and -inf or NaN means no sink or a broken one; the check reads the
    values where they are concrete (a traced array cannot be read, its finiteness is the caller's)."""
    if sinks is None:
        return
    if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
        raise ValueError(f"sinks must be a float32 array [num_q_heads], got {type(sinks).__name__}")
    if tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must have shape [num_q_heads] = ({num_q_heads},), got {tuple(sinks.shape)}")
    if jnp.dtype(sinks.dtype) != jnp.float32:
        raise ValueError(f"sinks must be float32, got {sinks.dtype} (cast a model's parameter with "
                         f".astype(jnp.float32))")
    if not isinstance(sinks, jax.core.Tracer) and not np.isfinite(np.asarray(sinks)).all():
        raise ValueError(f"sinks must be finite, got {np.asarray(sinks).tolist()}")


def check_vector(name: str, x: jax.Array, length: int) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an int32 array, got {type(x).__name__}")
    _check_int32(name, x, 1)
    if x.shape[0] != length:
        raise ValueError(f"{name} must have shape ({length},), got {x.shape}")


def check_attend_until(attend_until, num_tokens: int) -> None:
    """`None` (causal) or int32 `[num_tokens]`: one bound per query row of a ragged call (a traced array: the
    bounds change every step, the compiled program does not)."""
    if attend_until is not None:
        check_vector("attend_until", attend_until, num_tokens)


def validate_mla(q_latent: jax.Array, q_rope: jax.Array, kv_pages: jax.Array, block_tables: jax.Array, kv_scales,
                 num_q_rows: int | None = None) -> tuple[int, int, bool]:
    """Checks the arguments common to the MLA entry points (`mla_paged_attention`,
    `ragged_mla_paged_attention`); returns (kv_lora_rank R, rope dim Dr, quantized).

    q_latent `[tokens, num_heads, R]` and q_rope `[tokens, num_heads, Dr]` share one float dtype; kv_pages
    `[num_blocks, block_size, R + Dr]` (latent first, then rope) is in that dtype, or int8 / float8_e4m3fn with
    kv_scales `[num_blocks, block_size]` float32 or bfloat16 (and only then)."""
    for name, x in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_pages", kv_pages),
                    ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q_latent.ndim != 3:
        raise ValueError(f"q_latent must be 3-D [tokens, num_heads, kv_lora_rank], got shape {q_latent.shape}")
    if q_rope.ndim != 3:
        raise ValueError(f"q_rope must be 3-D [tokens, num_heads, rope_dim], got shape {q_rope.shape}")
    if q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_latent and q_rope must agree on [tokens, num_heads], got {q_latent.shape} and "
                         f"{q_rope.shape}")
    if kv_pages.ndim != 3:
        raise ValueError(f"kv_pages must be 3-D [num_blocks, block_size, kv_lora_rank + rope_dim], got shape "
                         f"{kv_pages.shape}")
    if jnp.dtype(q_latent.dtype) != jnp.dtype(q_rope.dtype):
        raise ValueError(f"q_latent and q_rope must share one dtype, got {q_latent.dtype} and {q_rope.dtype}")
    if jnp.dtype(q_latent.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q's dtype must be one of float32, bfloat16, float16; got {q_latent.dtype}")
    quantized = is_quantized(kv_pages.dtype)
    if not quantized and jnp.dtype(kv_pages.dtype) != jnp.dtype(q_latent.dtype):
        raise ValueError(f"kv_pages must be in q's dtype ({q_latent.dtype}) or int8 / float8_e4m3fn, got "
                         f"{kv_pages.dtype}")
    num_heads, rank, rope_dim = q_latent.shape[1], q_latent.shape[2], q_rope.shape[2]
    num_blocks, block_size, width = kv_pages.shape
    if num_heads < 1:
        raise ValueError(f"need at least one head, got num_heads={num_heads}")
    if rank < 1 or rope_dim < 1:
        raise ValueError(f"kv_lora_rank and rope_dim must be >= 1, got {rank} and {rope_dim}")
    if width != rank + rope_dim:
        raise ValueError(f"kv_pages' last dimension ({width}) must be kv_lora_rank + rope_dim = {rank} + {rope_dim} "
                         f"(q_latent.shape[-1] + q_rope.shape[-1])")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    _check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    _check_token_scales("kv_scales", "kv_pages", kv_pages, kv_scales)
    return rank, rope_dim, quantized


def _check_token_scales(name: str, pages_name: str, pages: jax.Array, scales) -> None:
    """One scale per token, `[num_blocks, block_size]` float32 or bfloat16, with 8-bit `pages` (and only then)."""
    names = ", ".join(jnp.dtype(d).name for d in QUANTIZED_DTYPES)
    if not is_quantized(pages.dtype):
        if scales is not None:
            raise ValueError(f"{name} is only for 8-bit pages ({names}); {pages_name} are {pages.dtype}")
        return
    if scales is None:
        raise ValueError(f"{name} is required with {pages.dtype} pages (one scale per token)")
    if not hasattr(scales, "shape") or not hasattr(scales, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(scales).__name__}")
    if tuple(scales.shape) != tuple(pages.shape[:2]):
        raise ValueError(f"{name} must have shape [num_blocks, block_size] = {tuple(pages.shape[:2])}, got "
                         f"{tuple(scales.shape)}")
    if jnp.dtype(scales.dtype) not in SCALE_DTYPES:
        raise ValueError(f"{name} must be float32 or bfloat16, got {scales.dtype}")


def check_mla_scale(scale) -> float:
    """MLA's scale is required (1 / sqrt(qk_nope_dim + rope_dim) in DeepSeek: not derivable from the latent
    shapes) and a static Python float."""
    if scale is None or isinstance(scale, bool):
        raise ValueError(f"scale must be given as a Python float (DeepSeek: 1 / sqrt(qk_nope_head_dim + "
                         f"qk_rope_head_dim)), got {scale!r}")
    return resolve_scale(scale, 1)


def validate_indexer(q_index: jax.Array, weights: jax.Array, index_pages: jax.Array, block_tables: jax.Array,
                     index_scales, num_q_rows: int | None = None) -> tuple[int, int, bool]:
    """Checks the arguments common to the indexer-score entry points (`indexer_scores`, `ragged_indexer_scores`);
    returns (index_n_heads, index_head_dim, quantized).

    q_index `[rows, index_n_heads, index_head_dim]` in a float dtype; weights `[rows, index_n_heads]` float32;
    index_pages `[num_blocks, block_size, index_head_dim]` (one key per token, shared by every indexer head) in
    q_index's dtype, or int8 / float8_e4m3fn with index_scales `[num_blocks, block_size]` float32 or bfloat16
    (and only then)."""
    for name, x in (("q_index", q_index), ("weights", weights), ("index_pages", index_pages),
                    ("block_tables", block_tables)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if q_index.ndim != 3:
        raise ValueError(f"q_index must be 3-D [tokens, index_n_heads, index_head_dim], got shape {q_index.shape}")
    if weights.ndim != 2 or tuple(weights.shape) != tuple(q_index.shape[:2]):
        raise ValueError(f"weights must have shape [tokens, index_n_heads] = {tuple(q_index.shape[:2])}, got "
                         f"{tuple(weights.shape)}")
    if jnp.dtype(weights.dtype) != jnp.float32:
        raise ValueError(f"weights must be float32, got {weights.dtype}")
    if index_pages.ndim != 3:
        raise ValueError(f"index_pages must be 3-D [num_blocks, block_size, index_head_dim], got shape "
                         f"{index_pages.shape}")
    if jnp.dtype(q_index.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"q_index's dtype must be one of float32, bfloat16, float16; got {q_index.dtype}")
    quantized = is_quantized(index_pages.dtype)
    if not quantized and jnp.dtype(index_pages.dtype) != jnp.dtype(q_index.dtype):
        raise ValueError(f"index_pages must be in q_index's dtype ({q_index.dtype}) or int8 / float8_e4m3fn, got "
                         f"{index_pages.dtype}")
    num_heads, head_dim = q_index.shape[1], q_index.shape[2]
    if num_heads < 1 or head_dim < 1:
        raise ValueError(f"need index_n_heads >= 1 and index_head_dim >= 1, got {num_heads} and {head_dim}")
    if index_pages.shape[2] != head_dim:
        raise ValueError(f"index_pages' last dimension ({index_pages.shape[2]}) must be index_head_dim = {head_dim} "
                         f"(q_index.shape[-1])")
    if index_pages.shape[1] < 1:
        raise ValueError(f"block_size must be >= 1, got {index_pages.shape[1]}")
    _check_int32("block_tables", block_tables, 2)
    if num_q_rows is not None and block_tables.shape[0] != num_q_rows:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but there are {num_q_rows} sequences")
    _check_token_scales("index_scales", "index_pages", index_pages, index_scales)
    return num_heads, head_dim, quantized


def check_indexer_scale(scale) -> float:
    """The indexer's scale is required (DeepSeek V3.2: 1 / sqrt(index_head_dim), with the weights already
    carrying index_n_heads ** -0.5) and a static Python float."""
    if scale is None or isinstance(scale, bool):
        raise ValueError(f"scale must be given as a Python float (DeepSeek V3.2: 1 / sqrt(index_head_dim)), "
                         f"got {scale!r}")
    return resolve_scale(scale, 1)


def check_top_k(k) -> int:
    """top_k: a Python int >= 1 (a static constant: it sizes the selection)."""
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k must be an int >= 1 (a static constant), got {k!r}")
    return int(k)


def validate_selection(indices, num_rows: int) -> int:
    """The selected positions of the sparse attention entry points: int32 `[rows, top_k]` with rows = the query
    rows and top_k >= 1; returns top_k."""
    if not hasattr(indices, "shape") or not hasattr(indices, "dtype"):
        raise ValueError(f"indices must be an int32 array, got {type(indices).__name__}")
    _check_int32("indices", indices, 2)
    if indices.shape[0] != num_rows:
        raise ValueError(f"indices must have one row per query row ({num_rows}), got shape {indices.shape}")
    if indices.shape[1] < 1:
        raise ValueError(f"indices must select at least one position per row (top_k >= 1), got shape "
                         f"{indices.shape}")
    return indices.shape[1]


# ---- recurrent-state layers (pallas_kernels.recurrent) ------------------------------------------------------------

RECURRENT_FORMS = ("chunked", "recurrent")


def _check_arrays(**arrays) -> None:
    for name, x in arrays.items():
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise ValueError(f"{name} must be an array, got {type(x).__name__}")


def _check_float(name: str, x, dtypes=SUPPORTED_DTYPES) -> None:
    if jnp.dtype(x.dtype) not in dtypes:
        raise ValueError(f"{name}'s dtype must be one of {', '.join(jnp.dtype(d).name for d in dtypes)}; got "
                         f"{x.dtype}")


def _check_shape(name: str, x, shape: tuple, what: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {tuple(shape)}, got {tuple(x.shape)}")


def validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size) -> int:
    """The step arguments every recurrent entry point shares: block_tables int32 `[S, max_blocks_per_seq]`, kv_lens
    int32 `[S]`, cu_q_lens int32 `[S + 1]`, block_size a positive Python int (the state pages hold one state per
    block, so it is not in their shape). Returns block_size."""
    _check_arrays(block_tables=block_tables)
    _check_int32("block_tables", block_tables, 2)
    check_vector("kv_lens", kv_lens, block_tables.shape[0])
    check_vector("cu_q_lens", cu_q_lens, block_tables.shape[0] + 1)
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size < 1:
        raise ValueError(f"block_size must be a positive int (tokens per block of the block tables), got "
                         f"{block_size!r}")
    return int(block_size)


def _check_pages(name: str, pages, tail: tuple, what: str, dtypes) -> None:
    if pages.ndim != 1 + len(tail) or tuple(pages.shape[1:]) != tuple(tail) or pages.shape[0] < 1:
        raise ValueError(f"{name} must have shape [num_blocks >= 1, {what}] = [num_blocks, "
                         f"{', '.join(map(str, tail))}], got {tuple(pages.shape)}")
    _check_float(name, pages, dtypes)


def check_form(form) -> None:
    if form is not None and form not in RECURRENT_FORMS:
        raise ValueError(f"form must be None (by shape), 'chunked' or 'recurrent', got {form!r}")


def validate_gated_delta_rule(q, k, v, g, beta, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size,
                              use_qk_l2norm, scale, form, chunk_size) -> tuple[int, float]:
    """q, k `[T, Hk, Dk]` and v `[T, Hv, Dv]` in one float dtype with Hv a multiple of Hk; g, beta float32
    `[T, Hv]`; state_pages float32 `[num_blocks, Hv, Dk, Dv]`; the step arguments. Returns (block_size, scale:
    Dk^-0.5 unless given)."""
    _check_arrays(q=q, k=k, v=v, g=g, beta=beta, state_pages=state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must be 3-D [tokens, num_k_heads, head_k_dim] of one shape, got {q.shape} and "
                         f"{k.shape}")
    if v.ndim != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"v must be 3-D [tokens, num_v_heads, head_v_dim] with q's {q.shape[0]} tokens, got "
                         f"{v.shape}")
    _check_float("q", q)
    if jnp.dtype(k.dtype) != jnp.dtype(q.dtype) or jnp.dtype(v.dtype) != jnp.dtype(q.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    num_tokens, num_k_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    if min(num_k_heads, num_v_heads, head_k, head_v) < 1:
        raise ValueError(f"need at least one head of at least one dimension, got q {q.shape} and v {v.shape}")
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads}): each q/k "
                         f"head serves num_v_heads // num_k_heads consecutive v heads")
    for name, x in (("g", g), ("beta", beta)):
        _check_shape(name, x, (num_tokens, num_v_heads), "[tokens, num_v_heads]")
        _check_float(name, x, (jnp.dtype(jnp.float32),))
    _check_pages("state_pages", state_pages, (num_v_heads, head_k, head_v), "num_v_heads, head_k_dim, head_v_dim",
                 (jnp.dtype(jnp.float32),))
    if not isinstance(use_qk_l2norm, bool):
        raise ValueError(f"use_qk_l2norm must be a bool, got {use_qk_l2norm!r}")
    check_form(form)
    check_positive_int("chunk_size", chunk_size)
    return block_size, (head_k ** -0.5 if scale is None else resolve_scale(scale, head_k))


def validate_causal_conv1d(x, weight, bias, conv_state_pages, block_tables, kv_lens, cu_q_lens, *, block_size,
                           activation, activations) -> int:
    """x `[T, C]` in a float dtype; weight `[C, K]` (K >= 2) and bias `[C]` (or None) in float dtypes;
    conv_state_pages `[num_blocks, C, K - 1]` in x's dtype (they hold inputs); the step arguments. Returns
    block_size."""
    _check_arrays(x=x, weight=weight, conv_state_pages=conv_state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if x.ndim != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D [tokens, channels], got shape {x.shape}")
    _check_float("x", x)
    channels = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight must have shape [channels, kernel_size] = [{channels}, K] with K >= 2 (a kernel "
                         f"of one tap keeps no state), got {tuple(weight.shape)}")
    _check_float("weight", weight)
    if bias is not None:
        _check_arrays(bias=bias)
        _check_shape("bias", bias, (channels,), "[channels]")
        _check_float("bias", bias)
    taps = weight.shape[1]
    _check_pages("conv_state_pages", conv_state_pages, (channels, taps - 1), "channels, kernel_size - 1",
                 (jnp.dtype(x.dtype),))
    if activation not in activations:
        raise ValueError(f"activation must be one of {activations}, got {activation!r}")
    return block_size


def validate_mamba2_ssd(x, dt, A, B, C, D, state_pages, block_tables, kv_lens, cu_q_lens, *, block_size, form,
                        chunk_size) -> int:
    """x `[T, H, P]` in a float dtype; dt float32 `[T, H]`; A float32 `[H]`; B, C `[T, G, N]` in x's dtype with H a
    multiple of G; D float32 `[H]` or None; state_pages float32 `[num_blocks, H, P, N]`; the step arguments.
    Returns block_size."""
    _check_arrays(x=x, dt=dt, A=A, B=B, C=C, state_pages=state_pages)
    block_size = validate_ragged_step(block_tables, kv_lens, cu_q_lens, block_size)
    if x.ndim != 3 or min(x.shape[1:]) < 1:
        raise ValueError(f"x must be 3-D [tokens, num_heads, head_dim], got shape {x.shape}")
    _check_float("x", x)
    num_tokens, num_heads, head_dim = x.shape
    if B.ndim != 3 or B.shape[0] != num_tokens or min(B.shape[1:]) < 1 or C.shape != B.shape:
        raise ValueError(f"B and C must be 3-D [tokens, n_groups, state_size] of one shape with x's {num_tokens} "
                         f"tokens, got {B.shape} and {C.shape}")
    if jnp.dtype(B.dtype) != jnp.dtype(x.dtype) or jnp.dtype(C.dtype) != jnp.dtype(x.dtype):
        raise ValueError(f"B and C must be in x's dtype ({x.dtype}), got {B.dtype} and {C.dtype}")
    num_groups, state_size = B.shape[1:]
    if num_heads % num_groups:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of n_groups ({num_groups})")
    f32 = (jnp.dtype(jnp.float32),)
    _check_shape("dt", dt, (num_tokens, num_heads), "[tokens, num_heads]")
    _check_float("dt", dt, f32)
    _check_shape("A", A, (num_heads,), "[num_heads]")
    _check_float("A", A, f32)
    if D is not None:
        _check_arrays(D=D)
        _check_shape("D", D, (num_heads,), "[num_heads]")
        _check_float("D", D, f32)
    _check_pages("state_pages", state_pages, (num_heads, head_dim, state_size), "num_heads, head_dim, state_size",
                 f32)
    check_form(form)
    check_positive_int("chunk_size", chunk_size)
    return block_size
