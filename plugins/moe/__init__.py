"""MoeExperts: the routed experts of a sparse MoE block as one grouped GEMM (spec.py, reference.py, kernel.cu),
with its routing op moe_route (torch only), ONNX body, TensorRT plugin and the model's seam."""
from dflash_trt.plugins.moe.spec import SPEC
from dflash_trt.plugins.opspec import OpBundle

BUNDLE = OpBundle("moe", SPEC, onnx_body="onnx_body:body", trt_plugin="trt_plugin:MoeExpertsPlugin",
                  seam=("seam:moe_experts",))
