"""Weight-only quantization of a model's linear layers (`ModelConfig.quantization`): a frozen dataclass of its
own, so that `pagedjax.config` stays about the float decoder.

Plain Python, no JAX (`pagedjax.config` imports it, and the host side imports that). The arithmetic is in
`pagedjax.model.layers.quant`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedjax.config.fields import check_choice, check_int, describe, from_fields

# What a linear kernel `[in, out]` is stored as (`pagedjax.model.layers.quant`; stored `[out, ...]`):
#   "int8"  int8 per output channel, symmetric: w ~= q * scale[out], q in [-127, 127].
#   "int4"  int4 in groups of `group_size` consecutive inputs, symmetric: w ~= q * scale[out, in // group_size],
#           q in [-8, 7] (the quantizer uses [-7, 7]); two values per byte along the input dimension.
#   "fp8"   float8 e4m3 (finite, max 448) per output channel: w ~= q * scale[out].
SCHEMES: tuple[str, ...] = ("int8", "int4", "fp8")
# What the activations a quantized linear multiplies are (`QuantConfig.activations`):
#   "float" the model's dtype (weight-only quantization: W8A16, W4A16).
#   "int8"  each row (token) quantized to int8 on the fly, symmetric, scale = max |x| / 127 over the row, and
#           multiplied by the weights in exact integer sums: W8A8 (scheme "int8": one int32 sum per output) and
#           W4A8 (scheme "int4": one per group, the groups' scaled sums in float32; groups of 8, 16, 32, 64 or a
#           multiple of 128 inputs, `int8_activation_groups`). On the CPU integer SIMD kernels
#           (`pagedjax.device.int8_matmul`).
ACTIVATIONS: tuple[str, ...] = ("float", "int8")
SCALE_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
DEFAULT_GROUP_SIZE = 128
# Every short name `QuantConfig.parse` reads, as its errors and `--quantization` list them.
NAMES = (f"int8, fp8, int4 (groups of {DEFAULT_GROUP_SIZE} inputs), int4:<N> (groups of an even N >= 2 inputs, "
         "e.g. int4:32), w8a8 (int8 weights and activations), w4a8 and w4a8:<N> (int4 weights, int8 activations)")
# Short names of the schemes with quantized activations -> (weights' scheme, activations).
_ACTIVATION_NAMES = {"w8a8": ("int8", "int8"), "w4a8": ("int4", "int8")}


def int8_activation_groups(group_size: int) -> bool:
    """Whether int4 groups of `group_size` inputs go with int8 activations: the kernel reads 64 packed bytes (128
    inputs) at a time, which half a group (its packed bytes) must divide or be a multiple of."""
    half = group_size // 2
    return group_size % 8 == 0 and (64 % half == 0 if half <= 64 else half % 64 == 0)


@dataclass(frozen=True)
class QuantConfig:
    """Which linear layers (and mixture-of-experts experts) hold quantized weights, and how. Activations stay in
    the model's dtype and every product accumulates in float32 (unless `activations` says otherwise); embeddings and
    MoE routers are never quantized.

    scheme: one of `SCHEMES`. group_size: int4's group along the input dimension (even, default 128; None for
    the per-channel schemes). scale_dtype: how scales are stored (one of `SCALE_DTYPES`). keep_float: names of
    linear modules left in float (by default the LM head: it decides every sampled token); "experts" keeps a MoE
    model's experts float (`pagedjax.model.layers.moe_quant`). activations: one of `ACTIVATIONS`: "int8"
    (W8A8 with scheme "int8", W4A8 with "int4") quantizes each row of a linear's input to int8 and multiplies
    integers exactly.

    Invariants (checked on construction, a TypeError / ValueError naming the field): group_size is set for int4
    only, and even (two values per byte); keep_float is a tuple of strings; int8 activations go with integer
    weights (int4's groups as `int8_activation_groups` says).
    """

    scheme: str
    group_size: int | None = None
    scale_dtype: str = "float32"
    keep_float: tuple[str, ...] = ("lm_head",)
    activations: str = "float"

    def __post_init__(self) -> None:
        owner = "QuantConfig"
        fix = lambda name, value: object.__setattr__(self, name, value)  # frozen dataclass: set through object
        check_choice(owner, "scheme", self.scheme, SCHEMES, optional=False)
        if self.scheme == "int4":
            size = DEFAULT_GROUP_SIZE if self.group_size is None else self.group_size
            fix("group_size", check_int(owner, "group_size", size, lo=2))
            if self.group_size % 2:
                raise ValueError(f"{owner}.group_size must be even (two int4 values per byte), got {self.group_size}")
        elif self.group_size is not None:
            raise ValueError(f"{owner}.group_size applies to scheme 'int4' only ({self.scheme!r} is per output "
                             f"channel), got {self.group_size!r}")
        check_choice(owner, "scale_dtype", self.scale_dtype, SCALE_DTYPES, optional=False)
        keep = self.keep_float
        if isinstance(keep, str) or not isinstance(keep, tuple | list) or not all(isinstance(k, str) for k in keep):
            raise TypeError(f"{owner}.keep_float must be a tuple of module names, got {describe(keep)}")
        fix("keep_float", tuple(keep))
        check_choice(owner, "activations", self.activations, ACTIVATIONS, optional=False)
        if self.activations == "int8" and self.scheme == "fp8":
            raise ValueError(f"{owner}.activations 'int8' goes with integer weights (scheme 'int8': W8A8, 'int4': "
                             f"W4A8), not 'fp8'")
        if self.activations == "int8" and self.scheme == "int4" and not int8_activation_groups(self.group_size):
            raise ValueError(f"{owner}.group_size {self.group_size}: int4 weights with int8 activations (W4A8) take "
                             f"groups of 8, 16, 32, 64 or a multiple of 128 inputs (the kernel's vectors tile them)")

    @property
    def name(self) -> str:
        """The short form `parse` reads: "int8", "fp8", "int4" (group 128), "int4:32", "w8a8", "w4a8" or
        "w4a8:32"."""
        base = next((short for short, kinds in _ACTIVATION_NAMES.items() if kinds == (self.scheme, self.activations)),
                    self.scheme)
        if self.scheme == "int4" and self.group_size != DEFAULT_GROUP_SIZE:
            return f"{base}:{self.group_size}"
        return base

    @classmethod
    def parse(cls, text: str) -> QuantConfig:
        """"int8" | "fp8" | "int4" | "int4:<group size>" | "w8a8" | "w4a8" | "w4a8:<group size>" (what
        `--quantization` takes), in any case ("INT8" is int8) -> a QuantConfig. ValueError naming the field at
        fault and listing every accepted name (`NAMES`)."""
        if not isinstance(text, str):
            raise TypeError(f"quantization must be a string ({NAMES}), got {describe(text)}")
        name, sep, size = text.strip().lower().partition(":")
        scheme, activations = _ACTIVATION_NAMES.get(name, (name, "float"))
        if scheme not in SCHEMES:
            raise ValueError(f"QuantConfig.scheme {name!r} is not supported; accepted names: {NAMES}")
        if not sep:
            return cls(scheme, activations=activations)
        if scheme != "int4" or not size.isdigit():
            raise ValueError(f"quantization {text!r}: a group size is written 'int4:<int>' or 'w4a8:<int>' (e.g. "
                             f"'int4:32'); accepted names: {NAMES}")
        return cls(scheme, group_size=int(size), activations=activations)

    @classmethod
    def coerce(cls, value) -> QuantConfig | None:
        """None, a QuantConfig, its short name (`parse`) or its fields as a mapping (a parsed
        `ModelConfig.to_dict`) -> a QuantConfig or None. Unknown fields are a ValueError naming them."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        if not isinstance(value, dict):
            raise TypeError(f"quantization must be None, a QuantConfig, a name such as 'int8' or a mapping of its "
                            f"fields, got {describe(value)}")
        return from_fields(cls, value, "QuantConfig")
