"""A conversation's stretches between added tokens, encoded once each (server/stretch_encoder.py), give exactly the ids
transformers' tokenizer gives the whole text; where a tokenizer would not (a pre-tokenizer that treats the first
stretch apart, an added token that strips the space beside it), the memo is not used."""
from __future__ import annotations

import random

import pytest

from server.stretch_encoder import StretchEncoder, why_not
from tests.server.test_prompt_encode_once import conversations


@pytest.fixture(scope="module")
def tok(synth):
    from server.tokenizer import Tokenizer
    return Tokenizer(synth("tiny", "nvfp4"))


def reference(tok, text):
    """transformers' own encode of the whole text (no memo anywhere on its path)."""
    return tok.tok.encode(text, add_special_tokens=False)


def growing_chat(seed):
    """An agent's conversation: each turn sends the whole history again, with one more exchange."""
    rng = random.Random(seed)
    for msgs in conversations(seed, n=4):
        for t in range(1, len(msgs) + 1):
            if msgs[t - 1]["role"] == "user":
                yield msgs[:t]
        # text that holds an added token's literal text, unicode and whitespace at the ends of a message
        yield msgs + [{"role": "user", "content": rng.choice(["<|im_start|>user\nx", " é中文 \n", "\t", "</s></s>"])}]


def test_the_stretch_encoder_is_used_for_the_synth_tokenizer(tok):
    assert tok.stretches is not None, why_not(__import__("json").loads(tok.backend.to_str()))


def test_every_turn_of_a_growing_chat_encodes_as_the_whole_text(tok):
    enc = StretchEncoder.for_backend(tok.backend)
    n = 0
    for msgs in growing_chat(11):
        for gen in (True, False):
            text = tok.render_chat(msgs, gen)
            assert enc.encode(text)[0] == reference(tok, text)
            assert tok.encode(text) == reference(tok, text)
            n += 1
    assert n > 20
    assert enc.hits > enc.misses        # the history's messages came from the memo on later turns


def test_where_the_last_message_ends_is_counted_as_the_prefix_encodes(tok):
    enc = StretchEncoder.for_backend(tok.backend)
    proven = 0
    for msgs in conversations(5):
        text, base = tok.render_chat(msgs, True), tok.render_chat(msgs, False)
        assert text.startswith(base)
        ids, n = enc.encode(text, cut_at=len(base))
        assert ids == reference(tok, text)
        if n is not None:
            assert ids[:n] == reference(tok, base)
            proven += 1
    assert proven == 12
    # no added token starts at the cut: nothing proven
    text = tok.render_chat([{"role": "user", "content": "hello there friend"}], True)
    assert enc.encode(text, cut_at=text.index("there") + 2)[1] is None


def test_must_fail_a_cut_inside_a_stretch_changes_the_ids(tok):
    """The twin the exactness rests on: cut each stretch in two as well, and the ids differ from the whole text's for
    some message (the BPE merges across the cut are lost)."""
    class Halved(StretchEncoder):
        def encode(self, text, cut_at=None):
            halves = []
            for a, b in zip([0] + [e for _, e in self.cuts(text)], [s for s, _ in self.cuts(text)] + [len(text)]):
                mid = (a + b) // 2
                halves += [text[a:mid], text[mid:b]]
            return [i for h in halves for i in StretchEncoder.encode(self, h)[0]], None
    right = StretchEncoder.for_backend(tok.backend)
    twin = Halved.for_backend(tok.backend)
    differ = 0
    for msgs in conversations(3):
        text = tok.render_chat(msgs, True)
        assert right.encode(text)[0] == reference(tok, text)
        differ += twin.encode(text)[0] != [i for i in reference(tok, text)
                                                          if i not in right.added.values()]
    assert differ > 0


def test_the_memo_is_bounded_and_drops_the_least_recently_used(tok):
    enc = StretchEncoder(tok.backend, StretchEncoder.for_backend(tok.backend).added, memo_chars=200)
    texts = [tok.render_chat([{"role": "user", "content": f"message number {i} " * 5}], True) for i in range(20)]
    for t in texts:
        assert enc.encode(t)[0] == reference(tok, t)
        assert enc.held_chars <= 200
    assert len(enc.memo) < 20
    long = "a long stretch " * 50                    # more than the memo holds: encoded, never kept
    assert enc.encode(long)[0] == reference(tok, long) and long not in enc.memo


