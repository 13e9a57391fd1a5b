"""The TensorRT backend's binding plan: which tensor binds where, with which shape, and in which order a step
launches — computed from the manifest and the graph ABI by plain functions, so all of it is tested on CPU
against the built engines' records (runtime/backends/trt.py only carries it out on a TensorRT-capable GPU).

For every engine of the manifest and every batch bucket the runtime can launch it at, an `EnginePlan` lists
each I/O tensor with its shape for that bucket (the `set_input_shape` values, inside the engine's batch
profile), its dtype, and where its memory comes from:
  pool    a runtime pool (kv_pool, gdn_pool, conv_pool, dkv_pool): bound zero-copy, read-only in the engine
  step    a tensor of the fused step: a view of the step's static input buffer or a value the step computed
          on the device (ids, positions, seq_len, windows); its address is set before each enqueue
  output  a buffer preallocated per engine and bucket; the commit kernels read it after the launch
drafter_ctx takes R = max_append rows (static): a step's K rows are copied into the first rows of a static
input (`pad_rows`), and the commit writes only the first n rows of its output.

Any disagreement between manifest and engine (missing / extra tensor, dtype, dims, a bucket outside the
batch profile, a pool layout that differs from the runtime's) is a PlanError naming what differs, raised
before any context exists or any launch. numpy/json only.
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_trt.abi import DRAFTER_CTX, PREFILL, drafter_block_graph, pool_specs, target_graph
from dflash_trt.engines.load import EngineError, engine_record
from dflash_trt.manifest import Manifest, ManifestError, diff_io
from dflash_trt.plugins.opspec import dtype_name
from dflash_trt.runtime.batching import BUCKETS, DECODE, PREFILL_STEP, SPEC, bucket_for


class PlanError(EngineError):
    """The engines cannot be bound as the manifest / runtime says (message names what differs)."""


@dataclass(frozen=True)
class Binding:
    name: str
    io: str  # "input" | "output"
    shape: tuple  # concrete, for this bucket
    dtype: str
    source: str  # "pool" | "step" | "output"
    pool: str | None = None  # the pool's name (source "pool")
    dynamic: bool = False  # has the batch dim: its shape is set per context with set_input_shape
    pad_rows: bool = False  # the step hands fewer rows (dim 1) than the static shape: copied into a padded input


@dataclass(frozen=True)
class EnginePlan:
    graph: str
    batch: int
    engine_file: str
    inputs: tuple
    outputs: tuple

    @property
    def input_shapes(self) -> dict:
        """name -> shape of every input whose shape the context must be told (set_input_shape)."""
        return {b.name: b.shape for b in self.inputs if b.dynamic}

    def binding(self, name: str) -> Binding:
        for b in self.inputs + self.outputs:
            if b.name == name:
                return b
        raise KeyError(name)


def _man(m) -> Manifest:
    return m if isinstance(m, Manifest) else Manifest.load(m)


def buckets(man) -> list[int]:
    """The batch buckets the runtime launches engines at: every bucket up to the one holding max_seqs, at most
    the widest (slots beyond it hold requests that finish while others join; a static-batch export: its batch)."""
    man = _man(man)
    if isinstance(man.batch, int):
        return [man.batch]
    return [b for b in BUCKETS if b <= bucket_for(min(man.sizes.max_seqs, BUCKETS[-1]))]


def runtime_pools(man) -> dict:
    """name -> (shape, dtype) of the pools the Runtime allocates for this manifest (abi.pool_specs)."""
    man = _man(man)
    return {n: (tuple(s), d) for n, (s, d) in
            pool_specs(man.target_config, man.drafter_config, man.sizes, man.kv_dtype).items()}


def _concrete(shape, B) -> tuple:
    return tuple(B if d == "B" else int(d) for d in shape)


def engine_plan(man, graph: str, B: int, engine_io: dict | None = None, pools: dict | None = None) -> EnginePlan:
    """The bindings of `graph`'s engine at batch B. engine_io: the deserialized engine's I/O ({"inputs",
    "outputs"} of {name, shape, dtype}; default the I/O recorded when it was built); pools: name -> (shape,
    dtype) of the runtime's pools (default: what the manifest's sizes and configs allocate)."""
    man = _man(man)
    rec = engine_record(man, graph)  # EngineError naming `dflash-trt build` when there is none
    where = f"engine {graph} ({rec.get('file')})"
    eio = engine_io if engine_io is not None else rec.get("io")
    if not eio or "inputs" not in eio or "outputs" not in eio:
        raise PlanError(f"{where}: no I/O recorded for the engine; rebuild with `dflash-trt build --manifest {man.root}`")
    ins, outs = man.io(graph)
    try:
        diff_io(where, "input", eio["inputs"], ins, "engine", "manifest")
        diff_io(where, "output", eio["outputs"], outs, "engine", "manifest")
    except ManifestError as e:
        raise PlanError(str(e)) from None
    dynamic = any("B" in t["shape"] for t in ins + outs)
    if dynamic:
        prof = rec.get("batch") or {}
        lo, hi = prof.get("min"), prof.get("max")
        if lo is None or hi is None or not lo <= B <= hi:
            raise PlanError(f"{where}: batch bucket {B} is outside the engine's batch profile {lo}..{hi}; rebuild "
                            f"with `dflash-trt build --manifest {man.root} --max-batch {max(B, hi or 0)}`")
    elif B != man.batch:
        raise PlanError(f"{where}: built for batch {man.batch} (static), the runtime launches batch {B}")
    have = runtime_pools(man) if pools is None else {n: (tuple(s), str(d)) for n, (s, d) in pools.items()}
    recorded = {n: (tuple(p["shape"]), p["dtype"]) for n, p in man.data["pools"].items()}
    inputs = []
    for t in ins:
        shape, src, pool = _concrete(t["shape"], B), "step", None
        if t["name"] in recorded:
            src, pool = "pool", t["name"]
            want = (shape, t["dtype"])
            for who, got in (("the manifest's pool record", recorded.get(pool)), ("the runtime's pool", have.get(pool))):
                if got != want:
                    raise PlanError(f"{where}: input {pool} is {list(shape)} {t['dtype']} in the engine, "
                                    f"{who} is {list(got[0]) if got else None} {got[1] if got else ''}".rstrip()
                                    + " (pool layout differs; re-export and rebuild with the runtime's sizes)")
        inputs.append(Binding(t["name"], "input", shape, t["dtype"], src, pool, "B" in t["shape"],
                              pad_rows=graph == DRAFTER_CTX))
    outputs = tuple(Binding(t["name"], "output", _concrete(t["shape"], B), t["dtype"], "output",
                            dynamic="B" in t["shape"]) for t in outs)
    return EnginePlan(graph, B, rec["file"], tuple(inputs), outputs)


def runtime_plan(man, engine_ios: dict | None = None, pools: dict | None = None) -> dict:
    """(graph, bucket) -> EnginePlan for every graph of the manifest and every bucket; the first mismatch
    anywhere is a PlanError (nothing is bound or launched before the whole plan holds)."""
    man = _man(man)
    engine_ios = engine_ios or {}
    return {(g, B): engine_plan(man, g, B, engine_ios.get(g), pools) for g in man.graphs for B in buckets(man)}


def check_bound(plan: EnginePlan, name: str, shape, dtype: str) -> None:
    """A tensor handed to binding `name`: PlanError unless its shape / dtype are the plan's (pad_rows inputs
    may have fewer rows in dim 1)."""
    b = plan.binding(name)
    shape = tuple(int(d) for d in shape)
    ok = shape == b.shape or (b.pad_rows and len(shape) == len(b.shape) and shape[1] <= b.shape[1]
                              and shape[:1] + shape[2:] == b.shape[:1] + b.shape[2:])
    if not ok or dtype_name(dtype) != b.dtype:
        raise PlanError(f"engine {plan.graph} batch {plan.batch}: {b.io} {name} is {list(shape)} "
                        f"{dtype_name(dtype)}, the plan binds {list(b.shape)} {b.dtype}")


def step_launches(kind: str, K: int, block_size: int | None) -> tuple:
    """The launches of one step, in stream order (DESIGN §5): ("engine", graph) or ("kernels", what).
    spec: drafter_block -> target verify -> accept on the device -> drafter ctx rows -> commit kernels."""
    ctx = (("engine", DRAFTER_CTX),) if block_size is not None else ()
    commit = (("kernels", "commit"), ("kernels", "advance"))
    if kind == PREFILL_STEP:
        return (("engine", PREFILL),) + ctx + commit
    if kind == DECODE:
        return (("engine", target_graph(1)),) + ctx + commit
    if kind == SPEC:
        if block_size is None:
            raise PlanError("a spec step needs a drafter")
        return ((("engine", drafter_block_graph(K, block_size)), ("engine", target_graph(K)), ("kernels", "accept"))
                + ctx + commit)
    raise ValueError(f"unknown step kind {kind!r}")

