"""pagedjax against transformers on the same DeepSeek V3 checkpoint (multi-head latent attention, sigmoid-routed
experts), on this CPU: prefill and decode tokens/s at batch 1 and a small batch, greedy, EOS ignored, the same
token ids for both, interleaved rounds, medians; and whether the greedy tokens are identical.

    python scripts/bench_mla_hf.py                    # the "small" V3-shaped model, MoE layers (a minute or two)
    python scripts/bench_mla_hf.py --dense            # the same with every layer's MLP dense
    python scripts/bench_mla_hf.py --quick            # = --model micro --rounds 1 --torch-threads 1: the smoke test

The checkpoint is written by transformers' own classes (`DeepseekV3Config` + `DeepseekV3ForCausalLM(...)
.save_pretrained`, float32 safetensors; kept in `--folder` and reused while its shape is unchanged), random:

    model   shape
    small   DeepSeek V3's layout scaled down: hidden 512, 6 layers (the first dense, intermediate 1408; then MoE:
            16 routed experts of width 256, top 4 in the 2 best of 4 groups, 1 shared expert), 8 heads, q_lora_rank
            256, kv_lora_rank 128, rope 32, nope 64, v 64, YaRN-free RoPE, vocab 16000 (~57M parameters)
    micro   hidden 32, 2 layers (1 dense, 1 MoE of 8 experts, top 2), 4 heads, kv_lora_rank 16 (the smoke test)

`--dense` makes every layer dense (`first_k_dense_replace` = the layer count). transformers runs its experts through
its configured experts implementation (the report names it and the attention implementation; `grouped_mm`, torch's
grouped matmul, in transformers 5.25), pagedjax's CPU path a token's own experts at batch 1 and every expert as
three large dots otherwise. Both are what each ships, and transformers' MoE path is not unrepresentatively slow
(measured under load, 1 thread, batch-1 decode of "small": ~45-50 ms/token with MoE against ~37 ms/token with
--dense, whose dense MLPs do slightly more work per token), so the MoE rows are the default; the dense rows
isolate the attention and the engine.

Systems (each row of the table):
- pagedjax: `LLMEngine.from_pretrained(folder, dtype="float32")` (bench_peers' set-up: block size 16, prefix caching
  on, fresh prompts every round), absorbed MLA over latent pages, `decode_steps_per_call` per --pagedjax-steps.
  Requests are added and the engine stepped: prefill = until every sequence has its first token, decode = from
  then until every sequence has its N tokens.
- transformers: `generate(do_sample=False)` with an attention mask (bench_peers' `Transformers`), torch CPU, one
  row per --torch-threads value (`torch.set_num_threads`, docs/benchmarks.md: on a shared 2-core machine 1 thread
  is often faster). Its DeepSeek V3 attention (transformers 5.25) caches the compressed latent and rotary key, as
  pagedjax does, but computes MLA without absorption: every step expands every cached token's K / V per head
  (`expand_kv`, the non-absorbed form of scripts/bench_mla_absorb.py), then runs SDPA. A streamer records when
  each token reaches the host: prefill = until the first new token, decode = from then until the last.

Prefill tok/s = batch x prompt tokens / prefill seconds; decode tok/s = batch x (N - 1) / decode seconds. Before
timing each system runs each workload once (pagedjax compiles there). "vs pagedjax" = the median over rounds of
(pagedjax's seconds / this system's): above 1 this system is faster. Greedy tokens are compared with pagedjax's
position by position, every round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_peers import PagedJax, Transformers, Workload, _cpu_name, _version, make_prompts  # noqa: E402

logger = logging.getLogger("bench_mla_hf")  # progress; the tables are printed

COMMON = dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False, rope_interleave=True, norm_topk_prob=True,
              routed_scaling_factor=2.5)
MODELS: dict[str, tuple[dict, tuple[Workload, ...]]] = {
    "small": (dict(COMMON, vocab_size=16000, hidden_size=512, intermediate_size=1408, moe_intermediate_size=256,
                   num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8,
                   n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                   q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                   initializer_range=0.05),
              (Workload("b1 256+32", 1, 256, 32), Workload("b4 256+32", 4, 256, 32))),
    "micro": (dict(COMMON, vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                   num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                   n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
                   q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                   initializer_range=0.2),
              (Workload("b1 8+6", 1, 8, 6), Workload("b2 8+6", 2, 8, 6))),
}
REFERENCE = "pagedjax, 8-step decode"


def build_checkpoint(folder: Path, hf_kwargs: dict, seed: int = 0) -> Path:
    """A random transformers DeepSeek V3 of `hf_kwargs` saved in `folder` (float32 safetensors); reused if already
    there with this shape."""
    spec = json.dumps({"deepseek_v3": hf_kwargs, "seed": seed}, sort_keys=True)
    marker = folder / "bench_mla_hf_spec.json"
    if marker.is_file() and marker.read_text() == spec and any(folder.glob("*.safetensors")):
        return folder
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**hf_kwargs)).to(torch.float32).eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    marker.write_text(spec)
    return folder


class PagedJaxPhases(PagedJax):
    """bench_peers' pagedjax set-up, timed by phase through `add_request` / `step`."""

    def run_phases(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, float, np.ndarray]:
        """(prefill seconds, decode seconds, tokens `[batch, new_tokens]`)."""
        from pagedjax import SamplingParams

        engine = self.engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ids = engine.fresh_request_ids("bench", len(prompts))
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        start = time.perf_counter()
        for rid, p in zip(ids, prompts, strict=True):
            engine.add_request(rid, p.tolist(), params)
        first = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = list(out.output_token_ids)
            if first is None and all(tokens.values()):
                first = time.perf_counter()
        end = time.perf_counter()
        return first - start, end - first, np.array([tokens[rid] for rid in ids])


