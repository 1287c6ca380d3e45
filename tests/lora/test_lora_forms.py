"""The per-token LoRA product's forms (`pagedjax.model.layers.lora`): each computes every token's own slot's
`scale * (x A) B`, and a token's output is bitwise the same whatever the other slots hold (NaN, infinities,
numbers whose products overflow), at decode's few tokens (`selected_delta`) and prefill's many (`grouped_delta`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pagedjax.model.layers.lora import gathered_delta, grouped_delta, lora_delta, selected_delta

N_IN, N_OUT, SLOTS, RANK = 24, 40, 4, 4
FORMS = {"gathered": gathered_delta, "selected": selected_delta, "grouped": grouped_delta, "model": lora_delta}
POISONS = {"nan": np.nan, "inf": -np.inf, "huge": 3e38}


def _case(tokens: int, seed: int = 0):
    """x, A, B, scales (slot 0 the base model's zeros), each token's slot (every slot used), the base output y."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((N_IN, SLOTS, RANK)).astype(np.float32)
    b = rng.standard_normal((SLOTS, RANK, N_OUT)).astype(np.float32)
    a[:, 0], b[0] = 0, 0
    scales = np.array([0, 0.5, 2, 1.5], np.float32)
    slots = np.arange(tokens, dtype=np.int32) % SLOTS
    rng.shuffle(slots)
    x = rng.standard_normal((tokens, N_IN)).astype(np.float32)
    y = rng.standard_normal((tokens, N_OUT)).astype(np.float32)
    return x, a, b, scales, slots, y


@pytest.mark.parametrize("tokens", [2 * RANK, 16 * RANK])  # the model's form: selected, then grouped
@pytest.mark.parametrize("form", FORMS)
def test_each_form_is_each_tokens_own_slots_product(form, tokens):
    x, a, b, scales, slots, _ = _case(tokens)
    want = np.stack([scales[s] * (x[t].astype(np.float64) @ a[:, s]) @ b[s] for t, s in enumerate(slots)])
    got = jax.jit(FORMS[form])(x, a, b, scales, slots)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [2 * RANK, 16 * RANK])
@pytest.mark.parametrize("form", FORMS)
def test_a_tokens_output_reads_no_other_slot(form, tokens):
    """Every slot but one poisoned (A, B and scale; the base model's slot 0 too): the clean slot's tokens get
    bitwise the linear's output `y + delta` of the unpoisoned slots."""
    x, a, b, scales, slots, y = _case(tokens)
    run = jax.jit(lambda a, b, scales: y + FORMS[form](x, a, b, scales, slots))
    clean = np.asarray(run(a, b, scales)).view(np.uint32)
    for kept in range(SLOTS):
        mine, others = slots == kept, [s for s in range(SLOTS) if s != kept]
        for name, value in POISONS.items():
            pa, pb, ps = a.copy(), b.copy(), scales.copy()
            pa[:, others], pb[others], ps[others] = value, value, value
            got = np.asarray(run(pa, pb, ps)).view(np.uint32)
            assert (got[~mine] != clean[~mine]).any(), (kept, name)  # the poison took
            np.testing.assert_array_equal(got[mine], clean[mine], err_msg=f"slot {kept} kept, {name}")
