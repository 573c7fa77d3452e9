"""Block-wise low-bit quantizers and their packing into ``uint8``.

Every quantizer here works on *blocks*: the last axis of its input is one block
of ``block_size`` values (default 256) that shares one fp32 scale.

``format="int"`` (8, 4, 2 bits): symmetric absmax integers::

    qmax  = 2**(b - 1) - 1                   # 127, 7, 1
    scale = max|x| / qmax                    # 1 for an all-zero block
    q     = clip(round(x / scale), -qmax, qmax)
    DQ(q) = q * scale

``format="int"`` at 1 bit: the scaled sign::

    q     = sign(x), with sign(0) = +1
    scale = mean|x|                          # 0 for an all-zero block
    DQ(q) = q * scale

``format="e3m0"`` (4 bits only; the float Streaming DiLoCo uses for outer
gradients): 1 sign bit and a 3-bit exponent field ``e``; ``e = 0`` is zero,
``e = 1..7`` is ``scale * 2**(e - 7)`` with ``scale = max|x|``. Each value is
rounded to the nearest representable magnitude (linear distance), so the 15
distinct values are ``0, +-scale * 2**k`` for ``k = -6..0``.

``format="uniform"`` (8, 4, 2, 1 bits): every one of the ``N = 2**b`` codes is
a level, on a mid-rise grid fitted to the block's RMS and then to the block::

    u     = x / max|x|;   r = sqrt(mean(u**2))   # normalised first: no overflow
    y     = u / r                                # the block in units of its RMS
    k     = clip(floor(y / D_N + N / 2), 0, N-1) # D_N: the MSE-optimal step for N(0, 1)
    L_k   = (2 k + 1 - N) / (N - 1)              # unit levels, the outer ones +-1
    s     = max(<u, L> / <L, L>, 0)              # least-squares scale for these codes
    scale = min(max|x| * s, float32 max);   DQ(k) = L_k * scale

so 2 bits has four levels ``{-3, -1, 1, 3} / 3 * scale`` (no code wasted on an
exact zero). Values beyond the outer level are clipped; what is clipped is
quantization error like any other, and error feedback sees it. The
least-squares scale never raises the block's error above assigning the same
codes at the RMS-fitted scale, and never above ``|x|^2`` (sending nothing); as a
projection it keeps ``|DQ| <= |x|``. Working in units of ``max|x|`` keeps huge
blocks from overflowing; only a scale beyond float32's range is capped there.
An all-zero block gets ``scale = 0``.
At 1 bit the codes are ``sign(x)`` and ``scale = mean|x|``, the ``int`` format's.

``format="lloyd"`` (4, 2, 1 bits): the same assignment-then-least-squares scale,
with the Lloyd-Max levels of a unit Gaussian (``LLOYD_LEVELS``; 2 bits:
``+-0.4528, +-1.5104``) as the unit levels, so the levels are denser where
Gaussian values are; codes come from comparisons with the midpoints and
decode by table lookup. After a random rotation (below) a block is close to
Gaussian whatever the gradient's shape, which is what these levels assume.

Rotation (``rotate(x, block_size, seed)``): each block is multiplied by random
signs ``S`` and by the normalised Walsh-Hadamard matrix ``H / sqrt(n)``, an
orthogonal map (``unrotate`` is ``S H / sqrt(n)``). It spreads an outlier over
its block so the block's values look Gaussian, and it keeps a NaN inside its
block. The signs are a hash of the column index and ``seed``, so every device
computes the same rotation with nothing stored or sent, and the map is linear:
a sum of rotated blocks is the rotation of the sum. The transform of a block
of ``n = a b`` values (``a``, ``b`` powers of two, ``a = b`` or ``2a = b``) is
``H_a X H_b`` on the block laid out as an ``a x b`` matrix ``X``, because the
Sylvester matrix factors as ``H_n = H_a (x) H_b``: two small matmuls, ``a + b``
(32 at n = 256) multiply-adds per value in float32 at full precision, which
XLA runs faster on CPU than the ``log2 n`` passes of a butterfly.

Stochastic rounding (pass ``key``) replaces round-to-nearest by an unbiased
random choice between the two neighbouring levels, ``E[DQ(Q(x))] = x``. At
1 bit that needs the scale ``max|x|`` and ``P(q = +1) = (1 + x / scale) / 2``.
It needs a grid that covers the block (``int`` and ``e3m0``): a clipping
format cannot round without bias, so ``uniform`` and ``lloyd`` refuse a key.
The caller derives one key per device (``fold_in(key, axis_index)``).

Non-finite input: a block holding NaN or Inf is detected *before* rounding
(``round(NaN)`` cast to an integer is garbage); its codes are set to zero and
its scale to NaN, so it decodes to NaN and the caller sees it, exactly as an
exact sum would propagate it. ``finite_blocks(scales)`` tells which blocks
were clean.

Subnormal inputs (below float32's smallest normal, 1.2e-38) are treated as
zero, as XLA's flush-to-zero arithmetic on CPU and GPU would treat them
anyway; doing it explicitly makes every format agree on it.

Codes are unsigned: ``q + qmax`` for the integer formats, the sign bit for
1 bit (1 = +1), ``sign << 3 | e`` for e3m0, the level index ``k`` for ``uniform`` and ``lloyd``. ``pack`` puts ``8 / b`` codes into
each byte (exact inverse: ``unpack``). ``encode`` / ``decode`` lay out a whole
``(rows, cols)`` array as one ``uint8`` payload per row: the packed codes
followed by the fp32 scales bitcast to bytes, so a collective moves one
``uint8`` buffer. Wire cost per value: ``b + 32 / block_size`` bits (4.125 at
4 bits and the default block), 0.129 of fp32.

Reference: docs/algorithms.md, "2. Low-bit formats"; LoCo (arXiv 2407.04480) and Streaming
DiLoCo (arXiv 2501.18512, section on quantized exchange).

Why one module of this size: every format shares the block layout, the packing and the payload
encoding (codes and scales in one uint8 buffer), which the collectives rely on being one definition.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loco_jax.checks import require_int

BITS = (1, 2, 4, 8)
Format = Literal["int", "e3m0", "uniform", "lloyd"]
FORMATS = get_args(Format)
FORMAT_BITS = {"int": (1, 2, 4, 8), "e3m0": (4,), "uniform": (1, 2, 4, 8), "lloyd": (1, 2, 4)}
ROUNDING_FORMATS = ("int", "e3m0")  # the ones whose grid covers the block: stochastic rounding is unbiased
DEFAULT_BLOCK_SIZE = 256
_E3M0_MIN_EXP = -6  # smallest non-zero e3m0 magnitude is scale * 2**-6


def _phi(t):
    return np.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)


_erf = np.frompyfunc(math.erf, 1, 1)  # math.erf per element; numpy has none, and np.vectorize is slower


def _cdf(t):
    return 0.5 * (1.0 + _erf(t / math.sqrt(2.0)).astype(np.float64))


def _edges(levels):
    """Cell boundaries of a nearest-level quantizer: -inf, the midpoints, +inf."""
    return np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])


def _phi_and_t_phi(edges):
    """phi(t) and t * phi(t) at each edge, 0 at the infinite ones."""
    finite = np.isfinite(edges)
    t = np.where(finite, edges, 0.0)
    p = np.where(finite, _phi(t), 0.0)
    return p, np.where(finite, t * p, 0.0)


def _gaussian_cell_mse(levels):
    """E[(X - nearest level)^2] for X ~ N(0, 1)."""
    edges = _edges(levels)
    (pa, ta), (pb, tb) = _phi_and_t_phi(edges[:-1]), _phi_and_t_phi(edges[1:])
    m0 = _cdf(edges[1:]) - _cdf(edges[:-1])
    m1 = pa - pb
    m2 = m0 - (tb - ta)
    return float(np.sum(m2 - 2 * levels * m1 + levels**2 * m0))


def lloyd_max(n, iters=3000):
    """Lloyd-Max levels of N(0, 1) with n levels (fixed point of centroid / midpoint), ascending."""
    levels = np.linspace(-2.0, 2.0, n) if n > 2 else np.array([-1.0, 1.0])
    for _ in range(iters):
        edges = _edges(levels)
        pa, pb = _phi_and_t_phi(edges[:-1])[0], _phi_and_t_phi(edges[1:])[0]
        levels = (pa - pb) / (_cdf(edges[1:]) - _cdf(edges[:-1]))
    return levels


def _uniform_levels(n, step):
    return (np.arange(n) + 0.5 - n / 2) * step


def uniform_step(n):
    """The MSE-optimal step of an n-level mid-rise uniform quantizer of N(0, 1) (golden-section search)."""
    lo, hi = 1e-3, 4.0
    g = (math.sqrt(5) - 1) / 2
    for _ in range(100):
        c, d = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, d) if _gaussian_cell_mse(_uniform_levels(n, c)) < _gaussian_cell_mse(_uniform_levels(n, d)) else (c, hi)
    return (lo + hi) / 2


# Unit-Gaussian tables, stored as the float64 values that ``uniform_step`` and ``lloyd_max`` compute
# (tests/test_formats.py recomputes both and compares to 1e-13: NumPy's exp differs in the last bits between
# CPUs), so importing the library costs nothing and every machine uses the same levels:
# UNIFORM_STEP[b]: the MSE-optimal mid-rise step for 2**b levels (0.9957 at 2 bits, 0.3352 at 4);
# LLOYD_LEVELS[b]: the Lloyd-Max levels (2 bits: -1.5104, -0.4528, 0.4528, 1.5104; 3000 iterations);
# GAUSSIAN_MSE[(format, b)]: the mean squared error per value of that quantizer on N(0, 1) (the floor a
# rotated block approaches; 0.1175 for 2-bit Lloyd-Max).
UNIFORM_STEP = {1: 1.5957691266601488, 2: 0.9956866949850329, 4: 0.3352006028909579, 8: 0.03076238903463145}
LLOYD_LEVELS = {
    1: np.array([-0.7978845608028654, 0.7978845608028654]),
    2: np.array([-1.510417608499096, -0.4527800346364921, 0.4527800346364921, 1.510417608499096]),
    4: np.array([-2.73258957099517, -2.0690172265313813, -1.6180463860218803, -1.2562311973471765, -0.9423404564869619, -0.6567591185324638, -0.3880482994902909, -0.12839502985114706, 0.12839502985114679, 0.3880482994902892, 0.6567591185324632, 0.9423404564869604, 1.256231197347177, 1.618046386021879, 2.0690172265313804, 2.732589570995157]),
}
GAUSSIAN_MSE = {("uniform", b): _gaussian_cell_mse(_uniform_levels(2**b, s)) for b, s in UNIFORM_STEP.items()}
GAUSSIAN_MSE.update({("lloyd", b): _gaussian_cell_mse(lv) for b, lv in LLOYD_LEVELS.items()})


def _check_rounding_format(format):
    if format not in ROUNDING_FORMATS:
        raise ValueError(
            f"stochastic rounding needs a grid that covers the block ({ROUNDING_FORMATS}); format={format!r} clips "
            "and cannot round without bias. Use format='int' or switch stochastic rounding off."
        )


def validate_format(bits, format):
    """Raises ``ValueError`` unless ``format`` is known and codes values at ``bits`` bits."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {BITS}.")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {FORMATS}.")
    if bits not in FORMAT_BITS[format]:
        others = [f for f in FORMATS if bits in FORMAT_BITS[f]]
        raise ValueError(
            f"format={format!r} supports bits in {FORMAT_BITS[format]}, not bits={bits!r}; at {bits} bits use one of {others}."
        )


