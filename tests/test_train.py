"""The training package (dflash_trt.tools.train) and the models' training paths.

TargetModel.forward_train / gdn_chunk_dense / Drafter.train_forward are options of the project's own
modules; here they are checked against the graph path the runtime runs (TargetModel.forward_full =
step from empty pools; Drafter.ctx + Drafter.block over pages), fp32 on tiny random configs, gradients
included. Then a CPU smoke run of every stage (prepare on a few stdlib files, train, finalize, tune)
whose output loads through the checkpoint loaders and generates through load_runtime.
"""
import json
import os

import pytest

torch = pytest.importorskip("torch")

from dflash_trt.config import DrafterConfig, TargetConfig  # noqa: E402
from dflash_trt.modeling.drafter import Drafter  # noqa: E402
from dflash_trt.modeling.gdn_dense import gdn_chunk_dense  # noqa: E402
from dflash_trt.modeling.target import TargetModel  # noqa: E402
from dflash_trt.tools.tiny import tiny_drafter_config, tiny_target_config  # noqa: E402
from dflash_trt.tools.train.configs import init_weights  # noqa: E402


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _model(model_type="qwen3_5_text", seed=0, taps=(1, 2)):
    over = {} if model_type == "qwen3_5_text" else dict(model_type="qwen3_next")
    cfg = TargetConfig.from_dict(tiny_target_config(vocab=300, **over))
    m = TargetModel(cfg, list(taps))
    g = torch.Generator().manual_seed(seed)
    init_weights(m, cfg.num_layers, g, std=0.1)
    with torch.no_grad():  # non-trivial norms and gates (init leaves norms at their identity)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return m


def test_tap_rows_follow_tap_ids_order():
    """ctx_hidden concatenates taps in tap_ids order (the drafter's fc columns), also when unsorted: compared
    with the residual stream after each layer, taken by hand from the layers."""
    m = _model(taps=(2, 0))
    ids = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(3))
    H = m.cfg.hidden_size
    with torch.no_grad():
        m.tap_ids = [0, 1, 2]
        rows = m.forward_full(ids)["ctx_hidden"]  # sorted taps: layer 0 | 1 | 2
        m.tap_ids = [2, 0]
        for path in (m.forward_full, m.forward_train):
            got = path(ids)["ctx_hidden"]
            assert _rel(got[..., :H], rows[..., 2 * H:]) < 1e-5 and _rel(got[..., H:], rows[..., :H]) < 1e-5


@pytest.mark.parametrize("chunk", [16, 64])
def test_gdn_chunk_dense_matches_recurrence(chunk):
    from dflash_trt.plugins.gdn.reference import gdn_recurrent

    g = torch.Generator().manual_seed(1)
    B, T, Hk, Hv, dk, dv = 2, 77, 2, 4, 8, 6  # T: several chunks and a padded tail; Hv = 2 Hk
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    q, k, v, S0 = r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv), r(B, Hv, dk, dv)
    gg = -torch.rand(B, T, Hv, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(B, T, Hv, generator=g, dtype=torch.float64)
    o_ref, S_ref = gdn_recurrent(q, k, v, gg, beta, S0)
    o, S = gdn_chunk_dense(q, k, v, gg, beta, S0, chunk=chunk)
    assert o.dtype == torch.float64
    assert _rel(o, o_ref) < 1e-10 and _rel(S, S_ref) < 1e-10


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_forward_train_matches_forward_full(model_type):
    """Logits, tap rows and every parameter's gradient: the training path == the graph path (fp32)."""
    m = _model(model_type)
    ids = torch.randint(0, 300, (2, 70), generator=torch.Generator().manual_seed(2))
    ref = m.forward_full(ids)
    fast = m.forward_train(ids)
    assert _rel(fast["logits"], ref["logits"]) < 1e-4
    assert _rel(fast["ctx_hidden"], ref["ctx_hidden"]) < 1e-4
    assert torch.equal(fast["logits"].argmax(-1), ref["logits"].argmax(-1))

    def grads(logits):
        m.zero_grad()
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 300), ids[:, 1:].reshape(-1)).backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    g_fast, g_ref = grads(m.forward_train(ids)["logits"]), grads(m.forward_full(ids)["logits"])
    assert set(g_fast) == {n for n, _ in m.named_parameters()}
    for n in g_fast:  # reaches A_log, dt_bias, conv1d, norms, ...: every parameter learns
        assert g_fast[n].abs().max() > 0, n
        assert _rel(g_fast[n], g_ref[n]) < 1e-3, n


@pytest.mark.parametrize("over", [{}, dict(conv_kernel_size=3, conv_group_size=16, selector_rank=4, selector_top_k=4)],
                         ids=["dflash", "dflash2"])
def test_drafter_train_forward_matches_ctx_block(over):
    """Several blocks per row with per-block ctx limits == one Drafter.block() per block over ctx() pages
    (DFlash2: its convs run per block, causal from each block's first slot)."""
    from dflash_trt.tools.train.drafter import block_logits, blocks, reference_block_logits

    m = _model(taps=(1, 2))
    dcfg = DrafterConfig.from_dict(tiny_drafter_config(tiny_target_config(vocab=300), layers=2, taps=[1, 2], **over))
    d = Drafter(dcfg, m.cfg.hidden_size, 300).bind_target(m)
    g = torch.Generator().manual_seed(3)
    init_weights(d, 2, g, std=0.1)
    ids = torch.randint(0, 300, (2, 48), generator=g)
    with torch.no_grad():
        ctx = m.forward_train(ids, want_logits=False)["ctx_hidden"]
    anc = torch.tensor([[3, 10, 32], [1, 17, 32]])
    block, _ = blocks(ids, anc, dcfg.mask_token_id)
    fast = block_logits(d, ctx, anc, block)
    for b in range(2):
        ref = reference_block_logits(d, ctx[b:b + 1], anc[b], block[b])
        assert _rel(fast[b].detach(), ref) < 1e-4
    fast.sum().backward()  # the selector picks drafts from the logits: no gradient reaches it through them
    assert all(p.grad is not None and p.grad.abs().max() > 0 for n, p in d.named_parameters()
               if not n.startswith("candidate_selector."))


