"""Embeddings per second: pagedjax vs sentence-transformers (and transformers) on the same local weights, CPU.

    python scripts/bench_embed.py --make /tmp/embed-150m         # write a random ~150M Qwen3-Embedding-shaped folder
    python scripts/bench_embed.py --model /tmp/embed-150m [--batches 1 32 256] [--doc-len 32] [--prefix-len 192]

The folder is a base `Qwen3Model` (tied embeddings, no `model.` prefix) with sentence-transformers' modules
(last-token pooling, Normalize) and a word-level tokenizer, as Qwen3-Embedding folders are laid out. Every system
embeds the same random token-id documents of `--doc-len` tokens (tokenization is left out of every row), float32:
  - sentence-transformers: the `SentenceTransformer` of the folder, called on the batch's ids (its forward:
    transformer, pooling, normalize), with torch's default threads;
  - transformers: `AutoModel` forward, last hidden state's last position, L2-normalised (the same computation);
  - pagedjax: `LLMEngine.embed` (the folder's pooling: last token, normalized), prefix cache reset between runs.
Each row is the best of `--repeats` timed runs after a warm-up run (compiles), "vs ST" its speed over
sentence-transformers' at the same batch, "min cos" the least cosine similarity of its vectors to ST's.
The prefix table: `--batch-prefix` documents that share a `--prefix-len`-token instruction (as retrieval
instructions do), last-token pooling: pagedjax cold (cache reset first), pagedjax warm (the instruction's blocks
cached by the run before: each document computes only its own tokens), and sentence-transformers.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedjax import CacheConfig, LLMEngine, SchedulerConfig  # noqa: E402

logger = logging.getLogger("bench_embed")

SIZES = {  # name: (vocab, hidden, layers, heads, kv heads, intermediate)
    "150m": (50000, 768, 12, 12, 4, 3072),
    "tiny": (512, 64, 2, 4, 2, 128),
}


def make_folder(path: Path, size: str) -> None:
    """A random Qwen3-Embedding-shaped folder (see the module docstring)."""
    import tokenizers
    import torch
    import transformers

    vocab, hidden, layers, heads, kv, inter = SIZES[size]
    config = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                                      intermediate_size=inter, tie_word_embeddings=True, max_position_embeddings=2048)
    torch.manual_seed(0)
    transformers.Qwen3Model(config).eval().save_pretrained(str(path), safe_serialization=True)
    words = {f"w{i}": i for i in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0").save_pretrained(str(path))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True, "include_prompt": True}))
    (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 2048, "do_lower_case": False}))
    logger.info("wrote %s (%s, %d layers, hidden %d)", path, size, layers, hidden)


def best_of(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up: compiles
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def run(path: Path, batches: list[int], doc_len: int, prefix_len: int, batch_prefix: int, repeats: int) -> None:
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(path), device="cpu")
    hf = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    longest = max(batches)
    engine = LLMEngine.from_pretrained(path, dtype="float32", cache_config=CacheConfig(block_size=16),
                                       scheduler_config=SchedulerConfig(
                                           max_model_len=prefix_len + doc_len + 16, max_num_seqs=min(longest, 256),
                                           max_num_batched_tokens=4096))
    vocab = hf.config.vocab_size
    rng = np.random.default_rng(0)

    def systems(docs: np.ndarray):
        ids = torch.from_numpy(docs).long()
        mask = torch.ones_like(ids)

        def st_run():
            with torch.inference_mode():
                return st({"input_ids": ids, "attention_mask": mask})["sentence_embedding"].numpy()

        def hf_run():
            with torch.inference_mode():
                h = hf(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]
                return torch.nn.functional.normalize(h, dim=-1).numpy()

        def pj_run():
            engine.scheduler.reset_prefix_cache()
            return np.array([o.outputs.embedding for o in engine.embed(docs.tolist())])

        return st_run, hf_run, pj_run

    print(f"\nembeddings per second, documents of {doc_len} tokens ({path.name}, float32, best of {repeats})")
    print(f"{'batch':>5} | {'system':<22} | {'ms':>9} | {'emb/s':>8} | {'vs ST':>6} | {'min cos':>8}")
    for batch in batches:
        docs = rng.integers(1, vocab, (batch, doc_len))
        st_run, hf_run, pj_run = systems(docs)
        st_s, st_out = best_of(st_run, repeats)
        for name, fn in (("sentence-transformers", st_run), ("transformers", hf_run), ("pagedjax", pj_run)):
            s, out = (st_s, st_out) if fn is st_run else best_of(fn, repeats)
            print(f"{batch:>5} | {name:<22} | {1e3 * s:>9.1f} | {batch / s:>8.1f} | {st_s / s:>5.2f}x | "
                  f"{min_cosine(out, st_out):>8.6f}")

    prefix = rng.integers(1, vocab, prefix_len)
    docs = np.concatenate([np.tile(prefix, (batch_prefix, 1)), rng.integers(1, vocab, (batch_prefix, doc_len))], 1)
    st_run, _, pj_run = systems(docs)
    st_s, st_out = best_of(st_run, repeats)
    cold_s, cold = best_of(pj_run, repeats)

    def warm():
        return np.array([o.outputs.embedding for o in engine.embed(docs.tolist())])

    engine.embed(docs[:1].tolist())  # the instruction's blocks into the cache
    warm_s, warm_out = best_of(warm, repeats)
    fresh = np.concatenate([prefix, rng.integers(1, vocab, doc_len)]).tolist()
    hits = engine.embed([fresh])[0].num_cached_tokens  # a new document's: the instruction's full blocks
    print(f"\n{batch_prefix} documents sharing a {prefix_len}-token instruction + {doc_len} tokens each (last token)")
    print(f"{'system':<24} | {'ms':>9} | {'emb/s':>8} | {'vs ST':>6} | {'min cos':>8}")
    for name, s, out in (("sentence-transformers", st_s, st_out), ("pagedjax, cold cache", cold_s, cold),
                         (f"pagedjax, warm ({hits} hit)", warm_s, warm_out)):
        print(f"{name:<24} | {1e3 * s:>9.1f} | {batch_prefix / s:>8.1f} | {st_s / s:>5.2f}x | "
              f"{min_cosine(out, st_out):>8.6f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--make", type=Path, help="write a random embedding folder here, then exit")
    p.add_argument("--size", choices=sorted(SIZES), default="150m")
    p.add_argument("--model", type=Path, help="an embedding folder (from --make)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    p.add_argument("--doc-len", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=192)
    p.add_argument("--batch-prefix", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.make is not None:
        make_folder(args.make, args.size)
        return
    if args.model is None:
        p.error("--model (or --make) is required")
    run(args.model, args.batches, args.doc_len, args.prefix_len, args.batch_prefix, args.repeats)


if __name__ == "__main__":
    main()
