"""FastAPI routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and
/metrics. Requests become (Request, SamplingParams) pairs for the async engine; its outputs become
OpenAI bodies or server-sent-event chunks. No tensors here.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..api import stop_ids_for
from ..engine import Request
from ..outputs import IncrementalText
from ..sampling import SamplingParams
from .async_engine import AsyncEngine, Submission
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_prompt,
    new_id,
    now,
    prompt_count,
    prompts_of,
    spec_stats,  # fmt: skip
    usage,
)

DISCONNECT_POLL_S = 0.1
MIN_BODY_LIMIT = 1 << 20  # bytes; the limit grows with the context (BODY_BYTES_PER_TOKEN)
BODY_BYTES_PER_TOKEN = 64  # far above any tokenizer's bytes per token: a body past it cannot fit the context
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's (and vLLM's) default for /v1/completions


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    request_timeout: float | None = None  # seconds per request, None: no limit
    default_temperature: float = 1.0  # OpenAI's default


def create_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    tokenizer = engine.engine.tokenizer
    stop_ids = stop_ids_for(engine.engine)
    max_length = engine.engine.max_length

    @asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown)  # uvicorn has drained the connections: finish and stop

    app = FastAPI(title="eaglespec", lifespan=lifespan)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * max_length))

    async def check_key(request: HttpRequest) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ApiError(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'")

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        headers = {"Retry-After": "1"} if e.status == 429 else None  # retryable: the queue drains
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, e: RequestValidationError):
        errors = e.errors()
        if any(err.get("type") == "json_invalid" for err in errors):
            return JSONResponse(ApiError(400, "the request body is not valid JSON").body(), status_code=400)
        parts, param = [], None
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body" and not _is_type_tag(x))
            param = param or loc or None
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
        return JSONResponse(ApiError(400, "; ".join(parts), param=param).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http_error(_req, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            raise ApiError(503, "the engine is not running")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    async def models():
        card = {"id": config.model_name, "object": "model", "created": now(), "owned_by": "eaglespec",
                "max_model_len": max_length}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(body: CompletionRequest, http: HttpRequest):
        _check_common(body)
        asked = prompt_count(body) * body.n
        if asked > engine.max_queue:  # can never be queued whole: not worth a retry (checked before tokenizing)
            raise ApiError(400, f"the request asks for {asked} completions (prompts x n) but this server queues at "
                                f"most {engine.max_queue} (--max-queue); send at most {engine.max_queue} per request",
                           param="prompt")  # fmt: skip
        prompts = await asyncio.to_thread(prompts_of, body, tokenizer)  # off the event loop: /health stays live
        items = [it for p in prompts for it in _items(body, p, body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)]
        return await _respond(http, body, items, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat_completions(body: ChatCompletionRequest, http: HttpRequest):
        _check_common(body)
        prompt = await asyncio.to_thread(chat_prompt, body, tokenizer)
        limit = body.max_completion_tokens or body.max_tokens or max(1, max_length - len(prompt))
        return await _respond(http, body, _items(body, prompt, limit), chat=True)

    def _check_common(body) -> None:
        body.refuse_unsupported()
        if body.model is not None and body.model != config.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {config.model_name!r}",
                           param="model")  # fmt: skip

    def _items(body, prompt: list[int], max_tokens: int) -> list[tuple[Request, SamplingParams]]:
        if not prompt:
            raise ApiError(400, "the prompt is empty; give at least one token", param="prompt")
        if len(prompt) + max_tokens > max_length:
            raise ApiError(400, f"this model's maximum context length is {max_length} tokens, but the request asks "
                                f"for {len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} to "
                                "generate); shorten the prompt or lower max_tokens", param="max_tokens")  # fmt: skip
        temperature = config.default_temperature if body.temperature is None else body.temperature
        top_k = 0 if body.top_k in (None, -1) else body.top_k
        out = []
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j  # choices differ, each one reproducible
            params = SamplingParams(temperature, 1.0 if body.top_p is None else body.top_p, top_k, seed)
            out.append((Request(list(prompt), max_tokens, stop_ids, tuple(body.stop or ()), params), params))
        return out

    async def _respond(http: HttpRequest, body, items, *, chat: bool):
        sub = await engine.submit(items)
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if body.stream:
            sse = _sse(engine, sub, config, tokenizer, body, rid, created, chat, len(items))
            return StreamingResponse(sse, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        finals = await _collect(engine, sub, config, http)
        if finals is None:  # the client went away; its requests are aborted
            return Response(status_code=499)
        choices = []
        for i, out in enumerate(finals):
            text = _text(tokenizer, out)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": out.finish_reason, "logprobs": None})  # fmt: skip
            else:
                choices.append({"index": i, "text": text, "finish_reason": out.finish_reason, "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": config.model_name, "choices": choices, **_totals(finals, body.n)}  # fmt: skip

    return app


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes gets a 413 (OpenAI error body) before it is read
    whole, parsed or tokenized, whether it announces its length or is sent in chunks."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        seen, refused = 0, False

        async def counted():
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # a chunked body past the limit: answer now, the app sees a disconnect
                    refused = True
                    await self._refuse(send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message):
            if not refused:  # after the 413, whatever the app answers to the disconnect is dropped
                await send(message)

        await self.app(scope, counted, guarded_send)

    async def _refuse(self, send):
        body = json.dumps(ApiError(413, f"the request body is larger than {self.limit} bytes, more than this "
                                        "model's context can hold; send a shorter prompt").body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


async def _collect(engine: AsyncEngine, sub: Submission, config: ServerConfig, http: HttpRequest):
    """Every choice's final output, or None when the client disconnected first (all aborted)."""
    finals = [None] * len(sub.ids)

    async def consume():
        async for i, out in engine.stream(sub, config.request_timeout):
            if out.finished:
                finals[i] = out

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await http.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return None
        task.result()
    finally:
        if not task.done():  # cancelled from outside (server shutdown): stop the consumer too
            task.cancel()
    return finals


