#!/usr/bin/env python
"""GRPO with Tunix's learner and pagedjax as its rollout engine, on the bundled model (needs `pip install -e
'.[tunix]'`).

Tunix's `GRPOLearner` drives the loop: `RLCluster` builds the rollout engine from `ClusterConfig.rollout_engine`
(here `PagedJaxRollout`, an `LLMEngine` over the actor's own arrays, in batch-invariant mode), samples
`--generations` completions of each prompt (one request with n samples: the group shares its prompt's prefill),
scores them, trains the actor (`TunixPolicy`: the pagedjax model as Tunix's trainer calls it) and hands the new
weights to the engine in place (`update_params`). The reward, as `scripts/rl_tiny.py`'s: 1 when a completion's
text matches a regular expression (default `\\w\\(`, a call such as `len(`), else 0.

Printed per step: the mean reward, the rollout's tokens/s, `update_params`' time, and how far Tunix's trainer
forward (its `compute_per_token_logps` over `TunixPolicy`) is from the rollout's own log-probabilities: Tunix
recomputes them in its own program, so they agree to float32 rounding, not bit for bit (pagedjax's own loop,
`scripts/rl_tiny.py`, trains on `pagedjax.integrations.policy.exact_logprobs`: there they are equal).

    python scripts/grpo_tunix.py                                  # about two minutes on a 2-core CPU
    python scripts/grpo_tunix.py --steps 30 --plot out/grpo.png   # and its reward curve
"""

from __future__ import annotations

import argparse
import functools
import logging
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from rl_tiny import PROMPTS  # the same prompts and reward as pagedjax's own loop

from pagedjax import CacheConfig, SchedulerConfig
from pagedjax.integrations.tunix import PagedJaxRollout, TunixPolicy, TunixTokenizer
from pagedjax.model.llama import model_from_state
from pagedjax.model.loading.loader import load_pretrained

try:
    from tunix.rl import common, rl_cluster
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout
except ImportError as e:
    raise SystemExit("grpo_tunix.py needs Tunix: pip install -e '.[tunix]'") from e



class TimedRollout(PagedJaxRollout):
    """The rollout engine, timing its calls for the table (what the learner sees is `PagedJaxRollout`'s)."""

    log: list[dict] = []
    swaps: list[float] = []  # ms of each check and swap of the actor's new weights into the engine

    def generate(self, prompts, rollout_config, **kwargs):
        start = time.perf_counter()
        out = super().generate(prompts, rollout_config, **kwargs)
        seconds = time.perf_counter() - start - self.swaps[-1] / 1e3
        completions = np.full((len(out.tokens), rollout_config.max_tokens_to_generate), self.pad_id(), np.int32)
        for row, t in enumerate(out.tokens):
            completions[row, :len(t)] = t
        graphdef, state = nnx.split(self.model())
        trainer = np.asarray(common.compute_per_token_logps(
            graphdef, state, prompt_tokens=jnp.asarray(out.left_padded_prompt_tokens),
            completion_tokens=jnp.asarray(completions), pad_id=self.pad_id(), eos_id=self.eos_id()))
        diff = max((float(np.max(np.abs(trainer[row, :len(lp)] - lp))) for row, lp in enumerate(out.logprobs)
                    if len(lp)), default=0.0)
        self.log.append(dict(seconds=seconds, tokens=sum(len(t) for t in out.tokens), diff=diff,
                             update_ms=self.swaps[-1]))
        return out

    def serve_actor_weights(self) -> None:
        start = time.perf_counter()
        super().serve_actor_weights()
        self.swaps.append((time.perf_counter() - start) * 1e3)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts per step (at most {len(PROMPTS)})")
    ap.add_argument("--generations", type=int, default=8, help="samples per prompt (GRPO's group)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--pattern", default=r"\w\(", help="reward 1 when a completion's text matches it")
    ap.add_argument("--plot", metavar="PNG", help="also write the reward curve to this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        ap.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    logging.getLogger("absl").setLevel(logging.WARNING)
    pattern = re.compile(args.pattern)
    cfg, params, tok = load_pretrained(None)
    actor = TunixPolicy(model_from_state(cfg, params))
    tokenizer = TunixTokenizer(tok)
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    seqs = args.prompts * args.generations
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_tokens, max_prompt_length=8, temperature=1.0, top_p=1.0, top_k=None,
        seed=0, return_logprobs=True)
    engine = functools.partial(
        TimedRollout, batch_invariant=True, cache_config=CacheConfig(block_size=16, num_blocks=seqs * 2 + 16),
        scheduler_config=SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=256, max_model_len=64))
    cluster = rl_cluster.RLCluster(
        actor=actor, tokenizer=tokenizer,
        cluster_config=rl_cluster.ClusterConfig(
            role_to_mesh={rl_cluster.Role.ACTOR: mesh, rl_cluster.Role.REFERENCE: mesh, rl_cluster.Role.ROLLOUT: mesh},
            rollout_engine=engine, offload_to_cpu=False, rollout_config=rollout_config,
            training_config=rl_cluster.RLTrainingConfig(
                actor_optimizer=optax.adam(args.lr), eval_every_n_steps=10**9, max_steps=args.steps,
                data_sharding_axis=("fsdp",), pbar_description=None)))
    rewards: list[float] = []

    def reward(prompts, completions, **_):
        r = [float(bool(pattern.search(c))) for c in completions]
        rewards.append(float(np.mean(r)))
        return r

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=[reward],
        algo_config=grpo_learner.GRPOConfig(num_generations=args.generations, num_iterations=1, beta=0.0))
    batches = [{"prompts": np.array(PROMPTS[:args.prompts])} for _ in range(args.steps)]  # an array: Tunix repeats
    # each leaf of a batch G times, and a list is no leaf
    print(f"GRPO (Tunix's learner, pagedjax's rollouts) on the bundled model: {args.prompts} prompts x "
          f"{args.generations} samples x {args.max_tokens} tokens, reward: the text matches {args.pattern!r}")
    start = time.perf_counter()
    learner.train(batches)
    total = time.perf_counter() - start
    print(f"{'step':>4} {'reward':>7} {'rollout tok/s':>13} {'update ms':>9} {'|trainer - rollout| logp':>25}")
    for step, (r, entry) in enumerate(zip(rewards, TimedRollout.log, strict=False)):
        print(f"{step:>4} {r:>7.3f} {entry['tokens'] / entry['seconds']:>13.0f} "
              f"{entry['update_ms']:>9.2f} {entry['diff']:>25.2e}")
    print(f"{len(rewards)} steps in {total:.1f} s; mean reward: first 3 steps {np.mean(rewards[:3]):.3f}, "
          f"last 3 steps {np.mean(rewards[-3:]):.3f}")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(rewards, args.plot)
        print(f"reward curve: {args.plot}")


def plot(rewards: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(rewards, marker="o")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(0, 1)
    ax.set_title("GRPO: Tunix's learner, pagedjax's rollouts (bundled model)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
