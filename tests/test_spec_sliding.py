"""A mixed sliding/full drafter shaped like the released ones (nested block size, scaling fields) in the runtime,
prompts longer than the window: spec == plain on the torch backend and on ORT, and with the default
ctx_window (= max_seq_len, full retention) every proposal equals the dense reference forward on the whole
context — what the reference computes; an explicit smaller ctx_window stays lossless (a memory bound)."""
import numpy as np
import pytest
import torch

from dflash_trt.abi import DRAFTER_BLOCK, PoolSizes, drafter_block_graph
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.interfaces import BackendDefaults
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import make_tiny_pair, tiny_target_config

WINDOW, BS = 5, 8
SIZES = PoolSizes(kv_blocks=48, page_size=4, max_seq_len=128, max_seqs=2, dkv_blocks=64, prefill_chunk=16)
DRAFTER = dict(layers=3, block_size=BS, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
               sliding_window=WINDOW, use_sliding_window=True, input_embedding_scale=1.5, output_multiplier=0.8,
               final_logit_softcapping=4.0, hidden_act="silu", attention_bias=False)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    n = tiny_target_config()["num_hidden_layers"]
    over = dict(DRAFTER, taps=[1, n - 1])  # a tap at the last target layer: taken after the final norm
    return make_tiny_pair(str(tmp_path_factory.mktemp("sliding")), seed=5, drafter_over=over)


@pytest.fixture(scope="module")
def pair(dirs):
    target = load_target(dirs[0])
    return target, load_drafter(dirs[1], target)


class Recorder(BackendDefaults):
    """Wraps a backend; keeps (block_ids, drafts) of every drafter block launch."""

    def __init__(self, inner):
        self.inner, self.name, self.kv_dtype = inner, inner.name, inner.kv_dtype
        self.calls = []

    def run(self, graph, inputs):
        out = self.inner.run(graph, inputs)
        if graph.startswith(DRAFTER_BLOCK):
            self.calls.append((graph, np.asarray(inputs["block_ids"]).copy(), np.asarray(inputs["positions"]).copy(),
                               np.asarray(out["drafts"]).copy()))
        return out


def _prompt(n=30, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 250, n)]


def _dense_drafts(target, drafter, tokens, block_ids, start):
    """The reference: ctx features of every position < start from one dense target pass, the block on top."""
    with torch.no_grad():
        ctx = target.forward_full(torch.tensor([tokens[:start]]), want_logits=False)["ctx_hidden"]
        logits = drafter.train_forward(ctx, torch.arange(start)[None], torch.tensor(block_ids),
                                       start + torch.arange(block_ids.shape[1])[None])
    return logits[0, 1:].argmax(-1).numpy()


@pytest.mark.parametrize("gamma", [BS - 1, 3])
def test_torch_lossless_and_drafts_equal_dense_reference(pair, gamma):
    target, drafter = pair
    assert SIZES.ctx_window == SIZES.max_seq_len  # the default: full retention
    prompt = _prompt()
    plain, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES).generate(prompt, 40, spec=False)
    be = Recorder(TorchBackend(target, drafter))
    rt = Runtime(be, target.cfg, drafter.cfg, SIZES)
    spec, st = rt.generate(prompt, 40, gamma=gamma)
    assert spec == plain and st.spec_steps > 3
    tokens = prompt + plain
    for graph, block, pos, drafts in be.calls:
        assert graph == drafter_block_graph(gamma + 1, BS) and block.shape == (1, gamma + 1)
        start = int(pos[0, 0])
        assert start > WINDOW
        np.testing.assert_array_equal(drafts[0], _dense_drafts(target, drafter, tokens, block, start))


def test_small_ctx_window_is_a_lossless_memory_bound(pair):
    target, drafter = pair
    small = PoolSizes(**{**SIZES.__dict__, "ctx_window": 8})
    prompt = _prompt(seed=1)
    plain, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, small).generate(prompt, 30, spec=False)
    spec, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, small).generate(prompt, 30, gamma=BS - 1)
    assert spec == plain


def test_ort_lossless_mixed_drafter(dirs, pair, tmp_path):
    pytest.importorskip("onnxscript")
    from dflash_trt.export.onnx_export import export_graphs
    from dflash_trt.runtime.backends import make_backend

    target, drafter = pair
    out = str(tmp_path / "export")
    export_graphs(*dirs, out, (1, 4, BS), SIZES, progress=None)
    ort = Recorder(make_backend("ort", manifest=out))
    prompt = _prompt(seed=2)
    plain, _ = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES).generate(prompt, 24, spec=False)
    for gamma in (BS - 1, 3):
        ort.calls.clear()
        rt = Runtime(ort, target.cfg, drafter.cfg, SIZES)
        spec, _ = rt.generate(prompt, 24, gamma=gamma)
        assert spec == plain
        tokens = prompt + plain
        for _, block, pos, drafts in ort.calls:  # the exported graphs propose what the dense reference does
            np.testing.assert_array_equal(drafts[0], _dense_drafts(target, drafter, tokens, block, int(pos[0, 0])))


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    """The mixed drafter at head dims our CUDA kernels take (tools/tiny.KERNEL_SHAPES)."""
    from dflash_trt.tools.tiny import KERNEL_SHAPES

    n = tiny_target_config()["num_hidden_layers"]
    over = dict(KERNEL_SHAPES["drafter_over"], **DRAFTER, taps=[1, n - 1])
    return make_tiny_pair(str(tmp_path_factory.mktemp("sliding_k")), seed=5,
                          target_over=KERNEL_SHAPES["target_over"], drafter_over=over)


@pytest.mark.gpu
@pytest.mark.parametrize("gamma", [BS - 1, 3])
def test_gpu_lossless_mixed_drafter(kernel_dirs, gamma):
    """fp32 on the GPU (CudaDevice, one CUDA graph per step, our kernels with the sliding window) == the CPU
    reference's plain greedy, prompts longer than the window."""
    from dflash_trt import load_runtime

    cpu, _ = load_runtime(*kernel_dirs, sizes=SIZES)
    gpu, _ = load_runtime(*kernel_dirs, sizes=SIZES, device="cuda", compile_steps=False)
    for seed in (3, 4):
        prompt = _prompt(seed=seed)
        plain, _ = cpu.generate(prompt, 40, spec=False)
        spec, st = gpu.generate(prompt, 40, gamma=gamma)
        assert spec == plain and st.spec_steps > 3
        gplain, _ = gpu.generate(prompt, 40, spec=False)
        assert gplain == plain
