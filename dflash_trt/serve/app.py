"""The FastAPI app: /v1/completions, /v1/chat/completions (JSON or server-sent events ending in `data: [DONE]`),
/v1/models, /health, /metrics. Handlers parse and tokenize, then hand the prompts to the EngineLoop and wait on an
asyncio queue its sink fills; a client that disconnects (stream closed, or gone while a non-streamed request runs)
has its completions aborted, so its slot and pages go back. Errors are OpenAI-shaped JSON."""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations (Request) as objects

import asyncio
import json
from dataclasses import dataclass

from dflash_trt.api.chat import ChatTemplate, ChatTemplateError
from dflash_trt.api.params import ParamError
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.runtime import CapacityError
from dflash_trt.serve import protocol
from dflash_trt.serve.loop import EngineLoop, QueueFull

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


@dataclass
class ServerState:
    loop: EngineLoop
    codec: object
    model_name: str
    defaults: dict
    template: ChatTemplate | None


def classify(err: Exception) -> tuple[int, dict]:
    """HTTP status and OpenAI error body for an exception a request met."""
    msg = " ".join(str(err).split()) or type(err).__name__
    if isinstance(err, QueueFull):
        return 503, protocol.error_body(msg, "server_overloaded", None, "queue_full")
    if isinstance(err, ParamError):
        return 400, protocol.error_body(msg, "invalid_request_error", err.param)
    if isinstance(err, ChatTemplateError):
        return 400, protocol.error_body(msg, "invalid_request_error", "messages")
    if isinstance(err, CapacityError):
        return 400, protocol.error_body(msg, "invalid_request_error", "prompt", "context_length_exceeded")
    if isinstance(err, PoolExhausted):
        return 503, protocol.error_body(msg, "server_overloaded", None, "pool_exhausted")
    if isinstance(err, (ValueError, TypeError)):  # the runtime's refusals (token ids, sampling, gamma, ...)
        return 400, protocol.error_body(msg, "invalid_request_error")
    return 500, protocol.error_body(msg, "server_error")


class Submission:
    """One HTTP request's completions in the engine: the tracks and the queue their sink fills."""

    def __init__(self, state: ServerState):
        self.state, self.aio = state, asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tracks: list = []

    def sink(self, track, delta: str, tokens: list) -> None:
        """Engine thread: the finish reason and the logprobs of the delta's tokens (None: not asked) are read here,
        with the delta they belong to (the track moves on)."""
        lps = None
        if track.params.logprobs is not None:
            lps = track.logprobs[track.sent_tokens - len(tokens):track.sent_tokens]
        self.aio.call_soon_threadsafe(self.queue.put_nowait, (track, delta, track.finish_reason, lps))

    async def start(self, prompt_ids: list, params) -> None:
        fut = self.state.loop.submit(prompt_ids, params, self.sink)
        self.tracks = await asyncio.wrap_future(fut)
        self.index = {id(t): i for i, t in enumerate(self.tracks)}

    def abort(self) -> None:
        if any(not t.finished for t in self.tracks):
            self.state.loop.abort(self.tracks)


def error_response(err: Exception):
    from fastapi.responses import JSONResponse

    status, body = classify(err)
    return JSONResponse(body, status_code=status)