class _Clock:
    """A transformers streamer that notes when each `put` comes: the prompt, then every new token."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class TransformersPhases(Transformers):
    """bench_peers' transformers set-up, timed by phase through a streamer."""

    def implementations(self) -> str:
        cfg = self.model.config
        return (f"attention {getattr(cfg, '_attn_implementation', '?')}, "
                f"experts {getattr(cfg, '_experts_implementation', '?')}")

    def run_phases(self, prompts: np.ndarray, new_tokens: int) -> tuple[float, float, np.ndarray]:
        torch = self.torch
        saved = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        clock = _Clock()
        try:
            ids = torch.from_numpy(prompts).long()
            with torch.inference_mode():
                start = time.perf_counter()
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                          min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                          pad_token_id=0, streamer=clock)
        finally:
            torch.set_num_threads(saved)
        if len(clock.times) != new_tokens + 1:
            raise RuntimeError(f"expected {new_tokens + 1} streamer calls, got {len(clock.times)}")
        return clock.times[1] - start, clock.times[-1] - clock.times[1], out[:, prompts.shape[1]:].numpy()


def run_bench(model: str, *, dense: bool = False, rounds: int = 3, folder: Path | None = None, seed: int = 0,
              torch_threads: tuple[int, ...] = (1, 2), pagedjax_steps: tuple[int, ...] = (8,)) -> dict:
    hf_kwargs, workloads = MODELS[model]
    if dense:
        hf_kwargs = dict(hf_kwargs, first_k_dense_replace=hf_kwargs["num_hidden_layers"])
    name = f"bench-mla-hf-{model}{'-dense' if dense else ''}"
    folder = build_checkpoint(Path(folder or Path(tempfile.gettempdir()) / name), hf_kwargs, seed)
    vocab = hf_kwargs["vocab_size"]
    systems = [PagedJaxPhases(folder, workloads, steps, 16, 1024) for steps in dict.fromkeys(pagedjax_steps)]
    systems += [TransformersPhases(folder, threads) for threads in dict.fromkeys(torch_threads)]
    reference = systems[0].name
    times = {(s.name, w.name): [] for s in systems for w in workloads}  # (prefill s, decode s) per round
    tokens = {(s.name, w.name): [] for s in systems for w in workloads}
    loads = []
    for s in systems:  # warm-up: pagedjax compiles its step shapes here
        for w in workloads:
            s.run_phases(make_prompts(w, vocab, seed, 10_000), w.new_tokens)
        s.start_timing()
    logger.info("warm-up done; %d timed round(s)", rounds)
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for w in workloads:
            prompts = make_prompts(w, vocab, seed, r)
            for s in order:
                prefill_s, decode_s, out = s.run_phases(prompts, w.new_tokens)
                if out.shape != (w.batch, w.new_tokens):
                    raise RuntimeError(f"{s.name} returned tokens of shape {out.shape} for {w.name}")
                times[s.name, w.name].append((prefill_s, decode_s))
                tokens[s.name, w.name].append(out)
        logger.info("round %d/%d done", r + 1, rounds)
    loads.append(os.getloadavg()[0])
    rows = []
    for w in workloads:
        ref = times[reference, w.name]
        for s in systems:
            t = times[s.name, w.name]
            pairs = list(zip(tokens[s.name, w.name], tokens[reference, w.name], strict=True))
            mismatch = next(((i, int(np.argmax(np.any(a != b, axis=0)))) for i, (a, b) in enumerate(pairs)
                             if not np.array_equal(a, b)), None)
            rows.append(dict(
                workload=w.name, system=s.name,
                prefill_tok_s=w.batch * w.prompt_len / statistics.median(p for p, _ in t),
                decode_tok_s=w.batch * (w.new_tokens - 1) / statistics.median(d for _, d in t),
                prefill_vs=statistics.median(rp / p for (rp, _), (p, _) in zip(ref, t, strict=True)),
                decode_vs=statistics.median(rd / d for (_, rd), (_, d) in zip(ref, t, strict=True)),
                agreement=float(np.mean([np.mean(a == b) for a, b in pairs])),
                first_mismatch=mismatch))  # (round, position) of the first differing token, or None
    compiled = sum(s.timed_compilations for s in systems if isinstance(s, PagedJax))
    versions = {"jax": _version("jax"), "transformers": _version("transformers"), "torch": _version("torch"),
                "cpu": f"{_cpu_name()}, {os.cpu_count()} logical CPUs",
                "transformers implementations": next(s.implementations() for s in systems
                                                     if isinstance(s, TransformersPhases))}
    return dict(model=model, dense=dense, config=hf_kwargs, folder=str(folder), rounds=rounds, rows=rows,
                loads=loads, versions=versions, timed_compilations=compiled, reference=reference,
                num_params=_num_params(folder))


