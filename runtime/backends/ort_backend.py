"""ONNX Runtime backend: executes the exported graphs of a manifest (dflash-trt export) with onnxruntime.

Same interface as the torch backend — run(graph, inputs: name -> array) -> name -> numpy — so the
Runtime's loop and commit path are unchanged. CPU EP by default; the CUDA EP (with IOBinding) when
onnxruntime-gpu is installed. ORT inlines each dflash node's FunctionProto body.
Inputs may be numpy arrays, ort.OrtValue, or device arrays exposing __cuda_array_interface__ (CUDA EP).
Sessions are created lazily, one per graph, and their io is checked against the manifest.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.manifest import Manifest, ManifestBacked, ManifestError, diff_io

_ORT_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
               "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(double)": "float64"}


def default_providers() -> list[str]:
    import onnxruntime as ort

    have = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in have]


class OrtBackend(ManifestBacked):
    name = "ort"
    kv_dtype: str  # the manifest's
    want_logits = False  # the manifest's: whether the export carries logits
    concurrent_prefill = False  # sessions run synchronously: no stream to run beside
    any_prefill_width = False  # the exported prefill graph takes the chunk's width
    fused_steps = None  # host steps only (numpy in and out)

    def __init__(self, manifest, providers=None, threads: int | None = None, check_inputs: bool = True,
                 optimize: bool = True):
        """manifest: a Manifest or the directory holding manifest.json; providers: ORT provider list
        (default CUDA when available, else CPU); threads: intra-op threads (default ORT's)."""
        self.manifest = manifest if isinstance(manifest, Manifest) else Manifest.load(manifest)
        self.kv_dtype = self.manifest.kv_dtype
        self.want_logits = self.manifest.want_logits
        self.providers = list(providers or default_providers())
        self.threads, self.optimize, self.check = threads, optimize, check_inputs
        self._sessions: dict = {}
        if self.kv_dtype == "bfloat16" and not self.on_cuda:
            # numpy (the CPU pools) has no bfloat16: refuse here in one line, not later in a numpy TypeError
            from dflash_trt.runtime.load import UsageError

            raise UsageError(f"{self.manifest.root}: a bfloat16 export cannot run on ONNX Runtime CPU (numpy has no "
                             f"bfloat16 pools); export with --dtype float32 (or float16), or use the trt backend")

    @property
    def on_cuda(self) -> bool:
        return self.providers[0] == "CUDAExecutionProvider"

    def session(self, graph: str):
        s = self._sessions.get(graph)
        if s is None:
            import onnxruntime as ort

            path = self.manifest.graph_path(graph)  # raises ManifestError naming a missing K/graph
            self.manifest.verify_graph(graph)  # a graph the export did not write is refused, not run
            so = ort.SessionOptions()
            so.log_severity_level = 3
            if not self.optimize:
                so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if self.threads:
                so.intra_op_num_threads = self.threads
            try:
                s = ort.InferenceSession(path, so, providers=self.providers)
            except Exception as e:  # ORT's own classes (InvalidProtobuf, Fail, ...): one line naming the graph
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise ManifestError(f"graph {graph} ({path}): ONNX Runtime cannot load it ({msg[:300]}); "
                                    f"re-run dflash-trt export") from None
            exp_in, exp_out = self.manifest.io(graph)
            for kind, got, exp in (("input", s.get_inputs(), exp_in), ("output", s.get_outputs(), exp_out)):
                rec = [{"name": a.name, "shape": ["B" if isinstance(d, str) or d is None else d for d in a.shape],
                        "dtype": _ORT_DTYPES.get(a.type, a.type)} for a in got]
                diff_io(f"{path}", kind, rec, exp, "onnx graph", "manifest")
            self._sessions[graph] = s
        return s

    def run(self, graph: str, inputs: dict) -> dict:
        sess = self.session(graph)
        if self.check and all(isinstance(v, np.ndarray) for v in inputs.values()):
            self.manifest.check_inputs(graph, inputs)
        names = [o.name for o in sess.get_outputs()]
        if not self.on_cuda:
            feeds = {k: np.ascontiguousarray(v) for k, v in inputs.items()}
            return dict(zip(names, sess.run(names, feeds)))
        return self._run_iobinding(sess, names, inputs)

    def _run_iobinding(self, sess, names, inputs) -> dict:
        """CUDA EP: device-resident inputs (OrtValue / __cuda_array_interface__) are bound in place,
        host arrays are copied once; outputs are produced on the device and copied back."""
        import onnxruntime as ort

        io = sess.io_binding()
        for k, v in inputs.items():
            if isinstance(v, ort.OrtValue):
                io.bind_ortvalue_input(k, v)
            elif hasattr(v, "__cuda_array_interface__"):
                cai = v.__cuda_array_interface__
                io.bind_input(k, "cuda", 0, np.dtype(cai["typestr"]).type, list(cai["shape"]), cai["data"][0])
            else:
                io.bind_cpu_input(k, np.ascontiguousarray(v))
        for n in names:
            io.bind_output(n, "cuda")
        sess.run_with_iobinding(io)
        return dict(zip(names, io.copy_outputs_to_cpu()))


__all__ = ["ManifestError", "OrtBackend", "default_providers"]
