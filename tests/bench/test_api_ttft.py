"""bench.api_ttft times the first token as a client sees it: the first streamed chunk that carries one, not the
role chunk the server sends before the prefill (the GPU run itself is `STEPS=api_ttft bench/gpu_session.sh`)."""
from bench.api_ttft import is_token_event

# chunk shapes as server/app.py streams a chat completion with logprobs on
ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}]}
TOKEN = {"choices": [{"index": 0, "delta": {"content": "Hi"},
                      "logprobs": {"content": [{"token": "Hi", "logprob": -0.1, "top_logprobs": []}]},
                      "finish_reason": None}]}
EMPTY_TEXT_TOKEN = {"choices": [{"index": 0, "delta": {},
                                 "logprobs": {"content": [{"token": "\ufffd", "logprob": -2.0, "top_logprobs": []}]},
                                 "finish_reason": None}]}
LAST = {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}], "timings": {}}
USAGE = {"choices": [], "usage": {"prompt_tokens": 126}}


def test_the_first_token_is_the_first_chunk_that_carries_one():
    stream = [ROLE, EMPTY_TEXT_TOKEN, TOKEN, LAST, USAGE]
    assert [is_token_event(e) for e in stream] == [False, True, True, False, False]
    first = next(i for i, e in enumerate(stream) if is_token_event(e))
    # must-fail twin: "the first chunk with a choice" would time the role chunk, sent before the prefill runs
    naive = next(i for i, e in enumerate(stream) if e.get("choices"))
    assert (first, naive) == (1, 0)
