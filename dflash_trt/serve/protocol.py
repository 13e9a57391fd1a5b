"""OpenAI request bodies -> (prompts, SamplingParams, options), and the response / chunk / error shapes.

A parameter the server cannot honour is refused by name (400), never silently ignored: penalties, logit_bias,
echo, suffix, best_of != n, tools. Unknown fields are ignored, as OpenAI-compatible servers do.
logprobs: completions take `logprobs: k` (0..20), chat `logprobs: true` with `top_logprobs: k`; the values are the
target's raw distribution (SamplingParams.logprobs), in OpenAI's shapes, streamed chunks carrying their tokens' own.
Non-OpenAI fields accepted as vLLM names them: top_k, min_p, stop_token_ids, ignore_eos, chat_template_kwargs,
add_generation_prompt."""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

from dflash_trt.api.llm import normalize_prompts
from dflash_trt.api.params import ParamError, SamplingParams
from dflash_trt.config import read_json
from dflash_trt.runtime.logprobs import LOGPROBS_MAX

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}


def generation_defaults(model_dir: str) -> dict:
    """Sampling defaults for fields a request leaves out: the checkpoint's generation_config.json (do_sample false:
    greedy), else OpenAI's (temperature 1)."""
    path = os.path.join(model_dir, "generation_config.json")
    cfg = read_json(path) if os.path.isfile(path) else {}
    if cfg.get("do_sample") is False:
        return {"temperature": 0.0, "top_p": 1.0, "top_k": 0}
    return {k: cfg.get(k, v) for k, v in OPENAI_DEFAULTS.items()}


@dataclass(frozen=True)
class Parsed:
    prompts: list  # str or token-id lists (completions) / rendered text (chat)
    params: SamplingParams
    stream: bool
    include_usage: bool


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1),
                          ("logit_bias", None), ("echo", False), ("suffix", None), ("tools", None),
                          ("functions", None)):
        v = body.get(name)
        if v not in (None, neutral) and v != {} and v != []:
            raise ParamError(name, f"{name} is not supported by this server")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise ParamError("response_format", "response_format other than {'type': 'text'} is not supported")


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ParamError(name, f"{name} must be true or false, got {v!r}")
    return v


def _logprobs(body: dict, chat: bool) -> int | None:
    """The k of SamplingParams.logprobs: completions' `logprobs` (an integer), chat's `top_logprobs` under
    `logprobs: true` (0 when only logprobs is set)."""
    if not chat:
        v = body.get("logprobs")
        if isinstance(v, bool):  # a chat-style flag on the completions endpoint
            raise ParamError("logprobs", f"logprobs must be an integer (alternatives per token) here, got {v!r}")
        return v
    top = body.get("top_logprobs")
    if not _bool(body, "logprobs", False):
        if top is not None:
            raise ParamError("top_logprobs", "top_logprobs needs logprobs: true")
        return None
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= LOGPROBS_MAX):
        raise ParamError("top_logprobs", f"top_logprobs must be an integer in [0, {LOGPROBS_MAX}], got {top!r}")
    return 0 if top is None else top


def sampling(body: dict, defaults: dict, max_tokens_default: int | None, chat: bool = False) -> SamplingParams:
    """The body's sampling fields as SamplingParams (missing or null: the defaults); ParamError names a bad one."""
    _refuse_unsupported(body)
    n, best_of = body.get("n"), body.get("best_of")
    if best_of is not None and best_of != (n or 1):
        raise ParamError("best_of", "best_of is not supported (only best_of == n)")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))

    def get(name, default):
        v = body.get(name)
        return default if v is None else v

    top_k = get("top_k", defaults["top_k"])
    return SamplingParams(max_tokens=max_tokens if max_tokens is not None else max_tokens_default,
                          temperature=get("temperature", defaults["temperature"]), top_p=get("top_p", defaults["top_p"]),
                          top_k=0 if top_k == -1 else top_k,  # -1: vLLM's "off"
                          min_p=get("min_p", 0.0), seed=body.get("seed"), stop=body.get("stop"),
                          stop_token_ids=body.get("stop_token_ids"), ignore_eos=_bool(body, "ignore_eos", False),
                          n=get("n", 1), logprobs=_logprobs(body, chat))


def _stream_opts(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ParamError("stream_options", f"stream_options must be an object, got {opts!r}")
    return stream, bool(stream and opts.get("include_usage"))


def parse_completion(body: dict, defaults: dict) -> Parsed:
    prompt = body.get("prompt")
    if prompt is None:
        raise ParamError("prompt", "prompt is required")
    try:
        prompts = normalize_prompts(prompt)
    except TypeError as e:
        raise ParamError("prompt", str(e)) from None
    return Parsed(prompts, sampling(body, defaults, 16), *_stream_opts(body))


def parse_chat(body: dict, defaults: dict) -> tuple[Parsed, dict]:
    """(parsed with no prompts yet, template kwargs); the messages are rendered by the caller's template."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ParamError("messages", "messages must be a non-empty list of {'role', 'content'} objects")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ParamError("chat_template_kwargs", f"chat_template_kwargs must be an object, got {kwargs!r}")
    kwargs = {**kwargs, "add_generation_prompt": _bool(body, "add_generation_prompt", True)}
    return Parsed([], sampling(body, defaults, None, chat=True), *_stream_opts(body)), kwargs


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_lens: list, tracks) -> dict:
    p, c = sum(prompt_lens), sum(len(t.token_ids) for t in tracks)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_logprobs(entries, decode, offset: int = 0) -> dict | None:
    """OpenAI's completions logprobs of runtime.logprobs.TokenLogprob entries (None: not asked); token strings are
    each token decoded alone; text_offset counts from `offset` (a stream's text before these tokens)."""
    if entries is None:
        return None
    tokens = [decode([e.token_id]) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode([i]): lp for i, lp in e.top} for e in entries], "text_offset": offsets}


def chat_logprobs(entries, decode) -> dict | None:
    """OpenAI's chat logprobs ({"content": [...]}) of TokenLogprob entries; None: not asked."""
    if entries is None:
        return None

    def item(tid, lp):
        text = decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, lp) for i, lp in e.top]}
                        for e in entries], "refusal": None}


def _entries(t):
    return t.logprobs if t.params.logprobs is not None else None


def completion_body(rid: str, model: str, tracks, prompt_lens: list, decode) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t.text, "logprobs": completion_logprobs(_entries(t), decode),
                         "finish_reason": t.finish_reason} for i, t in enumerate(tracks)],
            "usage": usage(prompt_lens, tracks)}


def chat_body(rid: str, model: str, tracks, prompt_lens: list, decode) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t.text},
                         "logprobs": chat_logprobs(_entries(t), decode), "finish_reason": t.finish_reason}
                        for i, t in enumerate(tracks)],
            "usage": usage(prompt_lens, tracks)}


def completion_chunk(rid: str, model: str, index: int, text: str, finish: str | None, logprobs=None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None, logprobs=None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
