"""Smoke tests of the quantization benchmarks: `bench_quant` (speed) runs end to end on a tiny workload (no timing
assertions); `bench_quant_accuracy`'s pieces measure what they say against references computed here."""

import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from pagedjax import ModelConfig
from pagedjax.model.llama import model_from_state
from pagedjax.model.loading.checkpoint import bundled_model_path, load_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_quant  # noqa: E402
import bench_quant_accuracy as acc  # noqa: E402
import train_tiny  # noqa: E402


@pytest.mark.slow  # compiles three engines: seconds to a minute on a shared CI machine
def test_bench_quant_quick_runs(capsys):
    bench_quant.main(["--quick"])
    out = capsys.readouterr().out
    speed = [line.split() for line in out.splitlines() if line.startswith(("float32 ", "int8 ", "int4 "))]
    assert [r[0] for r in speed] == ["float32"] * 2 + ["int8"] * 2 + ["int4"] * 2


@pytest.mark.slow  # compiles six engines
def test_bench_quant_fused_decode_table(capsys):
    bench_quant.main(["--quick", "--decode-steps", "1,4"])
    out = capsys.readouterr().out.split("median tokens/s by decode_steps_per_call")[1]
    rows = [line.split() for line in out.splitlines() if line.startswith(("float32 ", "int8 ", "int4 "))]
    assert [(r[0], r[1]) for r in rows] == [(s, b) for s in ("float32", "int8", "int4") for b in ("1", "2")]
    assert all(len(r) == 7 for r in rows)  # scheme, batch, (tokens/s, x f32) per value, 4 / 1


def test_scheme_names():
    from pagedjax.config.quant import QuantConfig

    assert bench_quant.quant_config("float32") is None
    assert bench_quant.quant_config("int4:32-head").keep_float == ()
    assert bench_quant.quant_config("int4:32").group_size == 32
    # "-head" keeps every other field (int8 activations were dropped once)
    assert bench_quant.quant_config("w4a8:32-head") == QuantConfig("int4", group_size=32, activations="int8",
                                                                   keep_float=())


def test_llama_rows_need_both_the_python_and_the_sources(capsys):
    with pytest.raises(SystemExit):
        bench_quant.main(["--llama-python", sys.executable])
    assert "--llama-python and --llama-cpp-dir go together" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ bench_quant_accuracy
LLAMA_PYTHON = Path("/work/peers/llama/bin/python")  # PEERS.md's llama-cpp-python venv, where it was built
LLAMA_CPP_DIR = Path("/work/peers/llama_cpp_python-0.3.36/vendor/llama.cpp")


def _logits(cfg: ModelConfig, state, ids: np.ndarray) -> np.ndarray:
    """f32[S, vocab]: a dense forward of the model `cfg` holding `state` over `ids` (i32[S])."""
    graphdef, s = nnx.split(model_from_state(cfg, state))
    return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s).forward_dense(t))(s, ids[None]))[0]


