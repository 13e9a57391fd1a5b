"""PagedAttention and kv_write in plain torch: the exact math (DESIGN §3) the ONNX body, the CUDA kernels
and the TensorRT plugin are tested against; also the CPU implementation of the dflash:: torch ops.

T new query rows attend to a sequence's cached K/V rows (stored in fixed-size pages of a shared
pool, addressed through a block table) plus the T new K/V rows. Causal within the new rows for
the target model, bidirectional within the block for the DFlash drafter. This is the oracle:
pages are gathered with plain indexing, one sequence at a time, no fused kernels.
"""
import torch

__all__ = ["paged_attention_ref", "gather_pages", "kv_write"]


def gather_pages(kv_pool, layer, block_table_row, start, end):
    """Cached K and V rows [start, end) of one sequence -> (K, V), each [end-start, Hkv, hd].

    Logical row j lives in page block_table_row[j // block_size] at offset j % block_size.
    """
    block_size = kv_pool.shape[3]
    rows = torch.arange(int(start), int(end), device=kv_pool.device)
    pages = block_table_row.to(kv_pool.device).long()[rows // block_size]
    offs = rows % block_size
    return kv_pool[layer, 0, pages, offs], kv_pool[layer, 1, pages, offs]


def paged_attention_ref(q, k_new, v_new, kv_pool, layer, block_table, kv_start, kv_len, causal, scale, window=0):
    """q [B,T,Hq,hd]; k_new, v_new [B,T,Hkv,hd]; kv_pool [L,2,num_blocks,block_size,Hkv,hd].

    block_table [B,max_blocks]; kv_start, kv_len int [B]: cached rows [kv_start, kv_len) are
    attended; the T new rows come logically after them. causal=True: new row t sees all cached rows
    and new rows <= t; causal=False: all cached + all T new rows. GQA: q-head h uses kv-head h // r.
    window W > 0 (sliding attention): new row t, at key index Lc + t, also needs Lc + t - s < W for key s.
    Softmax in float32 (float64 if inputs are). Returns o [B,T,Hq,hd] in q's dtype.
    """
    B, T, Hq, hd = q.shape
    Hkv = k_new.shape[2]
    assert Hq % Hkv == 0, f"Hq={Hq} not a multiple of Hkv={Hkv}"
    r = Hq // Hkv
    dt = torch.float64 if torch.float64 in (q.dtype, k_new.dtype, v_new.dtype, kv_pool.dtype) else torch.float32
    kv_start = torch.as_tensor(kv_start).reshape(B)
    kv_len = torch.as_tensor(kv_len).reshape(B)
    outs = []
    for b in range(B):
        Kc, Vc = gather_pages(kv_pool, layer, block_table[b], kv_start[b], kv_len[b])
        K = torch.cat([Kc.to(dt), k_new[b].to(dt)], dim=0)                 # [Lc+T, Hkv, hd]
        V = torch.cat([Vc.to(dt), v_new[b].to(dt)], dim=0)
        Lc = Kc.shape[0]
        # GQA: expand kv heads so q-head h reads kv-head h // r.
        K = K.repeat_interleave(r, dim=1)                                   # [Lc+T, Hq, hd]
        V = V.repeat_interleave(r, dim=1)
        s = torch.einsum("thd,shd->hts", q[b].to(dt), K) * scale            # [Hq, T, Lc+T]
        t_idx = torch.arange(T, device=q.device)[:, None]
        s_idx = torch.arange(Lc + T, device=q.device)[None, :]
        if causal:
            # New row t sees cached rows (s < Lc) and new rows s - Lc <= t.
            s = s.masked_fill(~(s_idx <= Lc + t_idx), float("-inf"))  # [T, Lc+T]
        if window > 0:
            # the row itself (distance 0) is always inside, so no row is left without a key
            s = s.masked_fill(~(Lc + t_idx - s_idx < window), float("-inf"))
        p = torch.softmax(s, dim=-1)
        outs.append(torch.einsum("hts,shd->thd", p, V))
    return torch.stack(outs, dim=0).to(q.dtype)


def kv_write(kv_pool, rows, block_table, pos, n):
    """In place, all layers: row t < n[b] of rows [L,2,B,T,Hkv,hd] -> logical row pos[b] + t of sequence b,
    i.e. page block_table[b, p // block_size] at offset p % block_size of kv_pool [L,2,blocks,bs,Hkv,hd].
    Negative page ids (unallocated) are skipped, as in the kernel."""
    B, T = rows.shape[2:4]
    bs = kv_pool.shape[3]
    dev = kv_pool.device
    n = torch.as_tensor(n).to(dev, torch.long).reshape(B).clamp(0, T)
    pos = torch.as_tensor(pos).to(dev, torch.long).reshape(B)
    b, t = torch.nonzero(torch.arange(T, device=dev)[None, :] < n[:, None], as_tuple=True)
    p = pos[b] + t
    page = block_table.to(dev).long()[b, p // bs]
    keep = page >= 0
    kv_pool[:, :, page[keep], (p % bs)[keep]] = rows.to(dev)[:, :, b[keep], t[keep]].to(kv_pool.dtype)
