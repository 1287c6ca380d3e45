"""Images through the engine: tiny random LLaVA (causal image tokens) and Gemma 3 (an image's tokens attend to each
other both ways) checkpoints made by transformers, prompts of one and two images, batched; the engine's greedy tokens
equal transformers' `generate` through chunked prefill cut inside (LLaVA) or before (Gemma 3) an image, a prefix hit
on the same image and a miss on another, forks (n = 2), preemption and fused decode; plus the prompt refusals."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from tests.model.vision_folders import PROMPTS, random_images, saved_models  # noqa: E402

pytestmark = pytest.mark.hf

MAX_NEW = 6
MIN_MARGIN = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """kind -> (transformers model, its processor, folder)."""
    return {kind: (reference, transformers.AutoProcessor.from_pretrained(folder), folder)
            for kind, (reference, folder) in saved_models(tmp_path_factory).items()}


@pytest.fixture(scope="module")
def engines(models):
    """kind -> an engine of the folder whose steps chunk prompts through images: 16 tokens per image, so a budget of
    20 cuts a LLaVA prompt's chunk inside an image and a Gemma 3 one before it; blocks of 4 put an image over several
    blocks; fused decodes of 4 steps. Tests leave it with nothing running."""
    return {kind: LLMEngine.from_pretrained(folder, cache_config=CacheConfig(block_size=4, num_blocks=128),
                                            scheduler_config=SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=4),
                                            decode_steps_per_call=4)
            for kind, (_, _, folder) in models.items()}


def hf_greedy(model, processor, prompt: str, images) -> list[int]:
    inputs = processor(text=[prompt], images=images, return_tensors="pt")
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = None
    with torch.no_grad():
        out = model.generate(**inputs, generation_config=gen, max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    for logits in out.logits:  # a near tie would make "identical tokens" depend on rounding: these seeds have none
        top2 = torch.topk(logits[0].float(), 2).values
        assert float(top2[0] - top2[1]) > MIN_MARGIN
    return out.sequences[0, inputs["input_ids"].shape[1]:].tolist()


def requests_of(kind: str):
    """(prompt, its images) of each prompt, with distinct images: the two prompts, then the first behind a longer
    text prefix (its image's placeholders start in its third block of 4) with an image, then with another."""
    images = random_images(3)
    first, second = PROMPTS[kind]
    longer = "the dog ran on the mat . " + first
    return [(first, [images[0]]), (second, [images[1], images[2]]), (longer, [images[3]]), (longer, [images[4]])]


def as_request(prompt, images) -> dict:
    return {"prompt": prompt, "multi_modal_data": {"image": images}}


# (CI time) LLaVA's through these flows in the slow run: its parity with transformers runs by default in
# test_token_id_prompts_and_processed_pixels_equal_text_and_pil, the flows with Gemma 3's images (the stricter case:
# images attended both ways, window and global KV cache groups)
@pytest.mark.parametrize("kind", [pytest.param("llava", marks=pytest.mark.slow), "gemma3"])
def test_greedy_equals_transformers_through_chunks_prefix_hits_forks_and_fused_decode(models, engines, kind):
    reference, processor, _ = models[kind]
    prompts = requests_of(kind)
    want = [hf_greedy(reference, processor, p, ims) for p, ims in prompts]
    engine = engines[kind]
    assert engine.scheduler.reset_prefix_cache()  # whatever ran on it before: nothing cached
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = engine.generate([as_request(*p) for p in prompts[:3]], greedy, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == want[:3]
    # again: the first prompt hits its cached blocks (the same image), the longer one with another image only the
    # blocks before its placeholders; the second as two samples (forked after its prefill)
    again = engine.generate([as_request(*prompts[0]), as_request(*prompts[3]), as_request(*prompts[1])],
                            [greedy, greedy, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                                                            n=2)], use_tqdm=False)
    assert again[0].output_token_ids == want[0] and again[1].output_token_ids == want[3]
    assert [c.token_ids for c in again[2].outputs] == [want[1], want[1]]
    first, longer = outs[0].prompt_token_ids, again[1].prompt_token_ids
    image = reference.config.image_token_id
    assert again[0].num_cached_tokens == (len(first) - 1) // 4 * 4  # all but the last token's block
    assert again[1].num_cached_tokens == longer.index(image) // 4 * 4 > 0  # the blocks before the image


# The pools of the preemption test, in blocks: the tiny Gemma 3's window and global layers are 3 KV cache groups of
# one layer each (`pagedjax.config.kv_layout`): 48 of its blocks are the bytes of 16 blocks of all three layers.
NUM_BLOCKS = {"llava": 16, "gemma3": 48}


# (CI time) LLaVA's preemption in the slow run: Gemma 3's, whose images are computed whole, is the stricter case
@pytest.mark.parametrize("kind", [pytest.param("llava", marks=pytest.mark.slow), "gemma3"])
def test_a_small_pool_preempts_and_recomputes_images_exactly(models, kind):
    reference, processor, folder = models[kind]
    prompts = requests_of(kind)[:2]
    want = [hf_greedy(reference, processor, p, ims) for p, ims in prompts]
    engine = LLMEngine.from_pretrained(folder, cache_config=CacheConfig(block_size=4, num_blocks=NUM_BLOCKS[kind],
                                                                        enable_prefix_caching=False),
                                       scheduler_config=SchedulerConfig(max_num_batched_tokens=64,
                                                                        encoder_cache_tokens=16))
    outs = engine.generate([as_request(*p) for p in prompts] * 2,
                           SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == want * 2
    assert engine.stats().scheduler.num_preemptions > 0


def test_token_id_prompts_and_processed_pixels_equal_text_and_pil(models, engines):
    reference, processor, _ = models["llava"]
    prompt, images = requests_of("llava")[0]
    engine = engines["llava"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    text = engine.generate([as_request(prompt, images)], greedy, use_tqdm=False)[0]
    ids = engine.tokenizer.encode(prompt)  # one <image> id: expanded by the engine
    pixels = engine.image_processor.pixel_values(images)
    by_ids = engine.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": list(pixels)}}], greedy,
                             use_tqdm=False)[0]
    expanded = engine.generate([{"prompt_token_ids": text.prompt_token_ids, "multi_modal_data": {"image": images}}],
                               greedy, use_tqdm=False)[0]
    assert by_ids.prompt_token_ids == expanded.prompt_token_ids == text.prompt_token_ids
    assert by_ids.output_token_ids == expanded.output_token_ids == text.output_token_ids
    assert text.output_token_ids == hf_greedy(reference, processor, prompt, images)


def test_bad_image_prompts_are_refused_naming_the_problem(engines):
    engine = engines["gemma3"]
    image = random_images(0)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    cases = [
        ({"prompt": "the <start_of_image>", "multi_modal_data": {"image": [image, image]}},
         "names 1 images .* but multi_modal_data has 2"),
        ({"prompt": "the cat", "prompt_token_ids": [1], "multi_modal_data": {}}, "one of them"),
        ({"prompt": "the <start_of_image>", "multi_modal_data": {"video": [image]}}, "takes 'image' only"),
        ({"prompt": "the <start_of_image>", "images": [image], "multi_modal_data": {}}, "unknown prompt keys"),
        ({"prompt": "the <start_of_image>", "multi_modal_data": {"image": np.zeros((3, 8, 8), np.float32)}},
         r"float32\[3, 16, 16\]"),
        ({"prompt_token_ids": [2, 5] + [engine.model_spec.images.image_token_id] * 16 * 2,
          "multi_modal_data": {"image": [image, image]}}, "adjacent"),
    ]
    for prompt, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.generate([prompt], greedy, use_tqdm=False)
    soft = engine.model_spec.images.image_token_id
    with pytest.raises(ValueError, match="image placeholder tokens .* but no images"):
        engine.generate([[2, soft, 5]], greedy, use_tqdm=False)
    with pytest.raises(TypeError, match="not a PIL.Image.Image"):
        engine.generate([{"prompt": "a <start_of_image>", "multi_modal_data": {"image": ["x.png"]}}], greedy,
                        use_tqdm=False)
    assert not engine.has_unfinished_requests()
    text_engine = LLMEngine.from_pretrained()  # the bundled text model
    with pytest.raises(ValueError, match="takes no images"):
        text_engine.generate([{"prompt": "a", "multi_modal_data": {"image": [image]}}], greedy, use_tqdm=False)


def test_pallas_kernels_serve_bidirectional_images(models):
    """The Pallas kernels (interpreted here; compiled through Triton / Mosaic on GPU / TPU) with Gemma 3's
    `attend_until`, through a chunk that stops before an image: transformers' tokens."""
    reference, processor, folder = models["gemma3"]
    prompt, images = requests_of("gemma3")[1]
    engine = LLMEngine.from_pretrained(folder, backend="pallas", cache_config=CacheConfig(block_size=8),
                                       scheduler_config=SchedulerConfig(max_num_batched_tokens=24))
    out = engine.generate([as_request(prompt, images)], SamplingParams(temperature=0.0, max_tokens=3,
                                                                       ignore_eos=True), use_tqdm=False)[0]
    assert out.output_token_ids == hf_greedy(reference, processor, prompt, images)[:3]
