"""Image encoders (ViT towers in Flax NNX: `clip`, `siglip`, on the shared blocks of `vit`) and the base of the
vision-language models built on them (`vlm`)."""
