"""OpenAI request bodies -> (prompts, SamplingParams, options), and the response / chunk / error shapes.

A parameter the server cannot honour is refused by name (400), never silently ignored: penalties, logit_bias,
echo, suffix, best_of != n, tools, logprobs. Unknown fields are ignored, as OpenAI-compatible servers do.
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
                          ("top_logprobs", None), ("functions", None)):
        v = body.get(name)
        if v not in (None, neutral) and v != {} and v != []:
            raise ParamError(name, f"{name} is not supported by this server")
    if body.get("logprobs") not in (None, False):
        raise ParamError("logprobs", "logprobs are not supported: the runtime's steps return the emitted tokens, "
                                     "not the target's distribution for each of them")
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


def sampling(body: dict, defaults: dict, max_tokens_default: int | None) -> SamplingParams:
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
                          n=get("n", 1))


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
    return Parsed([], sampling(body, defaults, None), *_stream_opts(body)), kwargs


# ---- responses --------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_lens: list, tracks) -> dict:
    p, c = sum(prompt_lens), sum(len(t.token_ids) for t in tracks)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion_body(rid: str, model: str, tracks, prompt_lens: list) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": t.text, "logprobs": None, "finish_reason": t.finish_reason}
                        for i, t in enumerate(tracks)],
            "usage": usage(prompt_lens, tracks)}


def chat_body(rid: str, model: str, tracks, prompt_lens: list) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "message": {"role": "assistant", "content": t.text}, "logprobs": None,
                         "finish_reason": t.finish_reason} for i, t in enumerate(tracks)],
            "usage": usage(prompt_lens, tracks)}


def completion_chunk(rid: str, model: str, index: int, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_chunk(rid: str, model: str, index: int, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
