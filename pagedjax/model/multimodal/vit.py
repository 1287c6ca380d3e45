"""The blocks CLIP's and SigLIP's vision transformers share, named as transformers' (`CLIPEncoderLayer`,
`SiglipEncoderLayer`, ...) so that checkpoints load by name: patch embedding (a strided convolution, computed as
one product per patch), pre-norm encoder layers (LayerNorm, bidirectional multi-head attention with biases, an MLP),
the encoder. Linear kernels are `[in, out]` (transformers' weights transposed); the patch embedding keeps
transformers' convolution weight `[hidden, channels, patch, patch]`.

Everything runs in the model's dtype; products accumulate in float32 and round once, LayerNorms and the softmax
compute in float32 (as transformers' eager attention: float32 softmax, probabilities rounded to the dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.config.vision import VisionConfig
from pagedjax.model.layers.norm import LayerNorm
from pagedjax.model.llama import Linear

# transformers' activations by name (`VISION_ACTIVATIONS`).
ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


def linear(n_in: int, n_out: int, dtype, rngs: nnx.Rngs, *, bias: bool = True) -> Linear:
    """A float linear layer (with bias unless `bias` is false); 16-bit ones accumulate in float32 and round once
    (`pagedjax.model.llama.Linear`)."""
    acc = jnp.float32 if jnp.dtype(dtype).itemsize == 2 else None
    return Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, preferred_element_type=acc, rngs=rngs)


def activate(name: str, x: jax.Array) -> jax.Array:
    """`ACTIVATIONS[name]` in float32, rounded to x's dtype."""
    return ACTIVATIONS[name](x.astype(jnp.float32)).astype(x.dtype)


class PatchEmbedding(nnx.Module):
    """transformers' `patch_embedding` (a Conv2d of kernel and stride `patch`, valid padding): pixels `[N, C, H, W]`
    -> `[N, (H // patch) * (W // patch), hidden]`, patches in row-major order (a remainder of rows or columns is
    dropped, as the convolution does)."""

    def __init__(self, channels: int, hidden: int, patch: int, dtype, rngs: nnx.Rngs, *, bias: bool):
        init = nnx.initializers.lecun_normal()(rngs.params(), (channels * patch * patch, hidden), dtype)
        self.weight = nnx.Param(init.T.reshape(hidden, channels, patch, patch))
        self.bias = nnx.Param(jnp.zeros((hidden,), dtype)) if bias else None
        self.patch = patch

    def __call__(self, pixels: jax.Array) -> jax.Array:
        n, c, h, w = pixels.shape
        p, (rows, cols) = self.patch, (h // self.patch, w // self.patch)
        weight = self.weight[...]
        x = pixels[:, :, :rows * p, :cols * p].astype(weight.dtype)
        x = x.reshape(n, c, rows, p, cols, p).transpose(0, 2, 4, 1, 3, 5).reshape(n, rows * cols, c * p * p)
        y = jnp.einsum("npk,dk->npd", x, weight.reshape(weight.shape[0], -1), preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(weight.dtype)


class Attention(nnx.Module):
    """Bidirectional multi-head attention with biased q / k / v / out projections, scores scaled by head_dim ** -0.5."""

    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.q_proj, self.k_proj, self.v_proj = (linear(d, d, dtype, rngs) for _ in range(3))
        self.out_proj = linear(d, d, dtype, rngs)
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def __call__(self, x: jax.Array) -> jax.Array:
        """x `[N, L, hidden]` -> `[N, L, hidden]`."""
        n, length, _ = x.shape
        q, k, v = (proj(x).reshape(n, length, self.num_heads, self.head_dim)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * self.head_dim ** -0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        o = jnp.einsum("nhqk,nkhd->nqhd", probs, v, preferred_element_type=jnp.float32).astype(x.dtype)
        return self.out_proj(o.reshape(n, length, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.fc1 = linear(cfg.hidden_size, cfg.intermediate_size, dtype, rngs)
        self.fc2 = linear(cfg.intermediate_size, cfg.hidden_size, dtype, rngs)
        self.act = cfg.hidden_act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(activate(self.act, self.fc1(x)))


class EncoderLayer(nnx.Module):
    """x += attn(layer_norm1(x)); x += mlp(layer_norm2(x))."""

    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.layer_norm1 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.layer_norm2 = LayerNorm(cfg.hidden_size, cfg.layer_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Encoder(nnx.Module):
    """`cfg.num_layers` encoder layers."""

    def __init__(self, cfg: VisionConfig, dtype, rngs: nnx.Rngs):
        self.layers = nnx.List([EncoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers:
            x = layer(x)
        return x
