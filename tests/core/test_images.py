"""Images on the host side: block hashes keyed by image content, the encoder budget and cache, bidirectional
images computed in one step, and every refusal. The property test runs random workloads of prompts with images
through the scheduler and a fake model whose KV at an image placeholder is that image's feature row (so a block
shared across different images, a missing or stale feature, or an image split across steps where it must not be
changes the output), against the cache-free reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from pagedjax.config import CacheConfig, SchedulerConfig
from pagedjax.core.images import ImageInput, image_hash, step_segments
from pagedjax.core.request import Request
from pagedjax.core.scheduler import Scheduler
from pagedjax.core.step_plan import StepPlan
from pagedjax.sampling_params import SamplingParams
from tests.core.harness import VOCAB, Checker, FakeModel, next_token, run_to_completion

IMG = VOCAB  # the placeholder token id (outside the fake vocabulary of sampled tokens)


def image(seed: int, offset: int, length: int) -> ImageInput:
    pixels = np.full((3, 2, 2), float(seed), np.float32)
    return ImageInput(image_hash(pixels), offset, length, pixels)


def feature(content_hash: str, row: int) -> int:
    """What an image's feature row writes into the fake KV: distinct per image and row, never a token id."""
    return 1000 + (int(content_hash[:8], 16) * 31 + row) % 100_000


def prompt_with(images: list[ImageInput], length: int, text: list[int]) -> list[int]:
    tokens = [text[i % len(text)] if text else 0 for i in range(length)]
    for im in images:
        tokens[im.offset:im.end] = [IMG] * im.length
    return tokens


def scheduler(*, budget=16, seqs=4, blocks=64, block_size=4, encoder=8, cache=16, bidirectional=False,
              caching=True, max_model_len=64, tpi=2) -> Scheduler:
    """`tpi` placeholder tokens per image; `encoder` and `cache` in feature rows."""
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                          max_num_encoder_tokens=encoder, encoder_cache_tokens=cache)
    return Scheduler(cfg, CacheConfig(block_size=block_size, enable_prefix_caching=caching), blocks, images=tpi,
                     bidirectional_images=bidirectional)


