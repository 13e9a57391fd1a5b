"""DFlash2 drafters against z-lab's reference (`dflash` 0.1.0: DFlash2DraftModel, dflash_generate): a reference
drafter with random weights trained a few steps on a tiny transformers target and saved with save_pretrained
loads here; its block logits and selector scores agree within fp32 noise, and greedy decoding emits the
reference's tokens with the same accepted-draft count at every step, on torch and on the exported ONNX graphs
(whose drafter_block TensorRT builds, where installed). Config parsing and checkpoint key names without the
oracle. Sampling with a DFlash2 drafter: tests/test_sampling_runtime.py."""
import json
import os
import shutil
import time

import pytest
import torch
from dflash2_ref import BS, DFLASH2, VOCAB, dflash_model, greedy_sequences, trained_reference
from hf_tiny import make_hf_model

from dflash_trt.abi import PoolSizes
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.export.checkpoint import CheckpointError, load_drafter, load_target
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.plugins.paged_attention.reference import kv_write
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import tiny_drafter_config, tiny_target_config

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SIZES = PoolSizes(kv_blocks=96, page_size=8, max_seq_len=128, max_seqs=2, dkv_blocks=96, prefill_chunk=16)
N_NEW, N_PROMPTS = 30, 8


def _cfg(**over):
    tc = tiny_target_config()
    dc = tiny_drafter_config(tc)
    dc.update(over)
    return tc, dc


# ---- config ------------------------------------------------------------------------------------------------
def test_dflash2_fields_nested_first_then_top_level():
    tc, dc = _cfg(**{**DFLASH2, "selector_rank": 99})
    dc["dflash_config"].update(selector_rank=8)  # dflash_config wins over the top level
    c = DrafterConfig.from_dict(dc)
    assert c.dflash2 and (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (3, 16, 8, 5)
    c.check_against(TargetConfig.from_dict(tc))


def test_dflash1_config_unchanged():
    tc, dc = _cfg()
    c = DrafterConfig.from_dict(dc)
    assert not c.dflash2
    names = {n for n, _ in Drafter(c, tc["hidden_size"], tc["vocab_size"]).named_parameters()}
    assert not any("conv" in n or "selector" in n for n in names)


@pytest.mark.parametrize("over,msg", [
    (dict(conv_kernel_size=3, conv_group_size=16), "given without ['selector_rank', 'selector_top_k']"),
    ({**DFLASH2, "conv_group_size": 24}, "conv_group_size 24 does not divide hidden_size 64"),
    ({**DFLASH2, "selector_top_k": 0}, "'selector_top_k' must be an integer >= 1"),
    (dict(mask_embedding=True), "field 'mask_embedding' is not supported"),
])
def test_dflash2_config_refusals(over, msg):
    _, dc = _cfg(**over)
    with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        DrafterConfig.from_dict(dc)


def test_selector_top_k_beyond_vocab_refused():
    tc, dc = _cfg(**{**DFLASH2, "selector_top_k": 300})
    with pytest.raises(ConfigError, match="selector_top_k 300 > target vocab 259"):
        DrafterConfig.from_dict(dc).check_against(TargetConfig.from_dict(tc))


# ---- the reference pair --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """(HF target, reference drafter, target dir, drafter dir, prompts)."""
    dflash_model()
    root = tmp_path_factory.mktemp("dflash2")
    tdir, ddir = str(root / "target"), str(root / "drafter")
    target = make_hf_model("qwen3_5", 2, tdir, seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB - 1, (7,), generator=g).tolist() for _ in range(N_PROMPTS)]
    dm = trained_reference(target, greedy_sequences(target, prompts, N_NEW), steps=100)
    dm.save_pretrained(ddir)
    return target, dm, tdir, ddir, prompts


@pytest.fixture(scope="module")
def ours(ref):
    t = load_target(ref[2], torch.float32)
    return t, load_drafter(ref[3], t, torch.float32)


def test_codebooks_stored_without_weight_suffix(ref, ours, tmp_path):
    from safetensors.torch import load_file, save_file

    src = load_file(os.path.join(ref[3], "model.safetensors"))
    bare = {k.removesuffix(".weight") if "_codebook" in k else k: v for k, v in src.items()}
    d = tmp_path / "bare"
    d.mkdir()
    shutil.copy(os.path.join(ref[3], "config.json"), d)
    save_file(bare, str(d / "model.safetensors"))
    got = load_drafter(str(d), ours[0], torch.float32).candidate_selector.predecessor_codebook.weight
    assert torch.equal(got, ours[1].candidate_selector.predecessor_codebook.weight)
    save_file({**src, **{k: v.clone() for k, v in bare.items()}}, str(d / "model.safetensors"))  # both: one left over
    with pytest.raises(CheckpointError, match="candidate_selector.predecessor_codebook' is not used"):
        load_drafter(str(d), ours[0], torch.float32)


