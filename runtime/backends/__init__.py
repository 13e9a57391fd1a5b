"""Backends execute the graphs of the ABI (dflash_trt.abi): run(graph_name, inputs) -> outputs, numpy in/out.
Each imports its framework lazily, so the runtime core stays free of torch/onnxruntime/tensorrt."""


def make_backend(name: str, **kw):
    if name == "torch":
        from .torch_backend import TorchBackend

        return TorchBackend(**kw)
    raise ValueError(f"unknown backend '{name}' (available: torch)")
