"""Constrained decoding, the compute side: a request's structural tag (built and checked by server/constrained.py)
compiled with xgrammar against the checkpoint's vocabulary, and a matcher that fills the next token's bitmask
on the CPU. The sampler applies the mask on the logits' device (gpu_worker/sampling.py) and fills the next one
in a helper thread while the model computes the next logits.

Special tokens are blanked from the grammar's vocabulary, so no constrained text can contain them
(`<|im_start|>` or `<think>` inside a JSON string, say), except the stop tokens and those the grammar spells
(`special_tokens`: `</think>` closing a reasoning block, `<tool_call>` / `</tool_call>`): the model
was trained to emit those as single tokens, so the grammar must let it.
"""
from __future__ import annotations

import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

_CONTROL = re.compile(rb"[\x00-\x08\x0b\x0c\x0e-\x1f]")
_mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")


class GrammarCompiler:
    """One per compute process: the tokenizer's xgrammar view (built on first use: ~1.5 s at 131k tokens) and
    a compiled-grammar cache."""

    def __init__(self, model_dir: str | Path, vocab_size: int, stop_token_ids):
        self.model_dir, self.vocab_size = str(model_dir), int(vocab_size)
        self.stop_token_ids = sorted(int(t) for t in stop_token_ids)
        self._compilers: dict = {}

    def _build(self, kept: frozenset):
        import xgrammar as xgr
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(self.model_dir)
        base = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids)
        vocab = [""] * self.vocab_size
        for s, i in tok.get_vocab().items():
            if i < self.vocab_size:
                vocab[i] = s
        special = {int(i) for i, t in tok.added_tokens_decoder.items() if t.special} | set(tok.all_special_ids)
        for i in special:
            keep = vocab[i] in kept or i in self.stop_token_ids
            if 0 <= i < self.vocab_size and not keep:
                vocab[i] = ""           # an empty token is one xgrammar never allows
        if "<tool_call>" not in kept:
            # JSON never holds a raw control character, but xgrammar 0.2.8's rule for a string with maxLength
            # lets one in (`[^"\\\r\n]{0,n}`): such tokens are dropped from the JSON grammars' vocabulary
            for i, b in enumerate(base.decoded_vocab[:self.vocab_size]):
                if _CONTROL.search(b) and i not in self.stop_token_ids:
                    vocab[i] = ""
        info = xgr.TokenizerInfo(vocab, base.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self.stop_token_ids, add_prefix_space=base.add_prefix_space)
        return xgr.GrammarCompiler(info, max_threads=1)

    def matcher(self, structural_tag: str, special_tokens=()) -> "Grammar":
        kept = frozenset(special_tokens)
        if kept not in self._compilers:
            self._compilers[kept] = self._build(kept)
        import xgrammar as xgr
        compiled = self._compilers[kept].compile_structural_tag(structural_tag)
        return Grammar(xgr.GrammarMatcher(compiled))


class Grammar:
    """What the sampler needs of a grammar: the next token's bitmask, and accepting the chosen token. Once the
    grammar has ended (a stop token was accepted) it constrains nothing more."""

    def __init__(self, matcher):
        self.m = matcher
        self.terminated = False
        self.rejected: int | None = None         # a token the grammar refused (a bug if it ever happens)
        self._pending: Future | None = None

    def fill(self, words: torch.Tensor) -> None:
        self.wait()
        self.m.fill_next_token_bitmask(words.view(1, -1) if words.dim() == 1 else words)

    def accept(self, token: int) -> None:
        self.wait()
        self._accept(token)

    def _accept(self, token: int) -> None:
        if not self.m.accept_token(int(token)):
            self.rejected = int(token)
            self.terminated = True
        elif self.m.is_terminated():
            self.terminated = True

    def accept_and_fill_async(self, token: int, words: torch.Tensor) -> None:
        """accept(token) then fill(words) on the helper thread; the next fill/accept/wait waits for it."""
        self.wait()

        def work():
            self._accept(token)
            if not self.terminated:
                self.m.fill_next_token_bitmask(words.view(1, -1))
        self._pending = _mask_thread.submit(work)

    def wait(self) -> None:
        p, self._pending = self._pending, None
        if p is not None:
            p.result()