def validate(bits, block_size=DEFAULT_BLOCK_SIZE, format="int", *, rotate=False, stochastic=False):
    """Raises ``ValueError`` naming the bad value and the valid choices."""
    validate_format(bits, format)
    if stochastic:
        _check_rounding_format(format)
    require_int("block_size", block_size, "a positive integer (a multiple of 8, e.g. 256)")
    if block_size % 8:
        raise ValueError(
            f"block_size={block_size!r} must be a multiple of 8 so that every block packs into whole bytes "
            "at 1 bit per value (e.g. 64, 128, 256)."
        )
    if rotate and block_size & (block_size - 1):
        raise ValueError(
            f"rotate=True needs a power-of-two block_size (the Hadamard transform's size), not {block_size}; "
            "use 64, 128, 256, 512 or 1024."
        )


def validate_compression(bits, block_size, format, *, error_bits, beta, beta_name="beta", rotate=False,
                         stochastic=False):
    """Checks shared by every compressing transformation: payload bits (None: exact fp32), block,
    format, rotation, the error buffer's storage bits and its moving-average weight."""
    if not isinstance(rotate, bool):
        raise ValueError(f"rotate={rotate!r} must be True or False.")
    if bits is not None:
        validate(bits, block_size, format, rotate=rotate, stochastic=stochastic)
    else:
        if format not in FORMATS:
            raise ValueError(f"format={format!r} is unknown; choose one of {FORMATS}.")
        validate(8, block_size, "int")  # the block size still lays out the error buffers
    if error_bits is not None and (isinstance(error_bits, bool) or error_bits not in BITS):
        raise ValueError(f"error_bits={error_bits!r} is not supported; choose one of {BITS} or None (fp32).")
    if isinstance(beta, bool) or not (isinstance(beta, (int, float)) and 0.0 <= beta < 1.0):
        raise ValueError(f"{beta_name}={beta!r} must lie in [0, 1) (0 is plain error feedback; LoCo uses 0.8).")


