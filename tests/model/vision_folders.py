"""Tiny Hugging Face vision-language folders made with transformers' own classes, for the model and processor tests:
a LLaVA (CLIP tower + Llama) and a Gemma 3 (SigLIP tower + Gemma 3 text), each saved with its processor (image
processor config, a small word-level tokenizer with the image tokens, processor_config.json) so that
transformers' `AutoProcessor` loads the folder. No hub access.

`save_folder(kind, folder, with_weights=...)` writes one; without weights only the configs and the processor are
written (what the processor tests need). `random_images` makes PIL images of several sizes and modes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "what", "is", "this", "?", "USER", "ASSISTANT", ":",
         "user", "model", "<start_of_turn>", "<end_of_turn>", "\n", "\n\n", "\n\n\n", "\n\n\n\n"]


def llava_tokenizer():
    """Word-level, whitespace and punctuation split, BOS prepended (as Llama's); "<image>" special."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<pad>", "<image>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok


def gemma3_tokenizer():
    """Word-level split at spaces, with runs of newlines as tokens of their own ("\\n\\n" one token, as Gemma's
    tokenizer has them), BOS prepended; Gemma 3's image tokens special."""
    import tokenizers
    from tokenizers import Regex, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", "removed"),
                                                 pre_tokenizers.Split(Regex(r"\n+"), "isolated")])
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>",
                            "<image_soft_token>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 2)])
    return tok


# One prompt with one image, one with two, per kind (the placeholders of each processor).
PROMPTS = {
    "llava": ["USER: <image>\nwhat is this ? ASSISTANT:", "the cat <image> sat on <image> a mat ."],
    "gemma3": ["<start_of_turn>user\n<start_of_image> what is this ?<end_of_turn>\n",
               "the cat<start_of_image>sat on<start_of_image> a mat"],
}

# LLaVA's text models besides Llama (`configs(..., text=...)`): Mistral with a window shorter than the prompts,
# Qwen2 with q/k/v biases and tied embeddings.
LLAVA_TEXT = {"llama": ("LlamaConfig", {}),
              "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=12)),
              "qwen2": ("Qwen2Config", dict(num_key_value_heads=4, tie_word_embeddings=True))}


def configs(kind: str, text: str = "llama", **changes):
    """(transformers config, processor) of a tiny `kind` ("llava" | "gemma3"); LLaVA's `text` model one of
    `LLAVA_TEXT`; `changes` update the top-level config's fields."""
    import transformers

    if kind == "llava":
        tok = llava_tokenizer()
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                    unk_token="<unk>", pad_token="<pad>", image_token="<image>")
        image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": 16},
                                                          crop_size={"height": 16, "width": 16})
        processor = transformers.LlavaProcessor(image_processor=image_processor, tokenizer=fast, patch_size=4,
                                                vision_feature_select_strategy="default",
                                                num_additional_image_tokens=1)
        vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, image_size=16, patch_size=4)
        cls, extra = LLAVA_TEXT[text]
        text = getattr(transformers, cls)(**{**dict(
            vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
            eos_token_id=2), **extra})
        config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                          image_token_index=tok.token_to_id("<image>"), image_seq_length=16,
                                          **changes)
        return config, processor
    tok = gemma3_tokenizer()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                                unk_token="<unk>", pad_token="<pad>", boi_token="<start_of_image>",
                                                eoi_token="<end_of_image>", image_token="<image_soft_token>")
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    processor = transformers.Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size={"height": 16, "width": 16}),
                                             tokenizer=fast, image_seq_length=16)
    # 8 x 8 patches pooled by 2 to 16 tokens per image, more than the local layers' window of 8: an image's
    # placeholders see each other both ways, within the window in the local layers.
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, image_size=16, patch_size=2, vision_use_head=True)
    text = transformers.Gemma3TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=16, max_position_embeddings=256, sliding_window=8,
                                         sliding_window_pattern=2, query_pre_attn_scalar=16, bos_token_id=2,
                                         eos_token_id=1, pad_token_id=0)
    config = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=16,
                                       boi_token_index=tok.token_to_id("<start_of_image>"),
                                       eoi_token_index=tok.token_to_id("<end_of_image>"),
                                       image_token_index=tok.token_to_id("<image_soft_token>"), **changes)
    return config, processor


def randomized(model, seed: int):
    """Every parameter of a transformers model drawn anew, at a scale that keeps activations of order one: matrices
    ~ N(0, 1 / fan_in), embedding tables ~ N(0, 1), norm weights around 1 (around 0 for Gemma's (1 + w) RMSNorms),
    biases and CLIP's class embedding random too: everything a loading mistake could hide behind."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            leaf = name.split(".")[-2] if name.endswith("weight") else ""
            if p.ndim >= 2:
                fan_in = p.shape[0] if name.endswith("mm_input_projection_weight") else int(np.prod(p.shape[1:]))
                scale = 1.0 if "embed" in name and "patch" not in name else fan_in ** -0.5
                p.copy_(scale * noise)
            elif "norm" in leaf or "layrnorm" in leaf:
                gemma_rms = "language_model" in name and "gemma" in type(model).__name__.lower() or \
                    "mm_soft_emb_norm" in name
                p.copy_((0.0 if gemma_rms else 1.0) + 0.2 * noise)
            else:  # biases, class embedding, probe / position vectors
                p.copy_(0.2 * noise)
    return model


def hf_model(kind: str, seed: int = 0, **changes):
    import transformers

    config, _ = configs(kind, **changes)
    model = transformers.AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    return randomized(model.eval(), seed)


def save_folder(kind: str, folder: Path, *, model=None, **changes) -> Path:
    """`kind`'s folder: the configs, the processor and, with `model` (a transformers model of the same config),
    its weights."""
    config, processor = configs(kind, **changes)
    folder = Path(folder)
    if model is None:
        config.save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def saved_models(tmp_path_factory, kinds=("llava", "gemma3")) -> dict:
    """kind -> (a random transformers model of the kind, seeded by its index in `kinds`, its folder)."""
    out = {}
    for seed, kind in enumerate(kinds):
        reference = hf_model(kind, seed)
        out[kind] = (reference, save_folder(kind, tmp_path_factory.mktemp(kind), model=reference))
    return out


def random_images(seed: int = 0):
    """PIL images of several sizes (larger, smaller and thinner than the processors' 16 pixels) and modes (RGB,
    RGBA, LA, L, P with and without transparency, CMYK)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    u8 = lambda *shape: rng.integers(0, 256, shape, dtype=np.uint8)
    images = [Image.fromarray(u8(h, w, 3)) for h, w in ((23, 37), (50, 20), (16, 16), (9, 13), (101, 64))]
    images.append(Image.fromarray(u8(30, 40, 4), "RGBA"))
    images.append(Image.fromarray(u8(19, 26, 2), "LA"))
    images.append(Image.fromarray(u8(30, 17), "L"))
    palette = Image.fromarray(u8(21, 33, 3)).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    images.append(palette)
    transparent = palette.copy()
    transparent.info["transparency"] = 3
    images.append(transparent)
    images.append(Image.fromarray(u8(24, 18, 4), "CMYK"))
    return images