class Handlers:
    """The completion endpoints' work: parse, tokenize, submit, then answer as JSON or as a stream."""

    def __init__(self, state: ServerState):
        self.state = state

    async def body_of(self, request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ParamError("body", f"request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ParamError("body", "request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.state.model_name:
            raise ParamError("model", f"model {model!r} is not served here (this server serves "
                                      f"{self.state.model_name!r})")
        return body

    def encode(self, prompts: list, chat: bool) -> list:
        """Token ids per prompt; a rendered chat template writes its own special tokens (none added)."""
        codec = self.state.codec
        return [codec.encode(p, add_special_tokens=not chat) if isinstance(p, str) else [int(i) for i in p]
                for p in prompts]

    async def handle(self, request, chat: bool):
        """One completion request end to end; every refusal becomes an OpenAI error body (the server goes on)."""
        try:
            body = await self.body_of(request)
            if chat:
                parsed, kwargs = protocol.parse_chat(body, self.state.defaults)
                if self.state.template is None:
                    raise ChatTemplateError(f"model {self.state.model_name!r} has no chat template; use "
                                            f"/v1/completions or start the server with --chat-template FILE")
                prompts = [self.state.template.render(body["messages"], **kwargs)]
            else:
                parsed = protocol.parse_completion(body, self.state.defaults)
                prompts = parsed.prompts
            return await self.run(request, parsed, self.encode(prompts, chat), chat)
        except Exception as err:
            return error_response(err)

    async def run(self, request, parsed, prompt_ids: list, chat: bool):
        from fastapi.responses import JSONResponse, StreamingResponse
        from starlette.background import BackgroundTask

        sub = Submission(self.state)
        await sub.start(prompt_ids, parsed.params)
        rid = protocol.new_id("chatcmpl" if chat else "cmpl")
        lens = [len(ids) for ids in prompt_ids]
        if parsed.stream:
            # background: also when the stream never started (client gone at once), its completions are aborted
            return StreamingResponse(self.stream(sub, rid, chat, lens, parsed.include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(sub.abort))
        try:
            await self.wait_all(request, sub)
        finally:
            sub.abort()  # a handler cancelled, or its client gone: nothing of it stays in the engine
        failed = next((t for t in sub.tracks if t.error is not None), None)
        if failed is not None:
            return error_response(failed.error)
        if any(t.finish_reason == "abort" for t in sub.tracks):
            return JSONResponse(protocol.error_body("client disconnected", "server_error"), status_code=499)
        make = protocol.chat_body if chat else protocol.completion_body
        return JSONResponse(make(rid, self.state.model_name, sub.tracks, lens, self.state.codec.decode))

    @staticmethod
    async def wait_all(request, sub: Submission) -> None:
        """Until every track of sub ended, or its client is gone (checked every DISCONNECT_POLL_S)."""
        left = len(sub.tracks)
        while left:
            try:
                _, _, finish, _ = await asyncio.wait_for(sub.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return
                continue
            left -= finish is not None

    async def stream(self, sub: Submission, rid: str, chat: bool, lens: list, include_usage: bool):
        """Server-sent events: per track its text deltas, then its finish_reason; `data: [DONE]` at the end."""
        model = self.state.model_name
        offsets = [0] * len(sub.tracks)  # per track: text_offset of its next token (completions logprobs)
        try:
            if chat:
                for i in range(len(sub.tracks)):
                    yield sse(protocol.chat_chunk(rid, model, i, {"role": "assistant", "content": ""}, None))
            left = len(sub.tracks)
            while left:
                track, delta, finish, lps = await sub.queue.get()
                left -= finish is not None
                if finish == "error":
                    yield sse(classify(track.error)[1])
                    continue
                i = sub.index[id(track)]
                if delta or finish or lps:
                    yield sse(self.chunk(rid, chat, i, delta, finish, lps, offsets))
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                           "model": model, "choices": [], "usage": protocol.usage(lens, sub.tracks)})
            yield "data: [DONE]\n\n"
        finally:
            sub.abort()  # the client closed the stream (the generator is cancelled/closed): release its requests

    def chunk(self, rid: str, chat: bool, i: int, delta: str, finish, lps, offsets: list) -> dict:
        """One stream chunk of track i: its text delta, finish reason and its new tokens' logprobs."""
        model, decode = self.state.model_name, self.state.codec.decode
        if chat:
            return protocol.chat_chunk(rid, model, i, {"content": delta} if delta else {}, finish,
                                       protocol.chat_logprobs(lps, decode) if lps else None)
        lp = protocol.completion_logprobs(lps, decode, offsets[i]) if lps else None
        if lp is not None:
            offsets[i] += sum(len(t) for t in lp["tokens"])
        return protocol.completion_chunk(rid, model, i, delta, finish, lp)


def build_app(state: ServerState):
    from fastapi import FastAPI, Request
    from fastapi.responses import PlainTextResponse

    app, handlers = FastAPI(title="dflash-trt"), Handlers(state)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "dflash-trt"}]}

    @app.get("/health")
    async def health():
        return state.loop.metrics.health()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.loop.metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
