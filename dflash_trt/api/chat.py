"""Chat templates as transformers renders them: the checkpoint's own Jinja template (chat_template.jinja, else
tokenizer_config.json's chat_template) in jinja2's ImmutableSandboxedEnvironment with transformers' settings
(trim_blocks, lstrip_blocks, loop controls, a `generation` block tag) and helpers (tojson without HTML escaping,
raise_exception, strftime_now, a guarded dict and namespace), the tokenizer's named special tokens and the caller's
kwargs (add_generation_prompt, enable_thinking, ...) passed through. Messages reach the template as plain JSON data
(keys whose value is None dropped, reasoning_content aliased), so a template can see nothing else."""
from __future__ import annotations

import json
import os
from datetime import datetime

from dflash_trt.config import read_json

TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """No chat template in the checkpoint, a template that does not compile, or one that refuses the messages
    (its raise_exception)."""


def find_template(model_dir: str) -> str | None:
    """The checkpoint's default chat template: chat_template.jinja first (as transformers prefers it), else
    tokenizer_config.json's chat_template (a string, or a list of {name, template}: the one named "default")."""
    path = os.path.join(model_dir, TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    tpl = read_json(cfg_path).get("chat_template") if os.path.isfile(cfg_path) else None
    if isinstance(tpl, list):
        tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
    return tpl if isinstance(tpl, str) else None


def special_tokens(model_dir: str) -> dict:
    """The tokenizer's named special tokens (bos_token, eos_token, ...) as strings: the template sees them."""
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    cfg = read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    out = {}
    for name in SPECIAL_TOKENS:
        v = cfg.get(name)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[name] = v
    return out


def plain(value):
    """value rebuilt from JSON types only (a template must not reach methods of caller objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (str enums, ...) lose their extra methods
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    raise ChatTemplateError(f"chat messages hold JSON data only, got a {type(value).__name__}")


def _messages(messages) -> list:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatTemplateError(f"each message must be a dict with a string 'role', got {m!r}")
        m = {k: v for k, v in plain(m).items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _environment():
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers of training templates) renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja's namespace without underscore names (no way to CPython internals)."""
        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, specials: dict | None = None):
        import jinja2

        try:
            self.template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        self.specials = dict(specials or {})

    @classmethod
    def from_checkpoint(cls, model_dir: str) -> "ChatTemplate":
        source = find_template(model_dir)
        if source is None:
            raise ChatTemplateError(f"{model_dir} has no chat template ({TEMPLATE_FILE} or tokenizer_config.json "
                                    f"chat_template); pass chat_template= or use generate() with plain prompts")
        return cls(source, special_tokens(model_dir))

    def render(self, messages, add_generation_prompt: bool = True, tools=None, documents=None, **kwargs) -> str:
        """The conversation as text; kwargs (enable_thinking, ...) reach the template, over the special tokens."""
        import jinja2

        try:
            return self.template.render(messages=_messages(messages), tools=plain(tools), documents=plain(documents),
                                        add_generation_prompt=add_generation_prompt,
                                        **plain({**self.specials, **kwargs}))
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template: {e}") from None
