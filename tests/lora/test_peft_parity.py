"""Parity with transformers + PEFT: a tiny random Llama and PEFT adapters of different ranks and target sets
(attention-only, MLP-only, all-linear rsLoRA), made and saved by PEFT itself, served by pagedjax in ONE mixed
batch (base rows too), give PEFT's greedy tokens token for token. No hub access: everything is local."""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from pagedjax import CacheConfig, LLMEngine, LoRARequest, SamplingParams, SchedulerConfig  # noqa: E402
from pagedjax.config import LoRAConfig  # noqa: E402
from pagedjax.model.loading.hf_loader import load_hf  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB, MAX_NEW = 96, 6
MIN_MARGIN = 1e-3
ADAPTERS = {  # id: (LoraConfig keywords, torch seed)
    1: (dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), 1),
    2: (dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]), 2),
    3: (dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True), 3),
}
_rng = np.random.default_rng(0)
PROMPTS = [_rng.integers(3, VOCAB, n).tolist() for n in (2, 7, 19)]


def base_model():
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def with_adapter(model, kwargs, seed):
    """A PEFT model of a copy of `model` whose A and B are both random (init_lora_weights=False: B is not zero),
    B scaled up so the adapter changes the greedy tokens."""
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(init_lora_weights=False, **kwargs))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    return peft_model.eval()


def greedy(model, prompt):
    """Greedy continuation by full recompute, and the smallest top-1 / top-2 logit margin on the way."""
    seq, margin = list(prompt), np.inf
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = torch.topk(logits, 2).values
            margin = min(margin, float(top2[0] - top2[1]))
            seq.append(int(torch.argmax(logits)))
    return seq[len(prompt):], margin


def test_one_mixed_batch_equals_peft(tmp_path):
    model = base_model()
    model.save_pretrained(tmp_path / "base", safe_serialization=True)
    loras, expected = {None: None}, {}
    for i, (kwargs, seed) in ADAPTERS.items():
        peft_model = with_adapter(model, kwargs, seed)
        peft_model.save_pretrained(tmp_path / f"a{i}", safe_serialization=True)
        loras[i] = LoRARequest(f"a{i}", i, str(tmp_path / f"a{i}"))
        expected[i] = [greedy(peft_model, p) for p in PROMPTS]
    expected[None] = [greedy(model, p) for p in PROMPTS]
    assert min(m for runs in expected.values() for _, m in runs) > MIN_MARGIN
    assert len({str([t for t, _ in runs]) for runs in expected.values()}) == 4  # every adapter matters

    cfg, state, _ = load_hf(str(tmp_path / "base"))
    engine = LLMEngine(model_config=cfg, cache_config=CacheConfig(block_size=8, num_blocks=64),
                       scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=64),
                       params=state, compile_cache=False, lora_config=LoRAConfig(max_loras=3, max_lora_rank=16))
    batch = [(i, k) for i in loras for k in range(len(PROMPTS))]
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([PROMPTS[k] for _, k in batch], params, use_tqdm=False,
                              lora_request=[loras[i] for i, _ in batch])
    assert [o.outputs[0].token_ids for o in outputs] == [expected[i][k][0] for i, k in batch]
