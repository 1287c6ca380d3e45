"""Hugging Face GPT-2 folders through the bring-your-own-model example (`tests/model/gpt2_example.py`): a tiny
random `GPT2LMHeadModel` saved with `save_pretrained` gives transformers' float32 logits within 1e-4, and its
greedy continuations token for token through the engine."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedjax import CacheConfig, LLMEngine, SamplingParams, SchedulerConfig  # noqa: E402
from tests.model.gpt2_example import load_hf_gpt2  # noqa: E402

pytestmark = pytest.mark.hf

_rng = np.random.default_rng(1)
PROMPTS = [_rng.integers(0, 96, n).tolist() for n in (1, 5, 17)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  initializer_range=0.2, eos_token_id=95, bos_token_id=95)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def test_logits_match_transformers(folder):
    path, hf = folder
    graphdef, state = nnx.split(load_hf_gpt2(path))
    forward = jax.jit(lambda tokens: nnx.merge(graphdef, state).forward_dense(tokens))
    batch = np.zeros((len(PROMPTS), max(map(len, PROMPTS))), np.int32)  # right-padded: causal, nothing leaks back
    for i, prompt in enumerate(PROMPTS):
        batch[i, :len(prompt)] = prompt
    logits = np.asarray(forward(batch))
    for i, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(logits[i, :len(prompt)], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_engine_greedy_equals_transformers_generate(folder):
    path, hf = folder
    engine = LLMEngine(model=load_hf_gpt2(path), cache_config=CacheConfig(block_size=4, num_blocks=32),
                       scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=48))
    got = [o.output_token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0,
                                                                               max_tokens=6, ignore_eos=True),
                                                       use_tqdm=False)]
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              pad_token_id=95)
        assert tokens == out[0, len(prompt):].tolist()
