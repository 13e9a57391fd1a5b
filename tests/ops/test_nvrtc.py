"""CI (no GPU): every op's kernel.cu compiles through NVRTC with its spec's -D macros (PTX for compute_90, cubin for
sm_120: the same source for another arch; no kernel is arch-conditional), the kernels instantiated are those the
specs list, every launcher passes the arguments its kernel entry declares (kinds and count against the PTX, the
launch stubbed: a wrong list would otherwise only show on a GPU, as garbage), compile errors surface the NVRTC log,
and the arch check of the shared launch helper. One NVRTC cache for the module: a family compiles once for all the
tests that read its PTX."""
import re

import pytest

from dflash_trt.plugins import cuda_launch, nvrtc
from dflash_trt.plugins.conv import launch as conv_launch
from dflash_trt.plugins.gdn import launch as gdn_launch
from dflash_trt.plugins.gemv import launch as gemv_launch
from dflash_trt.plugins.gemv_fp8 import launch as gemv_fp8_launch
from dflash_trt.plugins.moe import launch as moe_launch
from dflash_trt.plugins.paged_attention import launch as attention_launch
from dflash_trt.plugins.gdn import spec as gdn_spec
from dflash_trt.plugins.gemv_fp8 import spec as gemv_fp8_spec
from dflash_trt.plugins.opspec import KernelError, check_arch
from dflash_trt.plugins.paged_attention import spec as attention_spec

SLOW_SM120 = ("gdn", "paged_attention")  # 30 s of ptxas each; their PTX compiles in the suite

ENTRIES = {
    "gdn": [f"gdn_wy16_dk{dk}_cg1_p{p}_r{r}" for dk in (64, 128) for p in (32, 16, 8) for r in (4, 8, 16)]
    + [f"gdn_wy16_dk{dk}_cg{cg}_p32_r{r}" for dk, cg in ((64, 2), (128, 2), (128, 4)) for r in (4, 8, 16)]
    + ["gdn_fold_dk128_cg1", "gdn_fold_dk128_cg2", "gdn_fold_dk64_cg1", "gdn_fold_dk64_cg2"]
    + ["gdn_decode_dk128_cg1", "gdn_decode_dk128_cg2", "gdn_decode_dk64_cg1", "gdn_decode_dk64_cg2"],
    "conv": ["conv_verify", "conv_roll"],
    "paged_attention": [f"paged_attention_hd{h}_{d}" for h in (64, 128, 256) for d in ("bf16", "f16", "f32")]
    + ["paged_attention_combine", "kv_write"],
    "gemv": [f"mma_n{n}_u{u}_w{w}_{d}" for n in (1, 2) for u, w in ((1, 8), (2, 8), (4, 8), (8, 8), (4, 16))
             for d in ("bf16", "f16")],
    "gemv_fp8": gemv_fp8_spec.kernel_variants(),
    "moe": ["moe_plan", "moe_combine", "moe_route"]
    + [f"moe_dec_{k}_{d}" for k in ("gate_up", "down") for d in ("bf16", "f16", "fp8_bf16", "fp8_f16")]
    + [f"moe_{k}_{d}" for k in ("gate_up", "down") for d in ("bf16", "f16", "f32", "fp8_bf16", "fp8_f16")],
}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvrtc_cache")


@pytest.fixture(autouse=True)
def _cache(cache_dir, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(cache_dir))


@pytest.mark.parametrize("family", nvrtc.SOURCES)
def test_compiles_to_ptx(family, cache_dir, arch="compute_90"):
    ptx = nvrtc.compile_source(family, arch).decode()
    assert f".target sm_{arch.split('_')[1]}" in ptx
    for name in ENTRIES[family]:
        assert re.search(rf"\.entry {name}\(", ptx), name
    cached = list((cache_dir / "nvrtc").glob(f"{family}-{arch}-*.ptx"))
    assert len(cached) == 1
    assert nvrtc.compile_source(family, arch).decode() == ptx  # second call served from the cache


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_SM120 else f
                                    for f in nvrtc.SOURCES])