def _num_params(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            total += sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
    return total


def format_report(res: dict) -> str:
    k = res["config"]
    moe = (f"{k['first_k_dense_replace']} dense layer(s), then {k['n_routed_experts']} routed experts of width "
           f"{k['moe_intermediate_size']}, top {k['num_experts_per_tok']}, {k['n_shared_experts']} shared"
           if k["first_k_dense_replace"] < k["num_hidden_layers"] else "every layer dense")
    lines = [
        f"**{res['model']}{' (dense)' if res['dense'] else ''}**: a random DeepSeek V3 checkpoint "
        f"({res['num_params'] / 1e6:.1f}M parameters: hidden {k['hidden_size']}, {k['num_hidden_layers']} layers, "
        f"{moe}; {k['num_attention_heads']} heads, q_lora_rank {k['q_lora_rank']}, kv_lora_rank {k['kv_lora_rank']}, "
        f"rope {k['qk_rope_head_dim']}, nope {k['qk_nope_head_dim']}, v {k['v_head_dim']}, vocab {k['vocab_size']}, "
        f"float32), CPU. Greedy, EOS ignored, the same token ids for every system; medians of {res['rounds']} "
        "interleaved round(s) after one warm-up run of each workload. vs pagedjax > 1: faster than pagedjax.",
        "",
        "| workload | system | prefill tok/s | vs pagedjax | decode tok/s | vs pagedjax | same tokens |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['workload']} | {r['system']} | {r['prefill_tok_s']:,.0f} | {r['prefill_vs']:.2f}x | "
                     f"{r['decode_tok_s']:,.1f} | {r['decode_vs']:.2f}x | {r['agreement']:.3f} |")
    lines.append("")
    others = [r for r in res["rows"] if r["system"] != res["reference"]]
    if all(r["first_mismatch"] is None for r in others):
        lines.append("Greedy tokens identical to pagedjax's for every system, workload and round: yes")
    else:
        lines.append("Greedy tokens identical to pagedjax's: NO; first difference (round, position): " + "; ".join(
            f"{r['system']} {r['workload']} {r['first_mismatch']}" for r in others if r["first_mismatch"]))
    if res["timed_compilations"]:
        lines.append(f"pagedjax compiled {res['timed_compilations']} new step shape(s) during timed runs")
    v = res["versions"]
    lines.append(f"Versions: jax {v['jax']}, transformers {v['transformers']} ({v['transformers implementations']}), "
                 f"torch {v['torch']}; {v['cpu']}.")
    lines.append("Load average (1 min) at each round's start and at the end: "
                 + ", ".join(f"{x:.1f}" for x in res["loads"]))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--dense", action="store_true", help="every layer's MLP dense (no experts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--folder", type=Path, help="where to write (or reuse) the checkpoint")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, nargs="+", default=[1, 2], help="transformers rows, one per count")
    ap.add_argument("--pagedjax-steps", type=int, nargs="+", default=[8],
                    help="pagedjax rows, one per decode_steps_per_call (the first is the reference)")
    ap.add_argument("--json", type=Path, help="also write the results as JSON")
    ap.add_argument("--quick", action="store_true", help="the micro model, one round, 1 torch thread: seconds")
    args = ap.parse_args(argv)
    if args.quick:
        args.model, args.rounds, args.torch_threads = "micro", 1, [1]
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    res = run_bench(args.model, dense=args.dense, rounds=args.rounds, folder=args.folder, seed=args.seed,
                    torch_threads=tuple(args.torch_threads), pagedjax_steps=tuple(args.pagedjax_steps))
    print(format_report(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=float))
    return res


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    main()
