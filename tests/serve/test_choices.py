"""ChoiceTracker: engine snapshots -> text deltas per choice, with the final choices in the engine's order. The
engine's text is what it shows (`pagedjax.engine.output_processor`: nothing that can still change); the tracker decodes
nothing itself."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.outputs import RequestOutput
from pagedjax.serve.choices import ChoiceDelta, ChoiceTracker, RequestFailed

TOK = ByteTokenizer()


def _out(ids, reason=None, text=None, error=None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[256], output_token_ids=list(ids), num_cached_tokens=0,
                         finish_reason=reason, text=text, error=error)


def _multi(samples, finished: bool):
    """A snapshot of a multi-sample request: `samples` are (index, ids, finish_reason, final text)."""
    outputs = [SimpleNamespace(index=i, token_ids=ids, text=text, finish_reason=reason, logprobs=None)
               for i, ids, reason, text in samples]
    first = outputs[0]
    return SimpleNamespace(request_id="r", output_token_ids=first.token_ids, text=first.text, error=None,
                           finish_reason=first.finish_reason if finished else None, finished=finished,
                           outputs=outputs, num_cached_tokens=0)


def test_single_sample_deltas_and_final_text():
    tracker = ChoiceTracker()
    euro = list("€".encode())
    assert tracker.update(_out([104, euro[0]], text="h")) == [ChoiceDelta(0, "h", None)]
    assert tracker.update(_out([104, *euro[:2]], text="h")) == []  # the engine shows nothing new yet
    final = [104, *euro, 105]
    assert tracker.update(_out(final, "length", TOK.decode(final))) == [ChoiceDelta(0, "€i", "length")]
    assert tracker.final_choices() == [(0, "h€i", "length", None)]
    assert tracker.completion_tokens == 5


def test_stop_string_cut_comes_from_the_engines_final_text():
    tracker = ChoiceTracker()
    assert tracker.update(_out(TOK.encode("abX", add_bos=False), text="ab")) == [ChoiceDelta(0, "ab", None)]
    done = tracker.update(_out(TOK.encode("abXYZ", add_bos=False), "stop", "ab"))
    assert done == [ChoiceDelta(0, "", "stop")]
    assert tracker.final_choices() == [(0, "ab", "stop", None)]


def test_several_samples_and_the_final_order():
    tracker = ChoiceTracker()
    a, b, c = (TOK.encode(t, add_bos=False) for t in ("aa", "bbb", "c"))
    deltas = tracker.update(_multi([(0, a[:1], None, "a"), (1, b[:2], None, "bb"), (2, c, "stop", "c")], False))
    assert deltas == [ChoiceDelta(0, "a", None), ChoiceDelta(1, "bb", None), ChoiceDelta(2, "c", "stop")]
    # best_of 3, n 2: the engine returns the two best, best first, under their sample indices.
    tracker.update(_multi([(1, b, "length", "bbb"), (0, a, "length", "aa")], True))
    assert tracker.final_choices() == [(0, "bbb", "length", None), (1, "aa", "length", None)]


@pytest.mark.parametrize("reason", ["error", "abort"])
def test_a_failed_request_raises(reason):
    tracker = ChoiceTracker()
    with pytest.raises(RequestFailed, match="device fault" if reason == "error" else "abort"):
        tracker.update(_out([104], reason, "h", error="device fault" if reason == "error" else None))
