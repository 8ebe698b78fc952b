"""How a generation ends and what it streams: EOS, stop strings, the token budget, text deltas.

Engine tests run the embedded model (its byte-level BPE splits characters across tokens, which is what the
detokeniser and the stop matcher must cope with) with the n-gram drafter, so rounds emit several tokens at
once; the text helpers are also tested on their own over many random splits.
"""

from __future__ import annotations

import random

import pytest
import torch

from service.decoding import Engine, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.text import IncrementalDetokenizer, StopMatcher, encode_chat, encode_prompt

METHODS = [("vanilla", 0), ("sd", 6)]
# answered in one sentence that ends by EOS ("The capital of Japan is Tokyo."), in fp32 and on the 4-bit path.
# Not France: in bf16 its first token is an exact tie ("The" and "L" both 25.625), and the answer that wins the
# tie runs on. Not Italy: its first token "Il" starts a near-tie answer that ran on ("Il Corriere dii, ...")
# once the 4-bit kernel summed its blocks in another order.
CAPITAL = "What is the capital of Japan?"
# a completion prompt that the model continues by repeating it: long multi-token rounds
WEEK = "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday, Monday, Tuesday, Wednesday,"
MULTIBYTE = "😀🎉 café naïve 日本語 ½ Ωmega\n😀🎉 café naïve 日本語 ½ Ωmega\n😀🎉 café"

# One torch thread: see the fixture (on shared cores a second thread makes each forward several times slower).
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def engine(embedded):
    return Engine(embedded, {"ngram": NgramDrafter()})


def generate(engine, ids, method="sd", k=6, **sampling):
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k)
    generation = engine.generate(ids, SamplingParams(**sampling), spec, "ngram")
    rounds = list(run_alone(generation))
    return generation, rounds


def streamed(rounds) -> str:
    return "".join(r.text for r in rounds)


def chat(embedded, text):
    return encode_chat(embedded.tokenizer, [{"role": "user", "content": text}])


@pytest.fixture(scope="module")
def capital(engine, embedded):
    """The unconstrained greedy answer (ends by EOS): the reference for the stop-string tests."""
    generation, _ = generate(engine, chat(embedded, CAPITAL), "vanilla", max_tokens=40)
    return generation


# ---------------------------------------------------------------- EOS


@pytest.mark.parametrize("method, k", METHODS)
def test_eos_ends_with_stop_and_is_not_emitted(engine, embedded, method, k):
    ids = chat(embedded, CAPITAL)
    generation, rounds = generate(engine, ids, method, k, max_tokens=40)
    eos = embedded.eos_token_ids()
    tokens = [t.token_id for t in generation.tokens]
    assert generation.finish_reason == "stop" and rounds[-1].finish_reason == "stop"
    assert len(tokens) < 40 and not eos & set(tokens)
    assert embedded.tokenizer.eos_token not in generation.text
    # It really was EOS that ended it: the target's next token after the output is an EOS token.
    with torch.inference_mode():
        following = int(embedded.model(input_ids=torch.tensor([ids + tokens])).logits[0, -1].argmax())
    assert following in eos
    assert streamed(rounds) == generation.text


def test_ignore_eos_goes_on_to_max_tokens(engine, embedded, capital):
    n = len(capital.tokens)
    generation, _ = generate(engine, chat(embedded, CAPITAL), max_tokens=n + 3, ignore_eos=True)
    assert generation.finish_reason == "length" and len(generation.tokens) == n + 3
    assert generation.tokens[n].token_id in embedded.eos_token_ids()
    assert generation.text.startswith(capital.text)


# ---------------------------------------------------------------- stop strings


def boundary_stops(embedded, generation) -> list[str]:
    """Stop strings that straddle token boundaries of the output: 2 characters each side of a boundary,
    and one spanning three tokens; only those whose first occurrence is the one at that boundary."""
    tokens = [t.token_id for t in generation.tokens]
    text = generation.text
    bounds = [len(embedded.tokenizer.decode(tokens[:i])) for i in range(1, len(tokens))]
    stops = []
    for b in bounds:
        stop = text[b - 2 : b + 2]
        if b >= 2 and len(stop) == 4 and text.find(stop) == b - 2:
            stops.append(stop)
    if len(bounds) >= 3:
        stop = text[bounds[0] - 1 : bounds[2] + 1]
        if text.find(stop) == bounds[0] - 1:
            stops.append(stop)
    return stops


