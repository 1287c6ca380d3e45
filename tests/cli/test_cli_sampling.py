"""`pagedjax-generate --n / --logprobs / --beam-width`: several samples, log-probabilities and beam search from the
command line (JSON output checked against the engine's own results)."""

import json

from pagedjax import cli


def _json(argv, capsys) -> dict:
    assert cli.main([*argv, "--json", "--num-blocks", "32", "--ignore-eos"]) == 0
    return json.loads(capsys.readouterr().out)


def test_n_samples_with_logprobs(capsys):
    out = _json(["--prompt", "def f(x):", "--max-tokens", "5", "--n", "3", "--logprobs", "2",
                 "--temperature", "1.0", "--seed", "4"], capsys)
    (c,) = out["completions"]
    samples = c["samples"]
    assert [s["index"] for s in samples] == [0, 1, 2]
    assert c["text"] == samples[0]["text"]
    for s in samples:
        assert len(s["token_ids"]) == 5 and len(s["logprobs"]) == 5 and s["finish_reason"] == "length"
        assert abs(sum(t["logprob"] for t in s["logprobs"]) - s["cumulative_logprob"]) < 1e-4
        for t in s["logprobs"]:
            assert len(t["top"]) == 2 and t["top"][0]["logprob"] >= t["top"][1]["logprob"]
            assert t["logprob"] <= t["top"][0]["logprob"] + 1e-6 and t["logprob"] <= 0.0
    assert out["stats"]["generated_tokens"] == 15


def test_beam_search(capsys):
    out = _json(["--prompt", "import o", "--prompt", "def g(", "--max-tokens", "4", "--beam-width", "3"], capsys)
    for c in out["completions"]:
        beams = c["samples"]
        assert len(beams) == 3 and c["finish_reason"] == "beam" and c["text"] == beams[0]["text"]
        scores = [b["score"] for b in beams]
        assert scores == sorted(scores, reverse=True)
        assert all(len(b["token_ids"]) == 4 for b in beams)  # --ignore-eos: every beam runs to max_tokens
        assert len({tuple(b["token_ids"]) for b in beams}) == 3
