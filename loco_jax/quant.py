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

Stochastic rounding (pass ``key``) replaces round-to-nearest by an unbiased
random choice between the two neighbouring levels, ``E[DQ(Q(x))] = x``. At
1 bit that needs the scale ``max|x|`` and ``P(q = +1) = (1 + x / scale) / 2``.
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
1 bit (1 = +1), ``sign << 3 | e`` for e3m0. ``pack`` puts ``8 / b`` codes into
each byte (exact inverse: ``unpack``). ``encode`` / ``decode`` lay out a whole
``(rows, cols)`` array as one ``uint8`` payload per row: the packed codes
followed by the fp32 scales bitcast to bytes, so a collective moves one
``uint8`` buffer. Wire cost per value: ``b + 32 / block_size`` bits (4.125 at
4 bits and the default block), 0.129 of fp32.

Reference: ALGORITHMS.md section 1; LoCo (arXiv 2407.04480) and Streaming
DiLoCo (arXiv 2501.18512, section on quantized exchange).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

BITS = (1, 2, 4, 8)
FORMATS = ("int", "e3m0")
DEFAULT_BLOCK_SIZE = 256
_E3M0_MIN_EXP = -6  # smallest non-zero e3m0 magnitude is scale * 2**-6


def validate(bits, block_size=DEFAULT_BLOCK_SIZE, format="int"):
    """Raises ``ValueError`` naming the bad value and the valid choices."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r} is not supported; choose one of {BITS}.")
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {FORMATS}.")
    if format == "e3m0" and bits != 4:
        raise ValueError(f"format='e3m0' is a 4-bit format, but bits={bits!r}; use bits=4 or format='int'.")
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size <= 0:
        raise ValueError(f"block_size={block_size!r} must be a positive integer (a multiple of 8, e.g. 256).")
    if block_size % 8:
        raise ValueError(
            f"block_size={block_size!r} must be a multiple of 8 so that every block packs into whole bytes "
            "at 1 bit per value (e.g. 64, 128, 256)."
        )


def validate_compression(bits, block_size, format, *, error_bits, beta, beta_name="beta"):
    """Checks shared by every compressing transformation: payload bits (None: exact fp32), block,
    format, the error buffer's storage bits and its moving-average weight."""
    if bits is not None:
        validate(bits, block_size, format)
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

    if format == "e3m0":
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
    if format == "e3m0":
        e = c & 7
        mag = jnp.where(e > 0, jnp.ldexp(jnp.ones(c.shape, jnp.float32), e - 7), 0.0)
        val = jnp.where(c >= 8, -mag, mag)
    elif bits == 1:
        val = (2 * c - 1).astype(jnp.float32)
    else:
        val = (c - qmax(bits)).astype(jnp.float32)
    return val * scales


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
