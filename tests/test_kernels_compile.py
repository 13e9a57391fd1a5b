"""CI (no GPU): every plugin kernel compiles through NVRTC (PTX for compute_90 / compute_120, cubin
for sm_120), compile errors surface the NVRTC log, launchers reject bad input before touching the
GPU, and the CPU path of every dflash:: torch op equals the reference math."""
import re

import pytest
import torch

from dflash_trt.export import attention_ref, gdn_ref
from dflash_trt.plugins import launch, nvrtc

ENTRIES = {
    "gdn": [f"gdn_wy16_dk{dk}_cg{cg}_r{r}" for dk in (64, 128) for cg in (1, 2, 4)[: 3 if dk == 128 else 2]
            for r in (4, 8, 16)]
    + ["gdn_fold_dk128_cg1", "gdn_fold_dk128_cg2", "gdn_fold_dk64_cg1", "gdn_fold_dk64_cg2"],
    "conv": ["conv_verify", "conv_roll"],
    "attention": ["paged_attention_hd64", "paged_attention_hd128", "paged_attention_hd256", "kv_write"],
}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path))


@pytest.mark.parametrize("arch", ["compute_90", "compute_120"])
@pytest.mark.parametrize("family", nvrtc.SOURCES)
def test_compiles_to_ptx(family, arch, tmp_path):
    ptx = nvrtc.compile_source(family, arch).decode()
    assert f".target sm_{arch.split('_')[1]}" in ptx
    for name in ENTRIES[family]:
        assert re.search(rf"\.entry {name}\(", ptx), name
    cached = list((tmp_path / "nvrtc").glob(f"{family}-{arch}-*.ptx"))
    assert len(cached) == 1
    assert nvrtc.compile_source(family, arch).decode() == ptx  # second call served from the cache


@pytest.mark.parametrize("family", nvrtc.SOURCES)
def test_compiles_cubin_sm120(family):
    cubin = nvrtc.compile_source(family, "sm_120")
    assert cubin[:4] == b"\x7fELF"


def test_compile_error_carries_log():
    bad = '#include "common.cuh"\nextern "C" __global__ void broken(float* x) { x[0] = undefined_thing; }\n'
    with pytest.raises(nvrtc.NvrtcError) as ei:
        nvrtc.compile_text(bad, "broken", "compute_90")
    assert "undefined_thing" in ei.value.log and "undefined_thing" in str(ei.value)


def test_bad_arch_string():
    with pytest.raises(ValueError):
        nvrtc.compile_source("gdn", "ampere")


def test_launchers_validate_before_launch():
    kw = dict(B=1, T=4, Hk=1, Hv=2, dv=128)
    with pytest.raises(launch.KernelError, match="dk=96"):
        launch.gdn_wy16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dk=96, **kw)
    with pytest.raises(launch.KernelError, match="int8"):
        launch.gdn_wy16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, dk=128, in_dtype="int8", **kw)
    with pytest.raises(launch.KernelError, match="state"):
        launch.gdn_fold(0, 0, 0, 0, 0, 0, dk=128, state_dtype="bfloat16", **kw)
    with pytest.raises(launch.KernelError, match="Hv=3"):
        launch.gdn_fold(0, 0, 0, 0, 0, 0, B=1, T=1, Hk=2, Hv=3, dk=128, dv=128)
    with pytest.raises(launch.KernelError, match="head dim 96"):
        launch.paged_attention(0, 0, 0, 0, 0, 0, 0, 0, B=1, T=1, Hq=2, Hkv=1, hd=96, layer=0, num_blocks=1,
                               block_size=16, max_blocks=1, causal=True, scale=1.0)
    with pytest.raises(launch.KernelError, match="W=9"):
        launch.conv_verify(0, 0, 0, 0, 0, B=1, T=1, C=8, W=9)
    with pytest.raises(launch.KernelError):
        launch.check_arch((7, 5))