def _tiny_backend(pre_tokenizer, added, byte_level=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from tools.synth_tokenizer import CORPUS
    t = Tokenizer(models.BPE(unk_token=None if byte_level else "<unk>"))
    t.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if byte_level else []
    t.train_from_iterator([CORPUS] * 4, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>"],
                                                             initial_alphabet=alphabet, show_progress=False))
    for a in added:
        (t.add_special_tokens if a.special else t.add_tokens)([a])
    return t


# the split Nemotron's tekken-style tokenizer.json describes (a Split regex, then ByteLevel without its own regex)
TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def test_a_split_regex_tokenizer_is_exact_on_chat_text():
    """A tokenizer built as a tekken-style tokenizer.json is (Split by a regex with a lookahead, then ByteLevel),
    special and non-special added tokens: stretch-wise ids equal the whole text's on 300 chat-shaped texts with odd
    whitespace at every message's ends."""
    from tokenizers import AddedToken, Regex, pre_tokenizers
    from tools.synth_tokenizer import CORPUS
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(TEKKEN_SPLIT), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    added = [AddedToken(x, special=True) for x in ("<|im_start|>", "<|im_end|>", "<s>", "</s>")]
    added += [AddedToken(x, special=False) for x in ("<think>", "</think>")]
    be = _tiny_backend(pre, added, byte_level=True)
    enc = StretchEncoder.for_backend(be)
    assert enc is not None
    rng, words = random.Random(0), CORPUS.split()
    for _ in range(300):
        text = ""
        for _ in range(rng.randrange(1, 6)):
            s = " ".join(rng.choice(words) for _ in range(rng.randrange(0, 40)))
            s = rng.choice(["", " ", "\n", "  ", "\t\n "]) + s + rng.choice(["", " ", "\n", "\n\n", "   "])
            text += (f"<|im_start|>{rng.choice(['user', 'assistant'])}\n{rng.choice(['', '<think>', ' </think>'])}"
                     f"{s}<|im_end|>{rng.choice(['', chr(10)])}")
        assert enc.encode(text)[0] == be.encode(text, add_special_tokens=False).ids, text
    assert enc.hits > 0 and enc.misses > 0


def test_must_fail_metaspace_first_would_differ_and_is_not_used():
    """Why `why_not` refuses Metaspace's prepend_scheme 'first': it puts the word mark before the text's first
    stretch only, so a stretch encoded alone (its own first) differs. The twin encodes stretch-wise anyway."""
    from tokenizers import AddedToken, pre_tokenizers
    be = _tiny_backend(pre_tokenizers.Metaspace(prepend_scheme="first"), [AddedToken("<sep>", special=True)])
    assert StretchEncoder.for_backend(be) is None
    text = "the first words<sep>the second words"
    forced = StretchEncoder(be, {"<sep>": be.token_to_id("<sep>")})
    assert forced.encode(text)[0] != be.encode(text, add_special_tokens=False).ids
    # 'always' marks every stretch: used, and exact
    be2 = _tiny_backend(pre_tokenizers.Metaspace(prepend_scheme="always"), [AddedToken("<sep>", special=True)])
    enc = StretchEncoder.for_backend(be2)
    assert enc is not None and enc.encode(text)[0] == be2.encode(text, add_special_tokens=False).ids


def test_must_fail_an_added_token_that_strips_its_neighbours_space_is_not_used():
    from tokenizers import AddedToken, pre_tokenizers
    be = _tiny_backend(pre_tokenizers.ByteLevel(add_prefix_space=False),
                       [AddedToken("<sep>", special=True, lstrip=True)])
    assert StretchEncoder.for_backend(be) is None
    text = "the first words <sep>the second words"
    forced = StretchEncoder(be, {"<sep>": be.token_to_id("<sep>")})
    assert forced.encode(text)[0] != be.encode(text, add_special_tokens=False).ids


def test_why_not_names_each_reason():
    base = {"normalizer": None, "pre_tokenizer": {"type": "ByteLevel"},
            "added_tokens": [{"content": "<s>", "id": 1, "normalized": False}]}
    assert why_not(base) is None
    assert "rstrip" in why_not({**base, "added_tokens": [{"content": "<s>", "id": 1, "rstrip": True}]})
    assert "normalized" in why_not({**base, "normalizer": {"type": "NFC"},
                                    "added_tokens": [{"content": "<s>", "id": 1, "normalized": True}]})
    assert "Mystery" in why_not({**base, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "ByteLevel"}, {"type": "Mystery"}]}})
    assert "Mystery" in why_not({**base, "normalizer": {"type": "Mystery"}})