def qmax(bits):
    """Largest integer code magnitude of the symmetric ``int`` format."""
    return 2 ** (bits - 1) - 1


def _uniform(key, shape):
    return jax.random.uniform(key, shape, jnp.float32)


def quantize(x, bits, *, format="int", key=None):
    """Quantizes each block (the last axis of ``x``) to ``bits`` bits.

    Returns ``(codes, scales)``: ``codes`` are unsigned ``uint8`` of ``x``'s
    shape (one code per value, not yet packed), ``scales`` are fp32 of shape
    ``x.shape[:-1]``, NaN for a block that held NaN or Inf. ``key`` switches on
    stochastic rounding.
    """
    x = jnp.asarray(x, jnp.float32)
    finite = jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)
    x = jnp.where(finite, x, 0.0)  # detect before rounding: nothing garbage reaches the codes
    x = jnp.where(jnp.abs(x) < jnp.finfo(jnp.float32).tiny, 0.0, x)  # subnormals flush to zero, explicitly
    absmax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    noise = None if key is None else _uniform(key, x.shape)

    if format in ("uniform", "lloyd"):
        if noise is not None:
            _check_rounding_format(format)  # raises
        codes, scale = _quantize_fitted(x, absmax, bits, format)
    elif format == "e3m0":
        codes, scale = _quantize_e3m0(x, absmax, noise)
    elif bits == 1:
        if noise is None:
            scale = jnp.mean(jnp.abs(x), axis=-1, keepdims=True)
            positive = x >= 0  # sign(0) = +1
        else:
            scale = absmax
            safe = jnp.where(absmax > 0, absmax, 1.0)
            positive = noise < (1.0 + x / safe) * 0.5
        codes = positive.astype(jnp.uint8)
    else:
        m = qmax(bits)
        scale = jnp.where(absmax > 0, absmax / m, 1.0)
        y = x / scale
        q = jnp.round(y) if noise is None else jnp.floor(y + noise)
        q = jnp.clip(q, -m, m)
        codes = (q + m).astype(jnp.uint8)

    scale = jnp.where(finite, scale, jnp.nan)
    return codes, scale[..., 0]


