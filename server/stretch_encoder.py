"""A chat prompt's ids from its stretches between added tokens, each encoded once per process.

An agent sends the whole conversation on every turn; the server renders it and encodes it again, though only the
last message is new (a 16k-token history: ~5-15 ms of encode before the prefill starts, bench/NOTES.md session 16).

Why it is exact: `tokenizers` first cuts a text at its added tokens (leftmost, longest), and then normalizes,
pre-tokenizes and encodes each stretch between them on its own. So the ids of a text are its stretches' ids and its
added tokens' ids, in order, provided encoding a stretch alone does what encoding it inside the text does. That holds
when nothing looks past a stretch's ends: no added token strips the whitespace beside it or must stand as a word, no
added token is matched on normalized text under a normalizer, and no pre-tokenizer treats the text's first stretch
apart (Metaspace's prepend_scheme "first"). `for_backend` checks those from the tokenizer's own description and
gives None otherwise; the caller then encodes the whole text as before.

The memo keeps the stretches' ids in one process's memory (never on disk), bounded by the characters it holds, least
recently used out first. The stretches not in it are encoded in one `encode_batch_fast` call: its threads encode
them in parallel, so a first turn with several long messages gains too."""
from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict

# pre-tokenizers and normalizers that act on each stretch alone, the same wherever in the text it stands
_PER_STRETCH_PRE = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "BertPreTokenizer",
                    "UnicodeScripts", "CharDelimiterSplit", "Metaspace", "FixedLength"}
_PER_STRETCH_NORM = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents", "Replace", "Prepend",
                     "BertNormalizer", "Nmt", "Precompiled", "ByteLevel"}

MEMO_CHARS = 4 << 20        # ~1M tokens of text; ids kept as int32 (4 bytes an id)


def _parts(node: dict | None, key: str) -> list[dict]:
    if node is None:
        return []
    if node.get("type") == "Sequence":
        return [p for sub in node.get(key, []) for p in _parts(sub, key)]
    return [node]


def why_not(desc: dict) -> str | None:
    """None where stretch-wise encoding equals the whole text's for this tokenizer description (tokenizer.json),
    else the reason it may not."""
    for t in desc.get("added_tokens", []):
        if t.get("lstrip") or t.get("rstrip") or t.get("single_word"):
            return f"added token {t['content']!r} looks past its own text (lstrip/rstrip/single_word)"
        if t.get("normalized") and desc.get("normalizer") is not None:
            return f"added token {t['content']!r} is matched on normalized text"
    for p in _parts(desc.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") not in _PER_STRETCH_PRE:
            return f"pre-tokenizer {p.get('type')} is not known to act on each stretch alone"
        if p.get("type") == "Metaspace" and p.get("prepend_scheme", "always") == "first":
            return "Metaspace's prepend_scheme 'first' treats the text's first stretch apart"
    for n in _parts(desc.get("normalizer"), "normalizers"):
        if n.get("type") not in _PER_STRETCH_NORM:
            return f"normalizer {n.get('type')} is not known to act on each stretch alone"
    return None


class StretchEncoder:
    def __init__(self, backend, added: dict[str, int], memo_chars: int = MEMO_CHARS):
        self.backend = backend
        self.added = added
        # leftmost, and at one place the longest: the alternation tries longer contents first
        self.pattern = re.compile("|".join(re.escape(c) for c in sorted(added, key=len, reverse=True)))
        self.memo: OrderedDict[str, array] = OrderedDict()
        self.memo_chars = memo_chars
        self.held_chars = 0
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    @classmethod
    def for_backend(cls, backend, split_special_tokens: bool = False) -> StretchEncoder | None:
        """The encoder for a `tokenizers.Tokenizer` where stretch-wise encoding is exact (`why_not`), else None."""
        if split_special_tokens or not hasattr(backend, "encode_batch_fast"):
            return None
        if backend.truncation is not None or backend.padding is not None:
            return None
        desc = json.loads(backend.to_str())
        if why_not(desc) is not None:
            return None
        added = {t["content"]: t["id"] for t in desc.get("added_tokens", []) if t["content"]}
        return cls(backend, added) if added else None

    def cuts(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each added token in the text, in order."""
        return [m.span() for m in self.pattern.finditer(text)]

    def encode(self, text: str, cut_at: int | None = None) -> tuple[list[int], int | None]:
        """The text's ids, and, when `cut_at` is where an added token starts after at least one id, how many ids come
        before it: what `encode(text[:cut_at])` gives, by the proof above (else None)."""
        spans = self.cuts(text)
        pieces, prev = [], 0          # each stretch (its text) and each added token (its id), in order
        for a, b in spans:
            if a > prev:
                pieces.append(text[prev:a])
            pieces.append(self.added[text[a:b]])
            prev = b
        if prev < len(text):
            pieces.append(text[prev:])
        stretches = [p for p in pieces if isinstance(p, str)]
        with self.lock:
            known = {s: self.memo[s] for s in stretches if s in self.memo}
            for s in known:
                self.memo.move_to_end(s)
        new = list(dict.fromkeys(s for s in stretches if s not in known))
        if new:
            for s, enc in zip(new, self.backend.encode_batch_fast(new, add_special_tokens=False)):
                known[s] = array("i", enc.ids)
        with self.lock:
            self.hits += len(stretches) - len(new)
            self.misses += len(new)
            for s in new:
                if len(s) <= self.memo_chars and s not in self.memo:
                    self.memo[s] = known[s]
                    self.held_chars += len(s)
            while self.held_chars > self.memo_chars:
                old, _ = self.memo.popitem(last=False)
                self.held_chars -= len(old)
        ids: list[int] = []
        n = None
        starts = iter(spans)
        for p in pieces:
            if isinstance(p, str):
                ids.extend(known[p])
            else:
                if next(starts)[0] == cut_at and ids:        # an empty prefix proves nothing
                    n = len(ids)
                ids.append(p)
        return ids, n
