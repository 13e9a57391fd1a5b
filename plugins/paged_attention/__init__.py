"""PagedAttention and its commit kernel kv_write: spec, reference, ONNX body, CUDA kernel + launcher,
torch op, TensorRT plugin."""