def _unit_levels(bits, format):
    """The decode table: unit levels of the ``uniform`` / ``lloyd`` formats, ascending, outer ones +-1."""
    n = 2**bits
    if format == "uniform":
        levels = (2 * np.arange(n) + 1 - n) / (n - 1)
    else:
        levels = LLOYD_LEVELS[bits] / LLOYD_LEVELS[bits][-1]
    return levels.astype(np.float32)


def _lookup(k, table):
    """``table[k]`` for integer codes ``k``, as one select among the table's constants (XLA:CPU runs a gather of
    a small table about twice as slowly). Codes past the table's end take its last entry."""
    return lax.select_n(jnp.minimum(k, len(table) - 1), *(jnp.full(k.shape, v, jnp.float32) for v in table))


def _lloyd_thresholds(bits):
    """Decision boundaries in units of the block's RMS: midpoints between the Lloyd-Max levels."""
    levels = LLOYD_LEVELS[bits]
    return ((levels[1:] + levels[:-1]) / 2).astype(np.float32)


def _quantize_fitted(x, absmax, bits, format):
    """Codes at the RMS-fitted grid, then the least-squares scale for those codes (see the module docstring)."""
    n = 2**bits
    safe = jnp.where(absmax > 0, absmax, 1.0)
    u = x / safe  # |u| <= 1: nothing below overflows, however large the block
    rms = jnp.sqrt(jnp.mean(u * u, axis=-1, keepdims=True))
    y = u / jnp.where(rms > 0, rms, 1.0)
    if format == "uniform":
        k = jnp.clip(jnp.floor(y / np.float32(UNIFORM_STEP[bits]) + n / 2), 0, n - 1)
        codes = k.astype(jnp.uint8)
        level = (2.0 * k + (1 - n)) / (n - 1)
    else:
        k = jnp.zeros(y.shape, jnp.int32)
        for edge in _lloyd_thresholds(bits):  # 2**b - 1 comparisons: 3 at 2 bits, 15 at 4
            k = k + (y > edge).astype(jnp.int32)
        codes = k.astype(jnp.uint8)
        level = _lookup(k, _unit_levels(bits, format))
    s = jnp.sum(u * level, axis=-1, keepdims=True) / jnp.sum(level * level, axis=-1, keepdims=True)
    # s may exceed 1 (the grid's outer levels lie beyond a light-tailed block's absmax, e.g. at 8 bits);
    # the codes in use still decode near the block's values. Only a scale past float32's range is capped.
    return codes, jnp.minimum(absmax * jnp.maximum(s, 0.0), jnp.finfo(jnp.float32).max)


