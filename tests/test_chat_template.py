"""Chat templates rendered as transformers renders them: a Qwen3.5-style template (tests/data, no download) and the
shipped pair's own template, through dflash_trt.api.chat and through transformers' apply_chat_template (the
external oracle) on the shipped tokenizer; with and without enable_thinking, no tools."""
import os

import pytest

from dflash_trt.api.chat import ChatTemplate, ChatTemplateError, find_template, special_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "target")
QWEN = os.path.join(ROOT, "tests", "data", "qwen35_chat_template.jinja")

CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "<think>\nthe user greets\n</think>\n\nHello."},
     {"role": "user", "content": [{"type": "text", "text": "sum "}, {"type": "text", "text": "1..10 — ünïcode"}]}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "r2"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(TARGET, "tokenizer.json"),
                                                eos_token="<|endoftext|>", mask_token="<|mask|>")


def _qwen():
    with open(QWEN, encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_qwen_template_matches_transformers(hf_tokenizer, conv, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = CONVERSATIONS[conv]
    ours = ChatTemplate(_qwen(), special_tokens(TARGET)).render(messages, add_generation_prompt=True, **kwargs)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=_qwen(), tokenize=False,
                                              add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert ours.endswith("<think>\n\n</think>\n\n" if thinking is False else "<|im_start|>assistant\n<think>\n")


def test_qwen_template_without_generation_prompt(hf_tokenizer):
    messages = CONVERSATIONS[2]
    ours = ChatTemplate(_qwen()).render(messages, add_generation_prompt=False)
    theirs = hf_tokenizer.apply_chat_template(messages, chat_template=_qwen(), tokenize=False)
    assert ours == theirs and "<think>\nr2\n</think>" in ours and "r1" not in ours


@pytest.mark.parametrize("thinking", [None, False])
def test_shipped_template_matches_transformers(hf_tokenizer, thinking):
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    source = find_template(TARGET)
    assert source is not None and os.path.isfile(os.path.join(TARGET, "chat_template.jinja"))
    for messages in CONVERSATIONS[:2]:
        ours = ChatTemplate.from_checkpoint(TARGET).render(messages, **kwargs)
        theirs = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False,
                                                  add_generation_prompt=True, **kwargs)
        assert ours == theirs


def test_shipped_template_is_the_training_constant():
    from dflash_trt.tools.train.configs import CHAT_TEMPLATE

    assert find_template(TARGET) == CHAT_TEMPLATE


def test_unknown_role_refused_like_transformers(hf_tokenizer):
    messages = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="Unexpected message role: robot"):
        hf_tokenizer.apply_chat_template(messages, chat_template=_qwen(), tokenize=False)
    with pytest.raises(ChatTemplateError, match="Unexpected message role: robot"):
        ChatTemplate(_qwen()).render(messages)


def test_template_helpers_and_refusals():
    t = ChatTemplate("{{ messages | tojson }}{{ eos_token }}{% if x is defined %}{{ raise_exception('no ' ~ x) }}"
                     "{% endif %}", {"eos_token": "<E>"})
    out = t.render([{"role": "user", "content": "<é>", "name": None}])
    assert out == '[{"role": "user", "content": "<é>"}]<E>'  # no HTML escaping, None-valued keys dropped
    with pytest.raises(ChatTemplateError, match="no thanks"):
        t.render([{"role": "user", "content": "x"}], x="thanks")
    with pytest.raises(ChatTemplateError, match="non-empty list"):
        t.render([])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    assert ChatTemplate("{{ messages[0].content.__class__ }}").render([{"role": "user", "content": "x"}]) == ""
    with pytest.raises(ChatTemplateError, match="unsafe|not safe|immutable"):  # the immutable sandbox
        ChatTemplate("{% set _ = messages.append(1) %}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_checkpoint(os.path.join(ROOT, "models", "drafter"))
