"""Launchers of the conv kernels (kernel.cu): raw device pointers (ints) + a CUstream handle (int).

Used by the torch ops (torch_op.py) and the TensorRT plugin (trt_plugin.py). Every check reads spec.py
and runs before any launch (KernelError). Index tensors (slot, n) are int32; a null pointer (0) for
``slot`` means "row b uses slot b".
"""
from __future__ import annotations

from dflash_trt.plugins.conv import spec
from dflash_trt.plugins.cuda_launch import I, P, get_function, launch
from dflash_trt.plugins.opspec import dtype_code, kernel_need

THREADS = 128  # channels per CTA (conv_verify: one thread per (row, channel); conv_roll: per channel)


def conv_verify(x, state, slot, weight, y, *, B, T, C, W, x_dtype="bfloat16", s_dtype="bfloat16",
                w_dtype="bfloat16", y_dtype=None, stream=0, x_rs=None):
    """y [B,T,C] = silu(depthwise causal conv of [state | x]); state [*,C,W-1] read-only.
    x_rs: elements between consecutive (b, t) rows of x (None: C, contiguous): a slice of wider projection rows is
    read in place."""
    spec.check_dims(B, T, C, W)
    x_rs = x_rs or C
    kernel_need(x_rs >= C, f"conv_verify: x row stride {x_rs} < C = {C}")
    args = [(x, P), (dtype_code(x_dtype, "conv x"), I), (state, P), (dtype_code(s_dtype, "conv state"), I),
            (slot or 0, P), (weight, P), (dtype_code(w_dtype, "conv weight"), I), (y, P),
            (dtype_code(y_dtype or x_dtype, "conv y"), I), (T, I), (C, I), (W, I), (x_rs, I)]
    launch(get_function("conv", "conv_verify"), ((C + THREADS - 1) // THREADS, T, B), (THREADS, 1, 1), 0, stream, args,
           pdl=True)


def conv_roll(pool, slot, x, n, *, B, T, C, W, L=1, num_slots=0, s_dtype="bfloat16", x_dtype="bfloat16", stream=0):
    """In place, all L layers in one launch: pool[l, slot[b]] <- last W-1 columns of [pool[l, slot[b]] | x_1..x_n[b]].
    pool [L,num_slots,C,W-1]; x [L,B,T,C]; n, slot [B] on the device."""
    spec.check_dims(B, T, C, W)
    kernel_need(L >= 1 and (L == 1 or num_slots >= 1), f"conv_roll: need L >= 1 and num_slots >= 1 (L={L}, "
                f"num_slots={num_slots})")
    args = [(pool, P), (dtype_code(s_dtype, "conv state"), I), (slot or 0, P), (x, P), (dtype_code(x_dtype, "conv x"), I),
            (n, P), (B, I), (num_slots, I), (T, I), (C, I), (W, I)]
    launch(get_function("conv", "conv_roll"), ((C + THREADS - 1) // THREADS, B, L), (THREADS, 1, 1), 0, stream, args,
           pdl=True)
