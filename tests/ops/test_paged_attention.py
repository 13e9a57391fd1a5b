"""PagedAttention + kv_write (plugins/paged_attention/): the reference against dense SDPA; the ONNX body in ORT
== the reference; the CPU torch ops == the reference; launcher checks; on a GPU the kernels vs the float64
reference; the layer-batched kv_write (CPU op and GPU kernel) == HostDevice, also replayed from a CUDA graph."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_trt.plugins.opspec import KernelError, ShapeError
from dflash_trt.plugins.paged_attention import launch
from dflash_trt.plugins.paged_attention.reference import gather_pages, paged_attention_ref
from dflash_trt.runtime.devices.host import HostDevice

from op_helpers import close, kv_case, record_err, run_op

DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _ops():
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)


def _dense_attention(q, K, V, kn, vn, kv_start, kv_len, causal, scale):
    """Dense reference: contiguous cache K/V [B, maxlen, Hkv, hd], SDPA with an explicit mask."""
    B, T, Hq, hd = q.shape
    r = Hq // K.shape[2]
    outs = []
    for b in range(B):
        L = int(kv_len[b])
        keys = torch.cat([K[b, :L], kn[b]], 0).repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([V[b, :L], vn[b]], 0).repeat_interleave(r, 1).transpose(0, 1)
        pos = torch.arange(L + T)
        mask = (pos[None, :] >= int(kv_start[b])).expand(T, L + T).clone()
        if causal:
            mask &= pos[None, :] <= L + torch.arange(T)[:, None]
        o = F.scaled_dot_product_attention(q[b].transpose(0, 1), keys, vals, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.stack(outs)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("r", [1, 2])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_vs_dense(block_size, T, r, causal):
    gen = torch.Generator().manual_seed(block_size * 100 + T * 10 + r + int(causal))
    B, Hkv, hd, L, max_blocks = 3, 2, 8, 2, 6
    Hq, maxlen = Hkv * r, block_size * max_blocks
    nblocks = B * max_blocks + 3
    kv_len = torch.tensor([0, 5, maxlen - 1])[:B] if block_size == 4 else torch.tensor([17, 1, 60])
    kv_start = torch.tensor([0, 2, 9]) if not causal else torch.zeros(B, dtype=torch.long)
    kv_start = torch.minimum(kv_start, kv_len)
    Kc = torch.randn(B, maxlen, Hkv, hd, generator=gen, dtype=torch.float64)
    Vc = torch.randn(B, maxlen, Hkv, hd, generator=gen, dtype=torch.float64)
    q = torch.randn(B, T, Hq, hd, generator=gen, dtype=torch.float64)
    kn = torch.randn(B, T, Hkv, hd, generator=gen, dtype=torch.float64)
    vn = torch.randn(B, T, Hkv, hd, generator=gen, dtype=torch.float64)
    # Scatter each sequence's contiguous cache into randomly permuted pages of a shared pool;
    # garbage everywhere else (must never be read).
    pool = torch.randn(L, 2, nblocks, block_size, Hkv, hd, generator=gen, dtype=torch.float64) * 100
    perm = torch.randperm(nblocks, generator=gen)
    block_table = perm[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    layer = 1
    for b in range(B):
        for j in range(max_blocks):
            p = int(block_table[b, j])
            pool[layer, 0, p] = Kc[b, j * block_size:(j + 1) * block_size]
            pool[layer, 1, p] = Vc[b, j * block_size:(j + 1) * block_size]
    pool0 = pool.clone()
    scale = hd ** -0.5
    o = paged_attention_ref(q, kn, vn, pool, layer, block_table, kv_start, kv_len, causal, scale)
    ref = _dense_attention(q, Kc, Vc, kn, vn, kv_start, kv_len, causal, scale)
    assert o.shape == (B, T, Hq, hd) and o.dtype == q.dtype
    assert torch.allclose(o, ref, rtol=1e-10, atol=1e-12)
    assert torch.equal(pool, pool0)
    # float32 inputs -> float32 output, close to the float64 one.
    o32 = paged_attention_ref(q.float(), kn.float(), vn.float(), pool.float(), layer, block_table,
                              kv_start, kv_len, causal, scale)
    assert o32.dtype == torch.float32 and torch.allclose(o32.double(), ref, rtol=1e-4, atol=1e-5)


# (kv_start, kv_len) per sequence: empty cache, partial first page, page-aligned, offset start (slid window)
LAYOUTS = [([0, 0], [0, 0]), ([0, 0], [3, 16]), ([0, 5], [32, 37]), ([7, 13], [20, 60])]


@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("causal", [1, 0])
def test_onnx_body_paged_attention(T, Hq, Hkv, layout, causal):
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(T + 7 * Hq + 11 * Hkv + 13 * layout + causal)
    B, hd, L, NB, bs, MB = 2, 16, 3, 20, 8, 8
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    ks, kl = (np.array(x, dtype=np.int64) for x in LAYOUTS[layout])
    bt = np.stack([rng.permutation(NB)[:MB] for _ in range(B)]).astype(np.int64)  # scattered pages
    feeds = dict(q=f(B, T, Hq, hd), k_new=f(B, T, Hkv, hd), v_new=f(B, T, Hkv, hd), kv_pool=f(L, 2, NB, bs, Hkv, hd),
                 block_table=bt, kv_start=ks, kv_len=kl)
    got = run_op("PagedAttention", feeds, {"layer": 2, "causal": causal, "scale": 0.3})["o"]
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    ref = paged_attention_ref(t["q"], t["k_new"], t["v_new"], t["kv_pool"], 2, t["block_table"],
                              t["kv_start"], t["kv_len"], bool(causal), 0.3)
    close(got, ref)


def test_launcher_validates_before_launch():
    with pytest.raises(KernelError, match="head dim 96"):
        launch.paged_attention(0, 0, 0, 0, 0, 0, 0, 0, B=1, T=1, Hq=2, Hkv=1, hd=96, layer=0, num_blocks=1,
                               block_size=16, max_blocks=1, causal=True, scale=1.0)
    with pytest.raises(KernelError, match="L=0"):
        launch.kv_write(0, 0, 0, 0, 0, B=1, T=1, Hkv=1, hd=64, L=0, num_blocks=1, block_size=16, max_blocks=1)


@pytest.mark.parametrize("hd,G,T,want", [(128, 8, 1, 8), (128, 8, 16, 32), (64, 2, 1, 16), (64, 2, 16, 16),
                                          (256, 8, 1, 8), (256, 8, 16, 16), (64, 1, 128, 64)])
def test_rows_per_cta_pads_fewest_rows(hd, G, T, want):
    """CUDA-core tiles (fp32): decode GQA groups (G*T = 8 rows) get the small CTA, verify blocks the full one; the
    workspace bound covers both (it is taken at the largest R of any pass)."""
    from dflash_trt.plugins.paged_attention import spec
    assert spec.cta_rows(hd, G, T) == want
    tiles, nsplit, groups = spec.split_plan(1, T, G * 2, 2, hd, 8192)
    assert groups == -(-G * T // want)
    assert spec.workspace_bytes(1, T, G * 2, 2, hd, 8192) <= spec.workspace_bound(1, T, G * 2, hd)


def test_combine_groups_cover_every_split_plan():
    """For every split plan the launcher can make: the combine pass's groups per row and rows per CTA fill its
    threads exactly, the CTA's (max, sum) pairs fit its shared memory, a few rows keep one CTA each with every
    thread on the row, and many rows pack into CTAs whose groups' first COMBINE_LOADS loads cover the splits."""
    from dflash_trt.plugins.paged_attention import spec
    seen = set()
    for hd in spec.KERNEL_HD:
        for B in (1, 2, 3, 4, 8, 16, 64):
            for T in (1, 5, 16):
                for Hq, Hkv in ((4, 2), (16, 2), (8, 8)):
                    for rows in (16, 256, 1024, 8192 + 16, 32768):
                        for mma in (False, True):
                            nsplit = spec.split_plan(B, T, Hq, Hkv, hd, rows, mma)[1]
                            if nsplit == 1:
                                continue
                            out = B * T * Hq
                            ng, rpc = spec.combine_groups(nsplit, hd, out)
                            seen.add((hd, out, nsplit, ng, rpc))
                            assert ng * rpc * hd // 4 == spec.COMBINE_THREADS, (hd, nsplit, ng, rpc)
                            assert rpc * nsplit <= spec.MAX_SPLITS, (hd, nsplit, rpc)
                            if out <= spec.COMBINE_PACK_ROWS:
                                assert rpc == 1, (hd, out, nsplit)
                            else:
                                assert ng * spec.COMBINE_LOADS >= nsplit or rpc == 1, (hd, nsplit, ng)
    assert (64, 1024, 8, 1, 16) in seen  # the trained pair's batch-16 verify: 16 rows a CTA
    assert (64, 4, 32, 16, 1) in seen    # its batch-1 decode: a CTA a row


