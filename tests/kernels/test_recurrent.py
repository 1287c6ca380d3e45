"""Recurrent-state layers over paged state snapshots (`pallas_kernels.recurrent`): the gated delta rule, the causal
conv1d and Mamba-2's SSD scan, each through its XLA path and its GPU and TPU kernels (interpret mode on CPU), against
the float64 sequential reference; the reference against transformers' definitions.

Every step runs on a pool whose blocks are NaN except those the step may read, with table entries past each
sequence's blocks garbage (`recurrent_cases`): outputs must match the reference, every block the reference writes
must hold its state (the snapshots at block boundaries and the live state after each sequence's last row), and every
other block must come back bit-identical. Steps mix padding and idle sequences, decode tokens, prompts and chunks
after a prefix, at lengths 0, 1 and block multiples +- 1; a sequence processed in several steps, its state carried
through the pages, must equal one pass.

One static configuration (`Config`) serves the property tests, so each implementation compiles once per dtype and
form: blocks of 6 rows and chunks of 16 (pieces end at 6, 12, 16, 18, 24: block ends inside chunks and a chunk end
inside a block), 4 sequences, 24 rows.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import pallas_kernels as pk
from pallas_kernels import pieces as P
from pallas_kernels import recurrent as R
from tests.kernels import recurrent_cases as RC
from tests.kernels.cases import examples

pytestmark = pytest.mark.kernels

BLOCK, MAX_BLOCKS, SEQS, ROWS, CHUNK = 6, 4, 4, 24, 16
REAL_ROWS = ROWS - 2  # at least two padding rows in every step


@dataclasses.dataclass(frozen=True)
class Op:
    """One op under test: how to build its inputs and call any of its implementations on a step."""

    name: str
    state_shape: tuple
    inputs: object  # (rng, num_tokens, dtype) -> dict
    call: object  # (fn, inputs, pages, step, **kw) -> (out, pages)
    reference: object
    xla: object
    entry: object
    forms: tuple
    exact_pages: bool = False

    def run(self, impl: str, inputs, pages, step: RC.Step, **kw):
        """impl: "reference", "xla-<form>", "gpu-<form>" or "tpu-<form>" (the conv has no forms: "xla", "gpu")."""
        target, _, form = impl.partition("-")
        kw = dict(kw, form=form) if form else kw
        if target == "reference":
            return self.call(self.reference, inputs, pages, step)
        if target == "xla":
            return self.call(self.xla, inputs, pages, step, **kw)
        return self.call(self.entry, inputs, pages, step, target=target, interpret=True, **kw)

    def impls(self, targets=("xla", "gpu")) -> list[str]:
        return [f"{t}-{f}" if f else t for t in targets for f in (self.forms or ("",))]


def _gdn_call(fn, i, pages, step, **kw):
    return fn(i["q"], i["k"], i["v"], i["g"], i["beta"], pages, *step.args(), block_size=step.block_size, **kw)


def _conv_call(fn, i, pages, step, **kw):
    return fn(i["x"], i["weight"], pages, *step.args(), block_size=step.block_size, bias=i["bias"],
              activation="silu", **kw)


def _ssd_call(fn, i, pages, step, **kw):
    return fn(i["x"], i["dt"], i["A"], i["B"], i["C"], pages, *step.args(), block_size=step.block_size, D=i["D"],
              **kw)


GDN = Op("gated_delta_rule", (2, 16, 8), lambda rng, t, dt: RC.gdn_inputs(rng, t, 1, 2, 16, 8, dt), _gdn_call,
         R.gated_delta_rule_reference, pk.gated_delta_rule_xla, pk.gated_delta_rule, ("chunked", "recurrent"))
CONV = Op("causal_conv1d", (8, 3), lambda rng, t, dt: RC.conv_inputs(rng, t, 8, 4, dt), _conv_call,
          R.causal_conv1d_reference, pk.causal_conv1d_xla, pk.causal_conv1d, (), exact_pages=True)
SSD = Op("mamba2_ssd", (2, 8, 16), lambda rng, t, dt: RC.ssd_inputs(rng, t, 2, 8, 1, 16, dt), _ssd_call,
         R.mamba2_ssd_reference, pk.mamba2_ssd_xla, pk.mamba2_ssd, ("chunked", "recurrent"))
OPS = {op.name: op for op in (GDN, CONV, SSD)}
TUNING = {"gated_delta_rule": dict(chunk_size=CHUNK), "causal_conv1d": {}, "mamba2_ssd": dict(chunk_size=CHUNK)}
# Per target: the conv's tiles (GPU pieces of 8 rows: several per block and sequence).
TARGET_TUNING = {("causal_conv1d", "gpu"): dict(block_t=8), ("causal_conv1d", "tpu"): dict(block_t=8)}


def _tuning(op: Op, impl: str) -> dict:
    target = impl.partition("-")[0]
    kw = dict(TUNING[op.name]) if target != "xla" or op.forms else {}
    return {**kw, **TARGET_TUNING.get((op.name, target), {})}


def _case(op: Op, seqs, seed: int, dtype: str = "float32", final_lens=None):
    """(inputs, pages, step) of the configuration's shapes for `seqs` [(q_len, kv_len)], tables over a permuted pool
    sized for `final_lens` (default: each kv_len)."""
    rng = np.random.default_rng(seed)
    tables, num_blocks = RC.allocate(rng, final_lens or [kv for _, kv in seqs], block_size=BLOCK,
                                     max_blocks=MAX_BLOCKS)
    step = RC.step(tables, seqs, block_size=BLOCK, padding_rows=ROWS - sum(q for q, _ in seqs))
    pages = RC.pool(rng, num_blocks, op.state_shape, step.readable_blocks(),
                    dtype=np.float32 if not op.exact_pages else RC.DTYPES[dtype])
    return op.inputs(rng, ROWS, dtype), pages, step


def _check_impls(op: Op, impls, inputs, pages, step, dtype: str = "float32"):
    ref_out, ref_pages = op.run("reference", inputs, pages, step)
    outs = {}
    for impl in impls:
        out, new_pages = op.run(impl, inputs, pages, step, **_tuning(op, impl))
        assert out.shape == ref_out.shape and out.dtype == inputs[next(iter(inputs))].dtype, impl
        RC.assert_step_close(out, new_pages, ref_out, ref_pages, pages, dtype, exact_pages=op.exact_pages)
        np.testing.assert_array_equal(np.asarray(out, np.float32)[int(step.cu_q_lens[-1]):], 0.0)  # padding rows
        outs[impl] = (out, new_pages)
    return outs


SEQ_STRATEGY = RC.ragged_seqs(block_size=BLOCK, max_blocks=MAX_BLOCKS, num_seqs=SEQS, max_rows=REAL_ROWS)
# A decode token at a block's first position and at its last, a chunk ending exactly on a block boundary after a
# prefix that did too, a prompt of one full block + 1, and padding; then whole tables (24 = 4 blocks).
MIXED = [(1, 7), (6, 12), (7, 7), (0, 0)]
EDGES = [(1, 6), (11, 24), (0, 13), (10, 10)]


@pytest.mark.parametrize("name", OPS)
@settings(max_examples=examples(6))
@given(seqs=SEQ_STRATEGY, seed=st.integers(0, 2**32 - 1))
@example(seqs=MIXED, seed=0)
@example(seqs=EDGES, seed=1)
def test_xla_and_gpu_kernels_match_float64_reference(name, seqs, seed):
    """Both forms of the XLA path and of the GPU kernels (interpret mode) on a ragged step, against the float64
    reference, and bit-identical on the same step with its blocks moved elsewhere in the pool."""
    op = OPS[name]
    inputs, pages, step = _case(op, seqs, seed)
    outs = _check_impls(op, op.impls(), inputs, pages, step)
    rng = np.random.default_rng(seed + 1)
    moved = rng.permutation(pages.shape[0]).astype(np.int32)  # new block of each old one
    tables = np.asarray(step.block_tables)
    real = (tables >= 0) & (tables < pages.shape[0])
    step2 = dataclasses.replace(step, block_tables=jnp.asarray(np.where(real, moved[np.where(real, tables, 0)],
                                                                       tables)))
    pages2 = pages[np.argsort(moved)]
    for impl in (op.impls()[0], op.impls()[-1]):
        out, new_pages = op.run(impl, inputs, pages2, step2, **_tuning(op, impl))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(outs[impl][0], np.float32))
        np.testing.assert_array_equal(np.asarray(new_pages, np.float32)[moved],
                                      np.asarray(outs[impl][1], np.float32))


@pytest.mark.parametrize("name,form", [("gated_delta_rule", "chunked"), ("gated_delta_rule", "recurrent"),
                                       ("causal_conv1d", ""), ("mamba2_ssd", "chunked"), ("mamba2_ssd", "recurrent")])
def test_tpu_kernels_match_float64_reference(name, form):
    """The TPU kernels (TPU interpret mode: DMAs and VMEM simulated, fresh VMEM NaN) on the mixed step and on the
    edges (full tables, an idle sequence, a decode at a block's first position)."""
    op = OPS[name]
    for seqs, seed in ((MIXED, 0), (EDGES, 1)):
        _check_impls(op, [f"tpu-{form}" if form else "tpu"], *_case(op, seqs, seed))


@st.composite
def split_runs(draw):
    """(final lengths summing to at most REAL_ROWS, per sequence two cut positions): each sequence's rows in three
    steps cut anywhere (a step may give a sequence no rows)."""
    lens = []
    for _ in range(SEQS):
        lens.append(draw(st.integers(0, min(BLOCK * MAX_BLOCKS, REAL_ROWS - sum(lens)))))
    return lens, [sorted(draw(st.lists(st.integers(0, n), min_size=2, max_size=2))) for n in lens]


def _check_split_run(op: Op, lens, cuts, seed: int, impls):
    """Runs `impls` over three steps cut at `cuts` (the pages carried from step to step, starting all NaN) and
    compares the rows and final pages with one pass of the reference over the whole prompts."""
    bounds = [[0, *cut, n] for cut, n in zip(cuts, lens, strict=True)]
    rng = np.random.default_rng(seed)
    tables, num_blocks = RC.allocate(rng, lens, block_size=BLOCK, max_blocks=MAX_BLOCKS)
    inputs = op.inputs(rng, ROWS, "float32")
    one = RC.step(tables, [(n, n) for n in lens], block_size=BLOCK, padding_rows=ROWS - sum(lens))
    before = RC.pool(rng, num_blocks, op.state_shape, [])
    ref_out, ref_pages = op.run("reference", inputs, before, one)
    row_of = np.asarray(one.cu_q_lens)[:-1]  # where each sequence's rows start in the one-pass layout
    for impl in impls:
        pages, out = before, np.zeros(ref_out.shape)
        for j in range(3):
            seqs = [(b[j + 1] - b[j], b[j + 1]) for b in bounds]
            step = RC.step(tables, seqs, block_size=BLOCK, padding_rows=ROWS - sum(q for q, _ in seqs))
            rows = np.concatenate([row_of[s] + np.arange(b[j], b[j + 1]) for s, b in enumerate(bounds)]).astype(int)
            take = jnp.asarray(np.concatenate([rows, np.zeros(ROWS - len(rows), int)]))  # padding rows: copies
            step_inputs = {key: x[take] if x.shape[:1] == (ROWS,) else x for key, x in inputs.items()}
            step_out, pages = op.run(impl, step_inputs, pages, step, **_tuning(op, impl))
            out[rows] = np.asarray(step_out, np.float64)[: len(rows)]
        RC.assert_step_close(out, pages, ref_out, ref_pages, before, "float32", exact_pages=op.exact_pages)


SPLIT = ([13, 7, 0, 2], [[6, 12], [0, 1], [0, 0], [2, 2]])  # a block end, a block start, a padding sequence


@pytest.mark.parametrize("name", OPS)
@settings(max_examples=examples(4))
@given(run=split_runs(), seed=st.integers(0, 2**32 - 1))
@example(run=SPLIT, seed=0)
def test_steps_carried_through_pages_equal_one_pass(name, run, seed):
    """A set of sequences processed in three ragged steps (cut anywhere; each step's initial states read from the
    blocks the previous steps wrote), by the XLA path and the GPU kernels in both forms, gives the rows and the final
    pages (every block-boundary snapshot, every final state) of one pass of the reference over whole prompts."""
    _check_split_run(OPS[name], *run, seed, OPS[name].impls())


@pytest.mark.parametrize("name", ["gated_delta_rule", "causal_conv1d"])
def test_tpu_steps_carried_through_pages_equal_one_pass(name):
    """As above on the TPU kernels (the SSD kernel carries its state with the delta rule's code)."""
    op = OPS[name]
    _check_split_run(op, *SPLIT, 0, [f"tpu-{op.forms[0]}" if op.forms else "tpu"])


BF16_CASES = {  # other head shapes than the property tests': ratios 3 and 2, padded head dims
    "gated_delta_rule": Op("gated_delta_rule", (6, 24, 12), lambda rng, t, dt: RC.gdn_inputs(rng, t, 2, 6, 24, 12, dt),
                           _gdn_call, R.gated_delta_rule_reference, pk.gated_delta_rule_xla, pk.gated_delta_rule,
                           ("chunked",)),
    "causal_conv1d": dataclasses.replace(CONV, state_shape=(12, 2),
                                         inputs=lambda rng, t, dt: RC.conv_inputs(rng, t, 12, 3, dt)),
    "mamba2_ssd": Op("mamba2_ssd", (4, 12, 20), lambda rng, t, dt: RC.ssd_inputs(rng, t, 4, 12, 2, 20, dt),
                     _ssd_call, R.mamba2_ssd_reference, pk.mamba2_ssd_xla, pk.mamba2_ssd, ("chunked",)),
}


@pytest.mark.parametrize("name", OPS)
def test_bfloat16_inputs(name):
    """bfloat16 inputs (float32 states; the conv's pages bfloat16, copies of inputs) on the GPU kernels' chunked
    forms, which load them as bfloat16, against the reference on the same rounded inputs (the outputs round to
    bfloat16). The TPU kernels and the XLA paths widen their inputs to float32 before any arithmetic."""
    op = BF16_CASES[name]
    inputs, pages, step = _case(op, MIXED, 2, "bfloat16")
    _check_impls(op, op.impls(("gpu",)), inputs, pages, step, "bfloat16")


def test_recurrent_and_chunked_forms_agree_on_a_long_prompt():
    """A 96-token chunk after a live state at position 64 (blocks of 80, chunks of 64: pieces 64-80, 80-128,
    128-160), the gates of a reset (20 tokens decaying by e^-16 each, as Qwen3-Next's -exp(A_log) * softplus reach)
    then slow decay (g near 0): the XLA path's chunked and recurrent forms against the reference at float32
    tolerance. Inside the piece 80-128 the cumulative log decay reaches -320 before the slow tokens, whose pairwise
    decays (near 1) taken as differences of cumulative sums would lose float32 digits (~3e-5): they are summed as
    segments."""
    rng = np.random.default_rng(3)
    tables, num_blocks = RC.allocate(rng, [160], block_size=80, max_blocks=2)
    step = RC.step(tables, [(96, 160)], block_size=80)
    inputs = RC.gdn_inputs(rng, 96, 2, 4, 32, 16, "float32")
    reset = (np.arange(96) >= 16) & (np.arange(96) < 36)  # positions 80..99
    inputs["g"] = jnp.asarray(np.where(reset[:, None], -16.0, -0.01 * rng.uniform(size=(96, 4))), jnp.float32)
    pages = RC.pool(rng, num_blocks, (4, 32, 16), step.readable_blocks())
    ref_out, ref_pages = GDN.run("reference", inputs, pages, step)
    for form in ("chunked", "recurrent"):
        out, new_pages = GDN.run(f"xla-{form}", inputs, pages, step)
        RC.assert_step_close(out, new_pages, ref_out, ref_pages, pages, "float32")


def test_default_form_by_shape():
    assert P.default_form(16, 16) == "recurrent"  # a decode batch
    assert P.default_form(17, 16) == "chunked"
    assert inspect.signature(pk.gated_delta_rule).parameters["chunk_size"].default == 64


def test_pieces_end_at_block_and_chunk_boundaries():
    """Sequence 0: rows at positions 5..17 with blocks of 6 and chunks of 4: pieces [5], [6, 7], [8..11], [12..15],
    [16, 17]; snapshots after 5 (block end), 11, 17 (the step's end, mid-block). Sequence 1 (padding) has none."""
    tables = jnp.asarray([[3, 8, 1, 0], [9, -1, -1, -1]], jnp.int32)
    cut = jax.jit(functools.partial(P.pieces, num_tokens=15, chunk=4, block_size=6, num_blocks=10))
    p = jax.device_get(cut(jnp.asarray([18, 0], jnp.int32), jnp.asarray([0, 13, 13], jnp.int32), tables))
    n = int(p.count)
    assert list(zip(p.pos0[:n].tolist(), p.length[:n].tolist(), strict=True)) == [(5, 1), (6, 2), (8, 4), (12, 4),
                                                                                  (16, 2)]
    assert p.first[:n].tolist() == [True, False, False, False, False]
    assert p.write[:n].tolist() == [3, -1, 8, -1, 1]
    assert (np.asarray(p.length[n:]) == 0).all() and n <= p.length.shape[0]


@settings(max_examples=examples(50))
@given(q_lens=st.lists(st.integers(0, 70), min_size=1, max_size=6), starts=st.lists(st.integers(0, 90), min_size=6,
       max_size=6), chunk=st.sampled_from([None, 1, 4, 16, 64]), block=st.sampled_from([1, 3, 16, 48, 256]))
def test_max_pieces_bounds_every_step(q_lens, starts, chunk, block):
    """The static bound on the pieces holds for any step (pieces counted here from their definition)."""
    count = 0
    for q, a in zip(q_lens, starts[: len(q_lens)], strict=True):
        cuts = [p for p in range(a + 1, a + q) if p % block == 0 or (chunk is not None and p % chunk == 0)]
        count += (len(cuts) + 1) if q else 0
    assert count <= P.max_pieces(sum(q_lens), len(q_lens), chunk, block)


def test_empty_steps_return_zeros_and_the_pages():
    pages = jnp.full((3, 2, 16, 8), jnp.nan)
    q = jnp.zeros((0, 1, 16))
    out, same = pk.gated_delta_rule(q, q, jnp.zeros((0, 2, 8)), jnp.zeros((0, 2)), jnp.zeros((0, 2)), pages,
                                    jnp.zeros((2, 4), jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32),
                                    block_size=4)
    assert out.shape == (0, 2, 8) and same is pages


def _bad(fn, match, *args, **kw):
    with pytest.raises(ValueError, match=match):
        fn(*args, **kw)


def test_malformed_arguments_raise_value_errors():
    i = RC.gdn_inputs(np.random.default_rng(0), 4, 2, 4, 16, 8, "float32")
    pages = jnp.zeros((3, 4, 16, 8))
    step = (jnp.zeros((2, 2), jnp.int32), jnp.asarray([2, 2], jnp.int32), jnp.asarray([0, 2, 4], jnp.int32))
    args = (i["q"], i["k"], i["v"], i["g"], i["beta"], pages, *step)
    gdn = pk.gated_delta_rule
    _bad(gdn, "block_size must be a positive int", *args, block_size=0)
    _bad(gdn, "multiple of num_k_heads", i["q"], i["k"], i["v"][:, :3], i["g"][:, :3], i["beta"][:, :3],
         pages[:, :3], *step, block_size=2)
    _bad(gdn, "g must have shape", i["q"], i["k"], i["v"], i["g"][:, :1], i["beta"], pages, *step, block_size=2)
    _bad(gdn, "beta's dtype", *args[:4], i["beta"].astype(jnp.bfloat16), *args[5:], block_size=2)
    _bad(gdn, "state_pages must have shape", *args[:5], pages[:, :, :8], *step, block_size=2)
    _bad(gdn, "state_pages's dtype", *args[:5], pages.astype(jnp.bfloat16), *step, block_size=2)
    _bad(gdn, "share one dtype", i["q"].astype(jnp.bfloat16), *args[1:], block_size=2)
    _bad(gdn, "cu_q_lens must have shape", *args[:8], step[2][:2], block_size=2)
    _bad(gdn, "form must be", *args, block_size=2, form="fused")
    _bad(gdn, "chunk_size >= 16", *args, block_size=2, form="chunked", chunk_size=8, target="gpu")
    _bad(gdn, "multiple of 8", *args, block_size=2, chunk_size=12, target="tpu")
    _bad(gdn, "block_v tiles the GPU", *args, block_size=2, block_v=16, target="tpu")
    _bad(gdn, "power of two", *args, block_size=2, block_v=24, target="gpu")
    x = jnp.zeros((4, 8))
    conv_pages = jnp.zeros((3, 8, 3))
    _bad(pk.causal_conv1d, "K >= 2", x, jnp.zeros((8, 1)), jnp.zeros((3, 8, 0)), *step, block_size=2)
    _bad(pk.causal_conv1d, "conv_state_pages's dtype", x, jnp.zeros((8, 4)), conv_pages.astype(jnp.bfloat16),
         *step, block_size=2)
    _bad(pk.causal_conv1d, "activation must be", x, jnp.zeros((8, 4)), conv_pages, *step, block_size=2,
         activation="gelu")
    _bad(pk.causal_conv1d, "block_c to divide", x, jnp.zeros((8, 4)), conv_pages, *step, block_size=2, block_c=4,
         target="tpu")
    s = RC.ssd_inputs(np.random.default_rng(0), 4, 4, 8, 2, 16, "float32")
    ssd_pages = jnp.zeros((3, 4, 8, 16))
    _bad(pk.mamba2_ssd, "multiple of n_groups", s["x"][:, :3], s["dt"][:, :3], s["A"][:3], s["B"], s["C"],
         ssd_pages[:, :3], *step, block_size=2)
    _bad(pk.mamba2_ssd, "dt's dtype", s["x"], s["dt"].astype(jnp.bfloat16), s["A"], s["B"], s["C"], ssd_pages,
         *step, block_size=2)
    _bad(pk.mamba2_ssd, "B and C must be in x's dtype", s["x"], s["dt"], s["A"], s["B"].astype(jnp.bfloat16),
         s["C"], ssd_pages, *step, block_size=2)


# ---- the reference against transformers' definitions ----------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
    """(torch, transformers' qwen3_next modeling module, its mamba2 modeling module)."""
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    return torch, qwen, pytest.importorskip("transformers.models.mamba2.modeling_mamba2")


def _one_sequence(num_tokens: int, start: int, block_size: int = 64):
    """A step of one sequence at positions start .. start + num_tokens - 1 inside block 0 of a one-block pool: its
    initial state is page 0 before, its final state page 0 after."""
    assert start > 0 and start + num_tokens <= block_size
    return RC.Step(jnp.zeros((1, 1), jnp.int32), jnp.asarray([start + num_tokens], jnp.int32),
                   jnp.asarray([0, num_tokens], jnp.int32), num_tokens, block_size)


def test_reference_is_transformers_gated_delta_rule(hf):
    """transformers' torch_recurrent_gated_delta_rule and torch_chunk_gated_delta_rule (float32, L2-normalised q/k,
    2 v heads per k head, an initial state) give the reference's outputs and final state."""
    torch, qwen, _ = hf
    rng = np.random.default_rng(4)
    i = RC.gdn_inputs(rng, 40, 2, 4, 16, 8, "float32")
    init = (rng.standard_normal((1, 4, 16, 8)) * 0.5).astype(np.float32)
    out, pages = R.gated_delta_rule_reference(i["q"], i["k"], i["v"], i["g"], i["beta"], jnp.asarray(init),
                                              *_one_sequence(40, 5).args(), block_size=64)
    t = {name: torch.tensor(np.asarray(x))[None] for name, x in i.items()}
    for fn in (qwen.torch_recurrent_gated_delta_rule, qwen.torch_chunk_gated_delta_rule):
        o, state = fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=torch.tensor(init),
                      output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(o[0].numpy(), out, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(state[0].numpy(), pages[0], rtol=1e-4, atol=1e-5)


def test_reference_is_transformers_causal_conv1d(hf):
    """causal_conv1d_fn (a prompt from position 0) and causal_conv1d_update (a chunk after a conv state of K - 1
    inputs) give the reference's outputs and conv state."""
    torch, qwen, _ = hf
    rng = np.random.default_rng(5)
    i = RC.conv_inputs(rng, 9, 6, 4, "float32")
    x, w, b = (torch.tensor(np.asarray(i[n])) for n in ("x", "weight", "bias"))
    prompt = RC.Step(jnp.zeros((1, 2), jnp.int32), jnp.asarray([9], jnp.int32), jnp.asarray([0, 9], jnp.int32), 9,
                     64)
    out, _ = R.causal_conv1d_reference(i["x"], i["weight"], jnp.zeros((1, 6, 3)), *prompt.args(), block_size=64,
                                       bias=i["bias"], activation="silu")
    expected = qwen.causal_conv1d_fn(x.T[None], w, b, activation="silu")[0].T
    np.testing.assert_allclose(expected.numpy(), out, rtol=1e-5, atol=1e-6)
    init = rng.standard_normal((1, 6, 3)).astype(np.float32)
    out, pages = R.causal_conv1d_reference(i["x"], i["weight"], jnp.asarray(init), *_one_sequence(9, 7).args(),
                                           block_size=64, bias=i["bias"], activation="silu")
    state = torch.tensor(init)
    expected = qwen.causal_conv1d_update(x.T[None], state, w, b, activation="silu")[0].T
    np.testing.assert_allclose(expected.numpy(), out, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state[0].numpy(), pages[0])  # the last K - 1 inputs, as transformers keeps them


def test_reference_is_transformers_mamba2(hf):
    """mamba2_selective_state_update token by token and mamba2_chunk_scan (2 heads per group, D, an initial state)
    give the reference's outputs and final state."""
    torch, _, mamba = hf
    rng = np.random.default_rng(6)
    i = RC.ssd_inputs(rng, 21, 4, 8, 2, 16, "float32")
    init = (rng.standard_normal((1, 4, 8, 16)) * 0.5).astype(np.float32)
    out, pages = R.mamba2_ssd_reference(i["x"], i["dt"], i["A"], i["B"], i["C"], jnp.asarray(init),
                                        *_one_sequence(21, 3).args(), block_size=64, D=i["D"])
    t = {name: torch.tensor(np.asarray(x)) for name, x in i.items()}
    state = torch.tensor(init)
    for n in range(21):
        y = mamba.mamba2_selective_state_update(
            state, t["x"][n][None], t["dt"][n][None, :, None].expand(1, 4, 8), t["A"][:, None, None].expand(4, 8, 16),
            t["B"][n][None], t["C"][n][None], t["D"][:, None].expand(4, 8))
        np.testing.assert_allclose(y[0].numpy(), out[n], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state[0].numpy(), pages[0], rtol=1e-4, atol=1e-5)
    y, final = mamba.mamba2_chunk_scan(t["x"][None], t["dt"][None], t["A"], t["B"][None], t["C"][None], chunk_size=8,
                                       D=t["D"], initial_states=torch.tensor(init), return_final_states=True)
    np.testing.assert_allclose(y[0].numpy(), out, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(final[0].numpy(), pages[0], rtol=1e-4, atol=1e-5)
