"""Where every array lives on a `tp` mesh: PartitionSpecs for the model's parameters (by name) and the KV cache.

Megatron-style tensor parallelism, expressed only as shardings (XLA inserts the collectives):
  q_proj, k_proj, v_proj, gate_proj, up_proj  kernels `[in, out]` sharded by output columns (by heads), biases
                                              likewise: each device computes its own heads / MLP columns.
  o_proj, down_proj                           kernels sharded by input rows: each device's partial product is
                                              summed by one all-reduce per attention block and per MLP.
  embed_tokens, lm_head                       sharded over the vocabulary; the logits are gathered (replicated)
                                              before sampling, since top-k / top-p need whole rows.
  norms, the MoE router (`gate`)              replicated.
  experts (MoE gate_proj, up_proj, down_proj) stacked `[E, width, hidden]`, sharded by expert (axis 0): expert
                                              parallelism over the same axis. Tokens stay replicated; XLA's SPMD
                                              partitioner turns the grouped matmul over the local experts into a
                                              partial sum per device and one all-reduce per MoE layer (docs/design.md,
                                              "Mixture of experts"). The experts' biases (gpt-oss), `[E, width]`
                                              and `[E, hidden]`, split along axis 0 alike. Quantized experts
                                              (`pagedjax.model.layers.moe_quant`): each projection's `qweight` and
                                              `scale`, `[E, ...]` too, split along axis 0 alike.
  quantized linears (`pagedjax.model.layers.quant`)  `qweight`, stored `[out, in]`, along the kernel's split dimension
                                              (axis 0 for column-sharded layers, 1 for row-sharded ones); `scale`
                                              along the same output channels (per channel `[out]`: replicated for
                                              a row-sharded layer) or, int4's `[out, in // g]`, like its `qweight`
                                              (tp must divide the groups too, else the layer is replicated).
  KV cache `[kv_heads, blocks, block_size, head_dim]` per layer: sharded by KV heads (axis 0).
  recurrent state snapshots (`RecurrentState`: `[blocks, heads, ...]` and conv windows `[blocks, channels, K - 1]`):
                                              sharded by heads / channels (axis 1); the hybrid families declare how
                                              their linear layers' projections split (`param_partition`) and compute
                                              each device's heads in a shard_map (`pagedjax.parallel.recurrent`).
  LoRA stacks (`pagedjax.model.layers.lora`: A `[in, slots, r]`, B `[slots, r, out]` per target linear) as their
                                              base linear: a column-sharded base's B by its output columns (A
                                              replicated: each device computes every token's x A, then its own
                                              columns); a row-sharded base's A by its input rows (B replicated):
                                              each device's partial x A is summed by the all-reduce XLA already
                                              makes for the base's partial product (the two are combined into one
                                              collective), then every device applies B to the whole sum. A base
                                              kept replicated keeps its A and B replicated. Slot scales and each
                                              token's slot: replicated.
When tp > num_kv_heads the k/v projections stay replicated and the cache stores `tp` heads, each KV head
repeated on the tp / num_kv_heads devices whose query heads use it (as vLLM does). A dimension that tp does not
divide (an odd vocabulary, an MLP width, a number of experts) is replicated instead, with a log line: correct,
only less spread.
Block tables, slot mappings and page state are small int arrays: replicated (one host scheduler drives all).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax.config import ModelConfig
from pagedjax.config.parallel import TP, kv_heads_per_device

logger = logging.getLogger(__name__)

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")  # sharded by outputs
ROW = ("o_proj", "down_proj")  # sharded by inputs (their products all-reduced)
EXPERTS = "experts"  # the module of stacked expert weights `[E, ...]`: sharded by expert


def key_names(keypath) -> tuple:
    """A jax key path of an `nnx.State` leaf as plain names: ('layers', 0, 'self_attn', 'q_proj', 'kernel')."""
    names = []
    for k in keypath:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        names.append(name)
    if names and names[-1] == "value":  # nnx.Variable's own attribute
        names.pop()
    return tuple(names)


def _divides(cfg: ModelConfig, module: str, tp: int) -> bool:
    """Whether tp divides the dimension this module's weights would be sharded along (and, for int4 weights of a
    row-sharded module, its number of groups)."""
    quant = cfg.quantization
    if module in ROW and quant is not None and quant.scheme == "int4" and module not in quant.keep_float:
        n_in = cfg.num_q_heads * cfg.head_dim if module == "o_proj" else cfg.intermediate_size
        if (n_in // quant.group_size) % tp:
            return False
    if module in ("q_proj", "o_proj"):
        return cfg.num_q_heads % tp == 0
    if module in ("k_proj", "v_proj"):
        return cfg.num_kv_heads % tp == 0
    if module in ("gate_proj", "up_proj", "down_proj"):
        return cfg.intermediate_size % tp == 0
    if module in ("lm_head", "embed_tokens"):
        return cfg.vocab_size % tp == 0
    if module == EXPERTS:
        return cfg.moe is not None and cfg.moe.num_experts % tp == 0
    return False


def param_spec(names: tuple, cfg: ModelConfig, tp: int) -> P:
    """The PartitionSpec of the built-in models' parameter at `names` (see the module docstring)."""
    if tp == 1 or len(names) < 2:
        return P()
    if _quantized_expert_leaf(names):
        return P(TP) if _divides(cfg, EXPERTS, tp) else P()
    grouped = cfg.quantization is not None and cfg.quantization.scheme == "int4"
    return _by_name(str(names[-2]), str(names[-1]), _divides(cfg, str(names[-2]), tp), grouped)