def test_compiles_cubin_sm120(family):
    cubin = nvrtc.compile_source(family, "sm_120")
    assert cubin[:4] == b"\x7fELF"


def test_specs_list_the_instantiated_kernels():
    """The launchers pick kernels by the specs' variant lists: every one must exist in the PTX, and no other."""
    ptx = nvrtc.compile_source("gdn", "compute_90").decode()
    assert set(re.findall(r"\.entry (\w+)\(", ptx)) == set(gdn_spec.kernel_variants())
    assert set(gdn_spec.WY16_CG) == set(gdn_spec.KERNEL_DK) == set(gdn_spec.FOLD_CG)
    ptx = nvrtc.compile_source("gemv_fp8", "compute_90").decode()
    assert set(re.findall(r"\.entry (\w+)\(", ptx)) == set(gemv_fp8_spec.kernel_variants())
    ptx = nvrtc.compile_source("paged_attention", "compute_90").decode()
    rows = lambda h: (attention_spec.rows_per_cta(h), attention_spec.rows_per_cta(h, small=True))  # noqa: E731
    mma = {attention_spec.kernel_name(h, d, d, attention_spec.MMA_ROWS, mma=True) for h in attention_spec.KERNEL_HD
           for d in ("bfloat16", "float16")}
    assert set(re.findall(r"\.entry (\w+)\(", ptx)) == {attention_spec.kernel_name(h, d, d, r) for h in attention_spec.KERNEL_HD
                                                          for d in attention_spec.TILE_SUFFIX for r in rows(h)} | mma | {
        "paged_attention_combine", "kv_write"}


def test_kernel_limits_come_from_the_spec_only():
    """A kernel compiled without its spec's -D macros does not build (the limit is stated once, in spec.py)."""
    for family in nvrtc.SOURCES:
        assert nvrtc.define_options(family)
        with pytest.raises(nvrtc.NvrtcError, match="spec.py"):
            nvrtc.compile_text(nvrtc.read_source(family), family, "compute_90", use_cache=False)


def test_compile_error_carries_log():
    bad = '#include "common.cuh"\nextern "C" __global__ void broken(float* x) { x[0] = undefined_thing; }\n'
    with pytest.raises(nvrtc.NvrtcError) as ei:
        nvrtc.compile_text(bad, "broken", "compute_90")
    assert "undefined_thing" in ei.value.log and "undefined_thing" in str(ei.value)


def test_bad_arch_string():
    with pytest.raises(ValueError):
        nvrtc.compile_source("gdn", "ampere")


def test_arch_check():
    with pytest.raises(KernelError):
        check_arch((7, 5))
    check_arch((8, 0))


# ---------------------------------------------------------------- launchers against their entries ---------------------

KIND = {cuda_launch.P: ".u64", cuda_launch.I: ".u32", cuda_launch.F: ".f32"}


def _entries(family):
    """{entry name: [param type, ...]} of a family's PTX (compute_90)."""
    ptx = nvrtc.compile_source(family, "compute_90").decode()
    return {m.group(1): re.findall(r"\.param\s+(\.\w+)", m.group(2))
            for m in re.finditer(r"\.entry\s+(\w+)\(([^)]*)\)", ptx)}


@pytest.fixture
def launches(monkeypatch):
    """The launchers' calls [(family, entry, [(value, kind), ...])] with get_function / launch stubbed (an H100's
    arch and 132 resident CTAs where a launcher asks)."""
    got = []
    for mod in (gemv_launch, gemv_fp8_launch, gdn_launch, conv_launch, attention_launch, moe_launch):
        monkeypatch.setattr(mod, "get_function", lambda family, name, max_dynamic_smem=0: (family, name))
        monkeypatch.setattr(mod, "launch", lambda fn, grid, block, smem, stream, args, **kw: got.append((*fn, args)))
        for name, stub in (("device_arch", lambda: (9, 0)), ("resident_ctas", lambda fn, threads, smem=0: 132)):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, stub)
    return got


