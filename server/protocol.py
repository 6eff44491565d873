"""OpenAI request schemas (pydantic). Unknown fields are accepted and ignored, as vLLM does, so clients that send
extra fields keep working; fields we cannot honour are rejected with a 400 that names them.

A sampling field left out is None here: its default is applied once, by `procs.messages.SamplingParams.for_request`
(the model's generation config, else the API's defaults), not by the schema."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from procs.messages import SamplingParams

_ENGINE = SamplingParams()      # the defaults that do not depend on the model


TokenId = Annotated[int, Field(ge=0, lt=2 ** 31)]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Base):
    type: Literal["text"]
    text: str


class ImageURL(_Base):
    url: str
    detail: Optional[str] = None


class ImagePart(_Base):
    type: Literal["image_url"]
    image_url: Union[ImageURL, str]

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    reasoning_content: Optional[str] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    tool_call_id: Optional[str] = None


class StreamOptions(_Base):
    include_usage: bool = False
    continuous_usage_stats: Optional[bool] = Field(None, description="not supported (400): usage comes once")


class _Sampling(_Base):
    model: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    max_tokens: Optional[int] = Field(None, ge=1, lt=2 ** 31)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, lt=2 ** 31, description="0 or -1: off (vLLM/llama.cpp extension)")
    seed: Optional[int] = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[TokenId]] = Field(None, description="extra token ids that end generation (vLLM)")
    ignore_eos: bool = Field(False, description="do not stop at the model's end-of-sequence tokens (vLLM)")
    min_tokens: int = Field(_ENGINE.min_tokens, ge=0, lt=2 ** 31, description="end-of-sequence tokens are not chosen before this many (vLLM)")
    n: int = Field(1, ge=1, le=1, description="one choice per request")
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, gt=0, le=10, description="> 1 discourages tokens of the "
                                                "prompt and the answer (vLLM, HF)")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="drop tokens below min_p x the top probability")
    logit_bias: Optional[dict[str, float]] = Field(None, description="token id -> bias in [-100, 100]")
    best_of: Optional[int] = Field(None, description="not supported (400) unless 1")
    user: Optional[str] = None
    cache_prompt: bool = Field(True, description="continue from a conversation snapshot when one matches, and keep "
                                                 "one afterwards (llama.cpp)")
    return_token_ids: bool = Field(False, description="add prompt_token_ids and token_ids to the choice (vLLM)")


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1, lt=2 ** 31)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="extra variables for the chat template, e.g. {\"enable_thinking\": false}")
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[dict[str, Any]] = Field(None, description="text, json_object or json_schema "
                                                      "(constrained decoding)")
    functions: Optional[list[dict[str, Any]]] = Field(None, description="deprecated; not supported (400): use tools")
    function_call: Optional[Union[str, dict[str, Any]]] = Field(None, description="deprecated; not supported (400)")


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[TokenId], list[list[TokenId]]]
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[str] = None


class TokenizeRequest(_Base):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    tools: Optional[list[dict[str, Any]]] = None


class DetokenizeRequest(_Base):
    model: Optional[str] = None
    tokens: list[TokenId]
