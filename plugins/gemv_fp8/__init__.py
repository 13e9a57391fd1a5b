"""FP8 (W8A16, block-wise e4m3 with 128x128 fp32 scales) projections of decode and verify steps: gemv's kernel body
with an FP8 weight stream, for 1-16 rows of x a launch (up to 64 a call, in 16-row slices). A torch-only op:
exported graphs keep DequantizeLinear + MatMul."""
from dflash_trt.plugins.gemv_fp8.spec import SPEC
from dflash_trt.plugins.opspec import OpBundle

BUNDLE = OpBundle("gemv_fp8", SPEC)
