"""What the engine must know of a model that takes images (`ImageSpec`, `ModelSpec.images`): which token stands for
one image's features in a prompt, how many of them one image takes, the pixel size its encoder reads, and
whether an image's tokens attend to each other both ways.

Plain Python, no JAX (`pagedjax.config.model` imports it, and the host side imports that).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_bool, check_int, describe


@dataclass(frozen=True)
class ImageSpec:
    """Images in a model's prompts (`ModelSpec.images`).

    image_token_id    the placeholder token: each image is `tokens_per_image` consecutive copies of it in the
                      prompt's token ids (after the processor's expansion, `pagedjax.model.multimodal.processor`), whose
                      input embeddings the model replaces by the image's features (`pagedjax.model.api.ImageEmbeds`).
    tokens_per_image  how many placeholders (feature rows) one image takes.
    image_size        (height, width) of the pixel arrays the model's `encode_images` takes.
    bidirectional     True: the placeholders of one image attend to each other both ways (the run of consecutive
                      placeholders is one block; everything else causal), as Gemma 3 does; False: causal (LLaVA).

    Every field is checked on construction (TypeError / ValueError naming it); `image_size` is stored as a tuple.
    """

    image_token_id: int
    tokens_per_image: int
    image_size: tuple[int, int]
    bidirectional: bool = False

    def __post_init__(self) -> None:
        owner = "ImageSpec"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("image_token_id", check_int(owner, "image_token_id", self.image_token_id, lo=0))
        fix("tokens_per_image", check_int(owner, "tokens_per_image", self.tokens_per_image, lo=1))
        size = self.image_size
        if isinstance(size, str) or not isinstance(size, tuple | list) or len(size) != 2:
            raise TypeError(f"{owner}.image_size must be (height, width), two ints, got {describe(size)}")
        fix("image_size", (check_int(owner, "image_size[0]", size[0], lo=1),
                           check_int(owner, "image_size[1]", size[1], lo=1)))
        check_bool(owner, "bidirectional", self.bidirectional)
