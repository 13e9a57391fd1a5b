"""torch custom ops dflash::paged_attention and dflash::kv_write: CUDA -> kernel.cu via launch.py on torch's
current stream, CPU -> reference.py, plus fake impls. Register all ops through dflash_trt.plugins.torch_ops.
Index tensors may be int32 or int64.

  paged_attention(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0) -> o
  kv_write(kv_pool!, rows, block_table, pos, n)   all layers: kv_pool [L,2,blocks,bs,Hkv,hd], rows [L,2,B,T,Hkv,hd]
"""
from __future__ import annotations

import torch
from torch import Tensor

from dflash_trt.plugins import torch_util as U
from dflash_trt.plugins.opspec import KernelError
from dflash_trt.plugins.paged_attention import launch, reference, spec


@torch.library.custom_op("dflash::paged_attention", mutates_args=())
def paged_attention(q: Tensor, k_new: Tensor, v_new: Tensor, kv_pool: Tensor, layer: int, block_table: Tensor,
                    kv_start: Tensor, kv_len: Tensor, causal: bool, scale: float, window: int = 0) -> Tensor:
    raise NotImplementedError("dflash::paged_attention: no kernel for this device")


@paged_attention.register_kernel("cpu")
def _paged_attention_cpu(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    return reference.paged_attention_ref(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len,
                                         causal, scale, window).contiguous()


@paged_attention.register_kernel("cuda")
def _paged_attention_cuda(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    B, T, Hq, hd = q.shape
    Hkv = k_new.shape[2]
    L, _, NB, BS = kv_pool.shape[:4]
    ins = (q, k_new, v_new, kv_pool, block_table, kv_start.reshape(B), kv_len.reshape(B))
    spec.SPEC.check_shapes([t.shape for t in ins], {"layer": layer})  # ShapeError: layer out of range, ...
    q, kv_pool = q.contiguous(), kv_pool.contiguous()
    (k_new, k_rs), (v_new, v_rs) = U.rows(k_new), U.rows(v_new)  # slices of the qkv projection: read in place
    U.check_groups(spec.SPEC, (q, k_new, v_new, kv_pool) + ins[4:])
    bt, ks, kl = U.i32(block_table), U.i32(kv_start.reshape(B)), U.i32(kv_len.reshape(B))
    (shape,) = spec.SPEC.output_shapes([q.shape])
    o = torch.empty(shape, device=q.device, dtype=q.dtype)
    # split-KV partials, sized from shapes; inside a CUDA graph capture this lives in the graph's pool
    mma = spec.mma_tiles(U.dname(q), U.dname(kv_pool), U.dname(k_new))
    ws = torch.empty(spec.workspace_bytes(B, T, Hq, Hkv, hd, bt.shape[1] * BS, mma), device=q.device,
                     dtype=torch.uint8)
    launch.paged_attention(q.data_ptr(), k_new.data_ptr(), v_new.data_ptr(), kv_pool.data_ptr(), bt.data_ptr(),
                           ks.data_ptr(), kl.data_ptr(), o.data_ptr(), B=B, T=T, Hq=Hq, Hkv=Hkv, hd=hd, layer=layer,
                           num_blocks=NB, block_size=BS, max_blocks=bt.shape[1], causal=causal, scale=scale,
                           window=window, workspace=ws.data_ptr() if ws.numel() else 0,
                           q_dtype=U.dname(q), n_dtype=U.dname(k_new), p_dtype=U.dname(kv_pool), o_dtype=U.dname(o),
                           stream=U.stream(q), k_rs=k_rs, v_rs=v_rs)
    return o


@paged_attention.register_fake
def _paged_attention_fake(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    return torch.empty_like(q)


@torch.library.custom_op("dflash::kv_write", mutates_args=("kv_pool",))
def kv_write(kv_pool: Tensor, rows: Tensor, block_table: Tensor, pos: Tensor, n: Tensor) -> None:
    raise NotImplementedError("dflash::kv_write: no kernel for this device")


def _check(kv_pool, rows, block_table, pos, n) -> bool:
    """ShapeError unless the shapes fit; False when there is nothing to write (no layers, rows or sequences)."""
    spec.check_kv_write_shapes(U.shape(kv_pool), U.shape(rows), U.shape(block_table), U.shape(pos), U.shape(n))
    return min(rows.shape[0], rows.shape[2], rows.shape[3]) > 0


@kv_write.register_kernel("cpu")
def _kv_write_cpu(kv_pool, rows, block_table, pos, n):
    if not _check(kv_pool, rows, block_table, pos, n):
        return
    reference.kv_write(kv_pool, rows, block_table, pos, n)


@kv_write.register_kernel("cuda")
def _kv_write_cuda(kv_pool, rows, block_table, pos, n):
    if not _check(kv_pool, rows, block_table, pos, n):
        return
    L, _, NB, BS, Hkv, hd = kv_pool.shape
    B, T = rows.shape[2:4]
    if not kv_pool.is_contiguous():
        raise KernelError("kv_write: kv pool must be contiguous (updated in place)")
    rows = rows.contiguous()
    bt, pos, n = U.i32(block_table), U.i32(pos.reshape(B)), U.i32(n.reshape(B))
    launch.kv_write(kv_pool.data_ptr(), bt.data_ptr(), rows.data_ptr(), pos.data_ptr(), n.data_ptr(), B=B, T=T,
                    Hkv=Hkv, hd=hd, L=L, num_blocks=NB, block_size=BS, max_blocks=bt.shape[1],
                    p_dtype=U.dname(kv_pool), n_dtype=U.dname(rows), stream=U.stream(rows))


@kv_write.register_fake
def _kv_write_fake(kv_pool, rows, block_table, pos, n):
    return None
