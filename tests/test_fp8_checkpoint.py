"""FP8 block-wise checkpoints in Qwen's release layout (float8_e4m3fn `weight` + float32 `weight_scale_inv` per
128x128 block, quantization_config quant_method 'fp8'): loaded exactly, greedy tokens through the torch (CPU) and
ORT backends equal transformers on the same model with every weight replaced by its dequantized value (the W8A16
reference, exact in fp32), DFlash equals plain greedy, and every malformed tensor or field is one line naming it."""
import json
import os
import shutil
from dataclasses import asdict

import onnx
import pytest
import torch
from fp8_helpers import B, dequantize, fp8_checkpoint, quantize, skip_list
from hf_tiny import FP8_DIMS, make_hf_model
from refusal_helpers import refused
from safetensors.torch import load_file, save_file

from dflash_trt.abi import PoolSizes
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.export.checkpoint import CheckpointError, load_target, save_checkpoint
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.quant import Fp8Config
from dflash_trt.runtime.load import load_runtime
from dflash_trt.tools.tiny import tiny_drafter_config, tiny_target_config

SIZES = PoolSizes(kv_blocks=16, page_size=8, max_seq_len=96, max_seqs=2, dkv_blocks=32, prefill_chunk=16)
NEW = 20


def make_drafter(target_dir: str, out: str, seed: int = 0, **over) -> str:
    """A small random fp32 DFlash drafter (block 8) for the target at target_dir."""
    tcfg = json.load(open(os.path.join(target_dir, "config.json")))
    dcfg = tiny_drafter_config(tcfg, block_size=8, **over)
    drafter = Drafter(DrafterConfig.from_dict(dcfg), tcfg["hidden_size"])
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in drafter.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen) if "norm" in n
                    else 0.08 * torch.randn(p.shape, generator=gen))
    save_checkpoint(drafter, dcfg, out)
    return out


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def dense(request, tmp_path_factory):
    """(fp8 dir, oracle HF model, fp8 tensors) of a tiny dense model; Qwen3-Next's in_proj_ba (4 rows: one partial
    block) is quantized too."""
    torch.set_num_threads(1)
    d = tmp_path_factory.mktemp(request.param)
    make_hf_model(request.param, 1, str(d / "hf"), dims=FP8_DIMS)
    fp8 = fp8_checkpoint(str(d / "hf"), str(d / "fp8"), str(d / "ref"), skip_list(4))
    return str(d / "fp8"), oracle(str(d / "ref")), fp8


def oracle(ref_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


PROMPT = torch.randint(0, 251, (30,), generator=torch.Generator().manual_seed(2)).tolist()


def test_loaded_exactly(dense):
    """The FP8 bytes and scales bound as stored; full-sequence logits == the W8A16 oracle's."""
    d, hf, fp8 = dense
    m = load_target(d)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert (m.forward_full(ids)["logits"] - hf(ids).logits).abs().max().item() <= 1e-4
    sd = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): t for n, t in m.state_dict().items()}
    quantized = [k for k, t in fp8.items() if t.dtype == torch.float8_e4m3fn]
    assert any("in_proj_qkv" in k for k in quantized) and not any("in_proj_a" in k for k in quantized)
    for k in quantized:  # the fp8 bytes and scales as stored, never cast
        assert sd[k].dtype == torch.float8_e4m3fn and torch.equal(sd[k].view(torch.uint8), fp8[k].view(torch.uint8))
        assert sd[k + "_scale_inv"].dtype == torch.float32 and torch.equal(sd[k + "_scale_inv"], fp8[k + "_scale_inv"])
    assert not any(t.dtype == torch.float8_e4m3fn for k, t in sd.items() if k not in quantized)


def test_torch_greedy_and_dflash_match_transformers(dense, tmp_path):
    d, hf, _ = dense
    ref = hf_greedy(hf, PROMPT, NEW)
    rt, _ = load_runtime(d, make_drafter(d, str(tmp_path / "drafter")), "torch", sizes=SIZES)
    assert rt.generate(PROMPT, NEW, spec=False)[0] == ref
    assert rt.generate(PROMPT, NEW)[0] == ref  # DFlash: lossless on the FP8 target


