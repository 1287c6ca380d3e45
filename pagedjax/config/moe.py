"""The mixture-of-experts fields of a model config (`ModelConfig.moe`): a frozen dataclass of its own, so that
`pagedjax.config` stays about the dense decoder.

Plain Python, no JAX (`pagedjax.config` imports it, and the host side imports that).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_bool, check_choice, check_float, check_int, from_fields

# How router logits become each token's experts and their weights (`pagedjax.model.layers.moe.route`):
#   "topk_softmax"  the k largest logits, softmax over those k (Mixtral): the weights sum to 1.
#   "softmax_topk"  softmax over all experts, the k largest probabilities (Qwen3-MoE); with `norm_topk_prob`
#                   renormalized to sum to 1, else kept as they are (they sum to less).
# (The two give the same weights when norm_topk_prob is set; each is computed as its family does.)
ROUTERS: tuple[str, ...] = ("topk_softmax", "softmax_topk")
# Each expert's gated activation of its gate and up projections (`pagedjax.model.layers.moe.GLU`):
#   "silu"            silu(gate) * up: SwiGLU (Mixtral, Qwen3-MoE, DeepSeek).
#   "clamped_swiglu"  g * sigmoid(swiglu_alpha * g) * (u + 1), g = min(gate, swiglu_limit) and u = up clipped to
#                     [-swiglu_limit, swiglu_limit] (gpt-oss).
ACTIVATIONS: tuple[str, ...] = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoEConfig:
    """Every decoder layer's MLP is a mixture of `num_experts` SwiGLU experts of width `intermediate_size`, of
    which each token uses `num_experts_per_tok` (exactly: no capacity limit drops a token's expert), its outputs
    summed with the router's weights.

    `router_bias`: the router's logits have a bias (`gate.bias` `[E]`); `expert_bias`: every expert's three
    projections have one (`Experts.gate_proj_bias`, `up_proj_bias` `[E, width]`, `down_proj_bias` `[E, hidden]`).
    `activation` (one of `ACTIVATIONS`) with, for "clamped_swiglu", its `swiglu_alpha` and `swiglu_limit`.

    Invariants (checked on construction, a TypeError / ValueError naming the field): 1 <= num_experts_per_tok
    <= num_experts; `router` one of `ROUTERS`; `norm_topk_prob` only with "softmax_topk" (the "topk_softmax"
    weights already sum to 1); `swiglu_alpha` and `swiglu_limit` numbers > 0 with "clamped_swiglu", None with
    any other activation.
    """

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    router: str = "topk_softmax"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # one of ACTIVATIONS
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None

    def __post_init__(self) -> None:
        owner = "ModelConfig.moe"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        fix("num_experts", check_int(owner, "num_experts", self.num_experts, lo=1))
        fix("num_experts_per_tok", check_int(owner, "num_experts_per_tok", self.num_experts_per_tok, lo=1,
                                             hi=self.num_experts))
        fix("intermediate_size", check_int(owner, "intermediate_size", self.intermediate_size, lo=1))
        check_choice(owner, "router", self.router, ROUTERS, optional=False)
        check_bool(owner, "norm_topk_prob", self.norm_topk_prob)
        if self.norm_topk_prob and self.router != "softmax_topk":
            raise ValueError(f"{owner}.norm_topk_prob applies to router 'softmax_topk' only ({self.router!r} "
                             "weights sum to 1 already)")
        check_bool(owner, "router_bias", self.router_bias)
        check_bool(owner, "expert_bias", self.expert_bias)
        check_choice(owner, "activation", self.activation, ACTIVATIONS, optional=False)
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if self.activation == "clamped_swiglu":
                if value is None:
                    raise ValueError(f"{owner}.{name} is required with activation 'clamped_swiglu'")
                fix(name, check_float(owner, name, value, positive=True))
            elif value is not None:
                raise ValueError(f"{owner}.{name} applies to activation 'clamped_swiglu' only, not "
                                 f"{self.activation!r}")

    @classmethod
    def coerce(cls, value) -> MoEConfig | None:
        """None, a MoEConfig, or its fields as a mapping (a parsed `ModelConfig.to_dict`) -> a MoEConfig or None.
        Unknown fields are a ValueError naming them."""
        if value is None or isinstance(value, cls):
            return value
        return from_fields(cls, value, "ModelConfig.moe")
