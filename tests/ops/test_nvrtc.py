"""CI (no GPU): every op's kernel.cu compiles through NVRTC with its spec's -D macros (PTX for compute_90, cubin for
sm_120: the same source for another arch; no kernel is arch-conditional), the kernels instantiated are those the
specs list, compile errors surface the NVRTC log, and the arch check of the shared launch helper. One NVRTC cache
for the module: a family compiles once for all the tests that read its PTX."""
import re

import pytest

from dflash_trt.plugins import nvrtc
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
