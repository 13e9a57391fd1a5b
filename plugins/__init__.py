"""The dflash custom ops, one folder each (gdn/, conv/, paged_attention/): spec.py (the one statement of the
op's contract and kernel limits), reference.py, onnx_body.py, kernel.cu, launch.py, torch_op.py,
trt_plugin.py. Shared: opspec (the spec vocabulary), ops (the seam the models call), torch_ops / trt_plugins /
onnx_functions (all ops' torch ops, TensorRT plugins, ONNX functions), nvrtc, cuda_launch, trt_base,
trt_compat, torch_util, onnx_builder, common.cuh."""
