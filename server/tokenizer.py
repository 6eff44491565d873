"""The checkpoint's tokenizer and chat template (transformers' `apply_chat_template`, nothing hand-rolled),
and the incremental text of a token stream: detokenization (`tokenizers`' DecodeStream), stop strings, and the
split of `<think>…</think>` into `reasoning_content`.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from server.stretch_encoder import StretchEncoder


class Tokenizer:
    def __init__(self, model_dir):
        from transformers import AutoTokenizer
        self.dir = Path(model_dir)
        self.tok = AutoTokenizer.from_pretrained(str(self.dir))
        self.backend = self.tok._tokenizer          # the `tokenizers.Tokenizer` behind the fast tokenizer
        vocab = self.tok.get_vocab()
        self.think_start = vocab.get("<think>")
        self.think_end = vocab.get("</think>")
        self.im_start = vocab.get("<|im_start|>")
        self.tool_call_marks = [vocab[m] for m in ("<tool_call>", "</tool_call>") if m in vocab]
        self.has_template = bool(getattr(self.tok, "chat_template", None))
        self.eos_ids = self._eos_ids(vocab)
        # a conversation's messages encoded once each (server/stretch_encoder.py), where that is exact
        self.stretches = StretchEncoder.for_backend(self.backend, bool(self.tok.split_special_tokens))

    def _eos_ids(self, vocab) -> list[int]:
        """The generation config's eos ids (Nemotron: </s> and <|im_end|>), else the config's, else the tokenizer's."""
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = self.dir / name
            if p.exists():
                e = json.loads(p.read_text()).get("eos_token_id")
                if e is not None:
                    ids += [e] if isinstance(e, int) else list(e)
                    break
        if self.tok.eos_token_id is not None:
            ids.append(self.tok.eos_token_id)
        return sorted(set(int(i) for i in ids))

    # ---- prompts --------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools=None,
                    template_kwargs: dict | None = None) -> str:
        if not self.has_template:
            raise ValueError("the checkpoint has no chat template (tokenizer_config.json chat_template)")
        return self.tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """transformers' `encode`: its backend's `encode_batch` of [text] with no truncation, no padding and its
        `split_special_tokens`. When the backend is already so, the backend's `encode_batch_fast` (no offsets, no
        conversion to a BatchEncoding; the GIL released) gives the same ids in ~3/4 of the time (16k tokens: 6.8 ->
        5.2 ms on this VM, bench/NOTES.md session 16, h-api). Where the stretch memo is exact, it gives them."""
        if not self._backend_as_transformers_sets_it():
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        if self.stretches is not None and not add_special_tokens:
            return self.stretches.encode(text)[0]
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def _backend_as_transformers_sets_it(self) -> bool:
        """The backend has a fast encode and no truncation or padding, and splits special tokens as transformers'
        tokenizer says (checked per call: a caller may set the backend otherwise after the start)."""
        be = self.backend
        return (getattr(be, "encode_batch_fast", None) is not None and be.truncation is None and be.padding is None
                and be.encode_special_tokens == bool(self.tok.split_special_tokens))

    def encode_split(self, text: str, n_chars: int) -> tuple[list[int], int | None]:
        """`encode(text)` and how many of its ids `encode(text[:n_chars])` gives, or None where that is not proven
        (nemotron/vision_prompt.py `encode_prompt`: where the last message ends, without a second encode).

        The proof: `tokenizers` cuts a text at its added tokens first and encodes the stretches between them one by
        one. So if an added token starts exactly at n_chars, text[:n_chars] is the same stretches and added tokens
        up to there, and their ids are the same, but for the last stretch (after the last added token before
        n_chars), which the prefix ends in and the text does not. That stretch alone (in a chat template, the
        "\\n" after the last message's end mark) is encoded again and compared. No added token at n_chars, none
        before it, or a stretch that encodes otherwise: None. With the stretch memo, the same proof, read off the
        stretches (server/stretch_encoder.py)."""
        if self.stretches is not None and self.stretches.backend is self.backend and \
                self._backend_as_transformers_sets_it():
            return self.stretches.encode(text, cut_at=n_chars)
        enc = self.backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        added = self._added_ids()
        # the token at n_chars, asked of the encoding: its offsets as a Python list cost more than the encode itself
        # (16k tokens: ~5 ms, ~100 ms when the list's allocation meets a collection; bench/NOTES.md session 15)
        n = enc.char_to_token(n_chars) if 0 <= n_chars < len(text) else None
        if (n is None or n == 0 or enc.token_to_chars(n)[0] != n_chars or ids[n] not in added
                or enc.token_to_chars(n - 1)[1] > n_chars):
            return ids, None
        p = next((i for i in range(n - 1, -1, -1) if ids[i] in added), None)
        if p is None:
            return ids, None             # the whole prefix is one stretch: proving it costs the encode it saves
        start = enc.token_to_chars(p)[1]
        tail = self.backend.encode(text[start:n_chars], add_special_tokens=False).ids if start < n_chars else []
        return (ids, n) if tail == ids[p + 1:n] else (ids, None)

    @lru_cache(maxsize=1)
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @lru_cache(maxsize=1 << 16)
    def piece(self, token: int) -> str:
        """One token's text, as logprobs report it."""
        return self.tok.decode([token], skip_special_tokens=False)

    def pieces(self, ids) -> list[str]:
        return [self.piece(int(t)) for t in ids]

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        """True when the prompt leaves the model inside `<think>` (the generation prompt opened it)."""
        if self.think_start is None or self.think_end is None:
            return False
        for t in reversed(prompt_ids):
            if t == self.think_end:
                return False
            if t == self.think_start:
                return True
            if t == self.im_start:
                return False
        return False