def default_param_partition(names: tuple, shape: tuple, *, head_dim: int, tp: int) -> P:
    """The PartitionSpec of a parameter of any model by its name and shape: the rules of the module docstring
    for modules named like Hugging Face's Llama (q_proj, ..., down_proj, embed_tokens, lm_head) and for stacked
    expert weights (any parameter of a module named `experts`, split along axis 0), when `tp`
    divides the split dimension (in whole heads of `head_dim` for attention projections); anything else is
    replicated (always correct: the step's shardings only decide where XLA computes, never what)."""
    if tp == 1 or len(names) < 2 or not shape:
        return P()
    if _quantized_expert_leaf(names):
        return P(TP) if shape[0] % tp == 0 else P()
    module, leaf = str(names[-2]), str(names[-1])
    unit = head_dim if module in ("q_proj", "k_proj", "v_proj", "o_proj") else 1
    if leaf in ("qweight", "scale"):  # stored `[out, ...]`: the kernel's `[in, out]` axes swapped
        split = shape[-1] if module in ROW and len(shape) == 2 else shape[0]
    else:
        split = shape[0] if module in ROW or module in ("embed_tokens", EXPERTS) else shape[-1]
    return _by_name(module, leaf, split % (tp * unit) == 0, leaf == "scale" and len(shape) == 2)


def _quantized_expert_leaf(names: tuple) -> bool:
    """Whether `names` is a quantized expert projection's `qweight` or `scale` (`experts.gate_proj.qweight`,
    `pagedjax.model.layers.moe_quant`): `[E, ...]` of rank 2 or 3, split along the experts (P(TP): axis 0, any rank)."""
    return len(names) >= 3 and str(names[-3]) == EXPERTS and str(names[-1]) in ("qweight", "scale")


def _by_name(module: str, leaf: str, divides: bool, grouped: bool = False) -> P:
    """`grouped`: a `scale` leaf is int4's `[out, in // g]` (split like its `qweight`), not a per-channel `[out]`."""
    if not divides:
        return P()
    if leaf == "qweight" or (leaf == "scale" and grouped):  # stored `[out, in]`: the kernel's axes swapped
        return P(TP, None) if module in COLUMN else P(None, TP) if module in ROW else P()
    if module in COLUMN:
        return P(None, TP) if leaf == "kernel" else P(TP)
    if module in ROW:
        return P(TP, None) if leaf == "kernel" else P()
    if module == "embed_tokens" and leaf == "embedding":
        return P(TP, None)
    if module == EXPERTS:  # stacked weights [E, width, hidden] and biases [E, width]: along the experts
        return P(TP, None) if leaf.endswith("_bias") else P(TP, None, None)
    return P()


