"""The instrument's corpus and tokenizer, from Debian documentation packages (English prose and technical text).

    python -m tools.instrument_corpus --out DIR [--debs DIR] [--vocab 8192] [--heldout-percent 2]

Steps, all deterministic (same package versions in, same bytes out):
  1. `apt-get download` each package of PACKAGES into --debs (skipped for the ones already there; run
     `apt-get update` once first) and unpack it with `dpkg-deb -x` (nothing is installed);
  2. extract text: reST/plain/asciidoc sources as they are, POD and man pages (roff) stripped of their
     markup, HTML through a small tag stripper; per package rules below pick the files;
  3. deduplicate: a paragraph seen before (whitespace- and case-normalized hash) is dropped, and a document
     of which more than half was seen before is dropped whole (navigation, licence boilerplate, the same
     page in two formats);
  4. split by a hash of each document's path: --heldout-percent of the documents are held out;
  5. train a byte-level BPE (`tokenizers`) on the training text, Nemotron's special tokens at their ids and
     a ChatML chat template (tools/synth_tokenizer.py);
  6. tokenize: one stream per split, `</s>` (id 2) between documents; CHAT_SHARE of the training documents
     are rendered as multi-turn conversations with the chat template so that the model knows it.

DIR gets train.txt, heldout.txt, train.u16 / heldout.u16 (little-endian uint16 token ids), tokenizer/
(tokenizer.json, tokenizer_config.json, special_tokens_map.json) and manifest.json (packages, versions,
licences, sizes, hashes).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

# package -> (include regexes, exclude regexes, format overrides). Paths are relative to the unpacked root.
PACKAGES = {
    "python3.11-doc": ([r"usr/share/doc/python3\.11/html/_sources/.*\.rst\.txt$"], [r"/whatsnew/changelog"]),
    "linux-doc-6.1": ([r"usr/share/doc/linux-doc-6\.1/Documentation/.*\.(rst|txt)(\.gz)?$"],
                      [r"/devicetree/", r"/translations/", r"/ABI/", r"/output/"]),
    "perl-doc": ([r"usr/share/perl/.*\.pod(\.gz)?$", r"usr/share/doc/perl/.*\.pod(\.gz)?$"], [r"perl5\d+delta"]),
    "git-doc": ([r"usr/share/doc/git-doc/[^/]*\.txt$", r"usr/share/doc/git-doc/howto/.*\.txt$"],
                [r"RelNotes", r"/technical/api-"]),
    "postgresql-doc-15": ([r"usr/share/doc/postgresql-doc-15/html/.*\.html$"], [r"/release-\d"]),
    "debian-reference-en": ([r"usr/share/debian-reference/.*\.en\.html$"], [r"index\.en\.html$"]),
    "debian-policy": ([r"usr/share/doc/debian-policy/.*\.txt(\.gz)?$"], [r"upgrading-checklist"]),
    "developers-reference": ([r"usr/share/developers-reference/.*\.html$", r"usr/share/doc/developers-reference/.*\.html$"],
                             [r"/index\.html$", r"genindex", r"search\.html"]),
    "bash-doc": ([r"usr/share/doc/bash/bashref\.html$", r"usr/share/doc/bash/.*FAQ.*", r"usr/share/doc/bash/.*\.txt$"], []),
    "manpages": ([r"usr/share/man/man\d/.*\.\d\w*\.gz$"], []),
    "manpages-dev": ([r"usr/share/man/man\d/.*\.\d\w*\.gz$"], []),
}
CHAT_SHARE = 15          # percent of training documents rendered as conversations
MIN_DOC_CHARS = 400
MIN_DEDUP_PARA = 40      # shorter paragraphs ("Example:", "See also") are kept even when repeated


# ---------------------------------------------------------------- extraction

class _HTMLText(html.parser.HTMLParser):
    BLOCK = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd", "table",
             "section", "blockquote", "ul", "ol", "dl"}
    SKIP = {"script", "style", "head", "nav", "title"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.skip, self.pre = [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCK:
            self.out.append("\n\n" if tag != "br" else "\n")

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag in self.BLOCK:
            self.out.append("\n\n")

    def handle_data(self, data):
        if self.skip:
            return
        self.out.append(data if self.pre else re.sub(r"[ \t\r\n]+", " ", data))


def html_text(raw: str) -> str:
    p = _HTMLText()
    p.feed(raw)
    return "".join(p.out)


_POD_CODES = re.compile(r"[A-Z]<<+\s(.*?)\s>>+|[BCIFLSEXZ]<([^<>]*)>")


def pod_text(raw: str) -> str:
    lines, skip = [], False
    for ln in raw.splitlines():
        if ln.startswith("=begin") or ln.startswith("=for"):
            skip = ln.startswith("=begin")
            continue
        if ln.startswith("=end"):
            skip = False
            continue
        if skip or ln.startswith(("=cut", "=pod", "=over", "=back", "=encoding")):
            continue
        ln = re.sub(r"^=(head\d|item)\s*", "", ln)
        for _ in range(3):       # nested formatting codes
            ln = _POD_CODES.sub(lambda m: (m.group(1) or m.group(2) or "").split("|")[0], ln)
        lines.append(ln)
    return "\n".join(lines)


_ROFF_ESC = re.compile(r"\\f(\[[^\]]*\]|\(..|.)|\\\*(\(..|\[[^\]]*\]|.)|\\[&|^%]|\\s[-+]?\d+|\\n(\(..|.)")


def roff_text(raw: str) -> str:
    """A rough man(7) to text: macros dropped or reduced to their arguments, font escapes removed, filled
    lines joined into paragraphs (.nf/.EX blocks kept line by line)."""
    paras, cur, fill = [], [], True

    def flush():
        if cur:
            paras.append((" " if fill else "\n").join(cur))
            cur.clear()

    for ln in raw.splitlines():
        word = ln.split(None, 1)[0] if ln.strip() else ""
        rest = ln.split(None, 1)[1] if len(ln.split(None, 1)) > 1 else ""
        if ln.startswith(('.\\"', "'\\\"")) or word in (".TH", ".so", ".ds", ".de", ".nr", ".if", ".ie", ".el",
                                                     ".ad", ".na", ".hy", ".nh", ".ft", ".ta", ".in", ".ti",
                                                     ".ne", ".ps", ".vs", ".ll", ".UR", ".UE", ".MT", ".ME"):
            continue
        if word in (".nf", ".EX"):
            flush()
            fill = False
            continue
        if word in (".fi", ".EE"):
            flush()
            fill = True
            continue
        if word in (".PP", ".LP", ".P", ".sp", ".br", ".TP", ".IP", ".RS", ".RE", ".SH", ".SS", ".HP"):
            flush()
            if word in (".SH", ".SS", ".IP") and rest:
                cur.append(rest.split('" ')[0].strip('"'))
                flush()
            continue
        if word in (".B", ".I", ".SM", ".SB", ".BR", ".IR", ".BI", ".IB", ".RB", ".RI"):
            args = [x.strip('"') for x in re.findall(r'"[^"]*"|\S+', rest)]
            ln = (" " if word in (".B", ".I", ".SM", ".SB") else "").join(args)
        elif ln.startswith((".", "'")):
            continue
        ln = _ROFF_ESC.sub("", ln).replace("\\-", "-").replace("\\(em", "--").replace("\\e", "\\")
        ln = ln.replace("\\ ", " ").replace("\\(aq", "'").replace("\\(dq", '"')
        if not ln.strip():
            flush()
        else:
            cur.append(ln if not fill else ln.strip())
    flush()
    return "\n\n".join(paras)


def read_file(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def extract(path: Path, rel: str) -> str:
    raw = read_file(path)
    name = rel[:-3] if rel.endswith(".gz") else rel
    if name.endswith((".html", ".htm")):
        return html_text(raw)
    if name.endswith(".pod"):
        return pod_text(raw)
    if rel.startswith("usr/share/man/"):
        return roff_text(raw)
    return raw


def normalize(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\t", "    ").replace("\ufffd", "")
    text = re.sub(r"[ \u00a0]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def english_enough(text: str) -> bool:
    """Mostly ASCII, and with common English words (drops tables of numbers, binary-ish files, translations)."""
    if not text:
        return False
    ascii_share = sum(c < 128 for c in text.encode("utf-8", "replace")) / len(text.encode("utf-8", "replace"))
    words = re.findall(r"[a-z]+", text.lower())
    common = sum(w in ("the", "a", "is", "of", "to", "and", "in", "for", "be", "that") for w in words)
    return ascii_share > 0.97 and len(words) > 0 and common / len(words) > 0.04


# ---------------------------------------------------------------- packages

def download(debs: Path, packages) -> dict[str, Path]:
    debs.mkdir(parents=True, exist_ok=True)
    have = {}
    missing = []
    for p in packages:
        found = sorted(debs.glob(f"{p}_*.deb"))
        if found:
            have[p] = found[-1]
        else:
            missing.append(p)
    if missing:
        r = subprocess.run(["apt-get", "download", *missing], cwd=debs, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"apt-get download failed (run apt-get update first?):\n{r.stderr}")
        for p in missing:
            have[p] = sorted(debs.glob(f"{p}_*.deb"))[-1]
    return have


def deb_field(deb: Path, field: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), field], capture_output=True, text=True, check=True).stdout.strip()


def licences(root: Path) -> list[str]:
    found = set()
    for cp in root.glob("usr/share/doc/*/copyright"):
        for ln in cp.read_text(errors="replace").splitlines():
            if ln.startswith("License:"):
                found.add(ln.split(":", 1)[1].strip())
    return sorted(x for x in found if x)


def collect(work: Path, debs: dict[str, Path]):
    """-> (documents [(package, relpath, text)], package manifest)."""
    docs, manifest = [], {}
    for pkg, deb in debs.items():
        root = work / "unpacked" / pkg
        if not root.exists():
            root.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        inc, exc = (re.compile("|".join(x)) if x else None for x in PACKAGES[pkg])
        n_files = n_bytes = 0
        for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
            rel = path.relative_to(root).as_posix()
            if not inc.search(rel) or (exc is not None and exc.search(rel)):
                continue
            text = normalize(extract(path, rel))
            if len(text) < MIN_DOC_CHARS or not english_enough(text):
                continue
            docs.append((pkg, rel, text))
            n_files += 1
            n_bytes += len(text.encode())
        manifest[pkg] = {"version": deb_field(deb, "Version"), "deb": deb.name, "licences": licences(root),
                         "files": n_files, "extracted_bytes": n_bytes}
    return docs, manifest


def dedup(docs):
    seen: set[bytes] = set()
    out = []
    dropped_docs = 0
    for pkg, rel, text in docs:
        paras = text.split("\n\n")
        keep, dup_chars = [], 0
        for para in paras:
            norm = re.sub(r"\s+", " ", para.strip().lower())
            if len(norm) < MIN_DEDUP_PARA:
                keep.append(para)
                continue
            h = hashlib.blake2b(norm.encode(), digest_size=12).digest()
            if h in seen:
                dup_chars += len(para)
                continue
            seen.add(h)
            keep.append(para)
        if dup_chars > len(text) / 2:
            dropped_docs += 1
            continue
        text = normalize("\n\n".join(keep))
        if len(text) >= MIN_DOC_CHARS:
            out.append((pkg, rel, text))
    return out, dropped_docs


def bucket(key: str, salt: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{salt}:{key}".encode(), digest_size=8).digest(), "little") % 100


# ---------------------------------------------------------------- tokenizer and conversations

def train_tokenizer(texts, vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tools.synth_tokenizer import SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    d = json.loads(tok.to_str())
    for i, s in enumerate(SPECIALS):
        if d["model"]["vocab"].get(s) != i:
            raise AssertionError(f"special token {s} did not land at id {i}")
    if len(d["model"]["vocab"]) != vocab_size:
        raise SystemExit(f"the corpus gave only {len(d['model']['vocab'])} tokens, fewer than --vocab {vocab_size}")
    for a in d["added_tokens"]:
        a["special"] = True
    return json.dumps(d, ensure_ascii=False)


def conversation(text: str, seed_key: str) -> list[dict]:
    """A document as a multi-turn chat: the paragraphs in turns of 1-3, user and assistant alternating."""
    paras = [p for p in text.split("\n\n") if p.strip()]
    msgs, i, n = [], 0, 0
    while i < len(paras):
        take = 1 + bucket(f"{seed_key}:{n}", "turn") % 3
        msgs.append({"role": "user" if n % 2 == 0 else "assistant", "content": "\n\n".join(paras[i:i + take])})
        i += take
        n += 1
    return msgs


def render_chat(messages: list[dict], template: str) -> str:
    import jinja2
    env = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=False, tools=None)


def write_stream(path: Path, tok, texts: list[str], eos: int) -> int:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    arr = np.asarray(ids, dtype="<u2")
    arr.tofile(path)
    return int(arr.size)


def build(out: Path, debs_dir: Path, vocab: int, heldout_percent: int) -> dict:
    from tokenizers import Tokenizer

    from tools.synth_tokenizer import CHAT_TEMPLATE, write_tokenizer_files
    out.mkdir(parents=True, exist_ok=True)
    debs = download(debs_dir, PACKAGES)
    docs, manifest = collect(out, debs)
    raw_bytes = sum(len(t.encode()) for _, _, t in docs)
    docs, dropped = dedup(docs)
    train, held = [], []
    for pkg, rel, text in docs:
        (held if bucket(rel, "split") < heldout_percent else train).append((pkg, rel, text))
    (out / "train.txt").write_text("".join(t + "\n" for _, _, t in train))
    (out / "heldout.txt").write_text("".join(t + "\n" for _, _, t in held))
    tok_json = train_tokenizer([t for _, _, t in train], vocab)
    tdir = out / "tokenizer"
    tdir.mkdir(exist_ok=True)
    write_tokenizer_files(tdir, tok_json)
    tok = Tokenizer.from_str(tok_json)
    train_texts = [render_chat(conversation(t, rel), CHAT_TEMPLATE) if bucket(rel, "chat") < CHAT_SHARE else t
                   for _, rel, t in train]
    n_train = write_stream(out / "train.u16", tok, train_texts, eos=2)
    n_held = write_stream(out / "heldout.u16", tok, [t for _, _, t in held], eos=2)
    per_pkg = {}
    for pkg, _, t in docs:
        per_pkg[pkg] = per_pkg.get(pkg, 0) + len(t.encode())
    for pkg, n in per_pkg.items():
        manifest[pkg]["bytes_after_dedup"] = n
    info = {
        "packages": manifest,
        "extracted_bytes": raw_bytes,
        "documents": len(docs), "documents_dropped_as_duplicates": dropped,
        "train": {"documents": len(train), "bytes": (out / "train.txt").stat().st_size, "tokens": n_train,
                  "chat_documents_percent": CHAT_SHARE},
        "heldout": {"documents": len(held), "bytes": (out / "heldout.txt").stat().st_size, "tokens": n_held},
        "vocab_size": vocab,
        "sha256": {f: hashlib.sha256((out / f).read_bytes()).hexdigest()
                   for f in ("train.txt", "heldout.txt", "train.u16", "heldout.u16", "tokenizer/tokenizer.json")},
    }
    (out / "manifest.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--debs", type=Path, help="where the .deb files are kept (default OUT/debs)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--heldout-percent", type=int, default=2)
    a = ap.parse_args(argv)
    if not 8192 <= a.vocab <= 65535:
        raise SystemExit("--vocab must be in [8192, 65535] (uint16 token files)")
    info = build(a.out, a.debs or a.out / "debs", a.vocab, a.heldout_percent)
    print(json.dumps({k: v for k, v in info.items() if k != "packages"}, indent=2))
    for pkg, m in info["packages"].items():
        print(f"{pkg:22} {m['version']:28} {m.get('bytes_after_dedup', 0) / 1e6:7.2f} MB  {', '.join(m['licences'])}",
              file=sys.stderr)


if __name__ == "__main__":
    main()