@pytest.mark.parametrize("hd,G,T,dtypes,kernel", [
    (128, 8, 1, ("bfloat16",) * 3, "paged_attention_hd128_bf16_mma"),        # decode GQA group: tensor cores too
    (128, 8, 16, ("bfloat16",) * 3, "paged_attention_hd128_bf16_mma"),       # verify block: tensor cores
    (64, 2, 16, ("float16",) * 3, "paged_attention_hd64_f16_mma"),           # 32 rows: one mma CTA, not 2 small
    (256, 1, 5, ("bfloat16",) * 3, "paged_attention_hd256_bf16_mma"),        # 5 rows: one mma CTA
    (256, 6, 1, ("float32",) * 3, "paged_attention_hd256_f32_small"),        # fp32 decode group: a small CTA
    (128, 8, 16, ("float32",) * 3, "paged_attention_hd128_f32"),             # fp32 scores stay on CUDA cores
    (128, 8, 16, ("float32", "bfloat16", "bfloat16"), "paged_attention_hd128_bf16"),  # q of another dtype
])
def test_tensor_core_pass_takes_16_bit_blocks(hd, G, T, dtypes, kernel):
    """The launcher's choice: 16-bit q and K/V tiles run mma.cuh (MMA_ROWS rows a CTA), decode steps too; its
    workspace is within the bound a TensorRT plugin allocates."""
    from dflash_trt.plugins.paged_attention import spec
    q, p, n = dtypes
    mma = spec.mma_tiles(q, p, n)
    R = spec.cta_rows(hd, G, T, mma)
    assert spec.kernel_name(hd, p, n, R, mma) == kernel
    assert spec.split_plan(1, T, G * 2, 2, hd, 8192, mma)[2] == -(-G * T // R)
    assert spec.workspace_bytes(4, T, G * 2, 2, hd, 8192, mma) <= spec.workspace_bound(4, T, G * 2, hd)


@pytest.mark.parametrize("causal", [True, False])
def test_cpu_attention_ops_equal_reference(causal):
    B, T, Hq, Hkv, hd, L, NB, BS = 2, 3, 4, 2, 16, 2, 12, 4
    pool = torch.randn(L, 2, NB, BS, Hkv, hd)
    bt = torch.randperm(NB)[: B * 5].view(B, 5).int()
    ks, kl = torch.tensor([0, 3]), torch.tensor([7, 11])
    q, kn, vn = torch.randn(B, T, Hq, hd), torch.randn(B, T, Hkv, hd), torch.randn(B, T, Hkv, hd)
    o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.25)
    want = paged_attention_ref(q, kn, vn, pool, 1, bt, ks, kl, causal, 0.25)
    torch.testing.assert_close(o, want, rtol=0, atol=0)
    # kv_write then attention over the written rows == attention with those rows as new rows
    p2 = pool.clone()
    rows = torch.stack([torch.stack([kn + layer, vn + layer]) for layer in range(L)])  # [L,2,B,T,Hkv,hd]
    torch.ops.dflash.kv_write(p2, rows, bt, kl, torch.tensor([T, T]))
    o2 = paged_attention_ref(q[:, :0], kn[:, :0], vn[:, :0], p2, 1, bt, ks, kl + T, False, 0.25)
    assert o2.shape[1] == 0
    Kc, Vc = gather_pages(p2, 1, bt[1], kl[1], kl[1] + T)
    assert torch.equal(Kc, kn[1] + 1) and torch.equal(Vc, vn[1] + 1)
    Kc, Vc = gather_pages(p2, 0, bt[0], kl[0], kl[0] + T)  # every layer in the one call
    assert torch.equal(Kc, kn[0]) and torch.equal(Vc, vn[0])


