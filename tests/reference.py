"""NumPy re-derivations of the formulas in ALGORITHMS.md, written independently of loco_jax."""

import numpy as np


def quantize_dequantize(x, bits, block_size=256, fmt="int"):
    """DQ(Q(x)) of a 1-D float array (length a multiple of block_size), round to nearest."""
    x = np.asarray(x, np.float32).reshape(-1, block_size)
    out = np.empty_like(x)
    for i, blk in enumerate(x):
        if not np.all(np.isfinite(blk)):
            out[i] = np.nan
            continue
        amax = np.abs(blk).max()
        if fmt == "e3m0":
            levels = (np.concatenate([[0.0], 2.0 ** np.arange(-6, 1)]) * amax).astype(np.float32)
            mag = levels[np.argmin(np.abs(np.abs(blk)[:, None] - levels[None, :]), axis=1)]
            out[i] = np.where(blk < 0, -mag, mag)
        elif bits == 1:
            scale = np.abs(blk).mean(dtype=np.float32)
            out[i] = np.where(blk >= 0, 1.0, -1.0) * scale
        else:
            qmax = 2 ** (bits - 1) - 1
            scale = np.float32(amax / np.float32(qmax)) if amax > 0 else np.float32(1.0)
            out[i] = np.clip(np.round(blk / scale), -qmax, qmax) * scale
    return out.reshape(-1)


def loco_two_stage_step(g, e, bits, beta, block_size=256, error_bits=8, reset=False):
    """One LoCo step on M devices with the two-stage all-reduce, in NumPy.

    g, e: (M, N) per-device gradients and stored errors, N a multiple of M * block_size.
    Returns (mean every device receives (N,), new stored errors (M, N)).
    """
    m, n = g.shape
    if reset:
        e = np.zeros_like(e)
    h = g + e
    sent = np.stack([quantize_dequantize(h[i], bits, block_size) for i in range(m)])
    e_new = beta * e + (1 - beta) * (h - sent)
    e_store = np.stack([quantize_dequantize(e_new[i], error_bits, block_size) for i in range(m)]) if error_bits else e_new
    chunks = sent.reshape(m, m, n // m).sum(axis=0) / m  # chunk j = mean over devices of row j
    full = np.concatenate([quantize_dequantize(chunks[j], bits, block_size) for j in range(m)])
    return full, e_store
