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


def loco_step(g, e, bits, beta, *, block_size=256, error_bits=8, reset=False, mode="two_stage", e2=None):
    """One LoCo step on M devices, in NumPy (ALGORITHMS.md sections 2-3).

    g, e: (M, N) per-device gradients and stored errors, N a multiple of M * block_size;
    row i of a device's (M, N / M) bucket is chunk i. e2: (M, N / M) second-stage errors
    (device j's error on chunk j) or None for no second-stage compensation.
    Returns (mean every device receives (N,), new stored errors (M, N), new e2 or None).
    """
    m, n = g.shape
    store = (lambda v: quantize_dequantize(v, error_bits, block_size)) if error_bits else (lambda v: v)
    if reset:
        e = np.zeros_like(e)
        e2 = None if e2 is None else np.zeros_like(e2)
    h = g + e
    sent = np.stack([quantize_dequantize(h[i], bits, block_size) for i in range(m)])
    e_new = np.stack([store(beta * e[i] + (1 - beta) * (h[i] - sent[i])) for i in range(m)])
    if mode == "all_gather":
        return sent.sum(axis=0) / m, e_new, None
    chunks = sent.reshape(m, m, n // m).sum(axis=0) / m  # chunk j = mean over devices of row j
    if e2 is not None:
        h2 = chunks + e2
        sent2 = np.stack([quantize_dequantize(h2[j], bits, block_size) for j in range(m)])
        e2 = np.stack([store(beta * e2[j] + (1 - beta) * (h2[j] - sent2[j])) for j in range(m)])
        return sent2.reshape(-1), e_new, e2
    full = np.concatenate([quantize_dequantize(chunks[j], bits, block_size) for j in range(m)])
    return full, e_new, None
