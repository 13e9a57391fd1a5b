"""z-lab's reference DFlash2 drafter (the `dflash` package) on a tiny transformers target: built with random weights,
trained a few steps on the target's own greedy continuations so its drafts get accepted, saved with
save_pretrained. `dflash` is installed without its deps (torch + transformers only are imported)."""
import importlib.util

import pytest
import torch

VOCAB, BS = 251, 6  # the target's vocabulary (tests/hf_tiny.py), the drafter's block size
TAPS = [1, 3]
DFLASH2 = dict(conv_kernel_size=3, conv_group_size=16, selector_rank=8, selector_top_k=5)


def dflash_model():
    """dflash.model, or a skip that says how to install it."""
    if importlib.util.find_spec("dflash") is None:
        pytest.skip("z-lab's dflash is not installed: pip install --no-deps dflash==0.1.0 (the DFlash2 oracle)")
    from dflash import model

    return model


def ref_config(block_size=BS, **over):
    from transformers import Qwen3Config

    # conv sizes in dflash_config, selector sizes at top level: the reference reads dflash_config first
    dc = dict(target_layer_ids=TAPS, mask_token_id=VOCAB - 1, block_size=block_size,
              conv_kernel_size=DFLASH2["conv_kernel_size"], conv_group_size=DFLASH2["conv_group_size"])
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                      max_position_embeddings=512, tie_word_embeddings=False)
    cfg.architectures = ["DFlash2DraftModel"]
    cfg.num_target_layers = 6
    cfg.dflash_config = dc
    cfg.selector_rank, cfg.selector_top_k = DFLASH2["selector_rank"], DFLASH2["selector_top_k"]
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def greedy_sequences(target, prompts, n):
    """The target's greedy continuation of each prompt (n new tokens), full token lists."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = target.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            out.append(ids[0].tolist())
    return out


def _train_batch(dm, target, seqs, gen):
    """One block per sequence at a random anchor a: ctx = target features of rows [0, a), the block
    [tok_a, MASK...] predicts tok_{a+1..}. Loss: the drafter's logits, and the selector's scores along the
    true path (teacher forcing) whenever the true token is among the candidates."""
    mdl = dflash_model()
    losses = []
    head = target.lm_head
    for s in seqs:
        a = int(torch.randint(4, len(s) - BS, (1,), generator=gen))
        ids = torch.tensor([s])
        with torch.no_grad():
            hs = target(ids[:, :a], output_hidden_states=True).hidden_states
        ctx = mdl.extract_context_feature(hs, dm.target_layer_ids)
        block = torch.tensor([[s[a]] + [dm.mask_token_id] * (BS - 1)])
        noise = target.get_input_embeddings()(block)
        h = dm(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(a + BS)[None])[:, 1:]
        logits = dm.compute_logits(h, head)
        labels = torch.tensor([s[a + 1:a + BS]])
        losses.append(torch.nn.functional.cross_entropy(logits[0], labels[0]))
        sel = dm.candidate_selector
        unary, cand = torch.topk(logits, sel.top_k, dim=-1)
        hp = sel.hidden_projection(h)
        prev = torch.tensor([s[a:a + BS - 1]])  # teacher forcing: the true predecessor of each slot
        scores = unary + torch.einsum("bjr,bjkr->bjk", sel.predecessor_codebook(prev) * hp,
                                      sel.successor_codebook(cand))
        hit = cand == labels[..., None]
        rows = hit.any(-1)
        if rows.any():
            losses.append(torch.nn.functional.cross_entropy(scores[rows], hit[rows].float().argmax(-1)))
    return torch.stack(losses).mean()


def trained_reference(target, seqs, steps=60, seed=0, **over):
    """A reference DFlash2DraftModel, randomly initialised (the conv base kernels near the identity tap, the
    codebooks large enough that the selector overrides the drafter's argmax now and then) and trained `steps`
    Adam steps on `seqs`."""
    mdl = dflash_model()
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    dm = mdl.DFlash2DraftModel(ref_config(**over)).float()
    with torch.no_grad():
        for n, p in dm.named_parameters():
            if n.endswith("base_kernel"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
                p[:, 0] += 1.0
            elif "codebook" in n:
                p.copy_(0.7 * torch.randn(p.shape, generator=gen))
            elif "norm" in n:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    opt = torch.optim.Adam(dm.parameters(), lr=3e-3)
    dm.train()
    for _ in range(steps):
        opt.zero_grad()
        _train_batch(dm, target, seqs, gen).backward()
        opt.step()
    return dm.eval()
