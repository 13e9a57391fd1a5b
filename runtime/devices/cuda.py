"""CudaDevice: the Device seam on an NVIDIA GPU, owned through cuda-python (cuda.bindings.driver).

  memory   pools and step buffers are cuMemAlloc allocations, made once; torch sees them zero-copy through
           __cuda_array_interface__ (`torch_view`), TensorRT gets the raw pointers (`pointer`).
  stream   the runtime's own stream (cuStreamCreate); every launch, copy and graph replay goes to it, torch
           work included (`on_stream`), so step order is stream order. `side_stream()`: a sibling on a second
           stream (same memory; its own graph pool), which the GPU executor runs joining requests' prefills on;
           `stream_wait(event)` orders this stream after an event of the other.
  staging  pinned host buffers (cuMemHostAlloc) for the one H2D copy of a step's inputs and the one D2H copy
           of its results; events (cuEventRecord / cuEventSynchronize) tell the host when they landed.
  graphs   `capture(fn)`: one eager warm-up, then torch.cuda.CUDAGraph capture on the runtime stream. A capture
           that fails is ended here (the brick guard: cuStreamIsCapturing -> cuStreamEndCapture), the stream
           stays usable, and the caller runs that step eagerly.
The commit kernels are TorchDevice's (our dflash:: torch ops, one launch per kind for all layers).
"""
from __future__ import annotations

import copy
import ctypes
import gc

import numpy as np
import torch

from dflash_trt.plugins.cuda_launch import check as _ck
from dflash_trt.plugins.cuda_launch import driver as _driver
from dflash_trt.runtime.devices.torch_cpu import TorchStepIO
from dflash_trt.runtime.devices.torch_device import _DTYPES, TorchDevice


class CudaUnavailable(RuntimeError):
    """--device cuda on a machine without a usable CUDA GPU."""



def require_cuda() -> None:
    """Raise CudaUnavailable (one clear line) unless torch sees a CUDA GPU."""
    if not torch.cuda.is_available():
        raise CudaUnavailable("device 'cuda' requested but no CUDA GPU is visible (torch.cuda.is_available() is False)")


