"""GdnChunkWY16 (chunked WY gated delta rule) and its commit kernel gdn_fold: spec, reference, ONNX body,
CUDA kernel + launcher, torch op, TensorRT plugin."""