def _quantize_e3m0(x, absmax, noise):
    """Sign and 3-bit exponent field; levels 0 and absmax * 2**k, k = -6..0."""
    scale = absmax
    a = jnp.abs(x) / jnp.where(absmax > 0, absmax, 1.0)  # in [0, 1]
    # frexp: a = m * 2**ex with m in [0.5, 1), so a lies in [2**(ex-1), 2**ex).
    m, ex = jnp.frexp(a)
    lower = ex - 1  # exponent of the level just below (or equal to) a
    if noise is None:
        # Nearest in linear distance: midpoint between 2**(ex-1) and 2**ex is 0.75 * 2**ex.
        k = jnp.where(m >= 0.75, ex, lower)
        e = jnp.where(a >= 2.0 ** (_E3M0_MIN_EXP - 1), jnp.maximum(k - _E3M0_MIN_EXP + 1, 1), 0)
    else:
        small = lower < _E3M0_MIN_EXP  # between 0 and the smallest level
        lo = jnp.where(small, 0.0, jnp.ldexp(jnp.ones_like(a), lower))
        hi = jnp.where(small, 2.0**_E3M0_MIN_EXP, jnp.ldexp(jnp.ones_like(a), ex))
        up = noise < (a - lo) / (hi - lo)
        e_lo = jnp.where(small, 0, lower - _E3M0_MIN_EXP + 1)
        e_hi = jnp.where(small, 1, ex - _E3M0_MIN_EXP + 1)
        e = jnp.where(up, e_hi, e_lo)
    e = jnp.where(a > 0, jnp.clip(e, 0, 7), 0)
    sign = (x < 0).astype(jnp.int32)
    codes = (sign * 8 + e).astype(jnp.uint8)
    return codes, scale