def test_ort_greedy_and_dflash_match_transformers(dense, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    d, hf, _ = dense
    ref = hf_greedy(hf, PROMPT, NEW)
    rt, _ = load_runtime(d, make_drafter(d, str(tmp_path / "drafter")), "ort", sizes=SIZES, ks=(1, 8))
    assert rt.generate(PROMPT, NEW, spec=False)[0] == ref
    assert rt.generate(PROMPT, NEW)[0] == ref
    g = onnx.load(rt.backend.manifest.graph_path("target_k1")).graph  # the FP8 bytes are the graph's weights
    fp8 = {i.name for i in g.initializer if i.data_type == onnx.TensorProto.FLOAT8E4M3FN}
    dq = [n for n in g.node if n.op_type == "DequantizeLinear"]
    assert fp8 and len(dq) == len(fp8) and {n.input[0] for n in dq} == fp8
    _check_trt_build(rt.backend.manifest.root)


def _check_trt_build(export_dir):
    """TensorRT-RTX builds the FP8 graph on the CPU for the CCs that have e4m3 (>= 8.9) and refuses an older CC
    naming the graph and a weight."""
    from dflash_trt.engines.build import build_engines
    from dflash_trt.engines.network import BuildError
    from dflash_trt.plugins import trt_compat as C

    if not (C.HAVE_TRT and C.IS_RTX):
        return
    with pytest.raises(BuildError, match=r"target_k1 holds \d+ FP8 weights \(first 'target\.layers\..*drop 8\.6 from"):
        build_engines(export_dir, graphs=["target_k1"], target_cc="86,89", progress=None)
    man = build_engines(export_dir, graphs=["target_k1"], progress=None)
    assert man.data["engine_build"]["compute_capabilities"] == ["8.9", "12.0", "12.1"]
    assert os.path.getsize(os.path.join(export_dir, man.data["engines"]["target_k1"]["file"])) > 0


def test_fused_projections_stack_fp8_groups(dense):
    """fuse_projections (the CUDA step's GEMM fusion) also fuses all-FP8 groups whose scale blocks stack (weights and
    scales as two buffers, the layers' tensors row views of them; state_dict unchanged); same logits on the CPU,
    where each FP8 layer still dequantizes its own rows."""
    from dflash_trt.modeling.fuse import BUFFER, SCALES

    m = load_target(dense[0])
    ids = torch.tensor([PROMPT])
    keys = set(m.state_dict())
    with torch.no_grad():
        before = m.forward_full(ids)["logits"]
        m.fuse_projections()
        after = m.forward_full(ids)["logits"]
    assert torch.equal(before, after) and set(m.state_dict()) == keys
    bufs = dict(m.named_buffers())
    fp8 = [n for n, b in bufs.items() if BUFFER in n and b.dtype == torch.float8_e4m3fn]
    assert fp8 and all(n + SCALES in bufs and bufs[n + SCALES].dtype == torch.float32 for n in fp8)


@pytest.mark.parametrize("kind,backend", [("qwen3_5_moe", "torch"), ("qwen3_next_moe", "torch"), ("qwen3_5_moe", "ort")])
def test_moe_matches_transformers(kind, backend, tmp_path, monkeypatch):
    """Per-expert FP8 weights and scales stacked by the loader; routers and shared-expert gates unquantized."""
    if backend == "ort":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    make_hf_model(kind, 1, str(tmp_path / "hf"), dims=FP8_DIMS)
    fp8_checkpoint(str(tmp_path / "hf"), str(tmp_path / "fp8"), str(tmp_path / "ref"), skip_list(4))
    m = load_target(str(tmp_path / "fp8"))
    assert any(p.dtype == torch.float8_e4m3fn for n, p in m.named_parameters() if "experts.gate_up_proj" in n)
    rt, _ = load_runtime(str(tmp_path / "fp8"), None, backend, sizes=SIZES, ks=(1,))
    assert rt.generate(PROMPT, NEW, spec=False)[0] == hf_greedy(oracle(str(tmp_path / "ref")), PROMPT, NEW)


W = "model.layers.0.mlp.gate_proj.weight"  # an FP8 projection
A = "model.layers.0.linear_attn.in_proj_a.weight"  # kept unquantized by the skip list


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    make_hf_model("qwen3_5", 1, str(d / "hf"), dims=FP8_DIMS)
    fp8_checkpoint(str(d / "hf"), str(d / "fp8"), str(d / "ref"), skip_list(4))
    return str(d / "fp8")


def altered(src, dst, weights=None, quant=None):
    """A copy of checkpoint `src` at `dst`, its tensors changed by weights(dict) and its quantization_config by
    quant(dict) (in place)."""
    dst = str(dst)
    shutil.copytree(src, dst)
    p, c = os.path.join(dst, "model.safetensors"), os.path.join(dst, "config.json")
    if weights:
        w = load_file(p)
        weights(w)
        save_file(w, p)
    if quant:
        cfg = json.load(open(c))
        quant(cfg["quantization_config"])
        json.dump(cfg, open(c, "w"))
    return dst


def _set_byte(w, key, value):
    t = w[key].view(torch.uint8).clone()
    t[0, 0] = value
    w[key] = t.view(torch.float8_e4m3fn)


def _fp8_a(w, scale=True):
    w[A], s = quantize(w[A])
    if scale:
        w[A + "_scale_inv"] = s


@pytest.mark.parametrize("weights,names", [
    (lambda w: w.pop(W + "_scale_inv"), ["missing tensor", W + "_scale_inv"]),
    (lambda w: w.update({W + "_scale_inv": torch.ones(1, 1)}), [W + "_scale_inv", "has shape (1, 1), expected (2, 1)"]),
    (lambda w: w.update({"model.layers.0.mlp.nope.weight_scale_inv": torch.ones(1, 1)}),
     ["model.layers.0.mlp.nope.weight_scale_inv", "without its weight"]),
    (lambda w: w[W + "_scale_inv"].__setitem__((0, 0), float("nan")), [W + "_scale_inv", "non-finite or non-positive"]),
    (lambda w: w[W + "_scale_inv"].__setitem__((1, 0), 0.0), [W + "_scale_inv", "non-finite or non-positive"]),
    (lambda w: w.update({W + "_scale_inv": w[W + "_scale_inv"].bfloat16()}), [W + "_scale_inv", "bfloat16"]),
    (lambda w: _set_byte(w, W, 0x7F), [W, "NaN"]),
    (lambda w: _set_byte(w, W, 0xFF), [W, "NaN"]),
    (lambda w: w.update({W: w[W].float()}), [W, "float32", "makes this module FP8"]),
    (_fp8_a, [A + "_scale_inv", f"FP8 scale of '{A}'", "skip list"]),
    (lambda w: _fp8_a(w, scale=False), [A, "float8_e4m3fn", "skip list"]),
], ids=["no-scale", "scale-shape", "orphan-scale", "nan-scale", "zero-scale", "bf16-scale", "nan-fp8", "neg-nan-fp8",
        "unquantized", "skipped-fp8", "skipped-fp8-no-scale"])
def test_tensor_refusals(base, tmp_path, weights, names):
    refused(lambda: load_target(altered(base, tmp_path / "t", weights)), CheckpointError, *names)


@pytest.mark.parametrize("quant,names", [
    (lambda q: q.update(quant_method="awq"), ["'quantization_config'", "'awq'"]),
    (lambda q: q.update(quant_method="modelopt"), ["'quantization_config'", "'modelopt'"]),
    (lambda q: q.update(fmt="e5m2"), ["'quantization_config.fmt'", "'e5m2'"]),
    (lambda q: q.update(weight_block_size=[64, 64]), ["'quantization_config.weight_block_size'", "[64, 64]"]),
    (lambda q: q.update(activation_scheme="static"), ["'quantization_config.activation_scheme'", "'static'"]),
    (lambda q: q.update(bits=8), ["'quantization_config.bits'"]),
    (lambda q: q.update(ignored_layers=["lm_head"]), ["modules_to_not_convert", "ignored_layers", "both"]),
    (lambda q: q.update(modules_to_not_convert="lm_head"), ["'quantization_config.modules_to_not_convert'"]),
    (lambda q: q.update(scale_fmt="ue8m0"), ["'quantization_config.scale_fmt'", "'ue8m0'"]),
], ids=["awq", "modelopt", "fmt", "block", "static", "unknown-key", "two-skip-lists", "skip-not-list", "ue8m0"])
def test_config_refusals(base, tmp_path, quant, names):
    refused(lambda: load_target(altered(base, tmp_path / "t", quant=quant)), ConfigError, *names)


def test_ignored_layers_spelling_and_fp8_drafter(base, tmp_path):
    """ignored_layers is transformers' other spelling of the skip list; an FP8 drafter is refused by name."""
    d = altered(base, tmp_path / "t", quant=lambda q: q.update(ignored_layers=q.pop("modules_to_not_convert")))
    assert torch.equal(load_target(d).layers[0].mlp.gate_proj.weight_scale_inv,
                       load_target(base).layers[0].mlp.gate_proj.weight_scale_inv)
    dcfg = tiny_drafter_config(json.load(open(os.path.join(base, "config.json"))))
    refused(lambda: DrafterConfig.from_dict(dict(dcfg, quantization_config={"quant_method": "fp8"})), ConfigError,
            "'quantization_config'", "'fp8'")


def test_skip_list_matching_follows_transformers():
    """Prefix up to a module boundary, regex with the same boundary, or suffix (should_convert_module); the
    parsed config survives the manifest's JSON round trip."""
    q = Fp8Config(skip=("model.layers.1", r"model\.layers\.2\..*\.in_proj_z", "o_proj"))
    assert not q.converts("model.layers.1.mlp.gate_proj") and q.converts("model.layers.11.mlp.gate_proj")
    assert not q.converts("model.layers.2.linear_attn.in_proj_z") and q.converts("model.layers.3.linear_attn.in_proj_z")
    assert not q.converts("model.layers.5.self_attn.o_proj") and q.converts("model.layers.5.self_attn.q_proj")
    cfg = TargetConfig.from_dict(dict(tiny_target_config(), quantization_config={"quant_method": "fp8",
                                                                                   "ignored_layers": ["lm_head"]}))
    assert cfg.quant == Fp8Config(skip=("lm_head",))
    assert TargetConfig(**json.loads(json.dumps(asdict(cfg)))).quant == cfg.quant  # as a manifest stores it


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (4, 128), (3, 130, 70)])
def test_dequantize_blockwise_is_the_reference(shape):
    """modeling/fp8.dequantize_blockwise == the fully expanded product, bit for bit (partial blocks on both axes,
    stacked experts)."""
    from dflash_trt.modeling.fp8 import dequantize_blockwise

    q, s = quantize(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(dequantize_blockwise(q, s, (B, B)), dequantize(q, s))


def test_multimodal_layout(base, tmp_path):
    """Multimodal releases: the text decoder under model.language_model., quantization_config at top level with
    the skip list in those names; FP8 vision and mtp tensors are ignored by name like the others."""
    mm = tmp_path / "mm"
    mm.mkdir()
    cfg = json.load(open(os.path.join(base, "config.json")))
    q = cfg.pop("quantization_config")
    q["modules_to_not_convert"] = [s.replace("model.", "model.language_model.", 1) for s in q["modules_to_not_convert"]]
    json.dump({"model_type": "qwen3_5", "text_config": cfg, "quantization_config": q}, open(mm / "config.json", "w"))
    w = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
         for k, v in load_file(os.path.join(base, "model.safetensors")).items()}
    for extra in ("model.visual.blocks.0.attn.qkv.weight", "mtp.layers.0.mlp.gate_proj.weight"):
        w[extra], w[extra + "_scale_inv"] = quantize(torch.randn(128, 128))
    save_file(w, str(mm / "model.safetensors"))
    ours, ref = load_target(str(mm)).state_dict(), load_target(base).state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k].view(torch.uint8), ref[k].view(torch.uint8)) if ref[k].dtype == torch.float8_e4m3fn
               else torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.gpu
