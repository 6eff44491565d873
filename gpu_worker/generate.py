"""The generation loop: prefill in chunks, then one token at a time, as a streaming iterator."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from gpu_worker.sampling import Sampler, SamplingParams


@dataclass
class Step:
    token: int
    finish_reason: str | None = None   # 'stop' | 'length' on the last step


def generate(model, prompt_ids: list[int], params: SamplingParams, state=None, prefill_chunk: int = 512,
             cancel: threading.Event | None = None) -> Iterator[Step]:
    """Yields tokens as they are chosen. `state` (an InferenceState that already holds a prefix) is advanced
    in place; a stop token ends generation and is yielded with finish_reason 'stop'."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    state = model.new_state() if state is None else state
    sampler = Sampler(params)
    logits = None
    for s in range(0, len(prompt_ids), prefill_chunk):
        if cancel is not None and cancel.is_set():
            return
        logits = model.forward(prompt_ids[s:s + prefill_chunk], state, last_only=True)
    stops = set(params.stop_token_ids)
    for i in range(params.max_tokens):
        tok = sampler(logits[-1])
        if tok in stops:
            yield Step(tok, "stop")
            return
        last = i == params.max_tokens - 1
        yield Step(tok, "length" if last else None)
        if last:
            return
        if cancel is not None and cancel.is_set():
            return   # the caller who set `cancel` knows why the stream ended
        with torch.inference_mode():
            logits = model.forward([tok], state, last_only=True)
