"""A chat prompt is tokenized once (session 13): where the last message ends comes from the prompt's own encode
(`Tokenizer.encode_split`) wherever that is proven, and equals what the second encode of the text without the
generation prompt gives (the old way, still the fallback)."""
from __future__ import annotations

import random

import pytest

from nemotron.vision_prompt import encode_prompt


@pytest.fixture(scope="module", params=["stretch memo", "whole text"])
def tok(synth, request):
    """The tokenizer as the server runs it (the stretch memo, server/stretch_encoder.py), and with the memo off (the
    path of a tokenizer it is not exact for): each test runs on both."""
    from server.tokenizer import Tokenizer
    t = Tokenizer(synth("tiny", "nvfp4"))
    assert t.stretches is not None
    if request.param == "whole text":
        t.stretches = None
    return t


def conversations(seed: int, n: int = 12):
    """Varied chats: system or not, one to four turns, assistant turns with thinking, odd whitespace at the ends."""
    from tools.synth_tokenizer import CORPUS
    rng = random.Random(seed)
    words = CORPUS.split()
    for _ in range(n):
        def text():
            s = " ".join(rng.choice(words) for _ in range(rng.randrange(1, 60)))
            return rng.choice(["", " ", "\n", "  "]) + s + rng.choice(["", " ", "\n", "\n\n"])
        msgs = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for t in range(rng.randrange(1, 5)):
            msgs.append({"role": "user", "content": text()})
            if t + 1 < 5 and rng.random() < 0.6:
                msgs.append({"role": "assistant", "content": f"<think>{text()}</think>{text()}"})
        if msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": text()})
        yield msgs


def slow(tok, msgs):
    return encode_prompt(lambda gen: tok.render_chat(msgs, gen), tok.encode, None, True, messages_end=True)


def counted(tok):
    """encode_split and encode, each counting its calls."""
    calls = {"encode": 0, "split": 0}

    def encode(t):
        calls["encode"] += 1
        return tok.encode(t)

    def split(t, n):
        calls["split"] += 1
        return tok.encode_split(t, n)
    return calls, encode, split


def test_one_encode_gives_the_same_ids_and_messages_end(tok):
    proven = 0
    for msgs in conversations(7):
        ref = slow(tok, msgs)
        calls, encode, split = counted(tok)
        got = encode_prompt(lambda gen: tok.render_chat(msgs, gen), encode, None, True, messages_end=True,
                            encode_split=split)
        assert got.ids == ref.ids and got.messages_end == ref.messages_end
        assert ref.messages_end is not None          # the chat template's base is a prefix here
        proven += calls["encode"] == 0
        assert calls["split"] == 1 and calls["encode"] <= 1
    assert proven == 12                              # the template ends a message with an added token: always proven


def test_split_says_none_where_nothing_is_proven(tok):
    """The twins: a cut inside a stretch, a cut with no added token after it, a cut whose stretch encodes otherwise
    alone; each must say None (the caller then encodes the prefix), never a wrong count."""
    text = tok.render_chat([{"role": "user", "content": "hello there friend"}], True)
    base = tok.render_chat([{"role": "user", "content": "hello there friend"}], False)
    ids, n = tok.encode_split(text, len(base))
    assert n is not None and tok.encode(base) == ids[:n]
    cut = base.index("there") + 2                      # inside a word: no added token starts there
    assert tok.encode_split(text, cut)[1] is None
    assert tok.encode_split(base, len(base) - 1)[1] is None       # before the stretch's last character
    assert tok.encode_split("plain words only", 5)[1] is None     # no added token at all


def test_a_stretch_that_encodes_otherwise_is_caught(tok, monkeypatch):
    """The check of the last stretch is what proves the count: with a backend whose encode of the stretch alone
    differs (as a tokenizer adding a prefix space to every text would), the answer is None."""
    text = tok.render_chat([{"role": "user", "content": "a b c"}], True)
    base = tok.render_chat([{"role": "user", "content": "a b c"}], False)
    real = tok.backend

    class Shifted:
        def encode(self, t, add_special_tokens=False):
            enc = real.encode(t, add_special_tokens=add_special_tokens)
            if t == text:
                return enc

            class E:
                ids = [i + 1 for i in enc.ids]
                offsets = enc.offsets
            return E()

        def get_added_tokens_decoder(self):
            return real.get_added_tokens_decoder()
    monkeypatch.setattr(tok, "backend", Shifted())
    assert tok.encode_split(text, len(base))[1] is None


def test_no_messages_end_without_cache_prompt_costs_one_encode(tok):
    msgs = [{"role": "user", "content": "just one encode"}]
    calls, encode, split = counted(tok)
    p = encode_prompt(lambda gen: tok.render_chat(msgs, gen), encode, None, True, messages_end=False,
                      encode_split=split)
    assert calls == {"encode": 1, "split": 0} and p.messages_end is None and p.ids == slow(tok, msgs).ids


