"""Backends execute the graphs of the ABI (dflash_trt.abi): run(graph_name, inputs) -> outputs, numpy in/out
(runtime/interfaces.Backend is the contract). Each imports its framework lazily, so the runtime core stays free of
torch/onnxruntime/tensorrt. `make_backend` is the one registry of backends by name."""


def _torch(**kw):
    """make_backend("torch", target=..., drafter=..., compile_steps=...): the reference modules."""
    from dflash_trt.runtime.backends.torch_backend import TorchBackend

    return TorchBackend(**kw)


def _ort(**kw):
    """make_backend("ort", manifest=DIR or Manifest): the exported ONNX graphs on ONNX Runtime."""
    from dflash_trt.runtime.backends.ort_backend import OrtBackend

    return OrtBackend(**kw)


def _trt(**kw):
    """make_backend("trt", manifest=DIR or Manifest, device=CudaDevice): the export's built engines."""
    from dflash_trt.runtime.backends.trt import TrtBackend

    return TrtBackend(**kw)


BACKEND_FACTORIES = {"torch": _torch, "ort": _ort, "trt": _trt}  # name -> factory(**kw)
BACKENDS = tuple(BACKEND_FACTORIES)


def make_backend(name: str, **kw):
    """The backend `name` built from keyword arguments (each factory's docstring names them)."""
    factory = BACKEND_FACTORIES.get(name)
    if factory is None:
        raise ValueError(f"unknown backend '{name}' (available: {', '.join(BACKENDS)})")
    return factory(**kw)