class _CudaArray:
    """A device allocation as __cuda_array_interface__ (bytes), for torch.as_tensor without a copy."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


class CudaDevice(TorchStepIO, TorchDevice):
    graph_steps = True  # the graph executor captures one CUDA graph per step kind, K and bucket
    stream_handle = 0  # the runtime stream's raw handle, set with the stream (_own_stream)

    def __init__(self, index: int = 0):
        require_cuda()
        torch.cuda.set_device(index)
        torch.cuda.init()
        torch.zeros(1, device=f"cuda:{index}")  # torch's primary context is the one cuda-python uses
        super().__init__(f"cuda:{index}")
        cu = _driver()
        _ck(cu.cuInit(0), "cuInit")
        if int(_ck(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:  # torch's primary context, made current here
            dev = _ck(cu.cuDeviceGet(index), "cuDeviceGet")
            _ck(cu.cuCtxSetCurrent(_ck(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")
        self._own_stream()
        self._device_allocs: list = []
        self._host_allocs: list = []
        self.capture_failures: list[str] = []  # one line per failed capture (the brick guard's log)

    def _own_stream(self) -> None:
        """A new stream, and a graph pool of its own: graphs that may run at once must not share intermediates."""
        cu = _driver()
        self._stream = _ck(cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")
        self.stream_handle = int(self._stream)
        self.torch_stream = torch.cuda.ExternalStream(self.stream_handle, device=self.device)
        self._graph_pool = torch.cuda.graph_pool_handle()

    def side_stream(self) -> "CudaDevice":
        """This device on a second stream: the same allocations (freed by this one's close), its own graph pool."""
        side = copy.copy(self)
        side._own_stream()
        return side

    def stream_wait(self, event) -> None:
        """Work queued here from now on starts after `event` (recorded on another stream); the host does not wait."""
        _ck(_driver().cuStreamWaitEvent(self._stream, event, 0), "cuStreamWaitEvent")

    # ---- memory -----------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        cu = _driver()
        ptr = _ck(cu.cuMemAlloc(max(int(nbytes), 1)), "cuMemAlloc")
        self._device_allocs.append(ptr)
        _ck(cu.cuMemsetD8Async(ptr, 0, max(int(nbytes), 1), self._stream), "cuMemsetD8Async")
        return int(ptr)

    def torch_view(self, ptr: int, shape, dtype):
        """A torch tensor over device memory at ptr (no copy)."""
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        raw = torch.as_tensor(_CudaArray(ptr, max(nbytes, 1)), device=self.device)
        return raw[:nbytes].view(dtype).view(tuple(shape))

    @staticmethod
    def pointer(t) -> int:
        """The raw device pointer of a pool / buffer (what TensorRT bindings take)."""
        return int(t.data_ptr())

    def zeros(self, shape, dtype="float32"):
        dt = _DTYPES[str(dtype)]
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
        t = self.torch_view(self._alloc(nbytes), shape, dt)
        self.synchronize()  # the memset landed before anything else reads the pool
        return t

    def device_buffer(self, numel: int):
        """A zeroed int64 device buffer (a step's static inputs / results)."""
        t = self.torch_view(self._alloc(8 * max(int(numel), 1)), (max(int(numel), 1),), torch.int64)
        self.synchronize()
        return t[: int(numel)]

    def staging(self, numel: int) -> np.ndarray:
        """Pinned host int64 buffer (the source / target of a step's async copies)."""
        cu = _driver()
        n = max(int(numel), 1)
        ptr = _ck(cu.cuMemHostAlloc(8 * n, 0), "cuMemHostAlloc")
        self._host_allocs.append(ptr)
        arr = np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(int(ptr)))
        arr[:] = 0
        return arr[: int(numel)]

    # ---- copies, events, stream ----------------------------------------------------------------
    def h2d(self, dst, src: np.ndarray) -> None:
        _ck(_driver().cuMemcpyHtoDAsync(dst.data_ptr(), src.ctypes.data, src.nbytes, self._stream),
            "cuMemcpyHtoDAsync")

    def d2h(self, dst: np.ndarray, src) -> None:
        _ck(_driver().cuMemcpyDtoHAsync(dst.ctypes.data, src.data_ptr(), dst.nbytes, self._stream),
            "cuMemcpyDtoHAsync")

    def new_event(self, timing: bool = False):
        cu = _driver()
        flags = 0 if timing else int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        return _ck(cu.cuEventCreate(flags), "cuEventCreate")

    def record(self, event) -> None:
        _ck(_driver().cuEventRecord(event, self._stream), "cuEventRecord")

    def wait(self, event) -> None:
        _ck(_driver().cuEventSynchronize(event), "cuEventSynchronize")

    @staticmethod
    def done(event) -> bool:
        """Whether the work before the event has finished (no wait)."""
        cu = _driver()
        res = cu.cuEventQuery(event)
        if (res[0] if isinstance(res, tuple) else res) == cu.CUresult.CUDA_ERROR_NOT_READY:
            return False
        _ck(res, "cuEventQuery")
        return True

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return float(_ck(_driver().cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def synchronize(self) -> None:
        _ck(_driver().cuStreamSynchronize(self._stream), "cuStreamSynchronize")

    @staticmethod
    def sync_all() -> None:
        """The whole device drained (work torch queued on its own streams included: weight uploads)."""
        torch.cuda.synchronize()

    def on_stream(self):
        """torch work inside runs on the runtime stream (and is captured there)."""
        return torch.cuda.stream(self.torch_stream)

    # ---- reads for tests / tools (after the stream drained) -------------------------------------
    def to_host(self, a) -> np.ndarray:
        self.synchronize()
        return super().to_host(a)

    def gather_rows(self, pool, block_table_row, start, count) -> np.ndarray:
        self.synchronize()
        with self.on_stream():
            out = super().gather_rows(pool, block_table_row, start, count)
        return out

    # ---- graphs -------------------------------------------------------------------------------
    def capture(self, fn, hook=None):
        """A CUDA graph of fn() (replay callable), or None when its capture failed (then run fn eagerly).
        hook() runs inside the capture before fn (tests force a failure with it)."""
        self.sync_all()
        with self.on_stream():
            fn()  # warm-up: NVRTC modules, cuBLAS handles and workspaces exist before the capture
        self.synchronize()
        graph = torch.cuda.CUDAGraph()
        prev = torch.cuda.current_stream(self.device)
        # garbage collected mid-capture (a dead runtime's graphs, pools) would free CUDA memory inside the
        # capture, which invalidates it: collect now, and keep the collector off until the capture ended
        gc.collect()
        gc_on = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self._graph_pool, stream=self.torch_stream,
                                  capture_error_mode="thread_local"):
                if hook is not None:
                    hook()
                fn()
        except Exception as e:  # the brick guard: end the broken capture, keep the stream usable
            self._end_broken_capture()
            torch.cuda.set_stream(prev)  # torch skips its stream restore when capture_end raises
            # torch may still count the aborted capture as recording into the shared graph pool; later
            # captures take a fresh pool so they never collide with it
            self._graph_pool = torch.cuda.graph_pool_handle()
            self.capture_failures.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
            return None
        finally:
            if gc_on:
                gc.enable()
        return graph.replay

    def _end_broken_capture(self) -> None:
        cu = _driver()
        status = _ck(cu.cuStreamIsCapturing(self._stream), "cuStreamIsCapturing")
        if status != cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
            res = cu.cuStreamEndCapture(self._stream)
            graph = res[1] if isinstance(res, tuple) and len(res) > 1 else None
            if graph is not None and int(graph) != 0:
                cu.cuGraphDestroy(graph)
        self.synchronize()  # raises if the stream itself were broken: it must not be

    def close(self) -> None:
        """Free every allocation (tensors viewing them must not be used afterwards)."""
        cu = _driver()
        self.synchronize()
        for p in self._device_allocs:
            cu.cuMemFree(p)
        for p in self._host_allocs:
            cu.cuMemFreeHost(p)
        self._device_allocs, self._host_allocs = [], []
