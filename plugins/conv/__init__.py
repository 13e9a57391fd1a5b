"""CausalConvVerify (depthwise causal conv + SiLU) and its commit kernel conv_roll: spec, reference, ONNX
body, CUDA kernel + launcher, torch op, TensorRT plugin."""
