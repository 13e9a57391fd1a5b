"""The front door's text layer without a model: SamplingParams validation (one line naming the field), the
incremental detokenizer (never part of a multi-byte character; deltas add up to the full decode) on the shipped
byte-level BPE tokenizer, stop strings across token boundaries and what a stream holds back."""
import os

import pytest

from dflash_trt.api.detok import IncrementalDetokenizer, StopStrings
from dflash_trt.api.params import ParamError, SamplingParams, sample_seed
from dflash_trt.runtime.load import ByteCodec, load_codec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = os.path.join(ROOT, "models", "target")


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"), ({"seed": -1}, "seed"),
    ({"stop": ""}, "stop"), ({"stop": ["a", 3]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"), ({"n": 0}, "n"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
])
def test_params_refused_by_name(kwargs, field):
    with pytest.raises(ParamError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field and field in str(e.value) and "\n" not in str(e.value)


def test_params_normalised_and_seeds():
    sp = SamplingParams(stop="END", stop_token_ids=[3, 4], temperature=1, top_k=5, seed=7, n=3)
    assert sp.stop == ("END",) and sp.stop_token_ids == (3, 4) and sp.temperature == 1.0
    seeds = [sp.token_sampling(i).seed for i in range(3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3 and seeds == [sample_seed(7, i) for i in range(3)]
    assert SamplingParams(n=2).token_sampling(1).seed is None
    with pytest.raises(Exception):
        sp.n = 1  # frozen


def _stream(codec, ids):
    d = IncrementalDetokenizer(codec.decode)
    deltas = [d.push(t) for t in ids]
    return deltas, deltas + [d.flush()]


@pytest.mark.parametrize("text", ["def f(x):\n    return x  # naïve 😀 中文 ∑\n", "😀😀 é", "plain ascii"])
def test_detokenizer_never_splits_characters(text):
    for codec in (load_codec(TARGET), ByteCodec()):
        ids = codec.encode(text)
        deltas, all_ = _stream(codec, ids)
        assert "".join(all_) == codec.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    bytes_only = ByteCodec()
    deltas, _ = _stream(bytes_only, list("😀".encode()))
    assert deltas == ["", "", "", "😀"]  # held until its 4th byte


def test_detokenizer_flushes_incomplete_tail():
    codec = ByteCodec()
    deltas, all_ = _stream(codec, list("a😀".encode())[:3])
    assert deltas == ["a", "", ""] and all_[-1] == "\ufffd"


def test_stop_strings_across_tokens():
    s = StopStrings(["STOP", "\n\n"])
    text = ""
    for piece, want in (("ab", None), ("cS", None), ("TO", None), ("Pxx", (3, "STOP"))):
        before = len(text)
        text += piece
        assert s.find(text, before) == want
    assert s.held("abcST") == 2 and s.held("abc\n") == 1 and s.held("abc") == 0
    assert StopStrings(["b\n\nc", "\n\n"]).find("ab\n\nc", 0) == (1, "b\n\nc")  # the earliest match wins
    assert StopStrings([]).held("anything") == 0
