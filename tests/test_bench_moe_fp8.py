"""`bench e2e --model random-moe-35b-a3b --fp8` on the CPU with the preset's dims shrunk: the routed experts and
projections become FP8 as the release stores them (router and shared-expert gate kept 16-bit), every FP8 tensor
filled, the drafter quantized; the floor counts an expert's fp8 bytes and block scales once, and no expert tensor
as a dense weight."""
import pytest
import torch

from dflash_trt.modeling.fp8 import Fp8Experts, Fp8Linear
from dflash_trt.tools import bench_moe

SMALL = dict(vocab_size=512, hidden_size=256, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
             head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2, num_experts=8, moe_intermediate_size=128,
             shared_expert_intermediate_size=128)


@pytest.fixture
def small_preset(monkeypatch):
    target_cfg, drafter_cfg = bench_moe.moe_target_config, bench_moe.moe_drafter_config
    monkeypatch.setattr(bench_moe, "moe_target_config", lambda layers: {**target_cfg(layers), **SMALL})
    monkeypatch.setattr(bench_moe, "moe_drafter_config", lambda layers: {
        **drafter_cfg(layers), "hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 2,
        "num_key_value_heads": 1, "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 511}})


def test_fp8_preset_quantizes_experts_and_projections_as_released(small_preset):
    target, drafter = bench_moe.build_random_moe(torch.bfloat16, "cpu", 4, fp8=True)
    block = target.layers[0].mlp
    assert isinstance(block.experts, Fp8Experts) and isinstance(block.shared_expert.gate_proj, Fp8Linear)
    assert block.gate.weight.dtype == torch.bfloat16 and block.shared_expert_gate.weight.dtype == torch.bfloat16
    assert target.lm_head.weight.dtype == torch.bfloat16
    assert isinstance(drafter.layers[0].mlp.gate_proj, Fp8Linear)
    for w, s in ((block.experts.gate_up_proj, block.experts.gate_up_proj_scale_inv),
                 (block.experts.down_proj, block.experts.down_proj_scale_inv)):
        assert w.dtype == torch.float8_e4m3fn and bool((w.float() != 0).float().mean() > 0.9)  # every expert filled
        assert bool((s > 0).all())
    dense, _ = bench_moe.build_random_moe(torch.bfloat16, "cpu", 4)
    assert dense.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16


def test_floor_counts_fp8_experts_once_with_their_scales(small_preset):
    target, _ = bench_moe.build_random_moe(torch.bfloat16, "cpu", 4, fp8=True)
    ex = target.layers[0].mlp.experts
    E, H, I = 8, 256, 128  # noqa: E741
    one = 3 * I * H + 4 * (2 * I // 128 * H // 128 + H // 128 * I // 128)  # fp8 bytes + fp32 scales of one expert
    assert bench_moe._expert_bytes(target) == one == sum(p.numel() * p.element_size() for p in ex.parameters()) // E
    pools = {"gdn_pool": torch.zeros(3, 2, 2, 128, 128), "conv_pool": torch.zeros(3, 2, 8, 3),
             "kv_pool": torch.zeros(1, 2, 4, 16, 1, 128)}
    moe_layers = sum(hasattr(layer.mlp, "experts") for layer in target.layers)
    stored = sum(p.numel() * p.element_size() for layer in target.layers if hasattr(layer.mlp, "experts")
                 for p in layer.mlp.experts.parameters())
    assert stored == moe_layers * E * one
    everything = sum(p.numel() * p.element_size() for p in target.parameters())
    emb = target.embed_tokens.weight
    state = 3 * (2 * 128 * 128 + 8 * 3) * 4 + 2 * 128 * 4  # 3 GDN layers: state + conv slot; one K and V row (K=1)
    # every parameter but the experts and the embedding table (its one row a token reads), the state, the experts
    # the step selects
    dense = everything - stored - emb.numel() * emb.element_size() + H * emb.element_size()
    assert bench_moe.step_bytes(target, pools, 0, 1, []) == dense + state
    assert bench_moe.step_bytes(target, pools, 0, 1, [3.0] * moe_layers) == dense + state + 3 * moe_layers * one


def test_conversion_frees_each_replaced_module_as_its_twin_lands(small_preset, monkeypatch):
    """quantize_modules keeps no reference to the modules it replaced: at every twin made, the ones replaced before
    are gone (a 64-layer target converted on the GPU then peaks at its 16-bit size plus one twin)."""
    import weakref

    from dflash_trt.modeling import fp8
    from dflash_trt.tools.bench_dense import fp8_config

    target, _ = bench_moe.build_random_moe(torch.bfloat16, "cpu", 4)
    seen, alive_at_each = [], []
    real = fp8._fp8_twin

    def twin(owner, child, mod, q, path):
        made = real(owner, child, mod, q, path)
        if made is not None:  # mod is about to be replaced
            alive_at_each.append(sum(r() is not None for r in seen))
            seen.append(weakref.ref(mod))
        return made

    monkeypatch.setattr(fp8, "_fp8_twin", twin)
    done = fp8.quantize_modules(target, fp8_config(bench_moe.FP8_SKIP_MOE), "model.")
    assert len(done) > 10 and alive_at_each[-1] == 0 and max(alive_at_each) == 0
