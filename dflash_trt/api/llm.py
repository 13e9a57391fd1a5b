"""`LLM`: generation on strings over one Runtime. All prompts (and their n samples) of a call go through the
runtime's continuous batching together (add_request, then step() until every completion ends), so a call with many
prompts runs them batched, not one after another."""
from __future__ import annotations

import dataclasses
import numbers
import secrets

from dflash_trt.abi import verify_widths
from dflash_trt.api.chat import ChatTemplate, ChatTemplateError
from dflash_trt.api.engine import Engine, Track
from dflash_trt.api.outputs import CompletionOutput, RequestOutput
from dflash_trt.api.params import SamplingParams
from dflash_trt.runtime.load import drafter_block_size, load_runtime
from dflash_trt.runtime.sampling import SEED_BITS


def _is_ids(x) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in x)


def normalize_prompts(prompts) -> list:
    """str | list[str] | token ids | list of token-id lists -> a list of str or token-id lists."""
    if isinstance(prompts, str) or _is_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) or _is_ids(p) for p in prompts):
        return list(prompts)
    raise TypeError("prompts must be a string, a list of strings, a list of token ids or a list of token-id lists "
                    "(none empty)")


class LLM:
    """A target (+ DFlash drafter) checkpoint ready to complete text.

    model / drafter: checkpoint directories; backend "torch" | "ort" | "trt", device, dtype, sizes (PoolSizes),
    step_costs, compile_steps, drafter_fp8: as for `load_runtime` (on a GPU the torch backend compiles its steps
    and takes the checkpoint's dtype unless told otherwise). gamma: drafts per speculative step, or None / "auto" (default): chosen per step
    for the most tokens per second (runtime/draft_length.py); spec=False: plain decoding. chat_template: Jinja source
    overriding the checkpoint's own.
    tensor_parallel_size N > 1 (torch backend): the target split over N processes (runtime/parallel). Called in one
    process, the LLM starts N ranks (gloo on CPU, NCCL on CUDA: one GPU each) that each hold an LLM on their shard
    and run every generate / chat call alike, rank 0's outputs coming back; close() stops them. Called on each rank
    of an initialised torch.distributed group of N (a torchrun-style launch), it loads this rank's shard."""

    def __init__(self, model: str, drafter: str | None = None, backend: str = "torch", device: str = "cpu",
                 dtype: str | None = None, sizes=None, gamma: int | str | None = None, spec: bool = True,
                 step_costs=None, compile_steps: bool = True, chat_template: str | None = None,
                 engines: str | None = None, tensor_parallel_size: int = 1, drafter_fp8: bool | None = None):
        self.model_dir, self._ranks = model, None
        self._template = ChatTemplate(chat_template) if chat_template is not None else None
        self._next_id = 0
        if tensor_parallel_size != 1 and not _in_process_group():
            self.runtime, self.engine = None, None  # on the ranks
            self._ranks = _start_ranks(dict(
                model=model, drafter=drafter, backend=backend, device=device, dtype=dtype, sizes=sizes, gamma=gamma,
                spec=spec, step_costs=step_costs, compile_steps=compile_steps, chat_template=chat_template,
                engines=engines, tensor_parallel_size=tensor_parallel_size, drafter_fp8=drafter_fp8))
            return
        # the graphs an ort / trt run needs
        ks = verify_widths(gamma, drafter_block_size(drafter), spec, user_export=engines is not None)
        self.runtime, self.codec = load_runtime(model, drafter, backend, sizes=sizes, step_costs=step_costs, ks=ks,
                                                device=device, dtype=dtype, compile_steps=compile_steps,
                                                export_dir=engines, tensor_parallel_size=tensor_parallel_size,
                                                drafter_fp8=drafter_fp8)
        self.engine = Engine(self.runtime, self.codec, gamma=gamma, spec=spec)

    def close(self) -> None:
        """Stop the ranks of a tensor-parallel LLM started here (nothing to do otherwise)."""
        if self._ranks is not None:
            self._ranks.close()

    @property
    def chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_checkpoint(self.model_dir)
        return self._template

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None) -> list[RequestOutput]:
        """Complete each prompt; sampling_params: one for all prompts or one per prompt (default SamplingParams()).
        Bad input raises before anything runs; a completion that fails (a step fault) raises its error once the
        others ended. Slots and pages are back when this returns, also when it raises."""
        if self._ranks is not None:
            return self._ranks.call("generate", prompts, seeded(sampling_params))
        items = normalize_prompts(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("sampling_params must be dflash_trt.SamplingParams (one, or one per prompt)")
        encoded = [self.codec.encode(p) if isinstance(p, str) else [int(i) for i in p] for p in items]
        return self._run(items, encoded, params)

    def chat(self, messages, sampling_params: SamplingParams | list | None = None, *,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools=None) -> list[RequestOutput]:
        """Complete one conversation (a list of {"role", "content"} dicts) or a list of them through the checkpoint's
        chat template; chat_template_kwargs (e.g. {"enable_thinking": False}) reach the template."""
        if self._ranks is not None:
            return self._ranks.call("chat", messages, seeded(sampling_params), add_generation_prompt=add_generation_prompt,
                                    chat_template_kwargs=chat_template_kwargs, tools=tools)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ChatTemplateError("messages must be a conversation (a non-empty list of message dicts) or a list "
                                    "of them")
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        texts = [self.render_chat(c, add_generation_prompt=add_generation_prompt, tools=tools,
                                  **(chat_template_kwargs or {})) for c in convs]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(texts)
        if len(params) != len(texts):
            raise ValueError(f"{len(params)} sampling_params for {len(texts)} conversations")
        encoded = [self.codec.encode(t, add_special_tokens=False) for t in texts]
        return self._run(texts, encoded, params)

    def render_chat(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """The conversation as the prompt text the model sees."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)

    def _run(self, items, encoded, params) -> list[RequestOutput]:
        eng = self.engine
        per_prompt: list[list[Track]] = []
        try:
            for ids, sp in zip(encoded, params):
                per_prompt.append([])
                for j in range(sp.n):
                    per_prompt[-1].append(eng.add(ids, sp, j))
            while eng.has_work:
                eng.step()
        finally:
            for t in list(eng.live):  # only after an exception (bad input part-way, KeyboardInterrupt)
                eng.abort(t)
            if self.runtime.scheduler is not None:
                self.runtime.scheduler.drain()
        failed = next((t for ts in per_prompt for t in ts if t.error is not None), None)
        if failed is not None:
            raise failed.error
        outs = []
        for item, ids, tracks in zip(items, encoded, per_prompt):
            comps = tuple(CompletionOutput(t.index, t.text, tuple(t.token_ids), t.finish_reason, t.stop_reason,
                                           t.tau, t.req.steps,
                                           tuple(t.logprobs) if t.params.logprobs is not None else None)
                          for t in tracks)
            outs.append(RequestOutput(self._next_id, item if isinstance(item, str) else None, tuple(ids), comps,
                                      min(t.first_token_s or 0.0 for t in tracks), max(t.seconds for t in tracks)))
            self._next_id += 1
        return outs


def _in_process_group() -> bool:
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def seeded(params):
    """params with every unseeded sampling request seeded here, once for all ranks: ranks drawing their own fresh
    seeds would pick different tokens, and their steps (and collectives) would part."""
    many = isinstance(params, (list, tuple))
    out = [p if not isinstance(p, SamplingParams) or p.seed is not None or p.temperature == 0
           else dataclasses.replace(p, seed=secrets.randbits(SEED_BITS)) for p in (params if many else [params])]
    return out if many else out[0]


def _start_ranks(kwargs: dict):
    """A RankPool of tensor_parallel_size ranks, each holding LLM(**kwargs) on its shard; what every rank would
    refuse (backend, checkpoint directory, sizes that do not divide) is refused here first."""
    from dflash_trt.runtime.load import check_checkpoint_dir, check_tensor_parallel
    from dflash_trt.runtime.parallel.launch import RankPool, backend_for
    from dflash_trt.runtime.parallel.shard import check_checkpoint_shardable

    world = kwargs["tensor_parallel_size"]
    check_tensor_parallel(world, kwargs["backend"])
    check_checkpoint_dir(kwargs["model"], "target checkpoint")
    check_checkpoint_shardable(kwargs["model"], world)
    return RankPool(world, _rank_llm, (kwargs,), backend=backend_for(kwargs["device"]))


def _rank_llm(kwargs: dict) -> LLM:
    return LLM(**kwargs)
