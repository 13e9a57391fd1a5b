"""Skinny GEMM (GEMV) for decode steps: y = x W^T for a few rows of x, at the weights' HBM read rate."""
