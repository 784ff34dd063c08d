"""OpenAI request and response bodies (pydantic), and the checks that turn a request into engine inputs.

Fields we do not implement are refused with a 400 that names them, never silently ignored; a field
sent at its neutral value (a penalty of 0, logprobs false) is accepted, since many clients send those.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# fields OpenAI (or vLLM) define that we accept only at this neutral value
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logprobs": (None, False),
           "top_logprobs": (None, 0), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
           "functions": (None, []), "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
           "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""), "parallel_tool_calls": (None,),
           "min_p": (None, 0), "min_tokens": (None, 0)}  # fmt: skip
IGNORED = {"user", "metadata", "store", "service_tier"}  # informational: no effect on generation
MAX_STOP = 8
MAX_N = 16


class ApiError(Exception):
    """An error with the HTTP status and OpenAI error body it becomes."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type_ or {400: "invalid_request_error", 413: "invalid_request_error", 401: "authentication_error",
                              404: "not_found_error",
                              408: "timeout_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
            status, "server_error")  # fmt: skip

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


NonNegInt = Annotated[int, Field(ge=0)]


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # vLLM: -1 or 0 = off
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def refuse_unsupported(self) -> None:
        extra = self.model_extra or {}
        bad = sorted(k for k, v in extra.items() if k not in IGNORED and not _neutral(k, v))
        if bad:
            raise ApiError(400, f"unsupported field(s): {', '.join(bad)}; eaglespec implements model, prompt/messages, "
                                "max_tokens, max_completion_tokens, temperature, top_p, top_k, seed, stop, stream, "
                                "stream_options, n", param=bad[0])  # fmt: skip
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")


def _neutral(name: str, value: Any) -> bool:
    if name not in NEUTRAL:
        return False
    ok = NEUTRAL[name]
    return value in ok if isinstance(ok, tuple) else value == ok


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[NonNegInt]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    # fields the official client puts on the messages it returns (choices[0].message.model_dump()): accepted
    # when null or empty, so a reply can be appended to the conversation as it is
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    tool_calls: list | None = None

    def check_supported(self) -> None:
        for name in ("refusal", "annotations", "audio", "function_call", "tool_calls"):
            if getattr(self, name):
                raise ApiError(400, f"message field {name!r} is not supported by this text-only server (null or "
                                    "empty is accepted)", param=f"messages.{name}")  # fmt: skip

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ApiError(400, "message content parts must be {'type': 'text', 'text': str}; this model "
                                        "takes text only", param="messages")  # fmt: skip
                parts.append(p["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def prompts_of(req: CompletionRequest, tokenizer) -> list[list[int]]:
    """The request's prompts as token ids (one list per prompt)."""
    p = req.prompt
    if isinstance(p, str):
        texts = [p]
    elif len(p) == 0:
        raise ApiError(400, "the prompt is empty; give a string, a list of strings or token ids", param="prompt")
    elif all(isinstance(x, int) for x in p):
        return [list(p)]
    elif all(isinstance(x, list) for x in p):
        return [list(x) for x in p]
    else:
        texts = list(p)
    if tokenizer is None:
        raise ApiError(400, "the model has no tokenizer; send the prompt as token ids", param="prompt")
    for t in texts:
        check_text(t, "prompt")
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def prompt_count(req: CompletionRequest) -> int:
    """How many prompts the request holds, without tokenizing them."""
    p = req.prompt
    return 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)


def check_text(text: str, param: str) -> None:
    """Text a tokenizer can encode: no lone UTF-16 surrogate (JSON allows "\\ud800"; UTF-8 cannot hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"the {param} holds an unpaired UTF-16 surrogate ({text[e.start]!r} at character "
                            f"{e.start}); send valid Unicode text", param=param) from None  # fmt: skip


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> list[int]:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "the model has no chat template; use /v1/completions", param="messages")
    for m in req.messages:
        m.check_supported()
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    for m in messages:
        check_text(m["content"], "messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # template errors (e.g. role order) carry the useful message
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def spec_stats(stats) -> dict:
    """Our extension on every response: the request's speculative statistics (vLLM's definitions)."""
    return {"num_drafts": stats.drafts, "num_draft_tokens": stats.draft_tokens, "num_accepted_tokens": stats.accepted,
            "num_accepted_tokens_per_pos": list(stats.accepted_per_pos), "mean_acceptance_length": round(stats.tau, 4),
            "draft_acceptance_rate": round(stats.acceptance_rate, 4)}  # fmt: skip
