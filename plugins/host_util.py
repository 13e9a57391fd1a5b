"""What the numpy twins of the commit kernels (plugins/<op>/host.py) share. numpy only."""
from __future__ import annotations

import numpy as np


def commit_counts(n, B: int, T: int | None = None) -> np.ndarray:
    """Rows to commit per sequence as int64 [B]; with T, checked to lie in [0, T]."""
    n = np.asarray(n, dtype=np.int64).reshape(-1)
    if n.shape[0] != B:
        raise ValueError(f"n has {n.shape[0]} entries, batch is {B}")
    if T is not None and (np.any(n < 0) or np.any(n > T)):
        raise ValueError(f"n must be in [0, {T}], got {n.tolist()}")
    return n
