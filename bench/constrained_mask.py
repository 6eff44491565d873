"""What a grammar's token mask costs on the CPU, per token, for xgrammar and llguidance, with the tiny model's
vocabulary (1,024) and a 131,072-token byte-level BPE (Nemotron's size), on the same grammars: a JSON schema
(nested object, array, enum, number) and a required tool call in Nemotron's XML form. Each engine is fed a
valid answer token by token; per token it fills the next-token bitmask (the work that sits beside the GPU's
step) and accepts the token. Also: compile time, and applying the bitmask to a logits row with torch.

    python -m bench.constrained_mask [--vocab 1024 131072] [--reps 3]

The 131k tokenizer is trained once on the Python standard library and site-packages sources (cached under
~/.cache/moestream/bench-tok131k), so its tokens are real code and text pieces, not filler.
"""
from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "tags", "unit", "address", "score"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ada Lovelace, the first programmer of the analytical engine", "age": 36,
                     "tags": ["math", "poetry", "engines", "notes on the sketch"], "unit": "celsius",
                     "address": {"city": "London", "zip": "W1J 7NT"}, "score": 97.25})
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}}
TOOL_ANSWER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon, the capital of England\n"
               "</parameter>\n<parameter=days>\n14\n</parameter>\n</function>\n</tool_call>")


def tokenizer_dir(vocab: int) -> Path:
    from tools.synth_tokenizer import write_tokenizer
    out = Path.home() / ".cache" / "moestream" / f"bench-tok{vocab}"
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, vocab)             # config, template, specials; tokenizer.json replaced below if large
    if vocab > 4096:
        _train_code_bpe(out / "tokenizer.json", vocab)
    return out


def _train_code_bpe(path: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tools.synth_tokenizer import SPECIALS
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    files = sorted(f for r in roots for f in glob.glob(r + "/**/*.py", recursive=True))

    def texts(limit=120e6):
        n = 0
        for f in files:
            try:
                s = Path(f).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            n += len(s)
            yield s
            if n > limit:
                return
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=SPECIALS,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts(), trainer=tr)
    d = json.loads(tok.to_str())
    v = d["model"]["vocab"]
    real = len(v)
    for k in range(real, vocab):        # what the corpus could not fill (reported)
        v[f"<|reserved_{k}|>"] = k
    for a in d["added_tokens"]:
        a["special"] = True
    path.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")
    print(f"trained a {vocab}-token BPE on Python sources: {real} learned tokens", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ engines
class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[2, 11])
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.vocab = vocab

    def compile(self, kind):
        if kind == "json":
            return self.compiler.compile_json_schema(SCHEMA, any_whitespace=False, strict_mode=True)
        tag = self.xgr.get_model_structural_tag("qwen_3_coder", tools=[TOOL], tool_choice="required",
                                                reasoning="disabled")
        return self.compiler.compile_structural_tag(tag)

    def matcher(self, g):
        m = self.xgr.GrammarMatcher(g)
        bm = self.xgr.allocate_token_bitmask(1, self.vocab)
        return m, bm

    def fill(self, mb):
        mb[0].fill_next_token_bitmask(mb[1])

    def accept(self, mb, t):
        return mb[0].accept_token(t)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=11)
        self.vocab = vocab

    def compile(self, kind):
        LLMatcher = self.llg.LLMatcher
        if kind == "json":
            g = LLMatcher.grammar_from_json_schema(SCHEMA, defaults={
                "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        else:
            g = LLMatcher.grammar_from_lark(
                'start: <tool_call> "\\n<function=get_weather>\\n<parameter=city>\\n" CITY "\\n</parameter>\\n'
                '<parameter=days>\\n" DAYS "\\n</parameter>\\n</function>\\n" </tool_call>\n'
                'CITY: /[^<\\n]*/\n'
                'DAYS: /-?(0|[1-9][0-9]*)/\n')
        # (CITY is narrower than xgrammar's "any text up to </parameter>": llguidance's greedy lexer rejected that
        # form; the answer's city has neither '<' nor a newline.) llguidance compiles lazily inside the matcher: a
        # matcher built here is what "compile" costs
        m = LLMatcher(self.tok, g)
        assert not m.is_error(), m.get_error()
        return g

    def matcher(self, g):
        m = self.llg.LLMatcher(self.tok, g)
        bm = self.llg.torch.allocate_token_bitmask(1, self.vocab)
        return m, bm

    def fill(self, mb):
        self.llg.torch.fill_next_token_bitmask(mb[0], mb[1], 0)

    def accept(self, mb, t):
        return mb[0].consume_token(t)


def run(engine, hf, kind, reps):
    answer = ANSWER if kind == "json" else TOOL_ANSWER
    ids = hf.encode(answer, add_special_tokens=False) + [11]
    t = time.perf_counter()
    g = engine.compile(kind)
    compile_ms = (time.perf_counter() - t) * 1e3
    per_token = []
    for _ in range(reps):
        mb = engine.matcher(g)
        for tok in ids:
            t = time.perf_counter()
            engine.fill(mb)
            dt = time.perf_counter() - t
            allowed = bool((mb[1][0, tok // 32] >> (tok % 32)) & 1)
            assert allowed, f"{engine.name} masks out token {tok} ({hf.convert_ids_to_tokens(tok)!r}) of a valid answer"
            t = time.perf_counter()
            ok = engine.accept(mb, tok)
            per_token.append((dt + time.perf_counter() - t) * 1e6)
            assert ok is not False, f"{engine.name} rejected token {tok}"
    per_token.sort()
    return {"engine": engine.name, "vocab": engine.vocab, "grammar": kind, "tokens": len(ids),
            "compile_ms": round(compile_ms, 1), "mask_us_median": round(statistics.median(per_token), 1),
            "mask_us_p90": round(per_token[int(0.9 * len(per_token))], 1), "mask_us_max": round(per_token[-1], 1)}


def apply_cost(vocab: int) -> float:
    """µs to apply a bitmask to one fp32 logits row on this CPU with plain torch ops (the device path's code)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu_worker.sampling import apply_token_bitmask
    logits = torch.randn(vocab)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, ((vocab + 31) // 32,), dtype=torch.int32)
    for _ in range(5):
        apply_token_bitmask(logits.clone(), words)
    t = time.perf_counter()
    n = 50
    for _ in range(n):
        apply_token_bitmask(logits.clone(), words)
    return (time.perf_counter() - t) / n * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[1024, 131072])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    from transformers import AutoTokenizer
    rows = []
    for vocab in a.vocab:
        hf = AutoTokenizer.from_pretrained(str(tokenizer_dir(vocab)))
        for cls in (XGrammar, LLGuidance):
            t = time.perf_counter()
            eng = cls(hf, vocab)
            init_ms = (time.perf_counter() - t) * 1e3
            for kind in ("json", "tool"):
                r = run(eng, hf, kind, a.reps)
                r["tokenizer_init_ms"] = round(init_ms, 1)
                rows.append(r)
                print(json.dumps(r), flush=True)
        print(json.dumps({"vocab": vocab, "apply_bitmask_torch_cpu_us": round(apply_cost(vocab), 1)}), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
