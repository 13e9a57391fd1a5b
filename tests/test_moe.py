"""Sparse-MoE targets (CPU checks): transformers oracle for Qwen3-Next with mixed dense/sparse layers
and the Qwen3.5-MoE text model, both weight layouts, lossless spec on torch and ORT, bad expert tensors."""
import os
import shutil

import numpy as np
import pytest
import torch
from hf_tiny import cached_greedy_vs_hf, hf_greedy, hf_prompt, make_hf_model
from safetensors.torch import load_file, save_file
from spec_helpers import ScriptedDrafter

from dflash_trt.abi import PoolSizes
from dflash_trt.config import DrafterConfig, read_json
from dflash_trt.export.checkpoint import CheckpointError, load_drafter, load_target, save_checkpoint
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.modeling.mlp import SparseMoE
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import TINY_MOE, make_tiny_pair, tiny_drafter_config

KINDS = ["qwen3_next_moe", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=KINDS)
def hf_pair(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    return make_hf_model(request.param, 2, d), d


def logits(model, ids):
    with torch.no_grad():
        return model.forward_full(ids)["logits"]


def test_layers_are_sparse_where_the_config_says(hf_pair):
    hf, d = hf_pair
    ours = load_target(d)
    want = [type(layer.mlp).__name__ == "Qwen3NextSparseMoeBlock" or "SparseMoe" in type(layer.mlp).__name__
            for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoE) for layer in ours.layers] == want
    assert any(want) and (all(want) if ours.cfg.model_type == "qwen3_5_moe_text" else not all(want))


def test_logits_match_transformers(hf_pair):
    hf, d = hf_pair
    ours = load_target(d)
    ids = torch.randint(0, hf.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    diff = (logits(ours, ids) - ref).abs().max().item()
    print(f"{ours.cfg.model_type}: max-abs logits {diff:.3g}")
    assert diff <= 1e-4, diff
    # the training path runs the same MLP modules
    with torch.no_grad():
        assert (ours.forward_train(ids)["logits"] - ref).abs().max().item() <= 1e-4
    # the check can fail: routing without renormalisation is visibly different
    for layer in ours.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.norm_topk_prob = False
    assert (logits(ours, ids) - ref).abs().max().item() > 1e-3


def test_cached_greedy_matches_transformers(hf_pair):
    """Prefill chunks of 16 + K=1 cached steps through the Runtime == HF greedy recomputed on the full sequence."""
    new, ref, rt = cached_greedy_vs_hf(*hf_pair, 20)
    assert new == ref


def test_fused_expert_layout_loads(hf_pair, tmp_path):
    """The fused 3-D layout (HF's in-memory names: experts.gate_up_proj / experts.down_proj) == per-expert."""
    hf, d = hf_pair
    out = str(tmp_path / "fused")
    shutil.copytree(d, out)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, os.path.join(out, "model.safetensors"))
    keys = load_file(os.path.join(out, "model.safetensors")).keys()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    assert not any(".experts.0." in k for k in keys)
    ids = torch.randint(0, 251, (1, 24))
    assert torch.equal(logits(load_target(out), ids), logits(load_target(d), ids))


def _edit(d, tmp_path, fn):
    out = str(tmp_path / "bad")
    shutil.copytree(d, out)
    p = os.path.join(out, "model.safetensors")
    w = load_file(p)
    fn(w)
    save_file(w, p)
    return out, p


def test_missing_expert_tensor_named(hf_pair, tmp_path):
    hf, d = hf_pair
    i = next(i for i, layer in enumerate(hf.model.layers) if "Sparse" in type(layer.mlp).__name__)
    key = f"model.layers.{i}.mlp.experts.4.up_proj.weight"
    out, p = _edit(d, tmp_path, lambda w: w.pop(key))
    with pytest.raises(CheckpointError, match=rf"{p}: missing tensor '{key}'"):
        load_target(out)


def test_misshaped_expert_tensor_named(hf_pair, tmp_path):
    hf, d = hf_pair
    i = next(i for i, layer in enumerate(hf.model.layers) if "Sparse" in type(layer.mlp).__name__)
    key = f"model.layers.{i}.mlp.experts.2.down_proj.weight"
    out, p = _edit(d, tmp_path, lambda w: w.__setitem__(key, torch.zeros(64, 23)))
    with pytest.raises(CheckpointError, match=rf"{p}: tensor '{key}' has shape \(64, 23\), expected \(64, 24\)"):
        load_target(out)
    fkey = f"model.layers.{i}.mlp.experts.gate_up_proj"  # fused layout, wrong expert count
    out2 = str(tmp_path / "bad2")
    shutil.copytree(d, out2)
    save_file({**{k: v.contiguous() for k, v in hf.state_dict().items()}, fkey: torch.zeros(5, 48, 64)},
              os.path.join(out2, "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"tensor '{fkey}' has shape \(5, 48, 64\), expected \(6, 48, 64\)"):
        load_target(out2)


# ---- lossless speculative decoding on an MoE target (tools/tiny.py pair with TINY_MOE) ----

SIZES = PoolSizes(kv_blocks=64, page_size=4, max_seq_len=256, max_seqs=2, dkv_blocks=64, ctx_window=12,
                  prefill_chunk=16)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("moepair"))
    tdir, ddir = make_tiny_pair(d, seed=5, target_over=dict(TINY_MOE))
    target = load_target(tdir)
    assert target.cfg.moe_layers == [0, 2, 3]
    return tdir, ddir, target, load_drafter(ddir, target)


@pytest.mark.parametrize("gamma", [1, 3, 15, "auto"])
def test_lossless_spec_on_torch(moe_pair, gamma):
    _, _, target, drafter = moe_pair
    prompt = list(np.random.default_rng(0).integers(0, 250, 23))
    plain, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES).generate(prompt, 48, spec=False)
    be = ScriptedDrafter(TorchBackend(target, drafter), list(prompt) + plain, target.cfg.vocab_size,
                         lambda s, g: (s * 7) % (g + 1))
    out, st = Runtime(be, target.cfg, drafter.cfg, SIZES).generate(prompt, 48, gamma=gamma)
    assert st.spec_steps > 0 and out == plain


