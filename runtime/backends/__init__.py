"""Backends execute the graphs of the ABI (dflash_trt.abi): run(graph_name, inputs) -> outputs, numpy in/out.
Each imports its framework lazily, so the runtime core stays free of torch/onnxruntime/tensorrt."""

BACKENDS = ("torch", "ort", "trt")


def make_backend(name: str, **kw):
    """torch: make_backend("torch", target=..., drafter=...); ort: make_backend("ort", manifest=DIR or Manifest)."""
    if name == "torch":
        from dflash_trt.runtime.backends.torch_backend import TorchBackend

        return TorchBackend(**kw)
    if name == "ort":
        from dflash_trt.runtime.backends.ort_backend import OrtBackend

        return OrtBackend(**kw)
    if name == "trt":  # make_backend("trt", manifest=DIR or Manifest, device=CudaDevice): engines built
        from dflash_trt.runtime.backends.trt import TrtBackend

        return TrtBackend(**kw)
    raise ValueError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