def _split_by_offsets(tok, text: str, n_chars: int):
    """Twin of `encode_split` over the encoding's whole offsets list (session 13's way, before char_to_token)."""
    enc = tok.backend.encode(text, add_special_tokens=False)
    ids, offsets = enc.ids, enc.offsets
    added = tok._added_ids()
    n = next((i for i, (a, _) in enumerate(offsets) if a >= n_chars), None)
    if n is None or n == 0 or offsets[n][0] != n_chars or ids[n] not in added or offsets[n - 1][1] > n_chars:
        return ids, None
    p = next((i for i in range(n - 1, -1, -1) if ids[i] in added), None)
    if p is None:
        return ids, None
    start = offsets[p][1]
    tail = tok.backend.encode(text[start:n_chars], add_special_tokens=False).ids if start < n_chars else []
    return (ids, n) if tail == ids[p + 1:n] else (ids, None)


def test_split_equals_the_offsets_twin_at_every_cut(tok):
    """The split asks the encoding for the token at the cut: the same answer as the whole offsets list gives, at the
    start of every added token, inside words, at both ends and past them, on varied chats."""
    rng = random.Random(5)
    checked = proven = 0
    for msgs in conversations(11, n=6):
        text = tok.render_chat(msgs, True)
        enc = tok.backend.encode(text, add_special_tokens=False)
        marks = [a for (a, _), i in zip(enc.offsets, enc.ids) if i in tok._added_ids()]
        for cut in marks + [rng.randrange(len(text)) for _ in range(8)] + [0, 1, len(text) - 1, len(text)]:
            got = tok.encode_split(text, cut)
            assert got == _split_by_offsets(tok, text, cut), cut
            checked += 1
            proven += got[1] is not None
    assert checked > 50 and proven > 10           # both answers exercised


def test_must_fail_split_a_token_late_is_caught(tok, monkeypatch):
    """The twin: a split that asks for the token one character past the cut answers otherwise than the offsets twin
    at some cut (the equality test above can fail)."""
    real = tok.encode_split
    monkeypatch.setattr(tok, "encode_split", lambda text, n: real(text, n + 1))
    differs = 0
    for msgs in conversations(11, n=3):
        text = tok.render_chat(msgs, True)
        enc = tok.backend.encode(text, add_special_tokens=False)
        for (a, _), i in zip(enc.offsets, enc.ids):
            if i in tok._added_ids():
                differs += tok.encode_split(text, a) != _split_by_offsets(tok, text, a)
    assert differs > 0


def _transformers_encode(tok, text: str, add_special_tokens: bool = False) -> list[int]:
    return tok.tok.encode(text, add_special_tokens=add_special_tokens)


def test_the_fast_encode_equals_transformers_encode(tok):
    """`Tokenizer.encode` runs the backend's `encode_batch_fast` (no offsets) where the backend is set as
    transformers' encode sets it: the same ids on varied chats, special tokens, empty and odd texts."""
    from tools.synth_tokenizer import CORPUS
    texts = [tok.render_chat(msgs, True) for msgs in conversations(13, n=8)]
    texts += ["", " ", "\n\n", "a", "<|im_end|>", "x<think>y</think>\n", CORPUS * 12, "é" * 1001 + " ß\u200b"]
    for text in texts:
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == _transformers_encode(tok, text, special)
    assert type(tok.encode("abc")) is list


def test_a_backend_set_otherwise_takes_transformers_encode(tok, monkeypatch):
    """A backend left with truncation (a tokenizer.json may carry one) or a tokenizer that splits special tokens is
    not the fast path's case: `encode` then asks transformers, and the ids stay transformers' ids."""
    text = tok.render_chat([{"role": "user", "content": "a message long enough to be cut " * 20}], True)
    want = _transformers_encode(tok, text)
    tok.backend.enable_truncation(max_length=8)
    try:
        assert tok.encode(text) == want and len(want) > 8
    finally:
        tok.backend.no_truncation()
    monkeypatch.setattr(tok.tok, "split_special_tokens", True)
    assert tok.encode("<|im_end|>") == _transformers_encode(tok, "<|im_end|>") != [tok.tok.convert_tokens_to_ids(
        "<|im_end|>")]


def test_must_fail_a_fast_path_taken_regardless_is_caught(tok):
    """The twin: the backend's fast encode taken with the backend's truncation still on gives other ids, which the
    equality above would catch."""
    text = tok.render_chat([{"role": "user", "content": "a message long enough to be cut " * 20}], True)
    want = _transformers_encode(tok, text)
    tok.backend.enable_truncation(max_length=8)
    try:
        forced = tok.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
    finally:
        tok.backend.no_truncation()
    assert forced != want