def test_auto_spec_matches_transformers(hf_pair, tmp_path):
    """gamma auto (the width chosen per step) on each sparse-MoE target == transformers' greedy: the drafter proposes
    HF's own greedy tokens for a varying number of drafts, then wrong ones, so some steps accept and some do not."""
    hf, d = hf_pair
    prompt, n_new = hf_prompt(hf), 24
    ref = hf_greedy(hf, prompt, n_new)
    target, dcfg = load_target(d), tiny_drafter_config(read_json(os.path.join(d, "config.json")), block_size=8)
    save_checkpoint(Drafter(DrafterConfig.from_dict(dcfg), target.cfg.hidden_size), dcfg, str(tmp_path))
    drafter = load_drafter(str(tmp_path), target)  # its taps wired into the target
    be = ScriptedDrafter(TorchBackend(target, drafter), prompt + ref, target.cfg.vocab_size,
                         lambda s, g: (s * 5) % (g + 1))
    out, st = Runtime(be, target.cfg, drafter.cfg, SIZES).generate(prompt, n_new)
    assert out == ref and st.spec_steps > 0


def test_ort_graphs_and_lossless_on_ort(moe_pair, tmp_path):
    """The exported MoE target graphs (each sparse block's experts one dflash::MoeExperts node, run by ORT through
    its function body) on ORT == torch (fp32 <= 1e-4) on random valid inputs, and plain / spec decoding on ORT ==
    torch plain greedy."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from test_onnx_export import random_feeds

    from dflash_trt.export.onnx_export import export_graphs
    from dflash_trt.runtime.backends import make_backend

    tdir, ddir, target, drafter = moe_pair
    sizes = PoolSizes(**{**SIZES.__dict__, "max_seqs": 4})  # random_feeds uses slots 1 and 3
    out = str(tmp_path / "export")
    export_graphs(tdir, ddir, out, (1, 4), sizes, progress=None)
    ort, tb = make_backend("ort", manifest=out), TorchBackend(target, drafter, want_logits=True)
    import onnx

    moe_layers = sum(isinstance(layer.mlp, SparseMoE) for layer in target.layers)
    for graph in ("target_k4", "target_prefill"):
        m = onnx.load(ort.manifest.graph_path(graph), load_external_data=False)
        assert sum(n.op_type == "MoeExperts" and n.domain == "dflash" for n in m.graph.node) == moe_layers
        assert "MoeExperts" in {f.name for f in m.functions}
    for graph in ("target_k4", "target_prefill"):
        feeds = random_feeds(ort.manifest, graph)
        got, ref = ort.run(graph, feeds), tb.run(graph, feeds)
        assert sorted(got) == sorted(ref)
        for name, r in ref.items():
            if np.issubdtype(r.dtype, np.integer):
                np.testing.assert_array_equal(got[name], r, err_msg=f"{graph}/{name}")
            else:
                np.testing.assert_allclose(got[name], r, atol=1e-4, rtol=1e-4, err_msg=f"{graph}/{name}")
    prompt = list(np.random.default_rng(0).integers(0, 250, 23))
    plain, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, sizes).generate(prompt, 32, spec=False)
    assert Runtime(ort, target.cfg, drafter.cfg, sizes).generate(prompt, 32, spec=False)[0] == plain
    be = ScriptedDrafter(ort, list(prompt) + plain, target.cfg.vocab_size, lambda s, g: (s * 7) % (g + 1))
    spec, st = Runtime(be, target.cfg, drafter.cfg, sizes).generate(prompt, 32, gamma=3)
    assert st.spec_steps > 0 and spec == plain
    auto = Runtime(be, target.cfg, drafter.cfg, sizes)
    assert auto.verify_widths() == [1, 4]  # auto chooses among the exported widths
    assert auto.generate(prompt, 32)[0] == plain


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [3, 15])
def test_gpu_lossless_moe_target(tmp_path, gamma):
    """fp32 on the GPU (CudaDevice, one CUDA graph per step): an MoE target's plain and DFlash tokens == the CPU
    reference's plain greedy (the routing runs inside the captured graph)."""
    from dflash_trt import load_runtime
    from dflash_trt.tools.tiny import KERNEL_SHAPES

    dirs = make_tiny_pair(str(tmp_path), seed=5, target_over=dict(TINY_MOE, **KERNEL_SHAPES["target_over"]),
                          drafter_over=KERNEL_SHAPES["drafter_over"])
    cpu, _ = load_runtime(*dirs, sizes=SIZES)
    gpu, _ = load_runtime(*dirs, sizes=SIZES, device="cuda", compile_steps=False)
    prompt = list(np.random.default_rng(0).integers(0, 250, 23))
    plain, _ = cpu.generate(prompt, 48, spec=False)
    assert gpu.generate(prompt, 48, spec=False)[0] == plain
    spec, st = gpu.generate(prompt, 48, gamma=gamma)
    assert st.spec_steps > 0 and spec == plain
