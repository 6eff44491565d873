"""The generation loop: the prompt through the one prefill loop (gpu_worker/prefill.py), then one token at a time,
as a streaming iterator."""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from gpu_worker.prefill import prefill
from gpu_worker.sampling import Sampler, SamplingParams, copy_to_host


@dataclass
class Step:
    token: int
    finish_reason: str | None = None   # 'stop' | 'length' on the last step
    logprob: float | None = None       # with logprobs=: the token's log-probability under the raw model
    top_logprobs: list | None = None   # with logprobs=k > 0: [(token, logprob)] of the k most likely


def generate(model, prompt_ids: list[int], params: SamplingParams, state=None, prefill_budget: int | None = None,
             cancel: threading.Event | None = None, logprobs: int | None = None, grammar=None,
             context_ids: list[int] | None = None, max_span: int = 0, capture_at=(),
             on_capture=None) -> Iterator[Step]:
    """Yields tokens as they are chosen. `state` (an InferenceState that already holds a prefix) is advanced
    in place; a stop token ends generation and is yielded with finish_reason 'stop'. The last yielded token
    is never fed to the model, so afterwards `state.position` tokens of prompt + output are in the state.
    `logprobs` (None = off, k >= 0) adds each token's log-probability and the k most likely alternatives,
    from the raw logits (before temperature and truncation), as OpenAI and vLLM report them. The token is chosen on
    the logits' device (gpu_worker.sampling); `grammar` constrains it; `context_ids` (the whole prompt, when
    `prompt_ids` is the tail after a snapshot) is what repetition_penalty looks back at.
    `prefill_budget` (device bytes for the prompt's activations; None: `prefill.default_budget`) and `max_span`
    bound the prefill's spans (`gpu_worker.prefill.prefill`); `capture_at` / `on_capture` take states inside the
    prompt as it is prefilled (indices into `prompt_ids`; the same function's)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    state = model.new_state() if state is None else state
    sampler = Sampler(params, prompt_ids=context_ids if context_ids is not None else prompt_ids, grammar=grammar)
    logits = prefill(model, prompt_ids, state, cancel=cancel, budget_bytes=prefill_budget, max_span=max_span,
                     capture_at=capture_at, on_capture=on_capture)
    if logits is None:      # cancelled
        return
    stops = set(params.stop_token_ids)
    ahead = getattr(model, "step_ahead", None)     # the engine's; a bare model decodes one whole step at a time
    begun = False
    try:
        for i in range(params.max_tokens):
            choice = sampler.choose(logits[-1], logprobs)   # min_tokens' ban on stop tokens is the sampler's
            last = i == params.max_tokens - 1
            # the next step's first stretch goes to the device before the host reads the token (it may be a stop:
            # then it is abandoned, the state as it was)
            begun = ahead is not None and not last and not (cancel is not None and cancel.is_set()) and \
                ahead(choice.token, state)
            tok, lp, top = choice.result()
            if tok in stops:
                if begun:
                    model.step_abandon()
                    begun = False
                yield Step(tok, "stop", lp, top)
                return
            yield Step(tok, "length" if last else None, lp, top)
            if last:
                return
            if cancel is not None and cancel.is_set():
                return   # the caller who set `cancel` knows why the stream ended
            with torch.inference_mode():
                logits = model.step(tok, state)
            begun = False
    finally:
        if begun:        # a stop, a cancel, or the caller left the loop: the state keeps only what was fed
            model.step_abandon()


def token_reader(token: torch.Tensor):
    """`int(token)` of a device scalar, its copy to the host queued now, before whatever the caller queues next (a
    begun step: `.item()` afterwards would wait for that too). Returns the function that reads it."""
    host, ev = copy_to_host(token)

    def read() -> int:
        if ev is not None:
            ev.synchronize()
        return int(host)
    return read


def greedy_steps(model, logits, state, n: int) -> list[int]:
    """n greedy decode steps after `logits` (a prefill's or a step's, on the device), taken the way `generate` takes
    them: the argmax's copy to the host queued, the next step begun (`step_ahead`, where the model has it) with the
    argmax still on the device, then the token read, then the step finished. Returns the n tokens the steps chose (the
    first, `logits`' own, is fed, not returned). What the decode benchmarks time (bench.e2e_stream): the engine's loop
    without sampling's extras."""
    ahead = getattr(model, "step_ahead", None)
    nxt = logits[-1].argmax()
    out = []
    with torch.inference_mode():
        for k in range(n):
            read = token_reader(nxt)
            if ahead is not None:
                ahead(nxt, state)
            tok = read()
            if k:
                out.append(tok)
            nxt = model.step(tok, state)[-1].argmax()
        if n:
            out.append(int(nxt))
    return out
