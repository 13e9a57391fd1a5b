"""The spec of CausalConvVerify and of its commit kernel conv_roll (DESIGN §3). Math: reference.py.

CausalConvVerify(x, conv_state, weight) -> y
  x [B,T,C] (the pre-conv columns); conv_state [B,C,W-1] (oldest column first, read-only); weight [C,W].
  y [B,T,C] in x's dtype = silu(depthwise causal conv over [conv_state | x]).
conv_roll (runtime commit, all layers in one launch): pool [L,slots,C,W-1] in place; x [L,B,T,C];
  slot [B] (none: slot b), n [B]: pool[l, slot[b]] <- last W-1 columns of [pool[l, slot[b]] | x_1..x_n[b]];
  n = 0 or slot < 0 leaves it untouched.
"""
from __future__ import annotations

from dflash_trt.plugins.opspec import FLOATS, OpSpec, Port, check_float_dtypes, kernel_need, need

KERNEL_MAX_W = 8  # the kernel keeps a W-column window in registers (MAXW in kernel.cu)


def check_dims(B, T, C, W) -> None:
    """The kernels' shape limits (launchers and the plugin)."""
    kernel_need(2 <= W <= KERNEL_MAX_W, f"conv: kernel width W={W} not in [2, {KERNEL_MAX_W}]")
    kernel_need(0 < B <= 65535 and 0 < T <= 65535 and C > 0, f"conv: need 1 <= B, T <= 65535 (the grid) and C >= 1 "
                f"(got {B}, {T}, {C})")


def _output_shapes(ins):
    return [list(ins[0])]


def _check_shapes(d, attrs=None):
    x, s, w = (tuple(v) for v in d)
    need(len(x) == 3 and len(w) == 2 and w[0] == x[2], f"CausalConvVerify: x {x} [B,T,C], weight {w} [C,W]")
    need(s == (x[0], x[2], w[1] - 1), f"CausalConvVerify: conv_state {s} must be [B,C,W-1]")


def _check_kernel(d, dtypes):
    check_float_dtypes("CausalConvVerify", dtypes)
    (B, T, C), W = d[0], d[2][1]
    check_dims(B, T, C, W)


SPEC = OpSpec(
    name="CausalConvVerify",
    inputs=(Port("x", "x", "[B,T,C]"), Port("conv_state", "s", "[B,C,W-1]"), Port("weight", "w", "[C,W]")),
    outputs=(Port("y", "x", "[B,T,C]"),),
    attrs=(),
    groups={"x": FLOATS, "s": FLOATS, "w": FLOATS},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="depthwise causal conv over T new columns after the W-1 previous ones, + SiLU",
    cuda_defines={"MAXW": KERNEL_MAX_W},
)


def check_roll_shapes(pool, x, slot, n) -> None:
    """Shapes of one layer-batched conv_roll call (tuples; slot None = row b uses slot b)."""
    need(len(pool) == 4, f"conv_roll: pool {pool} must be [L,slots,C,W-1]")
    L, S, C, _ = pool
    need(len(x) == 4 and x[0] == L and x[3] == C, f"conv_roll: x {x} must be [L={L},B,T,C={C}]")
    B = x[1]
    need(n == (B,), f"conv_roll: n {n} must be [B] = {(B,)}")
    need(slot is None and B <= S or slot == (B,), f"conv_roll: slot {slot} must be [B] = {(B,)} (or none with B <= slots)")