def _check_launches(launches):
    assert launches
    entries = {}
    for family, name, args in launches:
        if family not in entries:
            entries[family] = _entries(family)
        assert [KIND[kind] for _, kind in args] == entries[family][name], name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dense_launchers_pass_what_their_entries_declare(launches, dtype):
    for M in (1, 16):
        for swiglu in (False, True):
            gemv_launch.gemv(1, 2, 3, M=M, N=4096, K=2048, dtype=dtype, swiglu=swiglu)
            gemv_fp8_launch.gemv_fp8(1, 2, 3, 4, M=M, N=4096, K=2048, dtype=dtype, swiglu=swiglu)
    gemv_fp8_launch.quantize_groups(1, 2, 3, M=4, K=256, ld_s=4, dtype=dtype)
    gdn = dict(B=1, Hk=16, Hv=32, dk=128, dv=128, in_dtype=dtype)
    gdn_launch.gdn_wy16(*range(1, 9), 0, 0, 0, 0, 0, T=16, **gdn)
    gdn_launch.gdn_wy16(*range(1, 14), T=16, A_log=20, dt_bias=21, **gdn)  # fold outputs, gates in the kernel
    gdn_launch.gdn_fold(*range(1, 8), T=16, L=2, num_slots=4, **{k: v for k, v in gdn.items() if k != "in_dtype"})
    gdn_launch.gdn_decode(*range(1, 10), num_slots=4, **gdn)
    conv_launch.conv_verify(1, 2, 3, 4, 5, B=1, T=16, C=1024, W=4, x_dtype=dtype)
    conv_launch.conv_roll(1, 2, 3, 4, B=1, T=16, C=1024, W=4, L=2, num_slots=4, x_dtype=dtype)
    attention_launch.paged_attention(16, 32, 48, 64, 5, 6, 7, 8, B=1, T=16, Hq=24, Hkv=4, hd=256, layer=0,
                                     num_blocks=64, block_size=16, max_blocks=512, causal=True, scale=0.1,
                                     q_dtype=dtype, workspace=1 << 20)
    attention_launch.kv_write(1, 2, 3, 4, 5, B=1, T=16, Hkv=4, hd=256, L=2, num_blocks=64, block_size=16,
                              max_blocks=512, p_dtype=dtype)
    _check_launches(launches)
    assert {name for _, name, _ in launches} >= {"paged_attention_combine", "kv_write", "conv_roll", "fp8_quant_groups_"
                                                 + {"bfloat16": "bf16", "float16": "f16"}[dtype]}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fp8", [False, True])
def test_moe_launchers_pass_what_their_entries_declare(launches, dtype, fp8):
    """Grouped, decode (with and without a fused shared expert), 16-bit or FP8 experts, the router."""
    dims, scales = dict(E=256, H=2048, I=512, dtype=dtype, w_dtype=dtype), (11, 12) if fp8 else None
    moe_launch.moe_experts(*range(1, 10), N=16, k=8, **dims, scales=scales)
    for shared in (None, (21, 22, 23, 5) + ((31, 32) if fp8 else ())):
        moe_launch.moe_experts_decode(*range(1, 8), N=2, k=8, **dims, scales=scales, shared=shared)
        gate_up, down = (args for _, _, args in launches[-2:])
        assert [v for v, _ in gate_up][-1 - fp8] == (21 if shared else 0)  # the shared gate_up after h
        assert [v for v, _ in down][-2:] == ([23, 5] if shared else [0, 0])  # its gate logit and row stride last
    moe_launch.moe_route(1, 2, 3, N=4, E=256, k=8, norm=True, l_dtype=dtype, w_dtype=dtype)
    _check_launches(launches)
    if not fp8:
        moe_launch.moe_experts(*range(1, 10), N=16, k=8, **dict(dims, dtype="float32", w_dtype="float32"))
        _check_launches(launches)
