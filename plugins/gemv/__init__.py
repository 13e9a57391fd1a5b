"""GEMV for decode steps: y = x W^T for one row of x, at the weights' HBM read rate."""
