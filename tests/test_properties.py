"""Property tests (hypothesis, bounded) of the quantizers and the quantized all-reduce."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from loco_jax import collectives, quant
from tests.helpers import put


def jitted(fn, *static, **static_kw):
    """``fn`` under one ``jax.jit`` per setting: ``jitted(f, 4, format="e3m0")(x)`` is ``f(x, 4, format="e3m0")``.

    Hypothesis calls each test a dozen times on a few shapes; op-by-op dispatch compiled every primitive
    anew for each shape, one jitted program per shape is a fraction of that."""
    return _jitted(fn, static, tuple(sorted(static_kw.items())))


@functools.lru_cache(maxsize=None)
def _jitted(fn, static, static_kw):
    return jax.jit(lambda *arrays: fn(*arrays, *static, **dict(static_kw)))


SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BLOCK = 64


@st.composite
def blocks(draw, max_rows=4):
    """(rows, k * BLOCK) float32 arrays mixing normal, huge, tiny, zero and subnormal values."""
    rows = draw(st.integers(1, max_rows))
    cols = BLOCK * draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.RandomState(seed)
    x = rng.randn(rows, cols).astype(np.float32)
    kind = draw(st.sampled_from(["normal", "huge", "tiny", "zeros", "mixed", "subnormal"]))
    if kind == "huge":
        x *= 1e30
    elif kind == "tiny":
        x *= 1e-30
    elif kind == "zeros":
        x[:] = 0
    elif kind == "subnormal":
        x *= 1e-40
    elif kind == "mixed":
        x *= np.float32(10.0) ** rng.randint(-20, 20, size=x.shape).astype(np.float32)
    return x


@SETTINGS
@given(bits=st.sampled_from(quant.BITS), n_groups=st.integers(1, 40), lead=st.integers(1, 3), seed=st.integers(0, 1000))
def test_pack_unpack_round_trip_any_shape(bits, n_groups, lead, seed):
    n = n_groups * (8 // bits)
    codes = np.random.RandomState(seed).randint(0, 2**bits, size=(lead, n)).astype(np.uint8)
    packed = jitted(quant.pack, bits)(jnp.asarray(codes))
    assert packed.dtype == jnp.uint8 and packed.shape == (lead, n * bits // 8)
    np.testing.assert_array_equal(np.asarray(jitted(quant.unpack, bits)(packed)), codes)


@SETTINGS
@given(x=blocks(), bits=st.sampled_from([8, 4, 2]), dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
def test_int_quantizer_error_is_at_most_half_a_step(x, bits, dtype):
    x = flushed(np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)))  # what the dtype holds (float16 may overflow)
    got = np.asarray(jitted(quant.quantize_dequantize, bits, block_size=BLOCK)(jnp.asarray(x)))
    blocks_x, blocks_q = x.reshape(-1, BLOCK), got.reshape(-1, BLOCK)
    for bx, bq in zip(blocks_x, blocks_q):
        if not np.all(np.isfinite(bx)):
            assert np.all(np.isnan(bq)), "a non-finite block decodes to NaN"
            continue
        step = np.abs(bx).max() / quant.qmax(bits)
        assert np.all(np.abs(bq - bx) <= step / 2 * (1 + 1e-5) + 1e-45), (bits, np.abs(bq - bx).max(), step)


def flushed(x):
    """Subnormals are zero to the quantizers (flush-to-zero, as XLA does)."""
    return np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x)


@SETTINGS
@given(x=blocks())
def test_e3m0_and_one_bit_bounds(x):
    x = flushed(x)
    got = np.asarray(jitted(quant.quantize_dequantize, 4, block_size=BLOCK, format="e3m0")(jnp.asarray(x)))
    sign = np.asarray(jitted(quant.quantize_dequantize, 1, block_size=BLOCK)(jnp.asarray(x)))
    for bx, be, bs in zip(x.reshape(-1, BLOCK), got.reshape(-1, BLOCK), sign.reshape(-1, BLOCK)):
        amax = np.abs(bx).max()
        # nearest power-of-two level: at most a third off above amax * 2**-6, at most amax * 2**-7 below
        bound = np.maximum(np.abs(bx) / 3, amax * 2.0**-7) * (1 + 1e-5) + 1e-45
        assert np.all(np.abs(be - bx) <= bound)
        assert np.all(np.sign(be)[be != 0] == np.sign(bx)[be != 0])
        # 1 bit: every value decodes to +-mean|x|, with sign(0) = +1
        scale = np.float32(np.abs(bx).mean(dtype=np.float32))
        np.testing.assert_allclose(np.abs(bs), scale, rtol=1e-6)
        assert np.all((bs >= 0) == (bx >= 0)) or scale == 0


@SETTINGS
@given(bits=st.sampled_from(quant.BITS), fmt=st.sampled_from(["int", "e3m0"]), seed=st.integers(0, 100))
def test_subnormal_values_decode_to_zero(bits, fmt, seed):
    if fmt == "e3m0" and bits != 4:
        return
    x = np.random.RandomState(seed).randn(2, BLOCK).astype(np.float32) * np.float32(1e-40)
    x[1] = np.random.RandomState(seed).randn(BLOCK)  # a normal block beside it is unaffected
    got = np.asarray(jitted(quant.quantize_dequantize, bits, block_size=BLOCK, format=fmt)(jnp.asarray(x)))
    np.testing.assert_array_equal(got[0], 0.0)
    assert np.any(got[1] != 0)


@SETTINGS
@given(x=blocks(), bits=st.sampled_from(quant.BITS), nan_at=st.integers(0, 10**6), bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nonfinite_values_poison_only_their_block(x, bits, nan_at, bad):
    x = x.copy()
    flat = x.reshape(-1)
    i = nan_at % flat.size
    flat[i] = bad
    codes, scales = jitted(quant.quantize, bits)(jnp.asarray(x).reshape(-1, BLOCK))
    finite = np.asarray(jitted(quant.finite_blocks)(scales))
    assert not finite[i // BLOCK] and finite.sum() == finite.size - 1
    out = np.asarray(jitted(quant.dequantize, bits)(codes, scales)).reshape(-1, BLOCK)
    assert np.all(np.isnan(out[i // BLOCK]))
    assert np.all(np.isfinite(np.delete(out, i // BLOCK, axis=0)))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    shape=st.sampled_from([(5,), (3, 7), (2, 3, 40), (300,), (17, 33)]),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16]),
    mode=st.sampled_from(collectives.MODES),
    seed=st.integers(0, 1000),
    scale=st.sampled_from([1e-20, 1.0, 1e20]),
)
def test_quantized_psum_bound_shape_dtype_any_input(data_mesh, shape, dtype, mode, seed, scale):
    x = (np.random.RandomState(seed).randn(8, *shape) * scale).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    f = jax.jit(jax.shard_map(
        lambda v: collectives.quantized_psum(v[0].astype(dtype), "data", bits=8, block_size=BLOCK, mode=mode)[None],
        mesh=data_mesh, in_specs=P("data"), out_specs=P("data"),
    ))
    out = f(put(data_mesh, x, P("data")))
    assert out.dtype == dtype and out.shape == (8,) + shape
    got = np.asarray(out.astype(jnp.float32))
    for d in range(8):
        np.testing.assert_array_equal(got[d], got[0])
    exact = x.sum(0)
    # stage 1: each device's rounding <= its absmax / (2 qmax); stage 2 (two-stage): the sum's absmax / (2 qmax)
    bound = (np.abs(x).reshape(8, -1).max(1).sum() + (np.abs(exact).max() if mode == "two_stage" else 0)) / (2 * 127)
    tol = bound * 1.01 + (np.abs(exact).max() * 2**-7 if dtype == jnp.bfloat16 else 0)  # the bf16 output cast
    assert np.all(np.abs(got[0] - exact) <= tol + 1e-44)


FEW = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # each shape compiles anew


@FEW
@given(x=blocks(), fmt_bits=st.sampled_from([("uniform", 8), ("uniform", 4), ("uniform", 2), ("lloyd", 4), ("lloyd", 2),
                                              ("lloyd", 1)]), rotate=st.booleans())
def test_fitted_formats_never_do_worse_than_sending_nothing(x, fmt_bits, rotate):
    """uniform / lloyd, rotated or not, on normal, huge, tiny, zero, mixed and subnormal blocks: every
    finite block decodes finite, no longer than itself (a least-squares projection), zeros to zeros."""
    fmt, bits = fmt_bits
    x = flushed(x)
    y = jitted(quant.rotate, BLOCK, 3)(jnp.asarray(x)) if rotate else jnp.asarray(x)
    in_domain = jitted(quant.quantize_dequantize, bits, block_size=BLOCK, format=fmt)(y)
    got = np.asarray(jitted(quant.unrotate, BLOCK, 3)(in_domain) if rotate else in_domain, np.float64)
    assert np.all(np.isfinite(got))
    yb = np.asarray(y, np.float64).reshape(-1, BLOCK)
    qb = np.asarray(in_domain, np.float64).reshape(-1, BLOCK)
    for by, bq in zip(yb, qb):
        norm = np.linalg.norm(by)
        assert np.linalg.norm(bq) <= norm * (1 + 1e-5) + 1e-40
        assert np.linalg.norm(bq - by) <= norm * (1 + 1e-5) + 1e-40
        if norm == 0:
            assert np.all(bq == 0)
    if rotate:  # the rotation is orthogonal: the error norm is the same in both domains
        np.testing.assert_allclose(np.linalg.norm(got - x), np.linalg.norm(qb - yb), rtol=1e-3, atol=1e-30)


@FEW
@given(x=blocks(), bad=st.sampled_from([np.nan, np.inf, -np.inf]), at=st.integers(0, 10**6),
       fmt_bits=st.sampled_from([("uniform", 2), ("lloyd", 2), ("lloyd", 4), ("int", 1)]))
def test_rotated_nonfinite_values_poison_only_their_block(x, bad, at, fmt_bits):
    fmt, bits = fmt_bits
    x = flushed(x).copy()
    flat = x.reshape(-1)
    i = at % flat.size
    flat[i] = bad
    rotated = jitted(quant.rotate, BLOCK, 0)(jnp.asarray(x))
    codes, scales = jitted(quant.quantize, bits, format=fmt)(rotated.reshape(-1, BLOCK))
    finite = np.asarray(jitted(quant.finite_blocks)(scales))
    assert not finite[i // BLOCK] and finite.sum() == finite.size - 1
    decoded = jitted(quant.dequantize, bits, format=fmt)(codes, scales).reshape(x.shape)
    out = np.asarray(jitted(quant.unrotate, BLOCK, 0)(decoded))
    out = out.reshape(-1, BLOCK)
    assert np.all(np.isnan(out[i // BLOCK])) and np.all(np.isfinite(np.delete(out, i // BLOCK, axis=0)))