def test_cuda_greedy_and_dflash_match_transformers(dense, tmp_path):
    """The FP8 target on the GPU: float32 tokens == the CPU backend's (which the tests above hold to the W8A16 oracle;
    transformers itself cannot be the oracle here, as with fla installed it sends CPU tensors to Triton kernels);
    bfloat16 DFlash == bfloat16 plain greedy, alone and as a batch of three (its verify of 3 x block_size rows runs
    the W8A16 kernel in 16-row slices, so each row gets a plain decode's sums)."""
    d, _, _ = dense
    drafter = make_drafter(d, str(tmp_path / "drafter"), head_dim=64)  # a head dim the CUDA attention kernel takes
    ref = load_runtime(d, drafter, "torch", sizes=SIZES)[0].generate(PROMPT, NEW, spec=False)[0]
    rt, _ = load_runtime(d, drafter, "torch", sizes=SIZES, device="cuda", dtype="float32", compile_steps=False)
    assert rt.generate(PROMPT, NEW, spec=False)[0] == ref
    assert rt.generate(PROMPT, NEW)[0] == ref
    three = PoolSizes(kv_blocks=48, page_size=8, max_seq_len=96, max_seqs=3, dkv_blocks=64, prefill_chunk=16)
    rt, _ = load_runtime(d, drafter, "torch", sizes=three, device="cuda", dtype="bfloat16", compile_steps=False)
    assert rt.generate(PROMPT, NEW)[0] == rt.generate(PROMPT, NEW, spec=False)[0]
    prompts = [PROMPT, PROMPT[::-1], PROMPT[1:] + PROMPT[:1]]
    reqs = [rt.add_request(p, NEW, gamma=rt.dcfg.block_size - 1) for p in prompts]
    while rt.scheduler.has_work:
        rt.step()
    assert [r.tokens for r in reqs] == [rt.generate(p, NEW, spec=False)[0] for p in prompts]