async def _sse(engine, sub, config, tokenizer, body, rid, created, chat, n) -> AsyncIterator[str]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    texts = [_TextStream(tokenizer, max((len(s) for s in body.stop or ()), default=0)) for _ in range(n)]
    finals = [None] * n
    include_usage = body.stream_options is not None and body.stream_options.include_usage

    def chunk(choice: dict | None, extra: dict | None = None) -> str:
        payload = {"id": rid, "object": obj, "created": created, "model": config.model_name,
                   "choices": [choice] if choice is not None else []}  # fmt: skip
        if include_usage:
            payload["usage"] = None
        payload.update(extra or {})
        return f"data: {json.dumps(payload)}\n\n"

    def piece(i: int, text: str, finish: str | None) -> dict:
        if chat:
            return {"index": i, "delta": {"content": text} if text or finish is None else {}, "finish_reason": finish,
                    "logprobs": None}  # fmt: skip
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": None}

    stream = engine.stream(sub, config.request_timeout)
    try:
        if chat:
            for i in range(n):
                yield chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                             "logprobs": None})  # fmt: skip
        async for i, out in stream:
            delta = texts[i].push(out)
            if out.finished:
                finals[i] = out
                yield chunk(piece(i, delta, out.finish_reason))
            elif delta:
                yield chunk(piece(i, delta, None))
        if include_usage:
            yield chunk(None, _totals(finals, body.n))
    except ApiError as e:  # e.g. the timeout: OpenAI-shaped error event, then the end of the stream
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        await stream.aclose()  # a disconnect cancels us here: abort what is unfinished
    yield "data: [DONE]\n\n"


class _TextStream:
    """Incremental detokenization (outputs.IncrementalText): the new text of each step, holding back what
    may still change (the start of a stop string); a finished output's text is the one its stop cut."""

    def __init__(self, tokenizer, hold: int):
        self.tokenizer, self.hold, self.sent = tokenizer, max(hold - 1, 0), 0
        self.text = IncrementalText(tokenizer.decode) if tokenizer is not None else None

    def push(self, out) -> str:
        if out.finished or self.text is None:
            text = _text(self.tokenizer, out)
        else:
            while self.text.read_one(out.output_ids) is not None:
                pass
            text = self.text.text[: max(len(self.text.text) - self.hold, 0)]
        if len(text) <= self.sent:
            return ""
        delta, self.sent = text[self.sent :], len(text)
        return delta


def _text(tokenizer, out) -> str:
    if out.text is not None:  # a stop string cut it
        return out.text
    return tokenizer.decode(out.output_ids, skip_special_tokens=True) if tokenizer is not None else ""


def _totals(finals, n: int) -> dict:
    """usage counts each prompt once (choices are prompt-major: n per prompt), as OpenAI does."""
    prompt_tokens = sum(f.stats.prompt_tokens for f in finals[::n])
    stats = finals[0].stats
    for f in finals[1:]:
        stats = stats.merge(f.stats)
    return {"usage": usage(prompt_tokens, sum(len(f.output_ids) for f in finals)),
            "spec_decode": spec_stats(stats)}  # fmt: skip


def _is_type_tag(x) -> bool:
    # pydantic puts union member names ("str", "list[int]") in error locations; they only add noise
    return isinstance(x, str) and ("[" in x or x in ("str", "int", "float", "bool", "function-after"))
