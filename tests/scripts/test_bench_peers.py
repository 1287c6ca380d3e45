"""Smoke test: the peer benchmark runs end to end on a micro model (pagedjax + transformers), and its
subprocess-peer plumbing (used for vLLM) works against a stand-in driver. No timing assertions."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_peers  # noqa: E402

FAKE_DRIVER = r'''
import json, sys
MARK = "@@BENCH_PEERS@@ "
cfg = json.loads(sys.argv[1])
print("some log line a peer prints on stdout", flush=True)
print(MARK + json.dumps({"ready": True, "version": "9.9"}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    if req.get("quit"):
        break
    if req["max_tokens"] == 13:
        sys.exit(3)  # a peer that dies mid-run
    tokens = [[p[-1] + cfg["offset"]] * req["max_tokens"] for p in req["prompts"]]
    print(MARK + json.dumps({"seconds": 0.5, "tokens": tokens}), flush=True)
'''


def _smoke_run(tmp_path, capsys, model: str) -> tuple[dict, str]:
    """One round of bench_peers on a micro model (pagedjax and transformers): (its results, what it printed)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    res = bench_peers.main(["--model", model, "--rounds", "1", "--torch-threads", "1",
                            "--folder", str(tmp_path / model)])
    return res, capsys.readouterr().out


@pytest.mark.hf
@pytest.mark.slow  # (CI time) a script's smoke run; bench_engine's quick run stays in the default run
def test_bench_peers_micro_runs(tmp_path, capsys):
    res, out = _smoke_run(tmp_path, capsys, "micro")
    assert "| workload | system | median s | tok/s | vs pagedjax | same tokens |" in out
    assert "warm-up run" in out and "GB/s" in out and "Versions: pagedjax" in out
    table = [line for line in out.splitlines() if line.startswith("| b2")]
    assert len(table) == 2 * 3  # 2 workloads x (pagedjax 8-step, 1-step, transformers)
    assert {r["system"] for r in res["rows"]} == {"pagedjax, 8-step decode", "pagedjax, 1-step decode",
                                                  "transformers, 1 torch thread"}
    # Greedy decoding of the same weights from the same token ids: every system emits pagedjax's tokens.
    assert all(r["agreement"] == 1.0 for r in res["rows"]), res["rows"]
    assert all(line.rstrip().endswith("| 1.000 |") for line in table)
    assert res["bandwidth_gbs"] > 0 and res["weight_bytes"] > 0


def test_subprocess_peer_protocol(tmp_path):
    peer = bench_peers.Subprocess("fake peer", sys.executable, FAKE_DRIVER, {"offset": 1}, {}, 60, 60)
    try:
        peer.wait_ready()
        assert peer.version == "9.9"
        seconds, tokens = peer.run(np.array([[5, 6, 7], [8, 9, 10]]), 4)
        assert seconds == 0.5 and tokens.tolist() == [[8] * 4, [11] * 4]
        with pytest.raises(RuntimeError, match="driver exited"):
            peer.run(np.array([[1, 2]]), 13)
    finally:
        peer.close()
    assert "some log line" in peer.log_path.read_text()


def test_missing_peer_is_reported_not_fatal():
    version, why = bench_peers.peer_version(sys.executable, "no_such_module_for_bench_peers")
    assert version is None and "no_such_module_for_bench_peers" in why


def test_prompts_share_prefix_and_differ_per_round():
    w = bench_peers.PREFIX
    a, b = bench_peers.make_prompts(w, 1024, 0, 0), bench_peers.make_prompts(w, 1024, 0, 1)
    assert a.shape == (64, 128) and (a >= 3).all() and (a < 1024).all()
    assert (a[:, :96] == a[0, :96]).all() and len({tuple(r[96:]) for r in a}) == 64
    assert not np.array_equal(a, b)
    # The prefill probe never finds the full batch-1 workload's prompt in a prefix cache.
    assert not np.array_equal(bench_peers.make_prompts(bench_peers.B1, 1024, 0, 0),
                              bench_peers.make_prompts(bench_peers.B1_PROBE, 1024, 0, 0))