@pytest.mark.parametrize("L,B,T", [(1, 1, 1), (3, 4, 16), (2, 5, 3)])
def test_cpu_kv_write_all_layers_equals_host_device(L, B, T):
    pool, rows, bt, start, n = kv_case(L, B, T, 2, 8, 4, 6, seed=L * 7 + B + T)
    want = pool.copy()
    HostDevice().kv_write(want, rows, bt, start, n)
    got = torch.from_numpy(pool.copy())
    torch.ops.dflash.kv_write(got, *(torch.from_numpy(a) for a in (rows, bt, start, n)))
    assert np.array_equal(got.numpy(), want)


def test_cpu_kv_write_checks_shapes():
    pool, rows, bt, start, n = (torch.from_numpy(a) for a in kv_case(2, 3, 4, 2, 8, 4, 6, seed=0))
    with pytest.raises(ShapeError, match="rows"):
        torch.ops.dflash.kv_write(pool, rows[:1], bt, start, n)


# ------------------------------------------------------------------------------------------- GPU
def _pages(B, T, Hkv, hd, L, BS, max_ctx, seed, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    kv_len = torch.randint(0, max_ctx + 1, (B,), generator=gen)
    kv_start = (torch.rand(B, generator=gen) * kv_len * 0.3).long()
    max_blocks = (max_ctx + T + BS - 1) // BS
    NB = B * max_blocks + 5
    bt = torch.randperm(NB, generator=gen)[: B * max_blocks].view(B, max_blocks).int()
    pool = torch.randn(L, 2, NB, BS, Hkv, hd, generator=gen).to(dtype)
    return pool.to(DEV), bt.to(DEV), kv_start.to(DEV), kv_len.to(DEV)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,G", [(64, 1), (128, 2), (256, 4)])
@pytest.mark.parametrize("T", [1, 5, 16, 128])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_paged_attention_kernel(B, T, hd, G):
    if B == 64 and T == 128 and hd == 256:
        pytest.skip("size")
    Hkv, L, BS = 2, 2, 16
    pool, bt, ks, kl = _pages(B, T, Hkv, hd, L, BS, max_ctx=300 if T < 128 else 200, seed=B + T + hd)
    gen = torch.Generator().manual_seed(hd * T + B)
    q = torch.randn(B, T, Hkv * G, hd, generator=gen).bfloat16().to(DEV)
    kn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    vn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    d = lambda *ts: [t.double() for t in ts]  # noqa: E731
    for causal in (True, False):
        o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, hd ** -0.5)
        want = paged_attention_ref(*d(q, kn, vn, pool), 1, bt, ks, kl, causal, hd ** -0.5)
        record_err(f"paged_attention hd{hd} {'causal' if causal else 'block'}", o, want, 1.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("BS", [1, 12, 48])
@pytest.mark.parametrize("T", [1, 16])
def test_paged_attention_kernel_any_block_size(BS, T):
    """Pages of any size: a power of two takes shifts in the kernel (1, 16, ...), others a division (12, 48); decode
    (CUDA-core small CTA) and verify (tensor cores) rows, one split and several (800 cached rows), bf16."""
    B, Hkv, G, hd, L = 3, 2, 8, 128, 2
    pool, bt, ks, kl = _pages(B, T, Hkv, hd, L, BS, max_ctx=800, seed=BS * 10 + T)
    gen = torch.Generator().manual_seed(BS + T)
    q = torch.randn(B, T, Hkv * G, hd, generator=gen).bfloat16().to(DEV)
    kn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    vn = torch.randn(B, T, Hkv, hd, generator=gen).bfloat16().to(DEV)
    for causal in (True, False):
        o = torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, causal, hd ** -0.5)
        want = paged_attention_ref(*(t.double() for t in (q, kn, vn, pool)), 1, bt, ks, kl, causal, hd ** -0.5)
        record_err(f"paged_attention block size {BS} T {T} {'causal' if causal else 'block'}", o, want, 1.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("B,T", [(1, 1), (8, 16), (64, 5)])
def test_kv_write_kernel(B, T):
    Hkv, hd, L, BS = 2, 128, 3, 16
    pool, bt, ks, kl = _pages(B, T, Hkv, hd, L, BS, max_ctx=100, seed=B * T)
    rows = torch.randn(L, 2, B, T, Hkv, hd).bfloat16().to(DEV)
    n = torch.randint(0, T + 1, (B,), dtype=torch.int32, device=DEV)
    got, want = pool.clone(), pool.clone().cpu()
    torch.ops.dflash.kv_write(got, rows, bt, kl, n)
    torch.ops.dflash.kv_write(want, rows.cpu(), bt.cpu(), kl.cpu(), n.cpu())
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,T,hd", [(1, 1, 1, 64), (4, 8, 16, 128), (3, 64, 5, 256)])
def test_kv_write_all_layers_kernel_equals_host_device(L, B, T, hd):
    pool, rows, bt, start, n = kv_case(L, B, T, 2, hd, 16, 4, seed=L + B + T)
    want = pool.copy()
    HostDevice().kv_write(want, rows, bt, start, n)
    got = torch.from_numpy(pool).to(DEV)
    torch.ops.dflash.kv_write(got, *(torch.from_numpy(a).to(DEV) for a in (rows, bt, start, n)))
    assert np.array_equal(got.cpu().numpy(), want)


@pytest.mark.gpu
def test_cuda_graph_replays_layer_batched_kv_write_with_new_n():
    L, B, T = 3, 4, 8
    pool, rows, bt, start, n = kv_case(L, B, T, 2, 64, 16, 4, seed=9)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    work, dr, dbt, dpos, dn = t(pool), t(rows), t(bt).int(), t(start).int(), t(n).int()
    torch.ops.dflash.kv_write(work.clone(), dr, dbt, dpos, dn)  # warm-up: module load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dflash.kv_write(work, dr, dbt, dpos, dn)
    for new_n in (n, np.array([T, 1, 0, 3]), np.zeros(B, np.int64)):
        want = pool.copy()
        HostDevice().kv_write(want, rows, bt, start, new_n)
        work.copy_(t(pool))
        dn.copy_(t(new_n).int())
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(work.cpu().numpy(), want)


# ------------------------------------------------------------------ GPU: the split-KV path (several key splits)
def _split_case(B, T, Hq, Hkv, hd, ctx, kl, ks, dtype, n_dtype, seed):
    """Pages for `ctx` rows per sequence (scattered, garbage in unused pages), kv_len kl, kv_start ks."""
    gen = torch.Generator().manual_seed(seed)
    BS = 16
    MB = -(-ctx // BS)
    NB = B * MB + 3
    bt = torch.stack([torch.randperm(NB, generator=gen)[:MB] for _ in range(B)]).int()
    pool = torch.randn(2, 2, NB, BS, Hkv, hd, generator=gen).to(dtype)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=gen).to(dt).to(DEV)  # noqa: E731
    return (r(B, T, Hq, hd), r(B, T, Hkv, hd, dt=n_dtype), r(B, T, Hkv, hd, dt=n_dtype), pool.to(DEV), bt.to(DEV),
            torch.tensor(ks, device=DEV), torch.tensor(kl, device=DEV))


SPLIT_CASES = [  # B, T, Hq, Hkv, hd, ctx (block table width in rows), kv_len, kv_start, window
    (1, 1, 16, 2, 128, 2048, [2000], [0], 0),        # one row spans ~64 splits
    (1, 16, 16, 2, 128, 1024, [1000], [37], 0),       # verify block, offset start
    (2, 16, 16, 2, 256, 1024, [0, 700], [0, 0], 0),   # kv_len 0: every cached split empty, only new rows
    (4, 5, 8, 2, 64, 4096, [4000, 1, 2500, 64], [10, 0, 2400, 0], 50),  # window: most splits see no key
    (16, 16, 16, 2, 128, 512, list(range(0, 512, 32)), [0] * 16, 0),   # B 16, T 16
    (3, 2, 4, 4, 128, 3000, [2999, 3000, 5], [0, 1000, 0], 17),          # G = 1, window inside a page
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", range(len(SPLIT_CASES)))
@pytest.mark.parametrize("dtypes", ["bf16", "f16", "f32", "f32 rows, bf16 pool"])
def test_paged_attention_kernel_split_kv(case, dtypes):
    """Several key splits + the combine pass == the float64 reference, causal (target) and non-causal (drafter)."""
    from dflash_trt.plugins.paged_attention import spec
    B, T, Hq, Hkv, hd, ctx, kl, ks, W = SPLIT_CASES[case]
    dt, ndt = {"bf16": (torch.bfloat16,) * 2, "f16": (torch.float16,) * 2, "f32": (torch.float32,) * 2,
               "f32 rows, bf16 pool": (torch.bfloat16, torch.float32)}[dtypes]
    ins = _split_case(B, T, Hq, Hkv, hd, ctx, kl, ks, dt, ndt, seed=case)
    mma = spec.mma_tiles(ins[0].dtype, ins[3].dtype, ins[1].dtype)
    assert spec.split_plan(B, T, Hq, Hkv, hd, ins[4].shape[1] * 16, mma)[1] > 1  # the split path is what runs
    tol = 2e-5 if dtypes == "f32" else 1.5e-2
    for causal in (True, False):
        o = torch.ops.dflash.paged_attention(*ins[:4], 1, *ins[4:], causal, hd ** -0.5, W)
        want = paged_attention_ref(*(x.double() for x in ins[:4]), 1, *ins[4:], causal, hd ** -0.5, W)
        assert o.dtype == ins[0].dtype and torch.isfinite(o).all()
        record_err(f"paged_attention split hd{hd} {dtypes} {'causal' if causal else 'block'}", o, want, tol)


@pytest.mark.gpu
def test_paged_attention_split_kv_replays_in_cuda_graph():
    """The split pass + combine, captured once (workspace from the graph's pool), replayed with new kv_len /
    kv_start / q on the device == the reference each time."""
    B, T, Hq, Hkv, hd, ctx = 2, 4, 16, 2, 128, 1500
    q, kn, vn, pool, bt, ks, kl = _split_case(B, T, Hq, Hkv, hd, ctx, [900, 20], [0, 3], torch.bfloat16,
                                              torch.bfloat16, seed=11)
    run = lambda: torch.ops.dflash.paged_attention(q, kn, vn, pool, 1, bt, ks, kl, True, 0.1)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # module load outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for lens, starts in (([900, 20], [0, 3]), ([1500, 0], [1499, 0]), ([7, 1333], [0, 100])):
        kl.copy_(torch.tensor(lens))
        ks.copy_(torch.tensor(starts))
        q.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = paged_attention_ref(q.double(), kn.double(), vn.double(), pool.double(), 1, bt, ks, kl, True, 0.1)
        record_err("paged_attention split graph replay", out, want, 1.5e-2)
