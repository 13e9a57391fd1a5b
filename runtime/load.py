"""`load_runtime`: checkpoint directories -> a ready `Runtime` over one backend, plus the text codec.

The one place that wires a target (+ drafter) to a backend; the CLI, demo, bench and tests call it.
"""
from __future__ import annotations

import os

from dflash_trt import log
from dflash_trt.abi import DEFAULT_KS, PoolSizes, default_prefill_chunk
from dflash_trt.config import DrafterConfig, TargetConfig, read_json
from dflash_trt.optional import require_torch
from dflash_trt.runtime.runtime import Runtime


class ByteCodec:
    """Fallback text codec for checkpoints without tokenizer.json: UTF-8 bytes are token ids 0..255."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """add_special_tokens=False: no post-processor tokens (a rendered chat template writes its own)."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_codec(model_dir: str):
    """tokenizer.json of the target when present, else UTF-8 bytes."""
    from dflash_trt.export.checkpoint import load_tokenizer

    tok = load_tokenizer(model_dir)
    return TokenizerCodec(tok) if tok is not None else ByteCodec()


DTYPES = ("float32", "bfloat16", "float16")


class UsageError(ValueError):
    """A device / dtype / backend combination the runtime does not offer (the CLI prints it as one line)."""


def check_checkpoint_dir(d: str, what: str) -> None:
    """A checkpoint argument that is not a directory with config.json, refused by name before anything reads it
    (the ORT cache path would otherwise fail on the weights listing, naming neither)."""
    if not os.path.isdir(d):
        raise UsageError(f"{what} {d}: not a directory (a checkpoint directory holds config.json and the weights)")
    if not os.path.isfile(os.path.join(d, "config.json")):
        raise UsageError(f"{what} {d}: no config.json in it (not a Hugging Face checkpoint directory)")
    read_json(os.path.join(d, "config.json"))  # JSON at all: a cached export would never read it


def load_runtime(model_dir: str, drafter_dir: str | None = None, backend: str = "torch",
                 sizes: PoolSizes | None = None, step_costs=None, ks=DEFAULT_KS, device: str = "cpu",
                 dtype: str | None = None, compile_steps: bool | str = True,
                 export_dir: str | None = None,
                 gpu_memory_utilization: float | None = None,
                 tensor_parallel_size: int = 1, drafter_fp8: bool | None = None) -> tuple[Runtime, object]:
    """Build a Runtime over the chosen backend; returns (runtime, codec). sizes: the pools (None: default_sizes, the
    prefill chunk chosen from the model; with export_dir, the export's own). step_costs: as for Runtime (the step times
    auto draft length weighs; None: the default cost model).
    torch: the reference modules; on device="cpu" in float32 with numpy pools, on device="cuda" (dtype
    float32 / bfloat16 / float16; None: the checkpoint's own, default_dtype) with pools owned by a CudaDevice and one
    CUDA graph per step.
    ort: the ONNX graphs for verify widths `ks` (CPU; None: the default widths), exported once into the cache
    (keyed by both checkpoint hashes, sizes and exporter version) and reused after. trt: that export's TensorRT
    engines (built once into the cache entry) on a CudaDevice's pools, one CUDA graph per step; refused in one line
    where engines cannot run.
    export_dir (ort, trt): a `dflash-trt export --out` directory of these checkpoints used instead of the cache
    (checked against the checkpoints' hashes, the widths ks (None: K=1, the run takes the widths it holds), the
    sizes when given and the dtype).
    compile_steps (torch on CUDA; on by default): the steps through Inductor, faster steps for a compile per step key
    on first use, kept in the cache for later processes (runtime/backends/torch_compile.py; figures: docs/PERF.md);
    "regions": the models' pieces compiled instead (each kind of layer once; torch_compile.CompiledRegions);
    False: eager steps. Ignored on the CPU. A missing GPU fails with one clear line.
    gpu_memory_utilization (torch on CUDA): the KV pools take what this fraction of the GPU's memory leaves once
    the weights are loaded (runtime/memory.py); `sizes` then gives only their shape (max_seq_len, max_seqs, page
    size, prefill chunk, ctx window).
    drafter_fp8 (torch on CUDA): the drafter's projections quantized to FP8 blocks at load (modeling/fp8.py
    quantize_projections): half its weight bytes a spec step streams; drafts may differ, the tokens never do. None:
    on when the target is an FP8 checkpoint (trained pair with an FP8 drafter: tau 2.926 vs 2.920, docs/PERF.md).
    tensor_parallel_size N > 1 (torch): called on every rank of an initialised torch.distributed group of N
    processes (runtime/parallel/launch.py starts them), each loads its shard of the target (runtime/parallel/shard.py;
    pools sized by its heads) and the whole drafter; on CUDA rank r takes GPU r of the node."""
    check_checkpoint_dir(model_dir, "target checkpoint")
    if drafter_dir:
        check_checkpoint_dir(drafter_dir, "drafter checkpoint")
    device, dtype = _checked_placement(backend, device, dtype or default_dtype(model_dir, backend, device),
                                       tensor_parallel_size)
    if gpu_memory_utilization is not None and not (device != "cpu" and backend == "torch"):
        raise UsageError("--gpu-memory-utilization sizes the pools of the torch backend on cuda (ort and trt take "
                         "the pool sizes their graphs were exported with)")
    if drafter_fp8 and not (device != "cpu" and backend == "torch" and drafter_dir):
        raise UsageError("--drafter-fp8 quantizes the drafter of the torch backend on cuda (it needs --drafter, "
                         "--device cuda and --backend torch)")
    codec = load_codec(model_dir)
    sizes = sizes if sizes is not None or export_dir is not None else default_sizes(model_dir)
    if backend in ("ort", "trt"):
        return _graphs_runtime(backend, model_dir, drafter_dir, sizes, step_costs, ks, device, dtype, export_dir), codec
    if export_dir is not None:
        raise UsageError(f"an export directory ({export_dir}) runs on the ort or trt backend, not '{backend}'")
    return _torch_runtime(backend, model_dir, drafter_dir, sizes, step_costs, device, dtype, compile_steps,
                          gpu_memory_utilization, tensor_parallel_size, drafter_fp8), codec