def _gdn_inputs(B, T, Hk, Hv, dk, dv, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    g, beta = gdn_ref.gdn_gates(r(B, T, Hv), r(B, T, Hv), r(Hv) * 0.5, r(Hv))
    return (r(B, T, Hk, dk).to(dtype), r(B, T, Hk, dk).to(dtype), r(B, T, Hv, dv).to(dtype), g, beta,
            r(B + 2, Hv, dk, dv) * 0.3)


@pytest.mark.parametrize("T", [1, 5, 16, 37])
def test_cpu_gdn_ops_equal_reference(T):
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)
    B, Hk, Hv, dk, dv = 3, 1, 2, 32, 16
    q, k, v, g, beta, pool = _gdn_inputs(B, T, Hk, Hv, dk, dv)
    slot = torch.tensor([4, 0, 2])
    o, kh, vn, gam, fs = torch.ops.dflash.gdn_wy16(q, k, v, g, beta, pool, slot, None, True)
    ref = gdn_ref.gdn_chunk_wy16(q, k, v, g, beta, pool[slot.long()])
    for a, b in zip((o, kh, vn, gam, fs), (ref.o, ref.k_hat, ref.v_new, ref.gamma, ref.state)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    n = torch.tensor([T, 0, min(2, T)])
    pool2 = pool.clone()
    torch.ops.dflash.gdn_fold(pool2, slot, kh, vn, gam, n)
    want = gdn_ref.gdn_fold(pool[slot.long()], kh, vn, gam, n)
    torch.testing.assert_close(pool2[slot.long()], want, rtol=0, atol=0)
    untouched = [i for i in range(B + 2) if i not in (4, 2)]
    assert torch.equal(pool2[untouched], pool[untouched])


def test_cpu_conv_ops_equal_reference():
    import dflash_trt.plugins.torch_ops  # noqa: F401
    B, T, C, W = 3, 6, 10, 4
    x, pool, w = torch.randn(B, T, C), torch.randn(5, C, W - 1), torch.randn(C, W)
    slot = torch.tensor([1, 4, 0])
    y = torch.ops.dflash.conv_verify(x, pool, w, slot)
    torch.testing.assert_close(y, gdn_ref.conv_verify(x, pool[slot.long()], w), rtol=0, atol=0)
    n = torch.tensor([0, 2, 6])
    p2 = pool.clone()
    torch.ops.dflash.conv_roll(p2, slot, x, n)
    want = gdn_ref.conv_roll(pool[slot.long()], x, n)
    torch.testing.assert_close(p2[slot.long()], want, rtol=0, atol=0)
    assert torch.equal(p2[[2, 3]], pool[[2, 3]])


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_attention_ops_equal_reference(causal):
    import dflash_trt.plugins.torch_ops  # noqa: F401
    B, T, Hq, Hkv, hd, L, NB, BS = 2, 3, 4, 2, 16, 2, 12, 4
    pool = torch.randn(L, 2, NB, BS, Hkv, hd)
    bt = torch.randperm(NB)[: B * 5].view(B, 5).int()
    ks, kl = torch.tensor([0, 3]), torch.tensor([7, 11])
    q, kn, vn = torch.randn(B, T, Hq, hd), torch.randn(B, T, Hkv, hd), torch.randn(B, T, Hkv, hd)
    o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.25)
    want = attention_ref.paged_attention_ref(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.25)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    # kv_write then attention over the written rows == attention with those rows as new rows
    p2 = pool.clone()
    torch.ops.dflash.kv_write(p2, 1, kn, vn, bt, kl, torch.tensor([T, T]))
    o2 = attention_ref.paged_attention_ref(q[:, :0], kn[:, :0], vn[:, :0], p2, 1, bt, ks, kl + T, False, 0.25)
    assert o2.shape[1] == 0
    Kc, Vc = attention_ref.gather_pages(p2, 1, bt[1], kl[1], kl[1] + T)
    assert torch.equal(Kc, kn[1]) and torch.equal(Vc, vn[1])
