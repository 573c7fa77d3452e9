"""Quantizers and packing against a NumPy re-derivation of docs/algorithms.md, "2. Low-bit formats"."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax import quant
from tests import reference

CASES = [(8, "int"), (4, "int"), (4, "e3m0"), (2, "int"), (1, "int")]


def _gauss(shape, seed=0, scale=1.0):
    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_unpack_round_trip(bits):
    codes = np.random.RandomState(bits).randint(0, 2**bits, size=(3, 64)).astype(np.uint8)
    packed = quant.pack(jnp.asarray(codes), bits)
    assert packed.dtype == jnp.uint8
    assert packed.shape == (3, 64 * bits // 8)
    np.testing.assert_array_equal(np.asarray(quant.unpack(packed, bits)), codes)


@pytest.mark.parametrize("bits,fmt", CASES)
def test_quantizer_matches_numpy_reference(bits, fmt):
    x = _gauss((8 * 256,), seed=bits)
    x[:256] = 0.0  # an all-zero block
    x[256:512] *= 1e-30  # tiny magnitudes
    x[512:768] *= 1e30  # huge magnitudes
    x[1000] = 0.0  # sign(0) = +1 at 1 bit
    got = np.asarray(quant.quantize_dequantize(jnp.asarray(x)[None], bits, format=fmt))[0]
    want = reference.quantize_dequantize(x, bits, fmt=fmt)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)
    assert np.all(got[:256] == 0.0), "an all-zero block decodes to zero"


def test_one_bit_sign_of_zero_is_plus():
    x = jnp.zeros((1, 256)).at[0, :128].set(-2.0)  # mean |x| = 1; the zeros must decode to +1
    got = np.asarray(quant.quantize_dequantize(x, 1))[0]
    np.testing.assert_array_equal(got[:128], -1.0)
    np.testing.assert_array_equal(got[128:], 1.0)


def test_e3m0_levels():
    levels = np.concatenate([[0.0], 2.0 ** np.arange(-6, 1)])
    x = np.concatenate([levels, -levels[1:]]).astype(np.float32)
    x = np.pad(x, (0, 256 - x.size))
    got = np.asarray(quant.quantize_dequantize(jnp.asarray(x)[None], 4, format="e3m0"))[0]
    np.testing.assert_array_equal(got, x)  # every representable value is exact
    assert len(np.unique(got)) == 15


@pytest.mark.parametrize("bits,fmt", CASES)
def test_encode_decode_is_quantize_dequantize(bits, fmt):
    x = jnp.asarray(_gauss((3, 512), seed=1))
    payload = quant.encode(x, bits, format=fmt)
    assert payload.dtype == jnp.uint8
    assert payload.shape == (3, quant.payload_bytes(512, bits))
    np.testing.assert_array_equal(
        np.asarray(quant.decode(payload, bits, cols=512, format=fmt)),
        np.asarray(quant.quantize_dequantize(x, bits, format=fmt)),
    )


@pytest.mark.parametrize("bits,fmt", CASES)
def test_nonfinite_block_detected_before_rounding(bits, fmt):
    x = _gauss((1, 768), seed=2)
    x[0, 300] = np.nan
    x[0, 700] = np.inf
    codes, scales = quant.quantize(jnp.asarray(x).reshape(1, 3, 256), bits, format=fmt)
    np.testing.assert_array_equal(np.asarray(quant.finite_blocks(scales))[0], [True, False, False])
    out = np.asarray(quant.dequantize(codes, scales, bits, format=fmt)).reshape(-1)
    assert np.all(np.isnan(out[256:])), "a non-finite block decodes to NaN, never to garbage"
    np.testing.assert_allclose(out[:256], reference.quantize_dequantize(x[0, :256], bits, fmt=fmt), rtol=1e-6)


@pytest.mark.parametrize("bits,fmt", CASES)
def test_stochastic_rounding_is_unbiased(bits, fmt):
    x = jnp.asarray(_gauss((1, 256), seed=3))
    keys = jax.random.split(jax.random.PRNGKey(0), 2000)
    samples = jax.vmap(lambda k: quant.quantize_dequantize(x, bits, format=fmt, key=k))(keys)
    mean = np.asarray(samples.mean(0))[0]
    xs = np.asarray(x)[0]
    amax = np.abs(xs).max()
    # widest gap between neighbouring levels: a two-point rounding has std <= gap / 2
    gap = {"e3m0": amax / 2, "int": 2 * amax if bits == 1 else amax / (2 ** (bits - 1) - 1)}[fmt]
    stderr = gap / 2 / np.sqrt(len(keys))
    assert np.all(np.abs(mean - xs) <= 5 * stderr), "each value is unbiased within 5 standard errors"
    assert abs(np.mean(mean - xs)) <= 5 * stderr / np.sqrt(xs.size), "no systematic bias over the block"
    # the deterministic quantizer is biased on the same input at low bit widths
    if bits <= 2:
        det = np.asarray(quant.quantize_dequantize(x, bits, format=fmt))[0]
        assert np.abs(det - xs).mean() > 10 * np.abs(mean - xs).mean()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=3), "bits=3"),
        (dict(bits=16), "bits=16"),
        (dict(bits=4, block_size=0), "block_size=0"),
        (dict(bits=4, block_size=-256), "block_size=-256"),
        (dict(bits=4, block_size=100), "multiple of 8"),
        (dict(bits=4, format="fp4"), "format='fp4'"),
        (dict(bits=8, format="e3m0"), "e3m0"),
    ],
)
def test_validate_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quant.validate(**kwargs)


@pytest.mark.parametrize("bits", [None, 8, 4, 2, 1])
def test_stored_zeros_equal_storing_zeros(bits):
    want = quant.store(jnp.zeros((2, 512)), bits)
    got = quant.stored_zeros((2, 512), bits)
    for w, g in zip(want, got):
        if w is None:
            assert g is None
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert g.dtype == w.dtype
    np.testing.assert_array_equal(np.asarray(quant.load(*got, bits)), 0.0)