def _paged_block(d, ctx_hidden, block_ids, **kw):
    """Our graph path: ctx rows -> drafter pages -> block over the pages (on ctx_hidden's device)."""
    cfg, R, Bs, dev = d.cfg, ctx_hidden.shape[1], block_ids.shape[1], ctx_hidden.device
    pool = torch.zeros(cfg.num_layers, 2, 16, 8, cfg.num_kv_heads, cfg.head_dim, device=dev)
    bt = torch.randperm(16, generator=torch.Generator().manual_seed(3))[None].to(dev)
    zero, rows = torch.tensor([0], device=dev), torch.tensor([R], device=dev)
    kv_write(pool, d.ctx(ctx_hidden, torch.arange(R, device=dev)[None])["dkv_rows"], bt, zero, rows)
    return d.block(block_ids, R + torch.arange(Bs, device=dev)[None], bt, zero, rows, pool, want_logits=True, **kw)


def test_block_logits_and_selector_equal_reference(ref, ours, monkeypatch):
    mdl = dflash_model()
    target, dm, _, _, prompts = ref
    seq = prompts[0] + prompts[1] + prompts[2]
    with torch.no_grad():
        ctx = mdl.extract_context_feature(target(torch.tensor([seq]), output_hidden_states=True).hidden_states,
                                          dm.target_layer_ids)
        block = torch.tensor([[seq[-1]] + [dm.mask_token_id] * (BS - 1)])
        h = dm(target_hidden=ctx, noise_embedding=target.get_input_embeddings()(block),
               position_ids=torch.arange(len(seq) + BS)[None])[:, 1:]
        ref_logits = dm.compute_logits(h, target.lm_head)
        t = 0.8
        u = torch.rand(1, BS - 1, generator=torch.Generator().manual_seed(0))
        out = _paged_block(ours[1], ctx, block, temperature=torch.tensor([t]), draft_u=u)
        greedy = _paged_block(ours[1], ctx, block)
        torch.testing.assert_close(out["logits"][:, 1:], ref_logits, rtol=1e-5, atol=1e-5)
        ref_path, ref_cand, _ = dm.candidate_selector.select(h, ref_logits, block[:, 0], 0.0)
        assert torch.equal(greedy["drafts"], ref_path)
        assert (ref_path != ref_logits.argmax(-1)).any()  # the selector's path is not the slots' argmax
        assert torch.equal(out["cand"].sort(-1).values, ref_cand.sort(-1).values)
        # at T > 0 the reference draws our picks: its q rows along the same path are ours
        picks = iter(range(BS - 1))
        monkeypatch.setattr(mdl, "_sample_probs", lambda q: (ref_cand[:, (j := next(picks))] ==
                                                              out["drafts"][:, j, None]).int().argmax(-1))
        path, cand, q_rows = dm.candidate_selector.select(h, ref_logits, block[:, 0], t)
    assert torch.equal(path, out["drafts"])
    dense = torch.zeros(1, BS - 1, VOCAB)
    torch.testing.assert_close(dense.scatter(-1, out["cand"], out["cand_q"]), dense.scatter(-1, cand, q_rows),
                               rtol=1e-5, atol=1e-6)
    assert (out["cand_q"].max(-1).values < 0.99).any()  # a real distribution, not a near one-hot


def _reference_runs(ref, monkeypatch):
    """dflash_generate's (tokens, accepted drafts per step) for each prompt, over the steps that ran a full block
    (the reference shortens its last blocks to the tokens left; the runtime keeps γ and drops the excess).
    Its cache records GDN states so that crop can roll a hybrid target back."""
    mdl = dflash_model()
    target, dm, _, _, prompts = ref

    def cache(config):
        c = mdl.DynamicCache(config=config)
        c.activate_past_recording(recurrent_states_to_keep=BS)
        return c

    monkeypatch.setattr(mdl, "_make_cache", cache)
    monkeypatch.setattr(mdl, "_cuda_time", time.perf_counter)  # its timer synchronises CUDA
    runs = []
    for p in prompts:
        r = mdl.dflash_generate(dm, target, torch.tensor([p]), N_NEW, None, return_stats=True)
        start, full = len(p), []
        for n in r.acceptance_lengths:
            if len(p) + N_NEW - start > BS:
                full.append(n - 1)
            start += n
        runs.append((r.output_ids[0, len(p):].tolist(), full))
    return runs


def _check_runs(backend, cfgs, ref, runs):
    total = 0
    for p, (tokens, accepted) in zip(ref[4], runs):
        got, st = Runtime(backend, *cfgs, SIZES).generate(p, N_NEW, gamma=BS - 1)
        assert got == tokens
        assert st.accepted[:len(accepted)] == accepted
        total += sum(accepted)
    assert total >= 2 * N_PROMPTS  # drafts do get accepted


