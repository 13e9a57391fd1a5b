"""Launchers of the paged-attention kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int).

Used by the torch ops (torch_op.py) and the TensorRT plugin (trt_plugin.py). Every check reads spec.py
and runs before any launch (KernelError). Index tensors (block_table, kv_start, kv_len, pos, n) are int32.
"""
from __future__ import annotations

from dflash_trt.plugins.cuda_launch import F, I, P, get_function, launch
from dflash_trt.plugins.opspec import dtype_code, kernel_need
from dflash_trt.plugins.paged_attention import spec

KV_WRITE_THREADS = 128


def paged_attention(q, k_new, v_new, pool, block_table, kv_start, kv_len, o, *, B, T, Hq, Hkv, hd, layer,
                    num_blocks, block_size, max_blocks, causal, scale, window=0, q_dtype="bfloat16", n_dtype=None,
                    p_dtype=None, o_dtype=None, workspace=0, stream=0, k_rs=None, v_rs=None):
    """o [B,T,Hq,hd] = attention of q over cached rows [kv_start, kv_len) in pages + T new rows
    (window > 0: sliding, spec.py). Split-KV: `workspace` (device pointer, 16-byte aligned) holds
    spec.workspace_bytes(B, T, Hq, Hkv, hd, max_blocks * block_size, spec.mma_tiles(...)) bytes when that is not 0
    (or spec.workspace_bound); the split pass (tensor cores for 16-bit q and K/V tiles, spec.mma_tiles)
    writes fp32 partials there and the combine pass merges them into o (two launches on `stream`).
    k_rs / v_rs: elements between consecutive (b, t) rows of k_new / v_new (None: Hkv * hd, contiguous; a wider
    stride reads a slice of the projection's rows in place, 16-byte aligned)."""
    spec.check_dims(B, T, Hq, Hkv, hd, block_size)
    k_rs, v_rs = k_rs or Hkv * hd, v_rs or Hkv * hd
    kernel_need(min(k_rs, v_rs) >= Hkv * hd, f"paged_attention: k/v row strides ({k_rs}, {v_rs}) < Hkv*hd")
    max_rows = max_blocks * block_size
    pd, nd = p_dtype or q_dtype, n_dtype or q_dtype
    mma = spec.mma_tiles(q_dtype, pd, nd)
    tiles, nsplit, groups = spec.split_plan(B, T, Hq, Hkv, hd, max_rows, mma)
    ws_bytes = spec.workspace_bytes(B, T, Hq, Hkv, hd, max_rows, mma)
    kernel_need(nsplit <= spec.MAX_SPLITS, f"paged_attention: {nsplit} splits > {spec.MAX_SPLITS}")
    kernel_need(ws_bytes == 0 or (workspace and workspace % 16 == 0),
                f"paged_attention: needs a 16-byte aligned workspace of {ws_bytes} bytes (got {workspace})")
    kernel_need(all(int(p) % 16 == 0 for p in (q, k_new, v_new, pool)),
                "paged_attention: q, k_new, v_new and the kv pool must be 16-byte aligned (vector loads)")
    ws_acc = workspace if ws_bytes else 0
    ws_ml = workspace + B * T * Hq * nsplit * hd * 4 if ws_bytes else 0
    o_code = dtype_code(o_dtype or q_dtype, "attn o")
    args = [(q, P), (dtype_code(q_dtype, "attn q"), I), (k_new, P), (v_new, P),
            (dtype_code(nd, "attn k/v"), I), (pool, P), (dtype_code(pd, "attn kv pool"), I),
            (layer, I), (num_blocks, I), (block_size, I), (block_table, P), (max_blocks, I), (kv_start, P),
            (kv_len, P), (o, P), (o_code, I), (T, I), (Hq, I), (Hkv, I),
            (int(bool(causal)), I), (max(int(window), 0), I), (scale, F), (ws_acc, P), (ws_ml, P), (tiles, I),
            (k_rs, I), (v_rs, I)]
    R = spec.cta_rows(hd, Hq // Hkv, T, mma)
    smem = spec.smem_bytes(hd, spec.tile_elem_bytes(pd, nd), R, mma)
    fn = get_function("paged_attention", spec.kernel_name(hd, pd, nd, R, mma), max_dynamic_smem=smem)
    launch(fn, (nsplit, Hkv * groups, B), (spec.NT, 1, 1), smem, stream, args, pdl=True)
    if ws_bytes:
        rows = B * T * Hq
        ng, rpc = spec.combine_groups(nsplit, hd, rows)
        launch(get_function("paged_attention", "paged_attention_combine"), (-(-rows // rpc), 1, 1),
               (spec.COMBINE_THREADS, 1, 1), 0, stream,
               [(ws_acc, P), (ws_ml, P), (o, P), (o_code, I), (nsplit, I), (hd, I), (ng, I), (rows, I)], pdl=True)


def kv_write(pool, block_table, rows, pos, n, *, B, T, Hkv, hd, L, num_blocks, block_size, max_blocks,
             p_dtype="bfloat16", n_dtype=None, stream=0):
    """In place, all L layers in one launch: row t < n[b] of rows [L,2,B,T,Hkv,hd] -> the pages at logical
    row pos[b] + t of pool [L,2,num_blocks,block_size,Hkv,hd]; pos, n, block_table on the device."""
    spec.check_kv_write_dims(B, T, Hkv, hd, block_size, L)
    args = [(pool, P), (dtype_code(p_dtype, "kv pool"), I), (num_blocks, I), (block_size, I), (block_table, P),
            (max_blocks, I), (rows, P), (dtype_code(n_dtype or p_dtype, "kv rows"), I), (pos, P), (n, P), (B, I),
            (T, I), (Hkv, I), (hd, I)]
    launch(get_function("paged_attention", "kv_write"), (T * Hkv, B, L), (KV_WRITE_THREADS, 1, 1), 0, stream, args,
           pdl=True)
