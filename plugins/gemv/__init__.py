"""Projections of decode and verify steps: y = x W^T for 1-16 rows of x on tensor cores, one kernel for every
row count (a row's result does not depend on the rows beside it). A torch-only op: exported graphs keep MatMul."""
from dflash_trt.plugins.gemv.spec import SPEC
from dflash_trt.plugins.opspec import OpBundle

BUNDLE = OpBundle("gemv", SPEC)