def test_rows_hold_each_schemes_top1_logit_error_bits_per_byte_and_kv_blocks():
    """Each row against the logits of its scheme's model computed here: its top-1 at every position, its logit
    error, and its bits per byte (the text as a one-window held-out split: every target after BOS, special
    tokens counting no bytes). That a quantized model's logits are the float model's of its dequantized kernels
    is tests/model/test_quant.py's."""
    cfg, state = load_checkpoint(bundled_model_path())
    tok = train_tiny.model_dir_corpus_tokenizer(bundled_model_path(), cfg)
    ids = tok.encode_files([acc.TEXT[:160].encode()])[:-1].astype(np.int32)  # BOS + text: i32[S]
    heldout = (ids.astype(np.uint16), tok.token_bytes, len(ids) - 1)
    budget = 16 * 2**20
    rows, want = acc.measure(cfg, state, ["float32", "int4"], ids, budget, heldout)
    assert [r.scheme for r in rows] == ["float32", "int4"]
    for r in rows:
        qcfg, qstate = bench_quant.quantized(cfg, state, r.scheme)
        logits = _logits(qcfg, qstate, ids)  # f32[S, vocab]
        if r.scheme == "float32":
            np.testing.assert_array_equal(want, logits)
        np.testing.assert_array_equal(r.top1, logits.argmax(-1))
        centered = want - want.mean(-1, keepdims=True)
        assert r.logit_error == pytest.approx(np.linalg.norm(logits - want) / np.linalg.norm(centered), rel=1e-4)
        nats = -jax.nn.log_softmax(logits[:-1], -1)[np.arange(len(ids) - 1), ids[1:]]  # f32[S - 1]
        nbytes = tok.token_bytes[ids[1:]]
        assert r.bpb == pytest.approx(float(nats[nbytes > 0].sum()) / math.log(2) / nbytes.sum(), rel=1e-5)
        assert r.agreement == float((r.top1 == rows[0].top1).mean())
        assert r.param_bytes == sum(x.nbytes for x in jax.tree.leaves(qstate))
        assert r.blocks == acc.kv_blocks(qcfg, r.param_bytes, budget)
    assert rows[0].agreement == 1.0 and rows[0].logit_error == 0.0
    assert rows[1].param_bytes < rows[0].param_bytes / 2.5 and 0 < rows[1].logit_error < 0.5
    assert rows[1].bpb > rows[0].bpb  # int4's rounding costs the trained model something on its own text

    peer = acc.Row("llama.cpp Q4_0", rows[1].top1, 0.5, 0.25, 2**20)  # no bits per byte, no blocks
    lines = acc.table(rows + [peer], budget).splitlines()
    assert lines[0].startswith("| scheme | held-out bits/byte |") and len(lines) == 2 + 3
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert lines[2].startswith(f"| float32 | {rows[0].bpb:.4f} | +0.0000 | 100.00% | 0.0000 | 9.01 | 1.00 | "
                               f"{rows[0].blocks} |")
    x = rows[0].param_bytes / 2**20
    assert lines[4] == f"| llama.cpp Q4_0 | - | - | 50.00% | 0.2500 | 1.00 | {x:.2f} | - | - | - |"


def test_top1_margin_by_hand():
    x = np.array([[0.0, 1.0, 3.0, 0.0], [2.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.0, 4.0]], np.float32)
    margins = [2.0 / x[0].std(), 0.0, 4.0 / x[2].std()]
    assert acc.top1_margin(x) == pytest.approx(float(np.median(margins)))


def test_kv_blocks_fill_what_the_parameters_leave():
    cfg = ModelConfig()  # float32 pages
    per_block = 16 * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # tokens x (K, V) x ... x bytes
    assert acc.kv_blocks(cfg, 1000, 1000 + 6 * per_block - 1) == 5
    assert acc.kv_blocks(cfg, 1000, 1000 + per_block) == 1
    with pytest.raises(ValueError, match="budget: 1000 bytes hold no KV block beside 1000 bytes"):
        acc.kv_blocks(cfg, 1000, 1000)
    with pytest.raises(ValueError, match="kv_memory_bytes=.* holds no block"):
        acc.kv_blocks(cfg, 1000, 1000 + per_block - 1)


def test_bad_input_is_refused():
    cfg, state = ModelConfig(num_layers=1), None
    with pytest.raises(ValueError, match="schemes: the first is the float32 baseline"):
        acc.measure(cfg, state, ["int8", "float32"], np.arange(4))
    with pytest.raises(ValueError, match="ids: a non-empty sequence"):
        acc.logits(cfg, state, np.zeros(0, np.int32))