class ImageFakeModel(FakeModel):
    """`FakeModel` whose KV at an image placeholder is the image's feature row, read from the encoder cache slot the
    plan names: the slot must hold that image's features (encoded into it in this step or an earlier one, and not
    overwritten since); with `bidirectional`, each step's image tokens must reach their image's last placeholder."""

    def __init__(self, num_blocks, block_size, bidirectional=False):
        super().__init__(num_blocks, block_size)
        self.slots: dict[int, str] = {}  # what each encoder cache slot holds
        self.kv_image = np.full(self.kv.shape, -1, np.int64)
        self.bidirectional = bidirectional
        self.encoded = 0

    def step(self, plan: StepPlan) -> np.ndarray:
        for im, slot in plan.encode_images:
            assert im.content_hash not in self.slots.values(), "an image encoded twice while cached"
            self.slots[slot] = im.content_hash
            self.encoded += 1
        image_at = np.full(plan.num_tokens, -1, np.int64)
        for seg in plan.image_segments:
            held = self.slots.get(seg.slot)
            assert held == seg.content_hash, "a step reads a slot that does not hold its image's features"
            image_at[seg.token:seg.token + seg.count] = [feature(held, seg.row + j) for j in range(seg.count)]
            if self.bidirectional:
                assert plan.positions[seg.token + seg.count - 1] == seg.last_position, "an image split across steps"
        assert ((plan.token_ids == IMG) == (image_at >= 0)).all(), "placeholders and segments disagree"
        self.kv_image[plan.slot_mapping] = image_at
        return super().step(plan)

    def read(self, table_row, length, first_query=None):
        tokens = super().read(table_row, length, first_query)
        pos = np.arange(length)
        codes = self.kv_image[table_row[pos // self.block_size] * self.block_size + pos % self.block_size]
        return np.where(codes >= 0, codes, tokens)


def reference(request: Request, max_model_len: int) -> list[int]:
    ctx = list(request.prompt_token_ids)
    for im in request.images:
        ctx[im.offset:im.end] = [feature(im.content_hash, j) for j in range(im.length)]
    out = []
    while True:
        t = next_token(ctx)
        out.append(t)
        ctx.append(t)
        if len(out) >= request.sampling_params.max_tokens or len(ctx) >= max_model_len:
            return out


def run(sched: Scheduler, requests: list[Request], model: ImageFakeModel | None = None
        ) -> tuple[ImageFakeModel, dict]:
    for r in requests:
        sched.add_request(r)
    if model is None:
        model = ImageFakeModel(sched.kv_cache_manager.num_blocks, sched.block_size, sched.bidirectional_images)
    outputs, _ = run_to_completion(sched, model, checker=Checker(sched, model), max_steps=500)
    for r in requests:
        assert outputs[r.request_id] == reference(r, sched.max_model_len), r.request_id
    return model, outputs


def test_the_same_text_with_another_image_shares_only_the_blocks_before_it():
    sched = scheduler(block_size=4)
    kv = sched.kv_cache_manager
    text = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]  # 12 tokens: blocks [0, 4) [4, 8) [8, 12)
    a = Request("a", prompt_with([image(1, 5, 2)], 12, text), images=(image(1, 5, 2),))
    b = Request("b", prompt_with([image(2, 5, 2)], 12, text), images=(image(2, 5, 2),))
    c = Request("c", prompt_with([image(1, 5, 2)], 12, text), images=(image(1, 5, 2),))
    ha, hb, hc = kv.block_hashes(a), kv.block_hashes(b), kv.block_hashes(c)
    assert ha[0] == hb[0]  # no image in the first block
    assert ha[1] != hb[1] and ha[2] != hb[2]  # the image's block, and every later one (chained)
    assert ha == hc  # the same image: the same blocks


def test_prefix_hits_reuse_blocks_under_the_same_image_only():
    sched = scheduler(budget=32, tpi=3)
    text = [1, 2, 3, 4, 5]
    first = Request("a", prompt_with([image(1, 4, 3)], 16, text), SamplingParams(max_tokens=2),
                    images=(image(1, 4, 3),))
    model, _ = run(sched, [first])
    same = Request("b", list(first.prompt_token_ids), SamplingParams(max_tokens=2), images=(image(1, 4, 3),))
    other = Request("c", list(first.prompt_token_ids), SamplingParams(max_tokens=2), images=(image(9, 4, 3),))
    run(sched, [same], model)
    run(sched, [other], model)
    assert same.num_cached_tokens == 12  # every full block of the prompt (the last token is always computed)
    assert other.num_cached_tokens == 4  # the block before the image only


def test_a_step_encodes_within_its_encoder_budget_and_the_rest_waits():
    sched = scheduler(budget=32, encoder=4, cache=16, tpi=4)
    r1 = Request("a", prompt_with([image(1, 2, 4)], 8, [1]), SamplingParams(max_tokens=1), images=(image(1, 2, 4),))
    r2 = Request("b", prompt_with([image(2, 3, 4)], 9, [2]), SamplingParams(max_tokens=1), images=(image(2, 3, 4),))
    sched.add_request(r1)
    sched.add_request(r2)
    plan = sched.schedule()
    assert [im.content_hash for im, _ in plan.encode_images] == [r1.images[0].content_hash]
    assert plan.q_lens.tolist() == [8, 3]  # b runs up to its image, which waits for the next step's budget
    sched.update(plan, np.zeros(plan.num_seqs, np.int32))
    plan = sched.schedule()
    assert [im.content_hash for im, _ in plan.encode_images] == [r2.images[0].content_hash]


def test_one_image_in_two_requests_is_encoded_once():
    sched = scheduler(budget=32, encoder=4, tpi=4)
    prompt = prompt_with([image(1, 1, 4)], 6, [3])
    model, _ = run(sched, [Request(rid, list(prompt), SamplingParams(max_tokens=3), images=(image(1, 1, 4),))
                           for rid in "ab"])
    assert model.encoded == 1


@pytest.mark.parametrize("bidirectional", [False, True])
def test_chunks_split_an_image_only_when_its_attention_is_causal(bidirectional):
    sched = scheduler(budget=6, encoder=8, bidirectional=bidirectional, tpi=5)
    r = Request("a", prompt_with([image(1, 4, 5)], 12, [1, 2]), SamplingParams(max_tokens=2),
                images=(image(1, 4, 5),))
    sched.add_request(r)
    plan = sched.schedule()
    # causal: the 6-token budget splits the image [4, 9); bidirectional: the chunk stops before it
    assert plan.q_lens.tolist() == ([6] if not bidirectional else [4])
    assert len(plan.encode_images) == (1 if not bidirectional else 0)
    sched.update(plan, np.zeros(1, np.int32))
    plan = sched.schedule()
    assert plan.q_lens.tolist() == ([6] if not bidirectional else [6])
    segs = plan.image_segments
    assert [(s.row, s.count) for s in segs] == ([(2, 3)] if not bidirectional else [(0, 5)])
    assert not plan.encode_images if not bidirectional else len(plan.encode_images) == 1


def test_features_stay_while_needed_and_are_encoded_again_after_eviction():
    # a cache of one image: b's image waits while a's chunked prompt still needs a's features, then evicts them; c,
    # with a's image, encodes it again
    sched = scheduler(budget=3, encoder=4, cache=4, tpi=4)
    a = Request("a", prompt_with([image(1, 1, 4)], 8, [1]), SamplingParams(max_tokens=2), images=(image(1, 1, 4),))
    b = Request("b", prompt_with([image(2, 0, 4)], 5, [2]), SamplingParams(max_tokens=2), images=(image(2, 0, 4),))
    c = Request("c", prompt_with([image(1, 0, 4)], 6, [3]), SamplingParams(max_tokens=2), images=(image(1, 0, 4),))
    for r in (a, b):
        sched.add_request(r)
    model = ImageFakeModel(sched.kv_cache_manager.num_blocks, sched.block_size)
    encodes = []
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        encodes.append([im.content_hash for im, _ in plan.encode_images])
        if encodes[-1] == [b.images[0].content_hash]:
            assert a.num_computed_tokens >= a.images[0].end  # only once a has passed its image
        sched.update(plan, model.step(plan))
    run(sched, [c], model)
    assert [h for step in encodes for h in step] == [a.images[0].content_hash, b.images[0].content_hash]
    assert model.encoded == 3


def test_refusals_name_the_problem():
    sched = scheduler(budget=8, encoder=4, cache=8, bidirectional=True, tpi=2)
    text_only = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(), 16)
    r = Request("x", [IMG] * 3 + [1], images=(image(1, 0, 3),))
    with pytest.raises(ValueError, match="takes no images"):
        text_only.add_request(r)
    for images, prompt_len, match in [
        ((image(1, 0, 3),), 8, "image 0 has 3 placeholder tokens; this model's images take 2"),
        ((image(1, 2, 2), image(2, 3, 2)), 8, "after the previous image"),  # overlapping
        ((image(1, 7, 2),), 8, "inside the 8-token prompt"),
        ((image(1, 0, 0),), 8, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            sched.add_request(Request("y", [1] * prompt_len, images=images))
    wide = scheduler(budget=4, encoder=8, cache=8, bidirectional=True, tpi=5)
    with pytest.raises(ValueError, match="run in one step, but max_num_batched_tokens is 4"):
        wide.add_request(Request("z", [1] * 8, images=(image(1, 1, 5),)))
    with pytest.raises(ValueError, match="ends inside an image"):
        sched.add_request(Request("w", [1, IMG, IMG], SamplingParams(n=2), images=(image(1, 1, 2),)))
    # a causal model forks through an image at the prompt's end
    scheduler(bidirectional=False).add_request(Request("w", [1, IMG, IMG], SamplingParams(n=2),
                                                       images=(image(1, 1, 2),)))
    with pytest.raises(ValueError, match="below one image"):
        SchedulerConfig(max_num_encoder_tokens=4).resolve_images(8)
    resolved = SchedulerConfig(max_num_batched_tokens=256).resolve_images(576)
    assert (resolved.max_num_encoder_tokens, resolved.encoder_cache_tokens) == (576, 1152)


def test_step_segments_lay_out_image_rows_on_the_step_tokens():
    ims = (image(1, 2, 3), image(2, 7, 2))
    # positions 3..8 from step token 10: image 1's rows 1-2 (positions 3, 4), image 2's rows 0-1 (positions 7, 8)
    segs = step_segments(ims, 3, 6, 10, {ims[0].content_hash: 5, ims[1].content_hash: 0}.get)
    assert [(s.slot, s.row, s.token, s.count, s.last_position) for s in segs] == [(5, 1, 10, 2, 4), (0, 0, 14, 2, 8)]


@st.composite
def workloads(draw):
    bidirectional = draw(st.booleans())
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_len = 24
    tpi = draw(st.integers(1, 6))  # rows per image (one model: every image the same size)
    budget = draw(st.integers(tpi if bidirectional else 1, 16))
    cfg = dict(budget=budget, seqs=draw(st.integers(1, 4)), block_size=block_size,
               blocks=draw(st.integers(-(-max_len // block_size), 3 * max_len // block_size)),
               encoder=draw(st.integers(tpi, 3 * tpi)), cache=draw(st.integers(tpi, 4 * tpi)),
               bidirectional=bidirectional, caching=draw(st.booleans()), max_model_len=max_len, tpi=tpi)
    requests = []
    for i in range(draw(st.integers(1, 6))):
        length = draw(st.integers(1, 16))
        offsets = sorted(draw(st.lists(st.integers(0, max(0, length - tpi)), max_size=3, unique=True)))
        ims, end = [], 0
        for off in offsets:
            if off >= end and off + tpi <= length:
                ims.append(image(draw(st.integers(0, 3)), off, tpi))
                end = off + tpi
        text = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))
        requests.append(Request(f"r{i}", prompt_with(ims, length, text),
                                SamplingParams(max_tokens=draw(st.integers(1, 6))), images=tuple(ims)))
    return cfg, requests


@settings(max_examples=2 * settings.default.max_examples)
@given(workloads())
@example((dict(budget=5, seqs=2, block_size=2, blocks=12, encoder=3, cache=3, bidirectional=True, caching=True,
               max_model_len=24, tpi=3),
          [Request("a", [1, IMG, IMG, IMG, 2, 2], SamplingParams(max_tokens=4), images=(image(1, 1, 3),)),
           Request("b", [1, IMG, IMG, IMG, 2, 2], SamplingParams(max_tokens=4), images=(image(2, 1, 3),))]))
@example((dict(budget=14, seqs=3, block_size=2, blocks=21, encoder=8, cache=4, bidirectional=True, caching=False,
               max_model_len=24, tpi=3),  # an image seen twice must not hold the cache against the one between
          [Request("a", prompt_with([image(0, 1, 3), image(1, 6, 3), image(0, 12, 3)], 15, [1]),
                   SamplingParams(max_tokens=6), images=(image(0, 1, 3), image(1, 6, 3), image(0, 12, 3))),
           Request("b", prompt_with([image(0, 2, 3)], 5, [2]), SamplingParams(max_tokens=1), images=(image(0, 2, 3),)),
           Request("c", prompt_with([image(0, 0, 3)], 4, [3]), SamplingParams(max_tokens=5),
                   images=(image(0, 0, 3),))]))
def test_any_workload_with_images_gives_the_reference_outputs(workload):
    cfg, requests = workload
    sched = scheduler(**cfg)
    accepted = []
    for r in requests:
        try:
            sched.add_request(r)
        except ValueError as e:
            assert "more than the whole pool" in str(e), e
            continue
        accepted.append(r)
    model = ImageFakeModel(sched.kv_cache_manager.num_blocks, sched.block_size, cfg["bidirectional"])
    outputs, _ = run_to_completion(sched, model, checker=Checker(sched, model), max_steps=2000)
    for r in accepted:
        assert outputs[r.request_id] == reference(r, sched.max_model_len), r.request_id
    assert sched.encoder_cache.num_cached <= cfg["cache"] // cfg["tpi"]
    if sched.stats().num_preemptions:
        event("preempted")
    if sched.stats().prefix_cache_hits:
        event("prefix hit")
