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
    """The target's greedy continuation of each prompt (n new tokens; prompts of one length), full token lists."""
    with torch.no_grad():
        ids = torch.tensor(prompts)
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                               min_new_tokens=n).tolist()


def _train_step(dm, target, seqs, feats, gen):
    """One batch of blocks, one per sequence at a common random anchor a: ctx = the target features of rows
    [0, a), the block [tok_a, MASK...] predicts tok_{a+1..}. Loss: the drafter's logits, and the selector's scores
    along the true path (teacher forcing) wherever the true token is among the candidates."""
    a = int(torch.randint(4, seqs.shape[1] - BS, (1,), generator=gen))
    block = torch.cat([seqs[:, a:a + 1], torch.full((len(seqs), BS - 1), dm.mask_token_id)], 1)
    h = dm(target_hidden=feats[:, :a], noise_embedding=target.get_input_embeddings()(block),
           position_ids=torch.arange(a + BS)[None])[:, 1:]
    logits = dm.compute_logits(h, target.lm_head)
    labels = seqs[:, a + 1:a + BS]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    sel = dm.candidate_selector
    unary, cand = torch.topk(logits, sel.top_k, dim=-1)
    prev = seqs[:, a:a + BS - 1]  # teacher forcing: the true predecessor of each slot
    scores = unary + torch.einsum("bjr,bjkr->bjk", sel.predecessor_codebook(prev) * sel.hidden_projection(h),
                                  sel.successor_codebook(cand))
    hit = cand == labels[..., None]
    rows = hit.any(-1)
    if rows.any():
        loss = loss + torch.nn.functional.cross_entropy(scores[rows], hit[rows].float().argmax(-1))
    return loss


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
    seqs = torch.tensor(seqs)
    with torch.no_grad():  # causal target: the features of rows [0, a) are those of the full sequences
        feats = mdl.extract_context_feature(target(seqs, output_hidden_states=True).hidden_states,
                                            dm.target_layer_ids)
    opt = torch.optim.Adam(dm.parameters(), lr=3e-3)
    dm.train()
    for _ in range(steps):
        opt.zero_grad()
        _train_step(dm, target, seqs, feats, gen).backward()
        opt.step()
    return dm.eval()
