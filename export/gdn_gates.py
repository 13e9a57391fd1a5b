"""The GDN gates of the target model (model math before the GdnChunkWY16 op, not part of it)."""
import torch
import torch.nn.functional as F

__all__ = ["gdn_gates"]


def gdn_gates(a, b, A_log, dt_bias):
    """a, b [..., Hv] -> (g, beta) in float32 (float64 if any input is float64).

    g = -exp(A_log) * softplus(a + dt_bias) is the per-token log-decay (<= 0); beta = sigmoid(b).
    """
    dt = torch.float64 if torch.float64 in (a.dtype, b.dtype, A_log.dtype, dt_bias.dtype) else torch.float32
    g = -torch.exp(A_log.to(dt)) * F.softplus(a.to(dt) + dt_bias.to(dt))
    beta = torch.sigmoid(b.to(dt))
    return g, beta
