"""GdnChunkWY16 (chunked WY gated delta rule), its commit kernel gdn_fold and the one-row step that commits itself
(gdn_decode, the torch backend's decode): spec, reference, ONNX body,
CUDA kernel + launcher, torch op, TensorRT plugin, the model's seam and the numpy twins of the commit writes."""
from dflash_trt.plugins.gdn.spec import SPEC
from dflash_trt.plugins.opspec import OpBundle

BUNDLE = OpBundle("gdn", SPEC, onnx_body="onnx_body:body", trt_plugin="trt_plugin:GdnChunkWY16Plugin",
                  seam=("seam:gdn_chunk", "seam:gdn_decode_commit"), host_twins=("host:gdn_fold", "host:gdn_set"),
                  device_ops=("device:gdn_fold", "device:gdn_set"))
