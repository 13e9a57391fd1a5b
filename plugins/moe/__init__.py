"""MoeExperts: the routed experts of a sparse MoE block as one grouped GEMM (spec.py, reference.py, kernel.cu)."""