@pytest.mark.parametrize("method, k", METHODS)
def test_stop_string_across_tokens_cuts_exactly_and_never_streams(engine, embedded, capital, method, k):
    stops = boundary_stops(embedded, capital)
    assert len(stops) >= 3, stops
    stops = [stops[0], stops[len(stops) // 2], stops[-1]]  # early, middle, and the three-token one
    ids = chat(embedded, CAPITAL)
    for stop in stops:
        generation, rounds = generate(engine, ids, method, k, max_tokens=40, stop=(stop,))
        expected = capital.text[: capital.text.index(stop)]
        assert generation.finish_reason == "stop", stop
        assert generation.text == expected, stop
        # Deltas only ever append, so if they add up to the text before the stop string, no part of it was
        # ever streamed (not even a prefix held back too late).
        assert streamed(rounds) == expected, stop


def test_earliest_of_several_stop_strings_wins(engine, embedded, capital):
    text = capital.text
    early, late = text[4:9], text[12:16]
    generation, rounds = generate(engine, chat(embedded, CAPITAL), max_tokens=40, stop=(late, early))
    assert generation.text == streamed(rounds) == text[: text.index(early)]


def test_stop_string_that_never_occurs_changes_nothing(engine, embedded, capital):
    """The matcher holds back a tail that could start a stop string; at the end it must give it back."""
    stop = capital.text[-3:] + "@@"  # starts like the end of the output, never completes
    generation, rounds = generate(engine, chat(embedded, CAPITAL), max_tokens=40, stop=(stop,))
    assert generation.finish_reason == "stop"  # by EOS
    assert generation.text == streamed(rounds) == capital.text


# ---------------------------------------------------------------- the token budget


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 7, 10])
def test_max_tokens_is_exact_when_the_draft_is_longer_than_the_budget(engine, embedded, max_tokens):
    ids = encode_prompt(embedded.tokenizer, WEEK)
    generation, rounds = generate(engine, ids, "sd", k=8, max_tokens=max_tokens)
    assert len(generation.tokens) == max_tokens
    assert sum(len(s.tokens) for s in rounds) == max_tokens
    assert generation.finish_reason == "length" and rounds[-1].finish_reason == "length"
    assert all(s.finish_reason is None for s in rounds[:-1])
    # never drafted what the budget could not keep: a round emits at most its draft + 1 token
    emitted = 0
    for s in rounds:
        assert s.round.num_draft_tokens <= max_tokens - emitted - 1
        emitted += len(s.tokens)
    assert streamed(rounds) == generation.text
    assert generation.text == embedded.tokenizer.decode([t.token_id for t in generation.tokens])
    if max_tokens >= 3:  # the prompt repeats itself: the drafter was used, not just budgeted away
        assert generation.stats.num_accepted > 0


# ---------------------------------------------------------------- multi-byte characters


def test_detokenizer_never_emits_replacement_characters(embedded):
    tok = embedded.tokenizer
    ids = tok(MULTIBYTE)["input_ids"]
    # the test is only meaningful if some tokens are pieces of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    rng = random.Random(0)
    for _ in range(20):
        detok = IncrementalDetokenizer(tok, [])
        deltas, i = [], 0
        while i < len(ids):
            n = rng.randint(1, 4)  # tokens arrive in rounds of varying size
            deltas.append(detok.push(ids[i : i + n]))
            i += n
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == MULTIBYTE


@pytest.mark.parametrize("method, k", METHODS)
def test_streamed_multibyte_text_has_no_replacement_characters(engine, embedded, method, k):
    ids = encode_prompt(embedded.tokenizer, MULTIBYTE)
    generation, rounds = generate(engine, ids, method, k, max_tokens=24)
    tokens = [t.token_id for t in generation.tokens]
    assert any("\ufffd" in embedded.tokenizer.decode([t]) for t in tokens), generation.text
    assert all("\ufffd" not in s.text for s in rounds)
    assert streamed(rounds) == generation.text
    assert any(ord(c) > 0x7F for c in generation.text)


# ---------------------------------------------------------------- the stop matcher on its own


def test_stop_matcher_over_random_splits():
    rng = random.Random(1)
    alphabet = "ab c"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))
        )
        matcher = StopMatcher(stops)
        out, stopped, i = "", False, 0
        while i < len(text) and not stopped:
            n = rng.randint(1, 5)
            piece, stopped = matcher.feed(text[i : i + n])
            out += piece
            i += n
        if not stopped:
            out += matcher.flush()
        # the stop string that completes first wins, cut where it starts (ties: the longer one)
        hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        assert stopped == bool(hits), (text, stops)
        assert out == (text[: min(hits)[1]] if hits else text), (text, stops)


def test_stop_matcher_result_does_not_depend_on_how_text_arrives():
    # "c" completes before "bcd" does, whether "abcd" arrives at once or one character at a time
    assert StopMatcher(("bcd", "c")).feed("abcd") == ("ab", True)
    matcher = StopMatcher(("bcd", "c"))
    assert [matcher.feed(ch) for ch in "abc"] == [("", False), ("", False), ("ab", True)]
