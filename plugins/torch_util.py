"""Small helpers shared by the ops' torch_op.py files (torch -> launcher arguments, dtypes)."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from dflash_trt.plugins.opspec import KernelError, dtype_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64,
           "int32": torch.int32, "int64": torch.int64}


def stream(t: Tensor) -> int:
    """torch's current stream on t's device: our kernels run in torch's stream order (and its CUDA graphs)."""
    return torch.cuda.current_stream(t.device).cuda_stream


def i32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.int32).contiguous()


def rows(t: Tensor, row_dims: int = 2, align: int = 16) -> tuple[Tensor, int]:
    """(t, rs) for a kernel that reads t as rows: its first row_dims dims flattened are the rows, rs elements apart,
    each row's elements packed. A view that fits (a slice of wider rows: q|k|v of one projection) is returned as is,
    so no copy kernel runs before the launch; anything else is made contiguous (rs = the packed row size).
    align: bytes the data pointer and the row stride must be a multiple of (the kernel's vector loads)."""
    inner = 1
    for size, st in reversed(list(zip(t.shape[row_dims:], t.stride()[row_dims:]))):
        if size != 1 and st != inner:
            return t.contiguous(), math.prod(t.shape[row_dims:])
        inner *= size
    rs = span = None
    for size, st in reversed(list(zip(t.shape[:row_dims], t.stride()[:row_dims]))):
        if size == 1:
            continue
        if span is not None and st != span:
            return t.contiguous(), inner
        rs = st if rs is None else rs
        span = st * size
    rs = inner if rs is None else rs
    if rs < inner or t.data_ptr() % align or rs * t.element_size() % align:
        return t.contiguous(), inner
    return t, rs


def ptr(t: Optional[Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


def dname(t) -> str:
    """torch dtype (or tensor) -> spec dtype name ('bfloat16')."""
    return dtype_name(getattr(t, "dtype", t))


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def shape(t: Optional[Tensor]):
    return None if t is None else tuple(t.shape)


def check_groups(spec, tensors) -> None:
    """The spec's dtype groups on the op's inputs: one dtype per group, one the kernels accept."""
    seen = {}
    for port, t in zip(spec.inputs, tensors):
        name = dname(t)
        if name not in spec.groups[port.group]:
            raise KernelError(f"{spec.name}: {port.name} dtype {name} not in {spec.groups[port.group]}")
        first = seen.setdefault(port.group, (port.name, name))
        if first[1] != name:
            raise KernelError(f"{spec.name}: {first[0]} and {port.name} must share one dtype ({first[1]}, {name})")


def gather(pool: Tensor, slot: Optional[Tensor], B: int, dim: int = 0) -> Tensor:
    """pool rows (along `dim`) by slot, slot < 0 -> zeros; or the first B rows without slot."""
    if slot is None:
        return pool.narrow(dim, 0, B)
    s = slot.to(pool.device).long()
    out = pool.index_select(dim, s.clamp(min=0))
    out[(slice(None),) * dim + (s < 0,)] = 0
    return out


def scatter_kept(pool: Tensor, slot: Optional[Tensor], n: Tensor, new: Tensor) -> None:
    """pool[l, slot[b]] = new[l, b] for rows with n[b] > 0 and slot[b] >= 0 (commit semantics), all layers."""
    B = new.shape[1]
    idx = torch.arange(B, device=pool.device) if slot is None else slot.to(pool.device).long()
    keep = (n.to(pool.device).long() > 0) & (idx >= 0)
    if bool(keep.any()):
        pool[:, idx[keep]] = new[:, keep.to(new.device)].to(pool.dtype)
