"""The vision-language models' configuration: `VisionConfig` (a ViT image encoder: CLIP's or SigLIP's), and the two
families built on it, `LlavaConfig` (CLIP tower, a hidden layer's features through a two-layer MLP projector, any
built-in decoder) and `Gemma3VisionConfig` (SigLIP tower, average pooling to `mm_tokens_per_image` tokens, an
RMS-normed linear projection, the Gemma 3 decoder). The models are `pagedjax.model.multimodal.llava.Llava` and
`pagedjax.model.multimodal.gemma3_vision.Gemma3Vision`; `pagedjax.model.multimodal.hf_vision` maps Hugging Face folders
("llava", "gemma3") to these.

Plain Python, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_bool, check_choice, check_float, check_int, describe
from pagedjax.config.model import ModelConfig, ModelSpec
from pagedjax.config.multimodal import ImageSpec

# The image encoders: CLIP's ViT (a class token, a LayerNorm before the encoder, no patch bias) and SigLIP's (no
# class token, a patch bias, a LayerNorm after the encoder).
VISION_TOWERS: tuple[str, ...] = ("clip", "siglip")
# Activations of the towers' MLPs and LLaVA's projector, by transformers' names: "gelu" (erf), "gelu_pytorch_tanh"
# and "gelu_new" (both the tanh approximation), "quick_gelu" (x * sigmoid(1.702 x), CLIP's).
VISION_ACTIVATIONS: tuple[str, ...] = ("gelu", "gelu_pytorch_tanh", "gelu_new", "quick_gelu")
# LLaVA's `vision_feature_select_strategy`: "default" drops the class token's row, "full" keeps it.
SELECT_STRATEGIES: tuple[str, ...] = ("default", "full")


def _image_size(owner: str, value) -> tuple[int, int]:
    if isinstance(value, str) or not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(f"{owner}.image_size must be (height, width), two ints, got {describe(value)}")
    return check_int(owner, "image_size[0]", value[0], lo=1), check_int(owner, "image_size[1]", value[1], lo=1)


@dataclass(frozen=True)
class VisionConfig:
    """A ViT image encoder of `kind` "clip" or "siglip" (`VISION_TOWERS`): `image_size` (height, width) pixels cut
    into `patch_size` squares (a remainder is dropped, as a strided convolution does), each embedded to
    `hidden_size` with a learned position, then `num_layers` pre-norm encoder layers (LayerNorm of
    `layer_norm_eps`, `num_heads` bidirectional attention heads with biases, an MLP of `intermediate_size` with
    `hidden_act`). `num_layers` is how many layers the model runs (LLaVA: up to its feature layer), which may be
    fewer than the checkpoint holds. Every field is checked on construction."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: tuple[int, int]
    patch_size: int
    hidden_act: str
    layer_norm_eps: float

    def __post_init__(self) -> None:
        owner = "VisionConfig"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        check_choice(owner, "kind", self.kind, VISION_TOWERS, optional=False)
        for name in ("hidden_size", "intermediate_size", "num_heads", "patch_size"):
            fix(name, check_int(owner, name, getattr(self, name), lo=1))
        fix("num_layers", check_int(owner, "num_layers", self.num_layers, lo=0))
        fix("image_size", _image_size(owner, self.image_size))
        check_choice(owner, "hidden_act", self.hidden_act, VISION_ACTIVATIONS, optional=False)
        fix("layer_norm_eps", check_float(owner, "layer_norm_eps", self.layer_norm_eps, positive=True))
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{owner}.hidden_size ({self.hidden_size}) must be a multiple of num_heads "
                             f"({self.num_heads})")
        if any(s < self.patch_size for s in self.image_size):
            raise ValueError(f"{owner}.image_size {self.image_size} is smaller than one patch ({self.patch_size})")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class LlavaConfig:
    """LLaVA (transformers' `LlavaForConditionalGeneration`): a CLIP tower (`vision`, kind "clip", running its first
    `vision.num_layers` layers: the hidden state `vision_feature_layer` selects), its rows (all, or without the class
    token's with `select_strategy` "default") through `linear_2(act(linear_1(x)))` (`projector_act`, biases with
    `projector_bias`) to the decoder's width, in place of the `image_token_id` placeholders of `text`'s decoder."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    select_strategy: str = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True

    def __post_init__(self) -> None:
        owner = "LlavaConfig"
        _check_parts(owner, self.text, self.vision, "clip")
        object.__setattr__(self, "image_token_id", check_int(owner, "image_token_id", self.image_token_id, lo=0))
        check_choice(owner, "select_strategy", self.select_strategy, SELECT_STRATEGIES, optional=False)
        check_choice(owner, "projector_act", self.projector_act, VISION_ACTIVATIONS, optional=False)
        check_bool(owner, "projector_bias", self.projector_bias)
        self.spec  # noqa: B018 - the ImageSpec's checks (the token within the vocabulary)

    @property
    def tokens_per_image(self) -> int:
        """One row per patch, plus the class token's with "full"."""
        return self.vision.num_patches + (self.select_strategy == "full")

    @property
    def spec(self) -> ModelSpec:
        return self.text.spec.replace(images=ImageSpec(self.image_token_id, self.tokens_per_image,
                                                       self.vision.image_size))


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """Gemma 3 with images (transformers' `Gemma3ForConditionalGeneration`): a SigLIP tower (`vision`, kind "siglip",
    square images) whose patch grid is average-pooled to `mm_tokens_per_image` rows (a square number: kernel and
    stride = patches per side // its root), RMS-normed ((1 + w), the tower's `layer_norm_eps`) and projected to the
    decoder's width, in place of the `image_token_id` placeholders of `text`'s Gemma 3 decoder
    (`architecture` "gemma2"); an image's placeholders attend to each other both ways."""

    text: ModelConfig
    vision: VisionConfig
    image_token_id: int
    mm_tokens_per_image: int

    def __post_init__(self) -> None:
        owner = "Gemma3VisionConfig"
        _check_parts(owner, self.text, self.vision, "siglip")
        object.__setattr__(self, "image_token_id", check_int(owner, "image_token_id", self.image_token_id, lo=0))
        tokens = check_int(owner, "mm_tokens_per_image", self.mm_tokens_per_image, lo=1)
        object.__setattr__(self, "mm_tokens_per_image", tokens)
        if self.text.architecture != "gemma2":
            raise ValueError(f"{owner}.text must be a Gemma decoder (architecture 'gemma2'), got "
                             f"{self.text.architecture!r}")
        rows, cols = self.vision.grid
        if rows != cols:
            raise ValueError(f"{owner}.vision.image_size {self.vision.image_size}: the pooling needs a square patch "
                             "grid")
        if self.pooled_side ** 2 != tokens:
            raise ValueError(f"{owner}.mm_tokens_per_image = {tokens}: pooling a {rows} x {rows} patch grid with "
                             f"kernel {self.pool_kernel} gives {self.pooled_side ** 2} rows (it must be a square "
                             f"number whose root divides into the grid)")
        self.spec  # noqa: B018 - the ImageSpec's checks (the token within the vocabulary)

    @property
    def pool_kernel(self) -> int:
        """The average pooling's kernel and stride, in patches (transformers: patches per side // tokens per side)."""
        return max(1, self.vision.grid[0] // max(1, int(self.mm_tokens_per_image ** 0.5)))

    @property
    def pooled_side(self) -> int:
        return self.vision.grid[0] // self.pool_kernel

    @property
    def spec(self) -> ModelSpec:
        return self.text.spec.replace(images=ImageSpec(self.image_token_id, self.mm_tokens_per_image,
                                                       self.vision.image_size, bidirectional=True))


def _check_parts(owner: str, text, vision, kind: str) -> None:
    if not isinstance(text, ModelConfig):
        raise TypeError(f"{owner}.text must be a pagedjax.ModelConfig, got {describe(text)}")
    if not isinstance(vision, VisionConfig):
        raise TypeError(f"{owner}.vision must be a VisionConfig, got {describe(vision)}")
    if vision.kind != kind:
        raise ValueError(f"{owner}.vision must be a {kind!r} tower, got {vision.kind!r}")
    if text.moe is not None:
        raise ValueError(f"{owner}.text: a mixture-of-experts decoder is not supported with images")
    if text.quantization is not None:
        raise ValueError(f"{owner}.text: quantized weights are not supported with images")