def test_greedy_equals_reference_torch(ref, ours, monkeypatch):
    t, d = ours
    _check_runs(TorchBackend(t, d), (t.cfg, d.cfg), ref, _reference_runs(ref, monkeypatch))


@pytest.mark.slow  # the ONNX export of five graphs takes most of a minute on a loaded CPU
def test_greedy_equals_reference_ort(ref, ours, monkeypatch, tmp_path):
    pytest.importorskip("onnxscript")
    from dflash_trt.export.onnx_export import export_graphs
    from dflash_trt.runtime.backends import make_backend

    out = str(tmp_path / "export")
    export_graphs(ref[2], ref[3], out, (1, BS), SIZES, progress=None)
    t, d = ours
    ort = make_backend("ort", manifest=out)
    _check_runs(ort, (t.cfg, d.cfg), ref, _reference_runs(ref, monkeypatch))
    for p in ref[4][:2]:  # sampling: the selector's draws and q from the graph, the same keys: the same tokens
        got = [Runtime(be, t.cfg, d.cfg, SIZES).generate(
            p, N_NEW, gamma=BS - 1, temperature=0.8, seed=7)[0] for be in (ort, TorchBackend(t, d))]
        assert got[0] == got[1]
    from dflash_trt.plugins import trt_compat

    if trt_compat.HAVE_TRT:  # TensorRT(-RTX) builds the DFlash2 block graph (convs and selector as standard ops)
        from dflash_trt.engines.build import main

        assert main(["--manifest", out, "--graphs", "drafter_block", "--opt-level", "0"]) == 0


def test_saved_config_is_the_reference_format(ref):
    with open(os.path.join(ref[3], "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["DFlash2DraftModel"] and "conv_kernel_size" in raw["dflash_config"]
    assert DrafterConfig.from_dict(raw).dflash2


@pytest.mark.gpu
def test_cuda_block_and_steps_equal_the_cpu_module(tmp_path):
    """A DFlash2 pair in our kernels' shapes, float32. The block on the GPU (our paged-attention kernel) equals the
    CPU module: logits, candidates, the selector's path and q. The CUDA-graph steps (block, selector walk and
    sparse-q rejection inside the graph) emit the CPU runtime's tokens with its accepted counts, greedy and sampled."""
    from dflash_trt.runtime.load import load_runtime
    from dflash_trt.tools.tiny import KERNEL_SHAPES, make_tiny_pair

    tdir, ddir = make_tiny_pair(str(tmp_path), target_over=KERNEL_SHAPES["target_over"],
                                drafter_over=dict(KERNEL_SHAPES["drafter_over"], **DFLASH2))
    t = load_target(tdir, torch.float32)
    d = load_drafter(ddir, t, torch.float32)
    g = torch.Generator().manual_seed(0)
    ctx = torch.randn(1, 24, len(d.cfg.target_layer_ids) * t.cfg.hidden_size, generator=g)
    block = torch.tensor([[5] + [d.cfg.mask_token_id] * (d.cfg.block_size - 1)])
    draw = dict(temperature=torch.tensor([0.8]), draft_u=torch.rand(1, d.cfg.block_size - 1, generator=g))
    with torch.no_grad():
        for kw in ({}, draw):
            cpu = _paged_block(d, ctx, block, **kw)
            t.to("cuda"), d.to("cuda")  # the drafter reads the target's embedding and lm_head
            gpu = _paged_block(d, ctx.cuda(), block.cuda(), **{k: v.cuda() for k, v in kw.items()})
            t.to("cpu"), d.to("cpu")
            torch.testing.assert_close(gpu["logits"].cpu(), cpu["logits"], rtol=1e-4, atol=1e-4)
            for k in ("drafts", "cand"):
                assert torch.equal(gpu[k].cpu(), cpu[k]), k
            if kw:  # q over the candidates: the draw's distribution (greedy rows return none)
                torch.testing.assert_close(gpu["cand_q"].cpu(), cpu["cand_q"], rtol=1e-4, atol=1e-5)
    sizes = PoolSizes(kv_blocks=32, page_size=8, max_seq_len=128, max_seqs=2, dkv_blocks=32, prefill_chunk=16)
    prompt = torch.randint(0, 250, (20,), generator=g).tolist()
    cpu, gpu = (load_runtime(tdir, ddir, sizes=sizes, **kw)[0] for kw in ({}, dict(device="cuda", dtype="float32", compile_steps=False)))
    for kw in ({}, dict(temperature=0.8, seed=7)):
        want, st = cpu.generate(prompt, 40, gamma=d.cfg.block_size - 1, **kw)
        got, gst = gpu.generate(prompt, 40, gamma=d.cfg.block_size - 1, **kw)
        assert got == want and gst.accepted == st.accepted, kw
