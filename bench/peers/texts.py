"""Prompts of varied real text, so that routing is the model's and not that of random token ids.

The source is a text file (the instrument's held-out text when it exists) or, on any machine with Python,
the docstrings of the standard library: English technical prose of many topics. Prompts rotate through
disjoint windows of the text, so no two prompts of a run repeat the same passage.
"""
from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXT_FILES = (ROOT / "tests" / "data" / "instrument-heldout.txt",)


# Well-documented standard-library modules with no import side effects, in a fixed order.
STDLIB_MODULES = (
    "argparse asyncio ast base64 bisect calendar cmath codecs collections colorsys concurrent.futures "
    "configparser contextlib copy csv dataclasses datetime decimal difflib doctest email enum fnmatch "
    "fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html.parser http.client imaplib "
    "inspect io ipaddress itertools json locale logging lzma mailbox math mmap multiprocessing numbers "
    "operator optparse os pathlib pdb pickle platform pprint queue random re sched secrets selectors shlex "
    "shutil signal smtplib socket sqlite3 ssl statistics string struct subprocess tarfile tempfile "
    "textwrap threading timeit tokenize trace typing unittest urllib.parse urllib.request uuid wave "
    "xml.etree.ElementTree zipfile zlib").split()


def stdlib_docstrings(min_chars: int = 200_000) -> str:
    """Module, class and function docstrings of the standard library: English technical prose."""
    parts, seen, total = [], set(), 0
    for name in STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:        # a module this Python lacks simply adds no text
            continue
        for obj in [mod, *[getattr(mod, n, None) for n in sorted(vars(mod)) if not n.startswith("_")]]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str) and len(doc) > 120 and doc not in seen:
                seen.add(doc)
                parts.append(doc.strip())
                total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(parts)


def load_text(path: str | Path | None = None) -> str:
    if path is not None:
        return Path(path).read_text(encoding="utf-8")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in DEFAULT_TEXT_FILES if p.exists())
    if len(text) < 200_000:        # the held-out file is small: long prompts must not repeat it
        text = (text + "\n\n" + stdlib_docstrings(200_000 - len(text))).strip()
    return text


def prompts(text: str, n: int, n_chars: int, seed: int = 0) -> list[str]:
    """n disjoint windows of about n_chars characters, starting at paragraph boundaries, rotated by seed."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    if not paras:
        raise ValueError("the prompt text is empty")
    out, i = [], (seed * 7919) % len(paras)
    for _ in range(n):
        buf, start = [], i
        while sum(map(len, buf)) < n_chars:
            buf.append(paras[i % len(paras)])
            i += 1
            if i - start > len(paras):
                break              # the text is shorter than one prompt: it repeats, which we say nowhere else
        out.append("\n\n".join(buf)[:n_chars])
    return out


def prompt_of_tokens(text: str, tokenizer, n_tokens: int, seed: int = 0) -> str:
    """A window of the text that tokenizes to about n_tokens tokens with `tokenizer` (tokenizers.Tokenizer)."""
    chars = max(64, n_tokens * 4)
    for _ in range(6):
        p = prompts(text, 1, chars, seed)[0]
        got = len(tokenizer.encode(p, add_special_tokens=False).ids)
        if abs(got - n_tokens) <= max(4, n_tokens // 50):
            return p
        chars = max(64, int(chars * n_tokens / max(got, 1)))
    ids = tokenizer.encode(prompts(text, 1, chars * 2, seed)[0], add_special_tokens=False).ids[:n_tokens]
    return tokenizer.decode(ids)


def split_text(text: str, first: float = 0.6) -> tuple[str, str]:
    """The text cut at a paragraph boundary into a first and a second part: prompts measured from one, the
    cache warmed from the other, so that no warm-up has routed a measured passage before."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    if len(paras) < 2:
        raise ValueError("the prompt text needs at least two paragraphs to be split")
    k = min(max(1, round(len(paras) * first)), len(paras) - 1)
    return "\n\n".join(paras[:k]), "\n\n".join(paras[k:])