def default_dtype(model_dir: str, backend: str, device: str) -> str:
    """The dtype of a run given none: on a GPU the torch backend takes the checkpoint's own 16-bit dtype (config.json
    torch_dtype or dtype, at top level or in text_config: what the weights were trained and shipped in; an FP8
    checkpoint names its 16-bit compute dtype there); float32 otherwise (the CPU computes in float32; exported
    graphs for ort / trt are float32 unless asked)."""
    if device == "cpu" or backend != "torch":
        return "float32"
    cfg = read_json(os.path.join(model_dir, "config.json"))
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}):
        for key in ("torch_dtype", "dtype"):
            if c.get(key) in ("bfloat16", "float16"):
                return c[key]
    return "float32"


def default_sizes(model_dir: str) -> PoolSizes:
    """The pools of a run given no sizes: PoolSizes' defaults with the prefill chunk of this model
    (abi.default_prefill_chunk)."""
    path = os.path.join(model_dir, "config.json")
    return PoolSizes(prefill_chunk=default_prefill_chunk(TargetConfig.from_dict(read_json(path), path)))


def _checked_placement(backend: str, device: str, dtype: str, world: int) -> tuple[str, str]:
    """(device, dtype) this backend runs on, or one UsageError line before anything is read or built."""
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"device '{device}' not supported (cpu, cuda, cuda:N)")
    if world != 1:
        device = _rank_device(world, backend, device)
    if backend == "trt":  # before anything exports, builds or loads: one line if engines cannot run here
        from dflash_trt.engines.load import check_can_execute

        check_can_execute()
        device = "cuda" if device == "cpu" else device  # engines run on the GPU only
    if dtype not in DTYPES:
        raise UsageError(f"dtype '{dtype}' not supported ({', '.join(DTYPES)})")
    if device != "cpu":
        require_torch(f"--device {device}", UsageError)  # the GPU pools are torch tensors
        from dflash_trt.runtime.devices.cuda import require_cuda

        require_cuda()
        if backend not in ("torch", "trt"):
            raise UsageError(f"device '{device}' runs the torch or trt backend (got backend '{backend}')")
    elif dtype != "float32":
        raise UsageError(f"on CPU the runtime computes in float32 (got dtype '{dtype}'); use --device cuda")
    return device, dtype


def _cuda_device(device: str):
    from dflash_trt.runtime.devices.cuda import CudaDevice

    return CudaDevice(int(device.split(":")[1]) if ":" in device else 0)


def _graphs_runtime(backend, model_dir, drafter_dir, sizes, step_costs, ks, device, dtype, export_dir) -> Runtime:
    """ort: the ONNX export on the CPU; trt: that export's engines (built once) on the GPU pools. The export is the
    user's export_dir (checked against these checkpoints) or the cache's."""
    from dflash_trt.export.onnx_export import ensure_export
    from dflash_trt.runtime.backends import make_backend

    need = (1,) if ks is None else ks  # what a user's export must hold
    ks = DEFAULT_KS if ks is None else ks  # what the cache's export gets
    man = export_dir and checked_export(export_dir, model_dir, drafter_dir, need, sizes, dtype) \
        or ensure_export(model_dir, drafter_dir, ks=ks, sizes=sizes or PoolSizes(), dtype=dtype)
    if backend == "ort":
        be = make_backend("ort", manifest=man)
        return Runtime(be, be.tcfg, be.dcfg, be.sizes, step_costs=step_costs)
    from dflash_trt.engines.build import ensure_engines

    man = ensure_engines(man)
    dev = _cuda_device(device)
    be = make_backend("trt", manifest=man, device=dev)
    return Runtime(be, be.tcfg, be.dcfg, be.sizes, device=dev, step_costs=step_costs)


