"""Tensor / expert parallelism over torch.distributed: shard.py splits a loaded target across the ranks of a process
group (heads, intermediate widths, experts, vocabulary) with the collectives after the output projections; launch.py
spawns one process per rank (gloo on CPU, NCCL on CUDA) with timeouts on every collective."""
