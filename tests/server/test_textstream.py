"""Token ids -> text deltas: stop strings held back across tokens, `<think>` routed to reasoning, multi-byte
characters split over tokens, with the synthetic checkpoint's real tokenizer (no server)."""
from __future__ import annotations

import pytest

from server.tokenizer import TextStream, Tokenizer


@pytest.fixture(scope="module")
def tok(synth):
    return Tokenizer(synth("tiny", "nvfp4"))


def run(tok, ids, **kw):
    ts = TextStream(tok, **kw)
    out = {"reasoning": [], "content": []}
    for t in ids:
        d = ts.push(t)
        for k in d:
            out[k].append(d[k])
    d = ts.finish()
    for k in d:
        out[k].append(d[k])
    return "".join(out["reasoning"]), "".join(out["content"]), ts, out


def test_plain_text_round_trips_token_by_token(tok):
    text = "Привет, fox! こんにちは 42"
    ids = tok.encode(text)
    r, c, _, out = run(tok, ids)
    assert (r, c) == ("", text)
    assert all("\ufffd" not in piece for piece in out["content"])     # no half characters on the wire


def test_stop_string_across_tokens_is_held_back_and_cut(tok):
    ids = tok.encode("The quick brown fox jumps")
    r, c, ts, out = run(tok, ids, stop=["brown f"])
    assert c == "The quick " and ts.stopped
    assert "brown" not in "".join(out["content"])
    r, c, ts, _ = run(tok, ids, stop=["brown x"])              # the twin: a near miss is released in full
    assert c == "The quick brown fox jumps" and not ts.stopped


def test_think_split(tok):
    ids = tok.encode("\nweighing options\n") + [tok.think_end] + tok.encode("\nthe answer")
    r, c, _, _ = run(tok, ids, reasoning=True, in_reasoning=True)
    assert (r, c) == ("weighing options", "the answer")
    r, c, _, _ = run(tok, [tok.think_start] + ids, reasoning=True)
    assert (r, c) == ("weighing options", "the answer")
    r, c, _, _ = run(tok, ids, reasoning=False)                # the twin: no split, think tags skipped
    assert r == "" and "weighing options" in c and "the answer" in c


def test_reasoning_that_never_closes_is_all_reasoning(tok):
    r, c, _, _ = run(tok, tok.encode("still thinking"), reasoning=True, in_reasoning=True)
    assert (r, c) == ("still thinking", "")


def test_starts_in_reasoning(tok):
    on = tok.encode(tok.render_chat([{"role": "user", "content": "hi"}]))
    off = tok.encode(tok.render_chat([{"role": "user", "content": "hi"}], template_kwargs={"enable_thinking": False}))
    assert tok.starts_in_reasoning(on) and not tok.starts_in_reasoning(off)
    assert tok.eos_ids == [2, 11]