def dequantize(codes, scales, bits, *, format="int"):
    """Inverse of :func:`quantize`: fp32 values of the codes' shape."""
    scales = jnp.asarray(scales, jnp.float32)[..., None]
    c = codes.astype(jnp.int32)
    if format in ("uniform", "lloyd"):
        val = _lookup(c, _unit_levels(bits, format))
    elif format == "e3m0":
        e = c & 7
        mag = jnp.where(e > 0, jnp.ldexp(jnp.ones(c.shape, jnp.float32), e - 7), 0.0)
        val = jnp.where(c >= 8, -mag, mag)
    elif bits == 1:
        val = (2 * c - 1).astype(jnp.float32)
    else:
        val = (c - qmax(bits)).astype(jnp.float32)
    return val * scales


def column_signs(cols, seed):
    """+-1 for each column, a hash of (column, seed): the same on every device, nothing stored."""
    seed = jnp.uint32(seed % 2**32) if isinstance(seed, (int, np.integer)) else jnp.asarray(seed, jnp.uint32)
    h = lax.iota(jnp.uint32, cols) * jnp.uint32(0x9E3779B1) + seed
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    h = h ^ (h >> 16)
    return 1.0 - 2.0 * (h >> 31).astype(jnp.float32)


def sylvester(n):
    """The ``n x n`` Walsh-Hadamard matrix of +-1 (Sylvester order: entry ``(i, j)`` is ``(-1)^popcount(i & j)``)."""
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h


