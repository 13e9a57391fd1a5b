"""PagedAttention and its commit kernel kv_write: spec, reference, ONNX body, CUDA kernel + launcher,
torch op, TensorRT plugin, the model's seam and the commit kernel's numpy twin."""
from dflash_trt.plugins.opspec import OpBundle
from dflash_trt.plugins.paged_attention.spec import SPEC

BUNDLE = OpBundle("paged_attention", SPEC, onnx_body="onnx_body:body", trt_plugin="trt_plugin:PagedAttentionPlugin",
                  seam=("seam:paged_attention",), host_twins=("host:kv_write",), device_ops=("device:kv_write",))