@pytest.mark.parametrize("argv, message", [
    (["--schemes", "int8,float32"], "--schemes must start with float32"),
    (["--models", "bundled,7b"], "--models: unknown ['7b']"),
    (["--llama-python", sys.executable], "--llama-python and --llama-cpp-dir go together"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        acc.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.slow  # two schemes' dense forwards and bits-per-byte windows compiled (CI time)
def test_the_bundled_table_end_to_end(tmp_path, capsys):
    """`main` over a corpus of one held-out and one train file: the bundled model's table, "-head" rows left
    out (its embeddings are tied)."""
    names = iter(f"m{i}.py" for i in range(10_000))
    heldout = next(n for n in names if train_tiny.is_heldout(n))
    train = next(n for n in names if not train_tiny.is_heldout(n))
    text = "def add(a, b):\n    return a + b\n"
    (tmp_path / heldout).write_text(text)
    (tmp_path / train).write_text("x = 1\n")
    acc.main(["--models", "bundled", "--schemes", "float32,int8,int8-head", "--corpus-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"held-out split of {tmp_path}: 1 files, {len(text)} bytes," in out and "int8-head left out: tied" in out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| float32 ", "| int8 "))]
    assert [r[0] for r in rows] == ["| float32", "| int8"] and rows[0][2:4] == ["+0.0000", "100.00%"]
    assert "float32's median top-1 margin:" in out


def test_an_unknown_scheme_fails_before_anything_runs():
    with pytest.raises(ValueError, match="int3"):
        acc.main(["--schemes", "float32,int3"])


def test_a_failing_llama_driver_reports_its_output(tmp_path):
    """The driver under a Python without llama-cpp-python: a RuntimeError carrying its traceback's end."""
    with pytest.raises(RuntimeError, match=r"llama.cpp driver failed \(exit code 1\):(.|\n)*llama_cpp"):
        acc.llama_logits(sys.executable, {"f32": tmp_path / "none.gguf"}, np.arange(4), 1)


@pytest.mark.hf
@pytest.mark.slow  # converts and quantizes a GGUF with llama.cpp's tools (tens of seconds)
@pytest.mark.skipif(not LLAMA_PYTHON.is_file() or not LLAMA_CPP_DIR.is_dir(), reason="no llama-cpp-python build")
def test_llama_cpp_f32_logits_are_pagedjax_float32s(tmp_path):
    """llama.cpp's f32 GGUF of a tiny Hugging Face checkpoint gives pagedjax float32's logits at every position
    (same weights, same ids), and its Q8_0 / Q4_0 logits come back for every position."""
    from bench_peers import MODELS, build_checkpoint

    from pagedjax.model.loading.hf_loader import load_hf

    folder = build_checkpoint(tmp_path / "tiny", MODELS["tiny"][0])  # micro's vocabulary is below byte fallback's 260
    cfg, state, _ = load_hf(folder)
    ids = np.random.default_rng(0).integers(3, cfg.vocab_size, 24).astype(np.int32)
    ggufs = bench_quant.llama_ggufs(folder, str(LLAMA_PYTHON), LLAMA_CPP_DIR, "/work/peers/sentencepiece",
                                    cfg.vocab_size)
    got = acc.llama_logits(str(LLAMA_PYTHON), ggufs, ids, 1)
    assert list(got) == list(bench_quant.LLAMA_TYPES)
    assert all(x.shape == (len(ids), cfg.vocab_size) for x in got.values())
    want = acc.logits(cfg, state, ids)
    assert acc.logit_error(got["llama.cpp f32"], want) < 1e-5  # 1.1e-6 measured; 9e-4 with its flash attention
    np.testing.assert_array_equal(got["llama.cpp f32"].argmax(-1), want.argmax(-1))
    assert 0 < acc.logit_error(got["llama.cpp Q8_0"], want) < acc.logit_error(got["llama.cpp Q4_0"], want)


@pytest.mark.slow  # (CI time) compiles eight small programs
def test_bench_quant_matvec_quick_runs(capsys):
    import bench_quant_matvec

    bench_quant_matvec.main(["--quick"])  # checks every formulation against the dequantized product first
    rows = [line.split("]", 1)[1].rsplit(None, 3)[0].strip() for line in capsys.readouterr().out.splitlines()
            if line.startswith("[256 -> 64]")]
    assert rows == ["float32", "int8", "int4", "int4 two shifts", "int4 jnp.int4", "int4 group sums", "int4 no scales",
                    "int8 x int8 dot"]