def _torch_runtime(backend, model_dir, drafter_dir, sizes, step_costs, device, dtype, compile_steps,
                   gpu_memory_utilization, world, drafter_fp8=None) -> Runtime:
    """The torch modules of the checkpoints (this rank's shard under tensor parallelism) on `device`."""
    from dflash_trt.export.checkpoint import checkpoint_hash, load_drafter, load_target
    from dflash_trt.runtime.backends import make_backend

    torch = require_torch(f"--backend {backend}", UsageError)
    dt = getattr(torch, dtype)
    split = None
    if world != 1:  # this rank reads only its slices; before the drafter binds embed / lm_head
        from dflash_trt.runtime.parallel.shard import shard_target as split
    target = load_target(model_dir, dt, split=split)
    drafter = load_drafter(drafter_dir, target, dt) if drafter_dir else None
    if drafter is not None and device != "cpu" and (target.cfg.quant is not None if drafter_fp8 is None
                                                    else drafter_fp8):
        from dflash_trt.modeling.fp8 import quantize_projections

        quantize_projections(drafter)
    # the weights' identity in snapshots, the one an export of these checkpoints records (runtime/snapshot.py)
    hashes = {"target": checkpoint_hash(model_dir)}
    if drafter is not None:
        hashes["drafter"] = checkpoint_hash(drafter_dir)
    dev = None
    if device != "cpu":
        dev = _cuda_device(device)
        target.to(dev.device)
        if drafter is not None:
            drafter.to(dev.device)
        if gpu_memory_utilization is not None:
            sizes = _sized_for_gpu(target.cfg, drafter.cfg if drafter else None, sizes,
                                   gpu_memory_utilization, dev.device, dtype)
    be = make_backend(backend, target=target, drafter=drafter,
                      compile_steps=compile_steps if dev is not None else False, checkpoint_hashes=hashes)
    if world != 1:
        from dflash_trt.runtime.parallel.launch import abort_group_on_error

        abort_group_on_error(be)
    return Runtime(be, target.cfg, drafter.cfg if drafter else None, sizes, device=dev,
                   step_costs=step_costs)


def check_tensor_parallel(world, backend: str) -> None:
    """A tensor-parallel size and backend a launch can take (else UsageError), before any process starts."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UsageError(f"tensor_parallel_size {world!r}: a positive number of processes")
    if world > 1 and backend != "torch":
        raise UsageError(f"tensor parallelism runs the torch backend (got backend '{backend}')")


def _rank_device(world: int, backend: str, device: str) -> str:
    """The device this rank runs on (cuda: GPU rank of the node), once the call is on a rank of a group of `world`."""
    import torch.distributed as dist

    check_tensor_parallel(world, backend)
    if not dist.is_initialized() or dist.get_world_size() != world:
        raise UsageError(f"tensor_parallel_size {world}: call this on each of {world} ranks of an initialised "
                         "torch.distributed group (LLM(tensor_parallel_size=N) starts them)")
    if device.startswith("cuda:"):
        raise UsageError(f"device '{device}': under tensor parallelism rank r runs on GPU r (pass device 'cuda')")
    if device != "cuda":
        return device
    import torch

    return f"cuda:{dist.get_rank() % max(torch.cuda.device_count(), 1)}"


def _sized_for_gpu(tcfg, dcfg, shape: PoolSizes, utilization: float, device, dtype: str) -> PoolSizes:
    import torch

    from dflash_trt.runtime.memory import sized_for_gpu

    free, total = torch.cuda.mem_get_info(device)
    sizes = sized_for_gpu(tcfg, dcfg, shape, utilization, free, total, dtype)
    log.progress(f"pools: {sizes.kv_blocks} KV pages of {sizes.page_size} rows ({sizes.kv_blocks * sizes.page_size} "
                 f"rows) for {sizes.max_seqs} sequences of up to {sizes.max_seq_len} (GPU memory: "
                 f"{free / 2**30:.1f} of {total / 2**30:.1f} GiB free after the weights, {utilization:g} used)")
    return sizes


def checked_export(export_dir: str, model_dir: str, drafter_dir, ks, sizes, dtype: str) -> str:
    """A user's `dflash-trt export --out` directory, refused in one line (ManifestError) unless it was exported from
    these checkpoints (hashes), with a drafter iff one is given, the widths ks, `sizes` (when given) and `dtype`."""
    from dflash_trt.export.checkpoint import checkpoint_hash
    from dflash_trt.manifest import Manifest, ManifestError

    m = Manifest.load(export_dir)
    if (m.data.get("drafter") is not None) != bool(drafter_dir):
        raise ManifestError(f"{m.root}: exported {'with' if m.data.get('drafter') else 'without'} a drafter, but the "
                            f"run has {'one' if drafter_dir else 'none'}")
    m.check(ks=ks, sizes=sizes, target_hash=checkpoint_hash(model_dir), kv_dtype=dtype,
            drafter_hash=checkpoint_hash(drafter_dir) if drafter_dir else None)
    return m.root


def drafter_block_size(drafter_dir: str | None) -> int | None:
    """The drafter's block size from its config.json (None without a drafter), read before any weight loads."""
    if not drafter_dir:
        return None
    check_checkpoint_dir(drafter_dir, "--drafter")
    p = os.path.join(drafter_dir, "config.json")
    return DrafterConfig.from_dict(read_json(p), p).block_size
