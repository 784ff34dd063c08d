"""Output processing: stop strings found incrementally (same cut and text as decoding the whole output
each token, at a cost per token that does not grow with the output)."""

from __future__ import annotations

import random

import pytest

from eaglespec.api import load_tokenizer
from eaglespec.outputs import OutputProcessor, StopStringMatcher
from eaglespec.request import Request, RequestState
from eaglespec.sampling import SamplingParams
from eaglespec.settings import default_models_dir


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_models_dir() / "target")


def _whole_text_cut(tokenizer, ids, stops):
    """The old rule: decode output[:j+1] for each j; the first j whose text holds a stop string."""
    for j in range(len(ids)):
        text = tokenizer.decode(ids[: j + 1], skip_special_tokens=True)
        hits = [p for p in (text.find(s) for s in stops) if p >= 0]
        if hits:
            return j + 1, text[: min(hits)]
    return None, None


def test_incremental_stop_strings_match_decoding_the_whole_output(tokenizer):
    rng = random.Random(0)
    text = "Hello there, général Kenobi! 3.14 ≈ π; naïve café — ok.\nEND of part ünd ✓ DONE"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for stops in [("END",), ("π;",), ("✓",), ("ok.\n", "zzz"), ("DONE",), ("Kenobi", "there")]:
        want_cut, want_text = _whole_text_cut(tokenizer, ids, stops)
        m = StopStringMatcher(tokenizer.decode, stops)
        got, pos = None, 0
        while got is None and pos < len(ids):  # tokens arrive in steps of 1-4, as accepted paths do
            pos = min(len(ids), pos + rng.randint(1, 4))
            got = m.add(ids, pos)
        assert (m.tokens_read if got is not None else None, got) == (want_cut, want_text), stops


def test_processor_cuts_the_output_at_the_stop_string(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    row = RequestState(0, Request([1, 2], 100, stop_strings=("three",)), SamplingParams(), None)
    proc = OutputProcessor(tokenizer, max_length=1000)
    outs = [proc.process([row], [[t]])[0] for t in ids]
    done = [o for o in outs if o.finished]
    assert done and done[0].finish_reason == "stop" and done[0].text == "one two "
    kept = tokenizer.decode(done[0].output_ids)
    assert kept.startswith("one two") and "three" in kept  # cut after the token that completed it


class _CountingDecode:
    def __init__(self, tokenizer):
        self.tokenizer, self.calls, self.tokens = tokenizer, 0, 0

    def __call__(self, ids, **kw):
        self.calls += 1
        self.tokens += len(ids)
        return self.tokenizer.decode(ids, **kw)


@pytest.mark.parametrize("stops", [("<never>",), ("a much longer stop string that never comes",)])
def test_stop_string_cost_per_token_does_not_grow_with_the_output(tokenizer, stops):
    """Decode calls for the next 10 tokens are the same after 10 and after 2,000, each over a few tokens."""
    words = "the quick brown fox jumps over the lazy dog and then some more words follow here".split()
    rng = random.Random(1)
    ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(3000)), add_special_tokens=False)[:2010]
    costs = []
    for start in (0, 2000):
        decode = _CountingDecode(tokenizer)
        m = StopStringMatcher(decode, stops)
        m.add(ids, start)  # the output so far
        decode.calls = decode.tokens = 0
        for j in range(start + 1, start + 11):
            assert m.add(ids, j) is None
        costs.append((decode.calls, decode.tokens))
    # two decode calls per token at either length, each over a few tokens (the whole output was 2,000)
    assert costs[0][0] == costs[1][0] == 20, costs
    assert all(tokens <= 20 * 4 for _, tokens in costs), costs
