"""Time to first token with images, on a random LLaVA-shaped model (a CLIP tower, a two-layer projector, a Llama
decoder; nothing downloaded), through the engine's XLA path on this machine.

Two tables:
  1. TTFT of one request of the same text with 0, 1 and 4 images (new images each time: the encoder runs), its
     prompt tokens, the time in the image encoder and its share of the TTFT, and the ratio to the text-only TTFT.
  2. Prefix-cache savings: the same prompt and image again (its blocks and the image's features are cached: the
     encoder does not run, only the prompt's last block is computed) against the same text with a new image (the
     blocks after the image's first one, and the encoder, run again).
Each row is the median of --repeats runs after one untimed run of the same shapes (compiles excluded); rows of one
table are measured in interleaved rounds, so that machine noise falls on all of them alike.

    python scripts/bench_images.py                 # ~50M decoder, ViT of 6 layers at 224 px (196 tokens/image)
    python scripts/bench_images.py --quick         # a tiny model (smoke test)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np
from flax import nnx

from pagedjax import CacheConfig, LLMEngine, ModelConfig, SamplingParams, SchedulerConfig
from pagedjax.config.vision import LlavaConfig, VisionConfig
from pagedjax.model.multimodal.llava import Llava

logger = logging.getLogger("bench_images")


def build(args) -> tuple[LLMEngine, int, int]:
    text = ModelConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                       num_layers=args.layers, num_q_heads=args.width // 64, num_kv_heads=args.width // 64,
                       max_position_embeddings=4096, dtype="float32")
    vision = VisionConfig("clip", hidden_size=args.vision_width, intermediate_size=4 * args.vision_width,
                          num_layers=args.vision_layers, num_heads=args.vision_width // 64,
                          image_size=(args.image_size, args.image_size), patch_size=args.patch, hidden_act="quick_gelu",
                          layer_norm_eps=1e-5)
    image_token = args.vocab - 1
    model = Llava(LlavaConfig(text=text, vision=vision, image_token_id=image_token), rngs=nnx.Rngs(0))
    tpi = model.spec.images.tokens_per_image
    engine = LLMEngine(model=model, cache_config=CacheConfig(block_size=16, num_blocks=args.blocks),
                       scheduler_config=SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=4,
                                                        encoder_cache_tokens=8 * tpi))
    return engine, image_token, tpi


def prompt(image_token: int, tpi: int, images: list[np.ndarray], text_len: int, salt: int = 0) -> dict:
    """`text_len` text tokens (a sequence of its own per `salt`), then each image's placeholders followed by a few
    text tokens."""
    ids = [1 + (7 * i + 13 * salt) % 97 for i in range(text_len)]
    for k in range(len(images)):
        ids += [image_token] * tpi + [5 + k, 6, 7]
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}


def ttft(engine: LLMEngine, request: dict) -> tuple[float, float, int, int]:
    """(seconds to the first token, seconds of it in the image encoder, prompt tokens, prompt tokens found in the
    prefix cache) of one request alone."""
    before = engine.stats().encoder_s
    start = time.perf_counter()
    out = engine.generate([request], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
    seconds = time.perf_counter() - start
    return seconds, engine.stats().encoder_s - before, len(out.prompt_token_ids), out.num_cached_tokens


def main(argv: list[str] | None = None) -> dict:
    """Print both tables; returns their rows ({"ttft": {images: row}, "prefix": {name: row}}, each row the runs'
    (seconds, encoder seconds, prompt tokens, cached tokens) medians and counts)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--vision-width", type=int, default=384)
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=16)
    ap.add_argument("--text", type=int, default=64, help="text tokens before the images")
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (one step takes a prompt)")
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 2 repeats (smoke test)")
    args = ap.parse_args(argv)
    if args.quick:
        args.width, args.layers, args.vocab, args.vision_width, args.vision_layers = 128, 2, 512, 64, 2
        args.image_size, args.patch, args.text, args.budget, args.repeats = 32, 8, 16, 256, 2
    logging.basicConfig(level=logging.WARNING)
    engine, image_token, tpi = build(args)
    rng = np.random.default_rng(0)
    size = (3, args.image_size, args.image_size)
    fresh = lambda n: [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    counts = (0, 1, 4)
    print(f"model: LLaVA-shaped, decoder {args.layers} x {args.width} (vocab {args.vocab}), CLIP tower "
          f"{args.vision_layers} x {args.vision_width} at {args.image_size} px / {args.patch} = {tpi} tokens per "
          f"image; float32, XLA path; median of {args.repeats}")

    # 1. TTFT by number of images: a text of its own per run and fresh images, so nothing is found in the prefix
    # cache and the encoder runs
    runs: dict[int, list[tuple[float, float, int, int]]] = {n: [] for n in counts}
    salt = 0
    for rnd in range(args.repeats + 1):  # round 0 untimed: compiles these shapes
        for n in counts:
            salt += 1
            run = ttft(engine, prompt(image_token, tpi, fresh(n), args.text, salt))
            assert run[3] == 0, "a prefix hit in the TTFT table"
            if rnd:
                runs[n].append(run)
    base = statistics.median(r[0] for r in runs[0])
    print("\n| images | prompt tokens | TTFT ms | encoder ms | encoder share | vs text only |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in counts:
        t = statistics.median(r[0] for r in runs[n])
        enc = statistics.median(r[1] for r in runs[n])
        print(f"| {n} | {runs[n][0][2]} | {1e3 * t:.1f} | {1e3 * enc:.1f} | {enc / t:.0%} | {t / base:.2f}x |")
    result = {"ttft": {n: _row(runs[n]) for n in counts}, "prefix": {}}

    # 2. the same image again vs a new one, after the same text
    image = fresh(1)
    ttft(engine, prompt(image_token, tpi, image, args.text))  # cached from here on
    rows = {"new image": [], "same image again": []}
    for rnd in range(args.repeats + 1):  # round 0 untimed: compiles the shapes of a prefix hit
        same = ttft(engine, prompt(image_token, tpi, image, args.text))
        new = ttft(engine, prompt(image_token, tpi, fresh(1), args.text))
        if rnd:
            rows["same image again"].append(same)
            rows["new image"].append(new)
    t_new = statistics.median(r[0] for r in rows["new image"])
    print("\n| request (1 image) | TTFT ms | encoder ms | prompt tokens cached | vs new image |")
    print("|---|---:|---:|---:|---:|")
    for name, runs_ in rows.items():
        t = statistics.median(r[0] for r in runs_)
        enc = statistics.median(r[1] for r in runs_)
        print(f"| {name} | {1e3 * t:.1f} | {1e3 * enc:.1f} | {runs_[0][3]} of {runs_[0][2]} | {t / t_new:.2f}x |")
        result["prefix"][name] = _row(runs_)
    result["images_encoded"] = engine.stats().images_encoded
    return result


def _row(runs: list[tuple[float, float, int, int]]) -> dict:
    return {"ttft_s": statistics.median(r[0] for r in runs), "encoder_s": statistics.median(r[1] for r in runs),
            "prompt_tokens": runs[0][2], "cached_tokens": runs[0][3]}


if __name__ == "__main__":
    main()
