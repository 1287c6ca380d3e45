"""The image processor of vision-language folders (`pagedjax.model.multimodal.processor`, numpy + Pillow) against
transformers' processors on tiny LLaVA and Gemma 3 folders (`tests.model.vision_folders`: configs, processor and
tokenizer, no weights): pixel values within 1e-5 (RGB, RGBA, LA, L, P with and without transparency, CMYK images larger
and smaller than the model's size; LLaVA's pad to a square and a centre crop that pads), and token ids identical to
the processor's `input_ids` for prompts with 0, 1 and 2 images. Unsupported settings are refused by name.
"""

from __future__ import annotations

import base64
import io
import json
import shutil

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("PIL")

from PIL import Image  # noqa: E402

from pagedjax.model.errors import ModelLoadError  # noqa: E402
from pagedjax.model.hf_tokenizer import HFTokenizer  # noqa: E402
from pagedjax.model.multimodal.processor import decode_image, image_transform, load_image_processor  # noqa: E402
from tests.model.vision_folders import random_images, save_folder  # noqa: E402

pytestmark = pytest.mark.hf

TOL = 1e-5
PROMPTS = {
    "llava": ["USER: what is the cat ? ASSISTANT:", "USER: <image>\nwhat is this ? ASSISTANT:",
              "<image> the cat sat on <image> a mat"],
    "gemma3": ["<start_of_turn>user\nwhat is this ?<end_of_turn>\n",
               "<start_of_turn>user\n<start_of_image> what is this ?<end_of_turn>\n",
               "the cat<start_of_image>sat on\n\na mat <start_of_image>\n\nthe dog"],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> a folder of configs, processor and tokenizer (no weights); "llava_pad": LLaVA's own image processor
    padding to a square, resizing the short side to 12 and cropping 16 (the crop pads)."""
    out = {kind: save_folder(kind, tmp_path_factory.mktemp(kind)) for kind in ("llava", "gemma3")}
    pad = tmp_path_factory.mktemp("llava_pad")
    shutil.copytree(out["llava"], pad, dirs_exist_ok=True)
    config = json.loads((pad / "processor_config.json").read_text())
    config["image_processor"].update(image_processor_type="LlavaImageProcessor", do_pad=True,
                                     size={"shortest_edge": 12})
    (pad / "processor_config.json").write_text(json.dumps(config))
    out["llava_pad"] = pad
    return out


def _reference(folder):
    return transformers.AutoProcessor.from_pretrained(str(folder))


@pytest.mark.parametrize("kind", ["llava", "llava_pad", "gemma3"])
def test_pixel_values_match_transformers(folders, kind):
    images = random_images()
    ours = load_image_processor(folders[kind]).pixel_values(images)
    reference = _reference(folders[kind])
    if kind == "llava_pad":
        assert type(reference.image_processor).__name__ == "LlavaImageProcessorPil"
    theirs = reference.image_processor(images, return_tensors="np")["pixel_values"]
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (len(images), 3, 16, 16)
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOL)


@pytest.mark.parametrize("kind", ["llava", "gemma3"])
def test_token_ids_match_transformers(folders, kind):
    """0, 1 and 2 images: the expanded text through the folder's tokenizer is the processor's input_ids, and its
    image spans are whole images of the model's tokens_per_image (Gemma 3's token_type_ids)."""
    processor, reference = load_image_processor(folders[kind]), _reference(folders[kind])
    tokenizer = HFTokenizer.from_pretrained(folders[kind])
    images = random_images()
    for n, prompt in enumerate(PROMPTS[kind]):
        assert processor.count_images(prompt) == n
        theirs = reference(text=prompt, images=images[:n] or None)
        ids = tokenizer.encode(processor.expand_prompt(prompt))
        assert ids == list(theirs["input_ids"][0]), prompt
        spans = processor.image_spans(ids)
        assert len(spans) == n
        is_image = np.zeros(len(ids), bool)
        for start in spans:
            is_image[start:start + processor.tokens_per_image] = True
        assert (np.asarray(ids) == processor.image_token_id).tolist() == is_image.tolist()
        if kind == "gemma3":
            assert list(theirs["token_type_ids"][0]) == is_image.astype(int).tolist()


def test_token_id_prompts_expand_as_text(folders):
    """`expand_token_ids` of the tokenized prompt equals the tokenized expansion where the text next to a placeholder
    does not merge with Gemma 3's inserted newlines, and differs where it does (documented): "user\\n" +
    "\\n\\n<start_of_image>" is one "\\n\\n\\n" token in the text, "\\n" and "\\n\\n" in the ids."""
    apart = {"llava": PROMPTS["llava"][1:], "gemma3": ["<start_of_turn>user what is<start_of_image> this ?"]}
    for kind, prompts in apart.items():
        processor, tokenizer = load_image_processor(folders[kind]), HFTokenizer.from_pretrained(folders[kind])
        for prompt in prompts:
            assert processor.expand_token_ids(tokenizer.encode(prompt)) == tokenizer.encode(
                processor.expand_prompt(prompt))
    processor, tokenizer = load_image_processor(folders["gemma3"]), HFTokenizer.from_pretrained(folders["gemma3"])
    for prompt, merged in ((PROMPTS["gemma3"][1], "\n\n\n"), (PROMPTS["gemma3"][2], "\n\n\n\n")):
        from_ids = processor.expand_token_ids(tokenizer.encode(prompt))
        from_text = tokenizer.encode(processor.expand_prompt(prompt))
        assert from_ids != from_text and tokenizer.token_to_id(merged) in set(from_text) - set(from_ids)
        images = processor.count_images(prompt)
        assert len(processor.image_spans(from_ids)) == len(processor.image_spans(from_text)) == images


def test_image_spans_split_adjacent_images(folders):
    processor = load_image_processor(folders["llava"])
    k, image = processor.tokens_per_image, processor.image_token_id
    assert processor.image_spans([1, *[image] * (2 * k), 5]) == [1, 1 + k]
    with pytest.raises(ValueError, match="not whole images"):
        processor.image_spans([1, *[image] * (k + 1)])


def test_decode_image_applies_exif_orientation_as_transformers():
    from transformers.image_utils import load_image

    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (12, 20, 4), dtype=np.uint8), "RGBA")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", exif=exif)
    data = buffer.getvalue()
    ours = decode_image(data)
    theirs = load_image("data:image/png;base64," + base64.b64encode(data).decode())
    assert ours.mode == "RGB" and ours.size == theirs.size == (12, 20)
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    with pytest.raises(ValueError, match="not a decodable image"):
        decode_image(b"not an image")


def test_reduce_factor_leaves_the_resize_three_pixels_per_output_pixel_and_divides_both_sides():
    """How far a server may shrink an image before the processor (`pagedjax.serve.images`): the largest factor of
    both sides that leaves the resize at least 3 source pixels per output pixel along each axis, in either
    orientation."""
    clip = image_transform({"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 336},
                            "crop_size": {"height": 336, "width": 336}}, "llava")
    assert clip.reduce_factor(4096, 4096) == 4  # 12.2 pixels per output pixel: 4 leaves 3.05
    assert clip.reduce_factor(4096, 3072) == 2  # 9.1: 3 would fit, but does not divide 4096
    assert clip.reduce_factor(4095, 4096) == 1  # no common factor: no box of the image is whole
    assert clip.reduce_factor(1000, 1000) == clip.reduce_factor(20, 30) == 1  # within 3x of the output
    padded = image_transform({"image_processor_type": "LlavaImageProcessor", "size": {"shortest_edge": 336},
                              "crop_size": {"height": 336, "width": 336}, "do_pad": True}, "llava")
    assert padded.reduce_factor(4096, 1024) == 4 and clip.reduce_factor(4096, 1024) == 1  # padded to 4096 square
    wide = image_transform({"image_processor_type": "SiglipImageProcessor", "size": {"height": 224, "width": 448}},
                           "gemma3")
    assert wide.reduce_factor(4480, 2240) == wide.reduce_factor(2240, 4480) == 1  # 10 one way, 5 x 20 rotated
    assert wide.reduce_factor(13440, 13440) == 10  # 30 and 60 pixels per output pixel: 10 leaves 3 and 6
    unresized = image_transform({"image_processor_type": "SiglipImageProcessor", "do_resize": False}, "gemma3")
    assert unresized.reduce_factor(4096, 4096) == 1


@pytest.mark.parametrize("changes,field", [
    ({"do_pan_and_scan": True}, "do_pan_and_scan"),
    ({"size": {"shortest_edge": 16, "longest_edge": 32}}, "size"),
    ({"crop_pct": 0.9}, "crop_pct"),
    ({"do_pad": True}, "do_pad"),
    ({"data_format": "channels_last"}, "data_format"),
    ({"resample": "bicubic"}, "resample"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"image_processor_type": "LlavaNextImageProcessor"}, "image_processor_type"),
])
def test_unsupported_image_processor_settings_are_named(changes, field):
    base = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 16, "width": 16}}
    with pytest.raises(ValueError, match=field):
        image_transform({**base, **changes}, "gemma3")


@pytest.mark.parametrize("kind,file,changes,field", [
    ("llava", "processor_config.json", {"patch_size": 8}, "patch_size"),
    ("llava", "processor_config.json", {"num_additional_image_tokens": 0}, "num_additional_image_tokens"),
    ("llava", "processor_config.json", {"image_grid_pinpoints": [[16, 32]]}, "image_grid_pinpoints"),
    ("llava", "config.json", {"image_token_index": 5}, "image_token_index"),
    ("gemma3", "processor_config.json", {"image_seq_length": 4}, "image_seq_length"),
    ("gemma3", "tokenizer_config.json", {"boi_token": None}, "boi_token"),
])
def test_processor_inconsistent_with_the_model_is_refused(folders, tmp_path, kind, file, changes, field):
    shutil.copytree(folders[kind], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / file).read_text())
    config.update(changes)
    (tmp_path / file).write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    with pytest.raises(ModelLoadError, match=field):
        load_image_processor(tmp_path)


def test_crop_size_must_be_the_model_image_size(folders, tmp_path):
    shutil.copytree(folders["llava"], tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    config["image_processor"]["crop_size"] = {"height": 20, "width": 20}
    (tmp_path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="image_size"):
        load_image_processor(tmp_path)