def lora_spec(cfg: ModelConfig, module: str, factor: str, tp: int) -> P:
    """The PartitionSpec of LoRA factor `factor` ("a": `[in, slots, r]`, "b": `[slots, r, out]`) of target linear
    `module` of a built-in dense model of `cfg` (see the module docstring): split as the base kernel is, or
    replicated where the base is."""
    if factor not in ("a", "b"):
        raise ValueError(f"lora_spec: factor must be 'a' or 'b', got {factor!r}")
    if tp == 1 or not _divides(cfg, module, tp):
        return P()
    if module in COLUMN:
        return P(None, None, TP) if factor == "b" else P()
    if module in ROW:
        return P(TP, None, None) if factor == "a" else P()
    return P()


def log_replicated(cfg, tp: int) -> None:
    """Say which weights stay replicated because tp does not divide their dimension (`cfg`: a ModelSpec, or a
    ModelConfig, whose MLP width is known too)."""
    if tp == 1:
        return
    for what, n in (("vocabulary", cfg.vocab_size), ("MLP width", getattr(cfg, "intermediate_size", None))):
        if n is not None and n % tp:
            logger.info("tensor_parallel_size %d does not divide the %s (%d): those weights are replicated", tp,
                        what, n)
    moe = getattr(cfg, "moe", None)
    if moe is not None and moe.num_experts % tp:
        logger.info("tensor_parallel_size %d does not divide the %d experts: the expert weights are replicated",
                    tp, moe.num_experts)
    if cfg.num_kv_heads is None and any(layer.heads_axis is not None for layer in getattr(cfg, "kv_layers", ())):
        logger.info("tensor_parallel_size %d: attention and recurrent-state layers split by heads, each device "
                    "holding its heads' KV pages and state snapshots", tp)
    elif cfg.num_kv_heads is None:
        logger.info("tensor_parallel_size %d: query heads split, the latent KV pages replicated on every device", tp)
    elif cfg.num_kv_heads % tp:
        logger.info("tensor_parallel_size %d > %d KV heads: k/v projections replicated, each KV head cached on %d "
                    "devices", tp, cfg.num_kv_heads, tp // cfg.num_kv_heads)


def param_sharding_fn(cfg: ModelConfig, mesh: Mesh) -> Callable[[tuple], NamedSharding]:
    """names -> NamedSharding of that parameter on `mesh` (what the loaders place each tensor with)."""
    tp = mesh.shape[TP]
    return lambda names: NamedSharding(mesh, param_spec(names, cfg, tp))


def param_shardings(state, cfg: ModelConfig, mesh: Mesh):
    """A tree like `state` (an `nnx.State` or its leaves' tree) of NamedShardings."""
    fn = param_sharding_fn(cfg, mesh)
    return jax.tree_util.tree_map_with_path(lambda kp, _: fn(key_names(kp)), state)


def shard_state(state, partition: Callable[[tuple, tuple], P], mesh: Mesh):
    """`state` with every leaf placed by `partition(names, shape)` (a no-op for leaves already placed so). A leaf
    moves device to device, or host to devices slice by slice: no device receives more than its slice."""
    shardings = jax.tree_util.tree_map_with_path(
        lambda kp, x: NamedSharding(mesh, partition(key_names(kp), tuple(x.shape))), state)
    return jax.device_put(state, shardings)


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """One layer's K or V pages, sharded by KV heads (axis 0)."""
    return NamedSharding(mesh, P(TP))


def pages_sharding(mesh: Mesh, heads_axis: int | None) -> NamedSharding:
    """A layer's page arrays split along `heads_axis` (its spec's: 0, full attention's KV heads; 1, a recurrent
    state's heads after its blocks), or whole on every device (None: latent pages)."""
    if heads_axis is None:
        return replicated(mesh)
    return NamedSharding(mesh, P(*(None,) * heads_axis, TP))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def per_device_model(cfg, tp: int):
    """`cfg` (a ModelSpec or ModelConfig) with the KV heads one device holds (num_kv_heads / tp, at least 1):
    what KV bytes per block are counted with when a per-device memory budget sizes the pool. A spec of layers of
    several kinds (num_kv_heads None): each layer as one device holds it (`KVCacheSpec.per_device`: a hybrid's
    KV heads and state heads split, latent layers whole on every device)."""
    if cfg.num_kv_heads is None:
        layers = getattr(cfg, "kv_layers", None)
        return cfg if layers is None else cfg.replace(kv_layers=tuple(layer.per_device(tp) for layer in layers))
    return cfg.replace(num_kv_heads=kv_heads_per_device(cfg.num_kv_heads, tp))
