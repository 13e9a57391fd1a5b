"""CausalConvVerify (depthwise causal conv + SiLU) and its commit kernel conv_roll: spec, reference, ONNX
body, CUDA kernel + launcher, torch op, TensorRT plugin, the model's seam and the commit kernel's numpy twin."""
from dflash_trt.plugins.conv.spec import SPEC
from dflash_trt.plugins.opspec import OpBundle

BUNDLE = OpBundle("conv", SPEC, onnx_body="onnx_body:body", trt_plugin="trt_plugin:CausalConvVerifyPlugin",
                  seam=("seam:conv_verify",), host_twins=("host:conv_roll",), device_ops=("device:conv_roll",))