def test_every_models_workloads_fit_its_positions_and_first_token_rows_find_nothing_cached():
    """Each model's longest workload fits its checkpoint's positions (the peers refuse a longer max_model_len);
    156m-long's time-to-first-token rows are table rows (not probes) whose prompts no other workload shares."""
    for name, (kwargs, workloads) in bench_peers.MODELS.items():
        assert max(w.total_len for w in workloads) <= kwargs["max_position_embeddings"], name
    long = bench_peers.MODELS["156m-long"][1]
    first = [w for w in long if w.new_tokens == 1]
    assert {(w.batch, w.prompt_len) for w in first} == {(1, 2048), (8, 1024)} and not any(w.probe for w in long)
    for w in first:
        full = next(x for x in long if x is not w and (x.batch, x.prompt_len) == (w.batch, w.prompt_len))
        assert not np.array_equal(bench_peers.make_prompts(w, 32000, 0, 0), bench_peers.make_prompts(full, 32000, 0, 0))


def test_byte_fallback_tokenizer_for_llama_cpp_conversion(tmp_path):
    """The tokenizer.json written for llama.cpp's converter has exactly the model's vocabulary, Llama's special
    tokens first and a byte-fallback token for each byte, and round-trips any text through its bytes."""
    from tokenizers import Tokenizer

    bench_peers.write_byte_fallback_tokenizer(tmp_path, 300)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 300
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<0x00>", "<0xFF>")] == [0, 1, 2, 3, 258]
    text = "héllo wörld"
    assert tok.decode(tok.encode(text).ids) == text
    with pytest.raises(ValueError, match="260"):
        bench_peers.write_byte_fallback_tokenizer(tmp_path, 256)


@pytest.mark.hf
@pytest.mark.slow  # ~4 s (torch and transformers imported for a benchmark's checkpoint): CI's budget
def test_mixtral_checkpoint_is_transformers_mixtral_with_the_counted_parameters(tmp_path):
    """--model micro-mixtral writes a MixtralForCausalLM (transformers' own class) whose saved tensors hold the
    parameter count the report prints, and whose per-token count uses top_k of the experts."""
    import json

    from safetensors import safe_open

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    kwargs, _ = bench_peers.MODELS["micro-mixtral"]
    folder = bench_peers.build_checkpoint(tmp_path / "mm", kwargs)
    assert bench_peers.architecture(kwargs) == "mixtral"
    assert bench_peers.architecture(bench_peers.MODELS["micro"][0]) == "llama"
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"] and config["sliding_window"] is None
    assert config["num_local_experts"] == 4 and config["num_experts_per_tok"] == 2
    sizes = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "np") as f:
            sizes.update({name: int(np.prod(f.get_slice(name).get_shape())) for name in f.keys()})
    experts = sum(n for name, n in sizes.items() if ".experts." in name)
    assert experts > 0
    assert bench_peers._num_params(kwargs) == sum(sizes.values())
    assert bench_peers._num_params(kwargs, active=True) == sum(sizes.values()) - experts + experts * 2 // 4


@pytest.mark.hf
@pytest.mark.slow  # (CI time) the Mixtral variant of the smoke run above
def test_bench_peers_micro_mixtral_runs(tmp_path, capsys):
    res, out = _smoke_run(tmp_path, capsys, "micro-mixtral")
    assert "random Mixtral (" in out and "4 experts, top 2" in out and "active per token" in out
    assert res["architecture"] == "mixtral" and res["active_params"] < res["num_params"]
    assert len([line for line in out.splitlines() if line.startswith("| b2")]) == 3
    # transformers' Mixtral and pagedjax's MoE route and decode the same greedy tokens.
    assert all(r["agreement"] == 1.0 for r in res["rows"]), res["rows"]
    assert res["decode"] == []  # no prefill probe: a decode step reads only its tokens' experts
