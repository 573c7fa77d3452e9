"""NumPy re-derivations of the formulas in docs/algorithms.md, written independently of loco_jax."""

import functools

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


def _q(v, bits, block_size, fmt):
    if fmt in ("uniform", "lloyd"):
        return fitted_quantize_dequantize(v, bits, fmt, block_size).astype(np.float32)
    return quantize_dequantize(v, bits, block_size, fmt)


def loco_step(g, e, bits, beta, *, block_size=256, error_bits=8, reset=False, mode="two_stage", e2=None, fmt="int"):
    """One LoCo step on M devices, in NumPy (docs/algorithms.md, "3. Quantized collectives" and "4. LoCo error compensation").

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
    sent = np.stack([_q(h[i], bits, block_size, fmt) for i in range(m)])
    e_new = np.stack([store(beta * e[i] + (1 - beta) * (h[i] - sent[i])) for i in range(m)])
    if mode == "all_gather":
        return sent.sum(axis=0) / m, e_new, None
    chunks = sent.reshape(m, m, n // m).sum(axis=0) / m  # chunk j = mean over devices of row j
    if e2 is not None:
        h2 = chunks + e2
        sent2 = np.stack([_q(h2[j], bits, block_size, fmt) for j in range(m)])
        e2 = np.stack([store(beta * e2[j] + (1 - beta) * (h2[j] - sent2[j])) for j in range(m)])
        return sent2.reshape(-1), e_new, e2
    full = np.concatenate([_q(chunks[j], bits, block_size, fmt) for j in range(m)])
    return full, e_new, None


@functools.lru_cache(maxsize=None)
def gaussian_lloyd_max(n, iters=4000):
    """Lloyd-Max levels of N(0, 1) with n levels: the centroid iteration on scipy's normal CDF (an independent
    derivation)."""
    from scipy import special

    pdf = lambda t: np.exp(-0.5 * t * t) / np.sqrt(2 * np.pi)  # noqa: E731  (0 at +-inf)
    levels = np.linspace(-2.0, 2.0, n)
    for _ in range(iters):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        mass = special.ndtr(edges[1:]) - special.ndtr(edges[:-1])
        levels = (pdf(edges[:-1]) - pdf(edges[1:])) / mass
    return levels


@functools.lru_cache(maxsize=None)
def gaussian_uniform_step(n):
    """The MSE-optimal step of an n-level mid-rise uniform quantizer of N(0, 1), by numerical integration.

    E(t - Q(t))^2 is integrated with the trapezoid rule on a fine grid over [-12, 12] (the library uses
    the closed form of each cell; this is the independent check), then minimised over the step."""
    from scipy import optimize, stats

    trapezoid = getattr(np, "trapezoid", None) or np.trapz  # numpy < 2 names it trapz
    t = np.linspace(-12.0, 12.0, 480_001)
    pdf = stats.norm.pdf(t)

    def mse(step):
        k = np.clip(np.floor(t / step + n / 2), 0, n - 1)
        return trapezoid((t - (k + 0.5 - n / 2) * step) ** 2 * pdf, t)

    return optimize.minimize_scalar(mse, bounds=(0.01, 3.0), method="bounded", options={"xatol": 1e-7}).x


def fitted_quantize_dequantize(x, bits, fmt, block_size=256):
    """DQ(Q(x)) of the ``uniform`` / ``lloyd`` formats: codes at the RMS-fitted grid, least-squares scale."""
    x = np.asarray(x, np.float64).reshape(-1, block_size)
    n = 2**bits
    if fmt == "uniform":
        step = gaussian_uniform_step(n)
        unit = (2 * np.arange(n) + 1 - n) / (n - 1)
    else:
        gl = gaussian_lloyd_max(n)
        unit = gl / gl[-1]
        edges = (gl[1:] + gl[:-1]) / 2
    out = np.empty_like(x)
    for i, blk in enumerate(x):
        amax = np.abs(blk).max()
        if amax == 0:
            out[i] = 0.0
            continue
        y = blk / np.sqrt(np.mean(blk**2))
        k = np.clip(np.floor(y / step + n / 2), 0, n - 1).astype(int) if fmt == "uniform" else np.searchsorted(edges, y)
        level = unit[k]
        s = max(np.dot(blk / amax, level) / np.dot(level, level), 0.0)
        out[i] = level * min(s * amax, np.finfo(np.float32).max)
    return out.reshape(-1)


def randomized_hadamard(x, signs):
    """(x * signs) @ H / sqrt(n) for each row block, with scipy's Sylvester Hadamard matrix."""
    from scipy.linalg import hadamard

    n = x.shape[-1]
    return (np.asarray(x, np.float64) * signs) @ hadamard(n) / np.sqrt(n)
