"""pagedjax as a Tunix rollout engine (`pip install 'pagedjax[tunix]'`): `PagedJaxRollout` implements Tunix's
`BaseRollout` over an `LLMEngine`, serving either a pagedjax model wrapped in `TunixPolicy` (a pagedjax model as
Tunix's trainer calls its actor) or one of Tunix's own models (Llama3, dense Qwen3: `tunix_models`).

    from tunix.rl import rl_cluster
    actor = TunixPolicy(model)              # a pagedjax model (e.g. load_pretrained's, via model_from_state)
    config = rl_cluster.ClusterConfig(
        rollout_engine=functools.partial(PagedJaxRollout, cache_config=CacheConfig(...), batch_invariant=True),
        ...)
    cluster = rl_cluster.RLCluster(actor=actor, tokenizer=TunixTokenizer(tok), cluster_config=config)

`RLCluster` builds the rollout with `rollout_actor`, `tokenizer`, `mesh` and `rollout_config`; the partial's
keywords go to `LLMEngine` (its cache, scheduler, `batch_invariant`, ...). The engine serves the actor's own arrays
(no copy): `model()` is the actor, so Tunix treats the rollout as sharing the trainer's weights, and each rollout
swaps in the arrays the last optimizer step left in the actor (`LLMEngine.update_weights`, no recompilation). An
actor with qwix LoRA parameters is served as the base weights plus one adapter in a device slot, replaced in place
when the trainer updates it (`lora_scale`, qwix's alpha / rank, is given to the rollout). Not here: a rollout mesh
of several devices (refused), and log-probabilities of temperature-scaled logits (pagedjax's are of the raw logits:
`return_logprobs` at a temperature other than 0 or 1 is refused, as Tunix's trainer would compare them with scaled
ones).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.config.lora import LoRAConfig
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.integrations.rollout import RolloutEngine
from pagedjax.integrations.tunix_models import lora_weights, tunix_family, tunix_model_config, tunix_model_params
from pagedjax.lora.adapter import LoRAAdapter
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.sampling_params import LoRARequest

try:
    from tunix.rl.rollout import base_rollout
except ImportError as e:  # pragma: no cover - the extra is installed where this module is tested
    raise ImportError("pagedjax.integrations.tunix needs Tunix: pip install 'pagedjax[tunix]'") from e


def _int_seed(seed) -> int | None:
    """`RolloutConfig.seed` (None, an int, or a one-element array: Tunix allows a `jax.Array`) as an int; ValueError
    for anything else (a PRNG key is not a seed here)."""
    if seed is None:
        return None
    value = np.asarray(seed)
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
        raise ValueError(f"PagedJaxRollout: RolloutConfig.seed must be an integer or a one-element integer array, "
                         f"got {value.dtype}{list(value.shape)}")
    return int(value.reshape(()))


class TunixPolicy(nnx.Module):
    """A pagedjax model (any with `forward_dense` and `config`) as Tunix's trainer calls an actor:
    `policy(input_tokens, positions=, cache=None, attention_mask=)` -> (float32 logits `[B, L, vocab]`, None).

    Tunix's rows are a left-padded prompt then a right-padded completion: real tokens contiguous, positions
    counting from 0 at the first. Each row is rotated so that its real tokens start at column 0, run through the
    dense forward (causal: the trailing padding changes nothing before it) and rotated back; a row whose mask is
    not one contiguous run, or whose positions do not count from its first real token, gets NaN logits (inside a
    jitted step nothing can raise; a NaN loss says it). Padding columns' logits are finite and meaningless, as
    Tunix masks them."""

    def __init__(self, model: nnx.Module):
        self.model = model

    @property
    def config(self):
        return self.model.config

    def __call__(self, input_tokens: jax.Array,  # i32[B, L]
                 positions: jax.Array | None = None,  # i32[B, L]
                 cache: Any = None, attention_mask: jax.Array | None = None,  # bool[B, L, L]
                 ) -> tuple[jax.Array, None]:
        if cache is not None:
            raise ValueError("TunixPolicy is the trainer's forward: it takes cache=None (rollouts run on "
                             "PagedJaxRollout's engine)")
        b, length = input_tokens.shape
        real = jnp.ones((b, length), bool) if attention_mask is None else attention_mask[:, -1, :].astype(bool)
        count = real.sum(axis=1)
        start = jnp.argmax(real, axis=1)  # the first real token (0 for an empty row)
        cols = jnp.arange(length)
        rotate = (cols[None, :] + start[:, None]) % length  # column i of the rotated row is column i + start
        rotated_real = jnp.take_along_axis(real, rotate, axis=1)
        ok = jnp.all(rotated_real == (cols[None, :] < count[:, None]), axis=1)
        if positions is not None:
            ok &= jnp.all(jnp.where(real, positions == (cols[None, :] - start[:, None]) % length, True), axis=1)
        logits = self.model.forward_dense(jnp.take_along_axis(input_tokens, rotate, axis=1))
        back = (cols[None, :] - start[:, None]) % length
        logits = jnp.take_along_axis(logits, back[:, :, None], axis=1)
        return jnp.where(ok[:, None, None], logits, jnp.nan), None


class TunixTokenizer:
    """A pagedjax tokenizer with the methods Tunix's `TokenizerAdapter` asks for (`bos_id`, `eos_id`, `pad_id`);
    `pad_id`: the one given, else the tokenizer's (`pad_token_id`, or a `<|pad|>` / `<pad>` / `[PAD]` token), else
    EOS (Tunix's rule for Hugging Face tokenizers without one). Encoding adds no BOS: Tunix's sampler adds it."""

    def __init__(self, tokenizer, *, pad_id: int | None = None):
        self.tokenizer = tokenizer
        found = getattr(tokenizer, "pad_token_id", None)
        if found is None and hasattr(tokenizer, "token_to_id"):
            found = next((i for name in ("<|pad|>", "<pad>", "[PAD]")
                          if (i := tokenizer.token_to_id(name)) is not None), None)
        self._pad = pad_id if pad_id is not None else found if found is not None else self.eos_id()

    def encode(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, ByteTokenizer):
            return self.tokenizer.encode(text, add_bos=False)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def bos_id(self) -> int | None:
        return self.tokenizer.bos_token_id

    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    def pad_id(self) -> int:
        return self._pad


class PagedJaxRollout(base_rollout.BaseRollout):
    """Tunix's rollout interface over an `LLMEngine` built from the actor (a `TunixPolicy`, or a Tunix Llama3 /
    Qwen3 model): `engine_kwargs` go to `LLMEngine` (cache, scheduler, `batch_invariant`, `seed`, ...);
    `sleep_when_idle` keeps the KV pool only during rollouts and scoring, so Tunix's training step has that
    memory. Prompts (text) are tokenized as Tunix's
    own sampler does (BOS first, not doubled); see `RolloutEngine` for that and for grouping, seeds, truncation and
    padding."""

    def __init__(self, rollout_actor: nnx.Module, tokenizer, mesh: jax.sharding.Mesh | None = None,
                 rollout_config: base_rollout.RolloutConfig | None = None, *, sleep_when_idle: bool = False,
                 lora_scale: float | None = None, **engine_kwargs):
        base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
        if isinstance(rollout_actor, TunixPolicy):
            config, self._params_of = rollout_actor.config, lambda: nnx.state(rollout_actor.model, base)
        elif tunix_family(rollout_actor) is not None:
            config = tunix_model_config(rollout_actor)
            self._params_of = lambda: tunix_model_params(rollout_actor, config)
        else:
            raise TypeError(f"PagedJaxRollout: rollout_actor must be a TunixPolicy (a pagedjax model for Tunix) or "
                            f"a Tunix Llama3 / Qwen3 model, got {type(rollout_actor).__name__}")
        if mesh is not None and mesh.size > 1:
            raise ValueError(f"PagedJaxRollout: a rollout mesh of {mesh.size} devices; pagedjax's Tunix rollout runs "
                             "on one device (give it a one-device mesh)")
        self._actor = rollout_actor
        self._tokenizer = tokenizer
        lora = lora_weights(rollout_actor)
        self._lora_request = None
        if lora:
            if lora_scale is None:
                raise ValueError("PagedJaxRollout: the actor has LoRA parameters; give lora_scale (qwix's alpha / "
                                 "rank: what scales the adapter's product)")
            rank = next(iter(lora.values()))[0].shape[1]
            engine_kwargs.setdefault("lora_config", LoRAConfig(max_loras=1, max_lora_rank=rank))
            self._lora_request = LoRARequest("tunix-policy", 1, "tunix:policy")  # a name: the weights are given
        elif lora_scale is not None:
            raise ValueError("PagedJaxRollout: lora_scale given for an actor without LoRA parameters")
        self._lora_scale = lora_scale
        self._served = self._leaves(base), self._leaves(nnx.LoRAParam)
        engine = LLMEngine(model_config=config, params=self._params_of(), **engine_kwargs)
        if lora:
            engine.add_lora_adapter(self._lora_request, self._adapter(lora))
        self.rollout = RolloutEngine(engine, pad_id=tokenizer.pad_id(), stop_ids=[tokenizer.eos_id()],
                                     sleep_when_idle=sleep_when_idle, lora_request=self._lora_request)

    def _leaves(self, kind) -> list:
        return jax.tree.leaves(nnx.state(self._actor, kind))

    def _adapter(self, weights: dict) -> LoRAAdapter:
        rank = next(iter(weights.values()))[0].shape[1]
        return LoRAAdapter(lora_name=self._lora_request.lora_name, lora_int_id=self._lora_request.lora_int_id,
                           lora_path=self._lora_request.lora_path, rank=rank, scale=float(self._lora_scale),
                           weights=weights)

    def serve_actor_weights(self) -> None:
        """The engine serves the actor's arrays as they are now. `model()` is the actor, so Tunix takes the rollout
        for one that shares the trainer's weights and never calls `update_params` (`RLLearner.should_sync_weights`);
        each call checks instead whether the trainer replaced the arrays (an optimizer step does) and swaps the new
        ones in: the base weights by `LLMEngine.update_weights` (no copy, no recompilation; a Tunix model's
        attention projections reshaped on the device first, `tunix_models`), LoRA parameters as the adapter's new
        weights in its device slot (`LLMEngine.add_lora_adapter`: the base weights untouched)."""
        base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
        leaves = self._leaves(base), self._leaves(nnx.LoRAParam)
        changed = [len(now) != len(was) or any(a is not b for a, b in zip(now, was, strict=False))
                   for now, was in zip(leaves, self._served, strict=True)]
        if changed[0]:
            self.rollout.update_params(self._params_of())
        if changed[1]:
            self.engine.add_lora_adapter(self._lora_request, self._adapter(lora_weights(self._actor)))
        self._served = leaves

    @property
    def engine(self) -> LLMEngine:
        return self.rollout.engine

    def _encode(self, text: str) -> list[int]:
        ids = list(self._tokenizer.encode(text))
        bos = self._tokenizer.bos_id()
        if bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def generate(self, prompts: str | list[str], rollout_config: base_rollout.RolloutConfig,
                 **kwargs) -> base_rollout.RolloutOutput:
        if kwargs:
            raise TypeError(f"PagedJaxRollout.generate: unexpected arguments {sorted(kwargs)}")
        cfg = rollout_config
        if cfg.return_logprobs and cfg.temperature not in (0.0, 1.0):
            raise ValueError(f"PagedJaxRollout: return_logprobs at temperature {cfg.temperature}: pagedjax returns "
                             "log-probabilities of the raw logits, Tunix's trainer of logits / temperature; sample "
                             "at temperature 1.0 (or 0) to compare them")
        self._check_config(cfg)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        self.serve_actor_weights()
        out = self.rollout.generate(
            [self._encode(p) if isinstance(p, str) else p for p in prompts], max_tokens=cfg.max_tokens_to_generate,
            max_prompt_length=cfg.max_prompt_length, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            seed=_int_seed(cfg.seed), stop_ids=cfg.eos_tokens,
            return_logprobs=cfg.return_logprobs)
        return base_rollout.RolloutOutput(
            text=[self._tokenizer.decode(t.tolist()) for t in out.tokens], logits=None, tokens=out.tokens,
            left_padded_prompt_tokens=out.left_padded_prompt_tokens, logprobs=out.logprobs)

    def _check_config(self, cfg: base_rollout.RolloutConfig) -> None:
        """ValueError for the `RolloutConfig` fields this engine would otherwise ignore: a rollout dtype other than
        the served model's, parallelism over several devices. (The fields of other engines, `rollout_vllm_*` /
        `rollout_sglang_jax_*`, and vanilla's `kv_cache_size` are theirs: the engine's own configs size it.)"""
        dtype = self.engine.model_config.dtype
        if cfg.data_type is not None and jnp.dtype(cfg.data_type) != jnp.dtype(dtype):
            raise ValueError(f"PagedJaxRollout: RolloutConfig.data_type {jnp.dtype(cfg.data_type).name}, but the "
                             f"engine serves the actor's {dtype} weights as they are")
        for name in ("tensor_parallel_size", "data_parallel_size", "expert_parallel_size"):
            if getattr(cfg, name) > 1:
                raise ValueError(f"PagedJaxRollout: RolloutConfig.{name} {getattr(cfg, name)}; pagedjax's Tunix "
                                 "rollout runs on one device")

    def get_per_token_logps(self, prompt_tokens: jax.Array, completion_tokens: jax.Array) -> jax.Array:
        self.serve_actor_weights()
        return jnp.asarray(self.rollout.score(np.asarray(prompt_tokens), np.asarray(completion_tokens)))

    def update_params(self, params, filter_types: tuple[Any, ...] | None = None) -> None:
        """Give the actor these parameters (`nnx.state` of the actor, or of a `TunixPolicy`'s model; all of them,
        or only its LoRA ones: Tunix's `sync_weights` filters by `(nnx.Param,)` or `(nnx.LoRAParam,)`) and serve
        them from the next step on (`serve_actor_weights`)."""
        if filter_types is not None and tuple(filter_types) not in ((nnx.Param,), (nnx.LoRAParam,)):
            raise ValueError(f"PagedJaxRollout.update_params: updates filtered by {filter_types}; "
                             "(nnx.Param,) and (nnx.LoRAParam,) are served")
        of_model = isinstance(self._actor, TunixPolicy) and not (isinstance(params, nnx.State) and
                                                                 set(params) == {"model"})
        nnx.update(self._actor.model if of_model else self._actor, params)
        self.serve_actor_weights()

    def pad_id(self) -> int:
        return self.rollout.pad_id

    def eos_id(self) -> int:
        return self.rollout.stop_ids[0]

    def model(self) -> nnx.Module:
        return self._actor
