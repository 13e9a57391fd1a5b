"""CausalConvVerify and conv_roll in plain torch: the exact math (DESIGN §3) the ONNX body, the CUDA kernels
and the TensorRT plugin are tested against; also the CPU implementation of the dflash:: torch ops.
Inputs are never mutated. Shapes: see spec.py.
"""
import torch
import torch.nn.functional as F

__all__ = ["conv_verify", "conv_roll", "conv_roll_layers"]


def conv_verify(x, conv_state, weight):
    """Depthwise causal conv + SiLU over T new columns (DESIGN §3, CausalConvVerify).

    x [B,T,C]; conv_state [B,C,W-1] (oldest first); weight [C,W]. y_t uses columns t-W+1..t of
    [state | x], i.e. window [t, t+W-1] of the concatenation (0-based). Returns y [B,T,C].
    """
    dt = torch.promote_types(torch.promote_types(x.dtype, conv_state.dtype), weight.dtype)
    W = weight.shape[-1]
    assert conv_state.shape[-1] == W - 1
    full = torch.cat([conv_state.to(dt), x.to(dt).transpose(1, 2)], dim=-1)  # [B,C,W-1+T]
    win = full.unfold(-1, W, 1)                                               # [B,C,T,W]
    y = (win * weight.to(dt)[None, :, None, :]).sum(-1)                       # [B,C,T]
    return F.silu(y).transpose(1, 2)


def conv_roll(conv_state, x, n):
    """New conv state = last W-1 columns of [state | x_1..x_n] per sequence (DESIGN §3, conv roll).

    conv_state [B,C,W-1]; x [B,T,C] (the pre-conv columns the graph outputs); n int [B], 0..T.
    """
    B, C, Wm1 = conv_state.shape
    dt = torch.promote_types(conv_state.dtype, x.dtype)
    full = torch.cat([conv_state.to(dt), x.to(dt).transpose(1, 2)], dim=-1)  # [B,C,W-1+T]
    n = n.to(device=conv_state.device, dtype=torch.long).reshape(B)
    # Columns n .. n+W-2 of the concatenation are the W-1 newest after taking n new columns.
    idx = n[:, None] + torch.arange(Wm1, device=conv_state.device)[None, :]   # [B,W-1]
    return full.gather(2, idx[:, None, :].expand(B, C, Wm1))


def conv_roll_layers(conv_state, x, n):
    """conv_roll over L layers at once: conv_state [L,B,C,W-1]; x [L,B,T,C]; n [B] (same per layer)."""
    L, B = x.shape[:2]
    n = n.to(device=conv_state.device, dtype=torch.long).reshape(1, B).expand(L, B).reshape(L * B)
    out = conv_roll(conv_state.reshape(L * B, *conv_state.shape[2:]), x.reshape(L * B, *x.shape[2:]), n)
    return out.reshape(L, B, *out.shape[1:])