class TextStream:
    """Turns generated token ids into text deltas, in order: detokenize incrementally (a multi-byte character
    split over tokens waits for its last byte), cut at the first stop string (text that might start one is held
    back until it cannot), and route text inside `<think>…</think>` to reasoning. Streamed and non-streamed
    responses both go through this, so they are equal by construction."""

    def __init__(self, tok: Tokenizer, stop: list[str] | None = None, reasoning: bool = False,
                 in_reasoning: bool = False, literal_tokens=()):
        from tokenizers.decoders import DecodeStream
        self.tok = tok
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.stops = [s for s in (stop or []) if s]
        self.reasoning = reasoning and tok.think_start is not None
        self.segment = "reasoning" if (self.reasoning and in_reasoning) else "content"
        self.pending = ""              # held back: may be the start of a stop string, or trailing newlines
        self.at_segment_start = True
        self.stopped = False
        self.text = {"reasoning": "", "content": ""}
        self.reasoning_tokens = 0
        self.literal = set(literal_tokens)   # special tokens whose text is kept (<tool_call>: the tool parser reads it)

    def push(self, token: int) -> dict:
        """Feed one token; returns {'reasoning': str, 'content': str} deltas (empty strings when nothing new)."""
        out = {"reasoning": "", "content": ""}
        if self.stopped:
            return out
        if self.reasoning and token in (self.tok.think_start, self.tok.think_end):
            self._flush(out, drop_trailing_newlines=self.segment == "reasoning")
            self.segment = "reasoning" if token == self.tok.think_start else "content"
            self.at_segment_start = True
            self.reasoning_tokens += 1
            return out
        if self.segment == "reasoning":
            self.reasoning_tokens += 1
        piece = self.tok.piece(token) if token in self.literal else self.decoder.step(self.tok.backend, int(token))
        if piece:
            self._add(piece, out)
        return out

    def finish(self) -> dict:
        out = {"reasoning": "", "content": ""}
        if not self.stopped:
            self._flush(out)
        return out

    def _emit(self, seg: str, s: str, out: dict) -> None:
        if s:
            out[seg] += s
            self.text[seg] += s

    def _add(self, piece: str, out: dict) -> None:
        buf = self.pending + piece
        if self.at_segment_start:
            buf = buf.lstrip("\n")          # the template writes "<think>\n" and "</think>\n"
            if not buf:
                self.pending = ""
                return
            self.at_segment_start = False
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._emit(self.segment, buf[:cut], out)
            self.pending = ""
            self.stopped = True
            return
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        if self.segment == "reasoning":
            hold = max(hold, len(buf) - len(buf.rstrip("\n")))
        self._emit(self.segment, buf[:len(buf) - hold], out)
        self.pending = buf[len(buf) - hold:]

    def _flush(self, out: dict, drop_trailing_newlines: bool = False) -> None:
        s = self.pending.rstrip("\n") if drop_trailing_newlines else self.pending
        self._emit(self.segment, s, out)
        self.pending = ""