def test_cli_help(capsys):
    from dflash_trt.tools.train.__main__ import main

    for argv in (["--help"], ["prepare", "--help"], ["train", "--help"], ["finalize", "--help"], ["tune", "--help"],
                 ["all", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0
    assert "How models/ was made" in capsys.readouterr().out


def test_tune_refuses_bf16_data_on_cpu(tmp_path):
    from dflash_trt.tools.train.tune import tune

    with pytest.raises(ValueError, match="need a GPU"):
        tune(str(tmp_path), str(tmp_path), device="cpu", dtypes=("float32", "bfloat16"))


def test_tune_data_cache_round_trips_without_pickle(tmp_path):
    """tune's data cache: safetensors, every tensor back bit for bit with its dtype, held-out sets in dtype order,
    slices of one tensor (shared storage) saved too."""
    from dflash_trt.tools.train.tune import _load_data, _save_data

    s, p, c = torch.arange(20).view(5, 4), torch.arange(5), torch.randn(5, 3, 8)
    train = (s[2:], p[2:], c[2:])
    held = {"float32": (s[:2], p[:2], c[:2]), "bfloat16": (s[:1], p[:1], c[:1].bfloat16())}
    path = str(tmp_path / "tune_data.safetensors")
    _save_data(path, train, held)
    with open(path, "rb") as f:
        assert not f.read(2).startswith(b"\x80")  # not a pickle stream
    got_train, got_held = _load_data(path, ("float32", "bfloat16"), torch.device("cpu"))
    assert list(got_held) == ["float32", "bfloat16"]
    for a, b in zip(train + held["float32"] + held["bfloat16"], got_train + got_held["float32"] + got_held["bfloat16"]):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_stages_smoke(tmp_path):
    """prepare -> train -> finalize -> tune on CPU, tiny; the result loads and generates (spec == plain)."""
    pytest.importorskip("tokenizers")
    from dflash_trt import PoolSizes, load_runtime
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.tools.train.__main__ import main

    work, out, models = str(tmp_path / "work"), str(tmp_path / "run"), str(tmp_path / "models")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main(["prepare", "--work", work, "--max-files", "6", "--vocab", "320", "--prompts", "4"])
    meta = json.load(open(os.path.join(work, "meta.json")))
    assert meta["train_files"] == 6 and meta["heldout_files"] == 1 and meta["vocab"] <= 320
    main(["train", "--work", work, "--out", out, "--small", "--device", "cpu", "--target-steps", "3",
          "--drafter-steps", "3", "--n-gen", "8", "--n-held", "4", "--gen-len", "48"])
    log = json.load(open(os.path.join(out, "train_log.json")))
    assert log["target"]["steps"] == 3 and log["drafter"]["steps"] == 3
    assert log["check_target_fast_vs_reference"]["max_abs_diff"] < 1e-3
    assert log["check_drafter_fast_vs_reference"]["max_abs_diff"] < 1e-3
    main(["finalize", "--src", out, "--work", work, "--models", models])
    main(["tune", "--models", models, "--work", work, "--n-train", "8", "--n-held", "4", "--steps", "2",
          "--batch", "4", "--new-tokens", "24", "--device", "cpu"])
    assert len(json.load(open(os.path.join(models, "train_log.json")))["drafter_tunes"]) == 1
    assert [f.split(".")[-1] for f in os.listdir(work) if f.startswith("tune_data_")] == ["safetensors"]  # no pickle
    snip = str(tmp_path / "snippets.json")  # the GPU route: snippets chosen here, tune reads no corpus
    main(["snippets", "--models", models, "--work", work, "--out", snip, "--n-train", "8", "--n-held", "4",
          "--lengths", "0"])
    sn = json.load(open(snip))
    assert len(sn["train"]) == 8 and len(sn["heldout"]) == 4 and all(x.startswith("def ") for x in sn["train"])
    main(["tune", "--models", models, "--work", str(tmp_path / "elsewhere"), "--snippets", snip, "--steps", "2",
          "--batch", "4", "--new-tokens", "24", "--device", "cpu", "--replay", "10"])
    tunes = json.load(open(os.path.join(models, "train_log.json")))["drafter_tunes"]
    assert len(tunes) == 2 and tunes[1]["snippets_file"] == snip and tunes[1]["n_train"] == 8

    tdir, ddir = os.path.join(models, "target"), os.path.join(models, "drafter")
    t = load_target(tdir, torch.float32)
    load_drafter(ddir, t, torch.float32)
    rt, codec = load_runtime(tdir, ddir, "torch", PoolSizes(max_seq_len=128, kv_blocks=16, dkv_blocks=16))
    ids = codec.encode("def f(x):\n    return")
    plain, _ = rt.generate(ids, 12, spec=False)
    spec, st = rt.generate(ids, 12, gamma=4)
    assert spec == plain and 1 <= len(plain) <= 12
    # the tune data's ragged batch (prompts of different lengths in one Runtime) == each prompt alone
    from dflash_trt.tools.train.generate import greedy_continue_ragged

    prompts = [ids, codec.encode("def g(a, b):\n    if a:"), ids[:3]]
    for p, row in zip(prompts, greedy_continue_ragged(t, prompts, 12)):
        alone, _ = rt.generate(p, 12, spec=False)
        assert row[:len(p)] == p and row[len(p):len(p) + len(alone)] == alone
