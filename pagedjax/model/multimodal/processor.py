"""A vision-language folder's processor in numpy + Pillow (no torch, no transformers): images -> pixel arrays, and
prompts -> prompts whose image placeholders are expanded to the tokens the model fills with image features,
as transformers' `LlavaProcessor` / `Gemma3Processor` do.

    processor = load_image_processor("path/to/folder")       # a "llava" or "gemma3" Hugging Face folder
    pixels = processor.pixel_values([image1, image2])        # float32 [2, 3, H, W]
    text = processor.expand_prompt("USER: <image>\\nWhat is this? ASSISTANT:")   # then the folder's tokenizer
    ids = processor.expand_token_ids(token_ids)              # the same for a token-id prompt
    image_placeholder("path/to/folder")                      # "<image>": the placeholder alone, from the configs

Pixels (`ImageProcessor.pixel_values`) follow transformers' PIL backend (`CLIPImageProcessorPil`,
`LlavaImageProcessorPil`, `SiglipImageProcessorPil`, `Gemma3ImageProcessorPil`: what transformers uses without
torchvision; its torchvision backend resizes with its own kernels and may differ by a rounding step of a pixel),
step by step: RGB conversion (an image with transparency composited onto white, any other mode converted by
Pillow; EXIF orientation is not applied, as transformers does not for an image passed to it), LLaVA's optional
`do_pad` to a square of the mean colour, Pillow's resize with the configured filter (`shortest_edge`: the short
side to it, the long one scaled and truncated; or `height` / `width`), a centre crop (zero-padded when the
image is smaller), rescale (in float64, then float32) and normalization (float32). The image processor's
settings come from `processor_config.json`'s nested "image_processor" or else `preprocessor_config.json`
(transformers' order), its class's defaults filling what they leave out; a setting this module does not
implement, or does not know, is a ValueError naming it (Gemma 3's `do_pan_and_scan`, a `size` by
`longest_edge`, `do_pad` outside LLaVA's processor, an unknown key), never ignored. Gemma 3's processor always
converts to RGB and never pans and scans (its call-time defaults override the image processor's), as here.

Prompts: a LLaVA prompt's every `<image>` (the processor's `image_token`) becomes `tokens_per_image` of it; a Gemma 3
prompt's every `<start_of_image>` becomes "\\n\\n<start_of_image>" + `tokens_per_image` `<image_soft_token>`s +
"<end_of_image>\\n\\n". `expand_prompt` then the folder's tokenizer gives transformers' processor's `input_ids`.
`expand_token_ids` does the same on token ids: each placeholder id becomes the replacement's ids (Gemma 3's
"\\n\\n" as the tokenizer encodes it alone). That equals tokenizing the expanded text wherever the tokenizer
splits the text at the placeholder; it differs where the text next to a Gemma 3 placeholder would merge with the
inserted newlines into one token (e.g. a prompt ending in "\\n" before `<start_of_image>`: the text gives one
"\\n\\n\\n" token, the ids "\\n" then "\\n\\n"). A prompt already expanded must not be expanded again.

`decode_image(data)` reads an encoded image as transformers' `load_image` does for a URL or base64 string (EXIF
orientation applied, then converted to RGB).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pagedjax.core.images import placeholder_starts
from pagedjax.model.errors import ModelLoadError, read_json

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
_CLIP = dict(resample=3, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, size={"shortest_edge": 224},
             default_to_square=False, crop_size={"height": 224, "width": 224}, do_resize=True, do_center_crop=True,
             do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True, do_pad=False)
# transformers' image processor classes (by `image_processor_type`, without a "Fast" / "Pil" suffix) -> their
# defaults, for the settings a config leaves out.
IMAGE_PROCESSOR_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP,
    "LlavaImageProcessor": _CLIP,
    "SiglipImageProcessor": dict(resample=3, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=False, crop_size=None,
                                 do_resize=True, do_center_crop=False, do_rescale=True, rescale_factor=1 / 255,
                                 do_normalize=True, do_convert_rgb=True, do_pad=False),
    "Gemma3ImageProcessor": dict(resample=2, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=True, crop_size=None,
                                 do_resize=True, do_center_crop=False, do_rescale=True, rescale_factor=1 / 255,
                                 do_normalize=True, do_convert_rgb=True, do_pad=False, do_pan_and_scan=False),
}
# The fewest source pixels per output pixel, along each axis, that a reduction before the resize leaves
# (`ImageTransform.reduce_factor`): Pillow's own `resize(reducing_gap=...)` calls 3.0 "indistinguishable from fair
# resampling in most cases".
REDUCING_GAP = 3.0
# AutoImageProcessor's class for a folder whose image processor config names none.
_DEFAULT_CLASS = {"llava": "LlavaImageProcessor", "gemma3": "Gemma3ImageProcessor"}
# Keys that change nothing for PIL images turned into numpy arrays (or only name the class).
_INERT = ("image_processor_type", "processor_class", "feature_extractor_type", "_valid_processor_keys", "data_format",
          "input_data_format", "device", "return_tensors", "disable_grouping", "image_seq_length", "pad_size")
_PAN_AND_SCAN = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")
# processor_config.json's keys each processor reads (besides the nested "image_processor").
_PROCESSOR_KEYS = {"llava": ("processor_class", "patch_size", "vision_feature_select_strategy", "image_token",
                             "num_additional_image_tokens", "chat_template"),
                   "gemma3": ("processor_class", "image_seq_length", "chat_template")}


@dataclass(frozen=True)
class ImageTransform:
    """One image processor's steps (see the module docstring): `resize` ("shortest_edge", n) or ("size", (h, w))
    or None, Pillow's `resample` filter, `crop` (h, w) or None, `rescale` factor or None, `normalize` (mean, std) or
    None, `pad_square` (LLaVA's `do_pad`: the background colour) or None, `convert_rgb`."""

    resize: tuple[str, Any] | None
    resample: int
    crop: tuple[int, int] | None
    rescale: float | None
    normalize: tuple[tuple[float, ...], tuple[float, ...]] | None
    pad_square: tuple[int, ...] | None
    convert_rgb: bool

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output, or None when it follows each image's shape."""
        if self.crop is not None:
            return self.crop
        if self.resize is not None and self.resize[0] == "size":
            return self.resize[1]
        return None

    def reduce_factor(self, width: int, height: int) -> int:
        """The largest integer factor of both `width` and `height` by which an image of that size may be shrunk
        before this transform (box averages, Pillow's `Image.reduce`, or a JPEG decoded at a fraction of its size,
        `Image.draft`) while its resize still reads at least `REDUCING_GAP` source pixels per output pixel along
        each axis, in either orientation (EXIF may rotate it after); 1 (no reduction) without a resize or for an
        image within that of the output. A factor of both sides makes every reduced pixel a whole box of the
        image, so the resize sees the image's geometry exactly (a last, partial box would stretch it)."""
        if self.resize is None:
            return 1
        most = min(self._most_reduced(width, height), self._most_reduced(height, width))
        return max(k for k in range(1, most + 1) if width % k == 0 and height % k == 0)

    def _most_reduced(self, width: int, height: int) -> int:
        if self.pad_square is not None:
            width = height = max(width, height)
        out_h, out_w = _resize_shape(height, width, self.resize)
        return max(1, int(min(width / out_w, height / out_h) / REDUCING_GAP))

    def __call__(self, image) -> np.ndarray:
        """One PIL image -> float32 `[3, H, W]`."""
        from PIL import Image

        if self.convert_rgb:
            image = _to_rgb(image)
        elif image.mode != "RGB":
            raise ValueError(f"an image of mode {image.mode!r}: the processor's do_convert_rgb is false, so only RGB "
                             "images are read")
        if self.pad_square is not None:
            image = Image.fromarray(_pad_square(np.asarray(image), self.pad_square))
        if self.resize is not None:
            h, w = _resize_shape(image.height, image.width, self.resize)
            image = image.resize((w, h), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image).transpose(2, 0, 1)  # HWC uint8 -> CHW
        if self.crop is not None:
            pixels = _center_crop(pixels, self.crop)
        if self.rescale is not None:
            pixels = (pixels.astype(np.float64) * self.rescale).astype(np.float32)
        if self.normalize is not None:
            if not np.issubdtype(pixels.dtype, np.floating):
                pixels = pixels.astype(np.float32)
            mean, std = (np.asarray(v, pixels.dtype) for v in self.normalize)
            pixels = ((pixels.T - mean) / std).T
        return np.ascontiguousarray(pixels, dtype=np.float32)


def _to_rgb(image):
    """transformers' `convert_to_rgb`: transparency (an alpha band or a palette / mode transparency) composited
    onto white, anything else converted by Pillow."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        image = image.convert("RGBA")
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")


def _pad_square(pixels: np.ndarray, color: tuple[int, ...]) -> np.ndarray:
    """HWC uint8 centred on a square of `color` (LLaVA's `pad_to_square`: the offset rounds down)."""
    h, w, c = pixels.shape
    if h == w:
        return pixels
    side = max(h, w)
    out = np.empty((side, side, c), pixels.dtype)
    out[...] = np.asarray(color, pixels.dtype)
    top, left = (side - h) // 2, (side - w) // 2
    out[top:top + h, left:left + w] = pixels
    return out


def _resize_shape(h: int, w: int, resize: tuple[str, Any]) -> tuple[int, int]:
    kind, value = resize
    if kind == "size":
        return value
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = value, int(value * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def _center_crop(pixels: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """transformers' `center_crop` of CHW: the centred window (top / left offsets round down); an image smaller
    than the window is first centred on zeros (its offsets round up)."""
    _, h, w = pixels.shape
    ch, cw = size
    top, left = (h - ch) // 2, (w - cw) // 2
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return pixels[:, top:top + ch, left:left + cw]
    nh, nw = max(ch, h), max(cw, w)
    padded = np.zeros((pixels.shape[0], nh, nw), pixels.dtype)
    pad_top, pad_left = math.ceil((nh - h) / 2), math.ceil((nw - w) / 2)
    padded[:, pad_top:pad_top + h, pad_left:pad_left + w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top):min(nh, top + ch), max(0, left):min(nw, left + cw)]


class ImageProcessor:
    """A vision-language folder's processor (`load_image_processor`; the module docstring has the definitions).

    image_size        (height, width) of every pixel array (the model's `ImageSpec.image_size`).
    tokens_per_image  the placeholder tokens (feature rows) one image takes.
    image_token_id    the repeated placeholder's id (`ImageSpec.image_token_id`).
    placeholder       the string that stands for an image in a prompt before expansion ("<image>",
                      "<start_of_image>"); `placeholder_id` its token id.
    """

    def __init__(self, transform: ImageTransform, *, placeholder: str, placeholder_id: int, replacement: str,
                 replacement_ids: Sequence[int], image_token_id: int, tokens_per_image: int):
        size = transform.output_size
        if size is None:
            raise ValueError("ImageProcessor: the transform's output size follows each image (resize by shortest "
                             "edge without a centre crop)")
        self.transform = transform
        self.image_size: tuple[int, int] = size
        self.placeholder, self.placeholder_id = placeholder, placeholder_id
        self.replacement, self.replacement_ids = replacement, tuple(replacement_ids)
        self.image_token_id, self.tokens_per_image = image_token_id, tokens_per_image

    def reduce_factor(self, width: int, height: int) -> int:
        """`ImageTransform.reduce_factor`: how far an image of `width` x `height` may be shrunk before decoding it
        whole (a server's decoder, `pagedjax.serve.images`)."""
        return self.transform.reduce_factor(width, height)

    def pixel_values(self, images: Sequence) -> np.ndarray:
        """PIL images -> float32 `[N, 3, H, W]` (`image_size`); TypeError naming an item that is not one."""
        from PIL import Image

        if isinstance(images, Image.Image):
            images = [images]
        out = np.empty((len(images), 3, *self.image_size), np.float32)
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise TypeError(f"pixel_values: images[{i}] is a {type(image).__name__}, not a PIL.Image.Image")
            out[i] = self.transform(image)
        return out

    def count_images(self, prompt: str | Sequence[int]) -> int:
        """The images a prompt (text, or token ids) asks for before expansion: its placeholders."""
        if isinstance(prompt, str):
            return prompt.count(self.placeholder)
        return sum(1 for t in prompt if t == self.placeholder_id)

    def expand_prompt(self, text: str) -> str:
        """`text` with each placeholder replaced by the image's tokens (transformers' processor's text)."""
        return text.replace(self.placeholder, self.replacement)

    def expand_token_ids(self, ids: Sequence[int]) -> list[int]:
        """A token-id prompt with each `placeholder_id` replaced by the image's token ids (see the module docstring
        for where this differs from expanding the text)."""
        out: list[int] = []
        for t in ids:
            if t == self.placeholder_id:
                out.extend(self.replacement_ids)
            else:
                out.append(int(t))
        return out

    def image_spans(self, ids: Sequence[int]) -> list[int]:
        """The first position of each image's `tokens_per_image` placeholders in expanded token ids, in order
        (`pagedjax.core.images.placeholder_starts`). ValueError for a run that is not whole images."""
        return placeholder_starts(ids, self.image_token_id, self.tokens_per_image)

    def __repr__(self) -> str:
        return (f"ImageProcessor(image_size={self.image_size}, tokens_per_image={self.tokens_per_image}, "
                f"placeholder={self.placeholder!r})")


def decode_image(data: bytes):
    """An encoded image (PNG, JPEG, ...) as transformers' `load_image` reads a URL or base64 string: EXIF
    orientation applied, converted to RGB. ValueError for bytes Pillow cannot decode (Pillow's decompression-bomb
    limit included)."""
    from PIL import Image, ImageOps

    try:
        image = Image.open(io.BytesIO(bytes(data)))
        image.load()
        return ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"not a decodable image: {e}") from None


def load_image_processor(path: str | os.PathLike) -> ImageProcessor:
    """The image processor of a "llava" / "gemma3" Hugging Face folder: `config.json` (the model it feeds),
    `processor_config.json` / `preprocessor_config.json` (the image processor's settings, the processor's),
    `tokenizer.json` and `tokenizer_config.json` (the image tokens). ModelLoadError naming the file and field for
    anything unsupported or inconsistent with the model (another image size, another count of tokens per image,
    another image token)."""
    from pagedjax.model.multimodal.hf_vision import load_config

    folder = Path(path)
    cfg = load_config(folder)
    spec = cfg.spec.images
    family = read_json(folder / "config.json")["model_type"]
    processor_path = folder / "processor_config.json"
    processor = read_json(processor_path) if processor_path.is_file() else {}
    nested = processor.get("image_processor")
    if isinstance(nested, dict):
        image_path, image_config = processor_path, nested
    elif (folder / "preprocessor_config.json").is_file():
        image_path = folder / "preprocessor_config.json"
        image_config = read_json(image_path)
    else:
        raise FileNotFoundError(f"no image processor config in {folder} (processor_config.json's 'image_processor' "
                                "or preprocessor_config.json)")
    try:
        transform = image_transform(image_config, family)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(image_path, str(e)) from None
    if transform.output_size != spec.image_size:
        raise ModelLoadError(image_path, f"the processor makes images of {transform.output_size} (crop_size / size), "
                                         f"the model's vision tower reads {spec.image_size} (vision_config.image_size)")
    unknown = sorted(set(processor) - {"image_processor", *_PROCESSOR_KEYS[family]})
    if unknown:
        raise ModelLoadError(processor_path, f"fields {unknown} are not supported by pagedjax's {family} processor")
    tokenizer, special = _tokenizer(folder)
    try:
        if family == "llava":
            fields = _llava_prompt(processor, special, spec, transform)
        else:
            fields = _gemma3_prompt(processor, special, spec)
        ids = {text: _single_id(tokenizer, text) for text in fields["specials"]}
    except (TypeError, ValueError) as e:
        raise ModelLoadError(processor_path if processor_path.is_file() else folder / "tokenizer_config.json",
                             str(e)) from None
    image_id = ids[fields["image_token"]]
    if image_id != spec.image_token_id:
        raise ModelLoadError(folder / "config.json", f"the model's image token ({spec.image_token_id}, "
                                                     f"image_token_index) is not the tokenizer's "
                                                     f"{fields['image_token']!r} ({image_id})")
    k = spec.tokens_per_image
    if family == "llava":
        replacement = fields["image_token"] * k
        replacement_ids = [image_id] * k
    else:
        boi, eoi, newlines = ids[fields["boi"]], ids[fields["eoi"]], tokenizer.encode("\n\n", add_special_tokens=False)
        replacement = f"\n\n{fields['boi']}{fields['image_token'] * k}{fields['eoi']}\n\n"
        replacement_ids = [*newlines.ids, boi, *[image_id] * k, eoi, *newlines.ids]
    return ImageProcessor(transform, placeholder=fields["placeholder"], placeholder_id=ids[fields["placeholder"]],
                          replacement=replacement, replacement_ids=replacement_ids, image_token_id=image_id,
                          tokens_per_image=k)


def image_placeholder(path: str | os.PathLike) -> str | None:
    """The text that stands for one image in a prompt of a "llava" / "gemma3" folder (`ImageProcessor.placeholder`,
    read as `load_image_processor` reads it, from the configs alone: no tokenizer is loaded), or None for a folder
    of another model type. ModelLoadError for a Gemma 3 folder whose tokenizer_config.json names no boi_token."""
    folder = Path(path)
    family = read_json(folder / "config.json").get("model_type") if (folder / "config.json").is_file() else None
    if family not in _DEFAULT_CLASS:
        return None
    special = _special_tokens(folder)
    if family == "gemma3":
        if "boi_token" not in special:
            raise ModelLoadError(folder / "tokenizer_config.json", "names no boi_token (Gemma 3's image token)")
        return special["boi_token"]
    processor_path = folder / "processor_config.json"
    return _llava_token(read_json(processor_path) if processor_path.is_file() else {}, special)


def _llava_token(processor: dict, special: dict) -> str:
    """LlavaProcessor's image token: the tokenizer's, else processor_config.json's, else "<image>"."""
    return special.get("image_token") or processor.get("image_token") or "<image>"


def _tokenizer(folder: Path):
    """(the folder's `tokenizers.Tokenizer`, tokenizer_config.json's named special tokens)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder} (the processor needs the image tokens' ids)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers package raises bare Exceptions
        raise ModelLoadError(path, f"not a valid tokenizer file: {e}") from e
    return tokenizer, _special_tokens(folder)


def _special_tokens(folder: Path) -> dict[str, str]:
    """tokenizer_config.json's named special tokens ("image_token", "boi_token", ...; its extra_special_tokens)."""
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    special = {}
    for key, value in config.items():  # transformers' model-specific special tokens: "image_token", "boi_token", ...
        if key.endswith("_token") and isinstance(value, dict):
            value = value.get("content")
        if key.endswith("_token") and isinstance(value, str):
            special[key] = value
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        special.update({k: v for k, v in extra.items() if isinstance(v, str)})
    return special


def _single_id(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) != 1:
        raise ValueError(f"the image token {text!r} is not one token of the tokenizer (it encodes to {ids})")
    return ids[0]


def _llava_prompt(processor: dict, special: dict, spec, transform: ImageTransform) -> dict:
    """LlavaProcessor: `image_token` (the tokenizer's, else processor_config's, else "<image>") repeated
    (H // patch_size) * (W // patch_size) + num_additional_image_tokens times, less one with the "default" strategy."""
    token = _llava_token(processor, special)
    patch = processor.get("patch_size")
    extra = processor.get("num_additional_image_tokens") or 0
    strategy = processor.get("vision_feature_select_strategy")
    for key, value, ok in (("patch_size", patch, isinstance(patch, int) and not isinstance(patch, bool) and patch > 0),
                           ("num_additional_image_tokens", extra, isinstance(extra, int) and extra >= 0),
                           ("vision_feature_select_strategy", strategy, strategy in (None, "default", "full"))):
        if not ok:
            raise ValueError(f"field {key!r} = {value!r} is not supported")
    h, w = transform.output_size
    count = (h // patch) * (w // patch) + extra - (strategy == "default")
    if count != spec.tokens_per_image:
        raise ValueError(f"the processor expands an image to {count} tokens (patch_size {patch}, "
                         f"num_additional_image_tokens {extra}, vision_feature_select_strategy {strategy!r}), the "
                         f"model fills {spec.tokens_per_image} (config.json's vision_feature_layer / strategy)")
    return dict(placeholder=token, image_token=token, specials=(token,))


def _gemma3_prompt(processor: dict, special: dict, spec) -> dict:
    """Gemma3Processor: `boi_token` stands for an image, which becomes "\\n\\n" + boi + `image_seq_length`
    `image_token`s + `eoi_token` + "\\n\\n" (tokenizer_config.json's names)."""
    missing = [k for k in ("boi_token", "eoi_token", "image_token") if k not in special]
    if missing:
        raise ValueError(f"tokenizer_config.json names no {', '.join(missing)} (Gemma 3's image tokens)")
    count = processor.get("image_seq_length", 256)
    if count != spec.tokens_per_image:
        raise ValueError(f"field 'image_seq_length' = {count!r}: the model fills {spec.tokens_per_image} tokens per "
                         "image (config.json's mm_tokens_per_image)")
    boi, eoi, image = special["boi_token"], special["eoi_token"], special["image_token"]
    return dict(placeholder=boi, image_token=image, boi=boi, eoi=eoi, specials=(boi, eoi, image))


def image_transform(config: dict, family: str) -> ImageTransform:
    """An image processor config (`preprocessor_config.json`'s object) as the steps it applies; ValueError naming a
    field that is unsupported, unknown or of the wrong type. `family` ("llava" / "gemma3") names the processor,
    whose default class applies when the config names none."""
    name = config.get("image_processor_type") or _DEFAULT_CLASS[family]
    base = name.removesuffix("Fast").removesuffix("Pil")
    if base not in IMAGE_PROCESSOR_DEFAULTS:
        raise ValueError(f"field 'image_processor_type' = {name!r} is not supported (supported: "
                         f"{', '.join(IMAGE_PROCESSOR_DEFAULTS)})")
    defaults = IMAGE_PROCESSOR_DEFAULTS[base]
    known = {*defaults, *_INERT, *(_PAN_AND_SCAN if base == "Gemma3ImageProcessor" else ())}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ValueError(f"fields {unknown} are not supported by pagedjax's {base}")
    if family == "gemma3":  # Gemma3Processor's call-time defaults override these
        config = {**config, "do_convert_rgb": True}
        if config.get("do_pan_and_scan"):
            raise ValueError("field 'do_pan_and_scan' = true is not supported (pan and scan crops are not "
                             "implemented; transformers' Gemma3Processor also skips them unless asked at call time)")
    value = lambda key: defaults[key] if config.get(key) is None else config[key]  # null: the class default
    for key in ("data_format", "input_data_format"):
        if config.get(key) not in (None, "channels_first"):
            raise ValueError(f"field {key!r} = {config[key]!r} is not supported (only channels_first)")
    flags = {}
    for key in ("do_resize", "do_center_crop", "do_rescale", "do_normalize", "do_convert_rgb", "do_pad"):
        flags[key] = value(key)
        if not isinstance(flags[key], bool):
            raise ValueError(f"field {key!r}: expected true or false, got {flags[key]!r}")
    square = value("default_to_square")
    resize = _size(value("size"), square, "size") if flags["do_resize"] else None
    crop = None
    if flags["do_center_crop"]:
        crop_size = _size(value("crop_size"), True, "crop_size")
        if crop_size[0] != "size":
            raise ValueError(f"field 'crop_size' = {value('crop_size')!r}: expected a height and a width")
        crop = crop_size[1]
    resample = value("resample")
    if not (isinstance(resample, int) and not isinstance(resample, bool) and 0 <= resample <= 5):
        raise ValueError(f"field 'resample': expected one of Pillow's filters 0-5, got {resample!r}")
    scale = value("rescale_factor")
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"field 'rescale_factor': expected a number, got {scale!r}")
    mean, std = _channels(value("image_mean"), "image_mean"), _channels(value("image_std"), "image_std")
    pad = None
    if flags["do_pad"]:
        if base != "LlavaImageProcessor":
            raise ValueError(f"field 'do_pad' = true is not supported for {base} (only LlavaImageProcessor's "
                             "pad to a square)")
        pad = tuple(int(x * 255) for x in mean)
    return ImageTransform(resize=resize, resample=resample, crop=crop,
                          rescale=float(scale) if flags["do_rescale"] else None,
                          normalize=(mean, std) if flags["do_normalize"] else None, pad_square=pad,
                          convert_rgb=flags["do_convert_rgb"])


def _size(size, default_to_square: bool, key: str) -> tuple[str, Any]:
    """transformers' size dict (an int or [h, w] converted as `get_size_dict` does) as ("size", (h, w)) or
    ("shortest_edge", n)."""
    positive = lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0
    if positive(size):
        size = {"height": size, "width": size} if default_to_square else {"shortest_edge": size}
    elif isinstance(size, list | tuple) and len(size) == 2:
        size = {"height": size[0], "width": size[1]}
    if isinstance(size, dict) and set(size) == {"height", "width"} and all(map(positive, size.values())):
        return "size", (size["height"], size["width"])
    if isinstance(size, dict) and set(size) == {"shortest_edge"} and positive(size["shortest_edge"]):
        return "shortest_edge", size["shortest_edge"]
    raise ValueError(f"field {key!r} = {size!r} is not supported (a height and width, or a shortest_edge)")


def _channels(value, key: str) -> tuple[float, ...]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        value = [value] * 3
    if not (isinstance(value, list | tuple) and len(value) == 3 and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value)):
        raise ValueError(f"field {key!r}: expected three numbers (one per channel), got {value!r}")
    return tuple(float(v) for v in value)