def block_hadamard(x, n):
    """``x @ H_n / sqrt(n)`` on every block of ``n`` values of the last axis.

    With ``n = a b`` and a block read as the ``a x b`` matrix ``X`` (row-major), ``H_n = H_a (x) H_b`` gives
    ``vec(H_a X H_b)``: two batched matmuls with +-1 matrices, summed in float32 at ``Precision.HIGHEST`` (no
    TF32 or bf16 passes on GPU). A NaN or Inf reaches every row and column of its own block and no other.
    """
    a = 1 << ((n.bit_length() - 1) // 2)
    b = n // a
    y = jnp.einsum("ij,rjk,kl->ril", sylvester(a), x.reshape(-1, a, b), sylvester(b),
                   precision=lax.Precision.HIGHEST)
    return (y.reshape(x.shape) * np.float32(1.0 / math.sqrt(n))).astype(x.dtype)


def rotate(x, block_size=DEFAULT_BLOCK_SIZE, seed=0):
    """The randomized Hadamard transform of every block of the last axis: ``(x * S) @ H / sqrt(n)``.

    Orthogonal and linear; the signs ``S`` depend on the column and ``seed`` only. Inverse: :func:`unrotate`.
    """
    validate(8, block_size, "int", rotate=True)
    cols = x.shape[-1]
    if cols % block_size:
        raise ValueError(f"a row of {cols} values is not a whole number of blocks of {block_size}.")
    return block_hadamard(x * column_signs(cols, seed), block_size)


def unrotate(y, block_size=DEFAULT_BLOCK_SIZE, seed=0):
    """Inverse of :func:`rotate`: ``(y @ H / sqrt(n)) * S`` (``H`` is symmetric and ``H H = n I``)."""
    cols = y.shape[-1]
    return block_hadamard(y, block_size) * column_signs(cols, seed)


def finite_blocks(scales):
    """True for each block that held only finite values."""
    return jnp.isfinite(scales)


def pack(codes, bits):
    """Packs unsigned ``bits``-bit codes along the last axis into ``uint8``.

    The last axis must be a multiple of ``8 // bits``; code ``i`` of a byte
    sits at bit ``i * bits`` (little-endian within the byte).
    """
    if bits == 8:
        return codes.astype(jnp.uint8)
    per_byte = 8 // bits
    n = codes.shape[-1]
    if n % per_byte:
        raise ValueError(f"cannot pack {n} codes at {bits} bits: the last axis must be a multiple of {per_byte}.")
    grouped = codes.astype(jnp.uint8).reshape(*codes.shape[:-1], n // per_byte, per_byte)
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    return jnp.sum(grouped << shifts, axis=-1, dtype=jnp.uint8)


def unpack(packed, bits):
    """Exact inverse of :func:`pack`."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    mask = jnp.uint8(2**bits - 1)
    codes = (packed[..., None] >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def payload_bytes(cols, bits, block_size=DEFAULT_BLOCK_SIZE):
    """Bytes of one encoded row of ``cols`` values (codes plus fp32 scales)."""
    return cols * bits // 8 + (cols // block_size) * 4


def _blocks(x, block_size):
    rows, cols = x.shape
    if cols % block_size:
        raise ValueError(f"a row of {cols} values is not a whole number of blocks of {block_size}.")
    return x.reshape(rows, cols // block_size, block_size)


def encode(x, bits, *, block_size=DEFAULT_BLOCK_SIZE, format="int", key=None):
    """Quantizes a ``(rows, cols)`` array into a ``uint8`` payload per row.

    Row layout: ``cols * bits / 8`` bytes of packed codes, then
    ``cols / block_size`` fp32 scales bitcast to 4 bytes each.
    """
    rows, cols = x.shape
    codes, scales = quantize(_blocks(x, block_size), bits, format=format, key=key)
    packed = pack(codes.reshape(rows, cols), bits)
    scale_bytes = lax.bitcast_convert_type(scales, jnp.uint8).reshape(rows, -1)
    return jnp.concatenate([packed, scale_bytes], axis=1)


def decode(payload, bits, *, cols, block_size=DEFAULT_BLOCK_SIZE, format="int"):
    """Inverse of :func:`encode`: fp32 ``(rows, cols)``."""
    rows = payload.shape[0]
    n_code_bytes = cols * bits // 8
    codes = unpack(payload[:, :n_code_bytes], bits)
    scales = lax.bitcast_convert_type(payload[:, n_code_bytes:].reshape(rows, cols // block_size, 4), jnp.float32)
    values = dequantize(codes.reshape(rows, cols // block_size, block_size), scales, bits, format=format)
    return values.reshape(rows, cols)


def quantize_dequantize(x, bits, *, block_size=DEFAULT_BLOCK_SIZE, format="int", key=None):
    """``DQ(Q(x))`` of a ``(rows, cols)`` array, without the packing."""
    rows, cols = x.shape
    codes, scales = quantize(_blocks(x, block_size), bits, format=format, key=key)
    return dequantize(codes, scales, bits, format=format).reshape(rows, cols)


def store(x, bits, *, block_size=DEFAULT_BLOCK_SIZE):
    """A ``(rows, cols)`` fp32 buffer kept in ``bits`` bits: ``(codes, scales)``; ``bits=None`` keeps fp32.

    Error buffers (LoCo, outer-gradient compensation) are stored this way.
    """
    if bits is None:
        return x, None
    rows, cols = x.shape
    codes, scales = quantize(_blocks(x, block_size), bits)
    return codes.reshape(rows, cols), scales


def load(codes, scales, bits, *, block_size=DEFAULT_BLOCK_SIZE):
    """Inverse of :func:`store`: fp32 ``(rows, cols)``."""
    if bits is None:
        return codes
    rows, cols = codes.shape
    return dequantize(_blocks(codes, block_size), scales, bits).reshape(rows, cols)


def stored_zeros(shape, bits, *, block_size=DEFAULT_BLOCK_SIZE):
    """What :func:`store` returns for a buffer of zeros, built without quantizing anything.

    (Quantizing a constant would make XLA constant-fold it at compile time.)
    """
    rows, cols = shape
    if bits is None:
        return jnp.zeros(shape, jnp.float32), None
    zero_code = 1 if bits == 1 else qmax(bits)  # sign(0) = +1 at 1 bit, the offset code of 0 otherwise
    zero_scale = 0.0 if bits == 1 else 1.0  # mean|0| at 1 bit, the all-zero scale otherwise
    codes = jnp.full(shape, zero_code, jnp.uint8)
    return codes, jnp.full((rows, cols // block_size), zero_scale, jnp.float32)
