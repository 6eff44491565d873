"""The request limits and the error scrubbing in-process (issue 16.1, 16.6): the context check's cost is bounded
by the context, not the text, and its answer is exact where it matters; client-visible errors carry no server
paths."""
from __future__ import annotations

import pytest

from server import limits
from server.errors import APIError, without_paths


@pytest.fixture(scope="module")
def tok(synth):
    from server.tokenizer import Tokenizer
    return Tokenizer(synth("tiny", "nvfp4"))


class Counting:
    def __init__(self, tok):
        self.tok, self.chars = tok, 0

    def __call__(self, text):
        self.chars += len(text)
        return self.tok.encode(text)


def test_context_check_tokenizes_a_bounded_part_of_an_oversized_text(tok):
    from tools.synth_tokenizer import CORPUS
    text = CORPUS * 2000                 # ~3 MB, ~700k tokens
    limit = 256
    enc = Counting(tok)
    with pytest.raises(limits.ContextTooLong) as e:
        limits.encode_within(enc, text, limit, limits.max_piece_chars(tok, 1024))
    assert enc.chars == 0 and e.value.at_least > limit       # characters alone prove it
    enc = Counting(tok)
    with pytest.raises(limits.ContextTooLong) as e:
        limits.encode_within(enc, text, limit, None)         # no character bound: doubling prefixes
    assert e.value.at_least > limit and enc.chars <= 12 * limit, enc.chars
    assert len(text) > 200 * enc.chars       # what tokenizing the whole text (the code before) would cost


def test_context_check_is_exact_where_the_answer_is_not_obvious(tok):
    """Around the limit, encode_within refuses only texts that do not fit, with a true lower bound of their
    tokens; whatever it returns is exactly tok.encode(text) (the request's own check then judges its length)."""
    from tools.synth_tokenizer import CORPUS
    limit = 64
    outcomes = {"refused": 0, "returned": 0}
    for n_chars in range(50, 2400, 37):
        text = (CORPUS * 3)[:n_chars]
        n = len(tok.encode(text))
        for piece_chars in (limits.max_piece_chars(tok, 1024), None):
            try:
                got = limits.encode_within(tok.encode, text, limit, piece_chars)
            except limits.ContextTooLong as e:
                assert n > limit and e.at_least <= n, (n_chars, n, e.at_least)
                outcomes["refused"] += 1
            else:
                assert got == tok.encode(text), (n_chars, n)
                outcomes["returned"] += 1
    assert outcomes["refused"] > 10 and outcomes["returned"] > 10, outcomes     # both sides were exercised


def test_lone_surrogates_anywhere_in_a_request_are_named():
    from server.protocol import ChatCompletionRequest
    req = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "ok"},
                                                                       {"type": "text", "text": "x\udbffy"}]}])
    with pytest.raises(APIError) as e:
        limits.check_text(req)
    assert e.value.status == 400 and e.value.param == "messages.0.content.1.text" and "U+DBFF" in e.value.message
    with pytest.raises(APIError):
        limits.check_text(ChatCompletionRequest(messages=[{"role": "user", "content": "ok"}], extra_field="\udc00"))
    limits.check_text(ChatCompletionRequest(messages=[{"role": "user", "content": "Привет 😀 \u4e16"}]))   # twin


def test_errors_carry_no_absolute_paths():
    e = APIError(500, "loading /srv/models/nano.moestream-store failed: StoreError: /srv/models/nano.moestream-store"
                      "/manifest.json: bad (block at offset 4096 of /srv/m/experts.bin)")
    assert "/srv" not in e.message and "manifest.json" in e.message and "experts.bin" in e.message
    assert "/srv" not in str(e.body())
    kept = "POST /v1/chat/completions at http://example.com/a/b.png: 3.1 tokens/s"
    assert without_paths(kept) == kept          # the twin: routes, URLs and ratios are not paths
