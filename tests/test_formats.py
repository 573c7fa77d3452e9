"""The ``uniform`` and ``lloyd`` formats and the randomized Hadamard rotation, against NumPy/SciPy re-derivations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import collectives, hlo, loco, quant
from tests import reference
from tests.helpers import DEVICES, gaussian, per_device, put, rel_err

FITTED = [(b, f) for f in ("uniform", "lloyd") for b in quant.FORMAT_BITS[f]]


def test_gaussian_tables_match_an_independent_derivation_and_max_1960():
    for b in quant.FORMAT_BITS["lloyd"]:
        np.testing.assert_allclose(quant.LLOYD_LEVELS[b], reference.gaussian_lloyd_max(2**b), atol=2e-4)
    np.testing.assert_allclose(quant.LLOYD_LEVELS[2], [-1.510, -0.4528, 0.4528, 1.510], atol=1e-3)  # Max (1960)
    for b in (1, 2, 4):
        assert quant.UNIFORM_STEP[b] == pytest.approx(reference.gaussian_uniform_step(2**b), abs=1e-4)
    assert quant.UNIFORM_STEP[2] == pytest.approx(0.9957, abs=1e-4) and quant.UNIFORM_STEP[4] == pytest.approx(0.3352, abs=1e-4)
    assert quant.GAUSSIAN_MSE[("lloyd", 2)] == pytest.approx(0.1175, abs=1e-4)
    assert quant.GAUSSIAN_MSE[("lloyd", 4)] == pytest.approx(0.009497, abs=2e-5)


def test_stored_gaussian_tables_are_what_the_library_computes():
    """quant stores its tables as constants (importing the library computes nothing); they must be the float64
    values of its own derivations, so that a change to either shows here. To 1e-13 relative, not to the bit:
    NumPy's vectorized exp picks its kernel by CPU and build, and the 16-level Lloyd-Max fixed point came out
    up to 5e-15 relative apart on two machines (2026-12-04); a float32 table differs by at most one ulp. The
    stored values are what every machine uses."""
    for b in quant.FORMAT_BITS["lloyd"]:
        computed = quant.lloyd_max(2**b)
        assert computed.dtype == quant.LLOYD_LEVELS[b].dtype, b
        np.testing.assert_allclose(computed, quant.LLOYD_LEVELS[b], rtol=1e-13, atol=0, err_msg=str(b))
        np.testing.assert_array_max_ulp(computed.astype(np.float32), quant.LLOYD_LEVELS[b].astype(np.float32), 1)
    for b in quant.FORMAT_BITS["uniform"]:
        # a golden-section argmin of a smooth minimum is fixed only to about sqrt(eps) of the step: near the
        # end two nearly equal errors decide the bracket (1e-10 relative apart on two machines)
        assert quant.uniform_step(2**b) == pytest.approx(quant.UNIFORM_STEP[b], rel=1e-8, abs=0), b


@pytest.mark.parametrize("bits,fmt", FITTED)
def test_fitted_formats_match_numpy(bits, fmt):
    x = np.random.RandomState(bits).standard_t(4, size=6 * 256).astype(np.float32)
    x[:256] = 0.0  # an all-zero block decodes to zero (scale 0)
    x[256:512] *= 1e30  # huge: no overflow
    x[512:768] *= 1e-30
    got = np.asarray(quant.quantize_dequantize(jnp.asarray(x)[None], bits, format=fmt))[0]
    want = reference.fitted_quantize_dequantize(x, bits, fmt)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=0)
    assert np.all(got[:256] == 0.0)
    codes, _ = quant.quantize(jnp.asarray(x[768:]).reshape(-1, 256), bits, format=fmt)
    if bits <= 4:  # 768 values cannot fill 256 codes
        assert len(np.unique(np.asarray(codes))) == 2**bits, "every code is used on heavy-tailed data"


@pytest.mark.parametrize("bits,fmt", FITTED)
def test_fitted_formats_error_bounds_and_nonfinite(bits, fmt):
    x = gaussian((4, 256), seed=bits) * np.float32(10.0) ** np.arange(-12, 12, 6, dtype=np.float32)[:, None]
    x[1, 7] = np.nan
    codes, scales = quant.quantize(jnp.asarray(x), bits, format=fmt)
    out = np.asarray(quant.dequantize(codes, scales, bits, format=fmt))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(np.delete(out, 1, 0)))
    for i in (0, 2, 3):
        amax = np.abs(x[i]).max()
        assert np.linalg.norm(out[i]) <= np.linalg.norm(x[i]) * (1 + 1e-5), "a projection: |DQ| <= |x|"
        assert np.abs(out[i]).max() <= 1.5 * amax
        # the least-squares scale never does worse than sending nothing, and on Gaussian data it is near the floor
        err = np.sum((out[i] - x[i]) ** 2) / np.sum(x[i] ** 2)
        assert err <= 1.0 and err < 1.35 * quant.GAUSSIAN_MSE[(fmt, bits)], (err, quant.GAUSSIAN_MSE[(fmt, bits)])


def test_one_bit_fitted_formats_are_the_scaled_sign():
    x = jnp.asarray(gaussian((3, 256), seed=5))
    want = np.asarray(quant.quantize_dequantize(x, 1))
    for fmt in ("uniform", "lloyd"):
        np.testing.assert_allclose(np.asarray(quant.quantize_dequantize(x, 1, format=fmt)), want, rtol=1e-6)


@pytest.mark.parametrize("bits,fmt", FITTED)
def test_fitted_encode_decode_round_trip(bits, fmt):
    x = jnp.asarray(gaussian((3, 512), seed=1))
    payload = quant.encode(x, bits, format=fmt)
    assert payload.dtype == jnp.uint8 and payload.shape == (3, quant.payload_bytes(512, bits))
    np.testing.assert_array_equal(np.asarray(quant.decode(payload, bits, cols=512, format=fmt)),
                                  np.asarray(quant.quantize_dequantize(x, bits, format=fmt)))


@pytest.mark.parametrize("block", [8, 64, 256])
def test_rotation_is_the_randomized_hadamard_transform(block):
    x = gaussian((3, 4 * block), seed=block)
    got = np.asarray(quant.rotate(jnp.asarray(x), block, seed=11))
    signs = np.asarray(quant.column_signs(4 * block, 11))
    assert set(np.unique(signs)) == {-1.0, 1.0}
    want = reference.randomized_hadamard(x.reshape(3, 4, block), signs.reshape(4, block)).reshape(3, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)  # orthogonal
    np.testing.assert_allclose(np.asarray(quant.unrotate(jnp.asarray(got), block, seed=11)), x, atol=1e-5)
    other = np.asarray(quant.rotate(jnp.asarray(x), block, seed=12))
    assert not np.allclose(other, got), "another seed is another rotation"


@pytest.mark.parametrize("block", [2, 8, 128, 256])
def test_kronecker_transform_is_the_hadamard_matmul_to_float32_rounding(block):
    """``H_a X H_b`` is ``x @ H_n`` (scipy's Sylvester matrix, float64) up to float32 rounding of 32 terms."""
    from scipy.linalg import hadamard

    np.testing.assert_array_equal(quant.sylvester(block), hadamard(block))
    x = (gaussian((3, 2 * block), seed=block) * 1e3).astype(np.float32)
    want = reference.randomized_hadamard(x.reshape(-1, block), 1.0).reshape(x.shape)
    got = np.asarray(quant.block_hadamard(jnp.asarray(x), block))
    assert got.dtype == np.float32
    scale = np.linalg.norm(x.reshape(-1, block), axis=1).repeat(block).reshape(x.shape)
    assert np.max(np.abs(got - want) / scale) < 1e-6


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rotation_keeps_a_nan_or_inf_inside_its_block(bad):
    x = gaussian((1, 1024), seed=0)
    x[0, 300] = bad
    y = np.asarray(quant.rotate(jnp.asarray(x), 256, 0))[0]
    assert np.all(~np.isfinite(y[256:512])) and np.all(np.isfinite(np.delete(y, np.s_[256:512])))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(bits=4, format="nf5"), "format='nf5' is unknown"),
        (dict(bits=8, format="lloyd"), r"format='lloyd' supports bits in \(1, 2, 4\), not bits=8"),
        (dict(bits=2, format="e3m0"), r"not bits=2; at 2 bits use one of"),
        (dict(bits=4, block_size=96, rotate=True), "power-of-two block_size .* not 96"),
        (dict(bits=2, format="lloyd", stochastic=True), "stochastic rounding needs a grid that covers the block"),
    ],
)
def test_validate_rejects_new_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        quant.validate(**kwargs)


def test_bad_options_fail_at_construction():
    with pytest.raises(ValueError, match="power-of-two block_size"):
        loco.compress(loco.codec(2, rotate=True, block_size=96))
    with pytest.raises(ValueError, match="format='lloyd' supports bits"):
        loco.compress(loco.codec(8, format="lloyd"))
    with pytest.raises(ValueError, match="stochastic rounding needs"):
        loco.compress(loco.codec(2, format="uniform", stochastic_rounding=True))
    with pytest.raises(ValueError, match="preset='best' is unknown"):
        loco.compress(loco.codec(2, preset="best"))
    with pytest.raises(ValueError, match="power-of-two block_size"):
        collectives.quantized_psum(jnp.ones(4), "data", rotate=True, block_size=24)


# ------------------------------------------------------------------- the rotated all-reduce

N = 3000


@pytest.fixture(scope="module")
def grads(mesh):
    g = gaussian((8, N), seed=0) * np.linspace(0.1, 10, N, dtype=np.float32)  # uneven magnitudes
    return g, put(mesh, g, P(DEVICES))


@pytest.mark.parametrize("mode", collectives.MODES)
@pytest.mark.parametrize("bits,fmt", [(4, "lloyd"), (2, "lloyd"), (2, "uniform"), (1, "int")])
def test_rotated_psum_is_unrotate_of_the_psum_of_rotated_inputs(mesh, grads, mode, bits, fmt):
    """rotate once, sum in the rotated domain, rotate back once: bit for bit the same as doing it by hand."""
    _, gs = grads
    seed = 5
    cfg = collectives.QuantConfig(bits, 256, fmt, True, seed)

    def by_hand(v):
        rows, bucket = collectives.make_bucket(v[0], 4, 256)
        rotated = quant.rotate(rows, 256, cfg.rotation_seed(0))
        total = collectives.quantized_psum(rotated, "data", bits=bits, format=fmt, mode=mode)
        return collectives.unbucket(quant.unrotate(total, 256, cfg.rotation_seed(0)), bucket)

    fused = lambda v: collectives.quantized_psum(v[0], "data", bits=bits, format=fmt, mode=mode, rotate=True, seed=seed)
    a = np.asarray(per_device(mesh, fused, gs, in_specs=P(DEVICES)))
    b = np.asarray(per_device(mesh, by_hand, gs, in_specs=P(DEVICES)))
    np.testing.assert_array_equal(a, b)
    for d in range(8):
        np.testing.assert_array_equal(a[d], a[4 * (d // 4)], err_msg="every device of a group gets the same bits")


@pytest.mark.parametrize("bits,fmt,bound", [(4, "lloyd", 0.16), (2, "lloyd", 0.55), (2, "uniform", 0.56), (1, "int", 0.95)])
def test_rotated_psum_error_near_the_gaussian_two_stage_floor(mesh, grads, bits, fmt, bound):
    g, gs = grads
    out = np.asarray(per_device(mesh, lambda v: collectives.quantized_psum(v[0], "data", bits=bits, format=fmt, rotate=True),
                                gs, in_specs=P(DEVICES)))
    exact = g.reshape(2, 4, N).sum(axis=1)
    errs = [rel_err(out[4 * r], exact[r]) for r in range(2)]
    assert max(errs) < bound, errs
    # the same format without rotation is worse on these uneven magnitudes, and absmax int 2-bit much worse
    plain = np.asarray(per_device(mesh, lambda v: collectives.quantized_psum(v[0], "data", bits=bits, format=fmt), gs,
                                  in_specs=P(DEVICES)))
    assert rel_err(plain[0], exact[0]) > errs[0]


def test_rotated_psum_scatter_is_the_sum_of_each_devices_decoded_rotated_rows(mesh, grads):
    """Each device's shard is, to fp32 rounding, the sum over its replica's 4 data devices of their decoded
    rotated rows (a host re-derivation through the payload format: rotate in, encode, decode, sum, rotate
    out); against the exact sum, and against the two-stage psum's shard (one more 2-bit quantization), it
    is only within 2-bit error."""
    g, gs = grads
    x = lambda v: v[0][:2048].reshape(8, 256)
    full = per_device(mesh, lambda v: collectives.quantized_psum(x(v), "data", bits=2, format="lloyd", rotate=True), gs,
                      in_specs=P(DEVICES))
    shard = per_device(mesh, lambda v: collectives.quantized_psum_scatter(x(v), "data", bits=2, format="lloyd", rotate=True),
                       gs, in_specs=P(DEVICES))
    full, shard = np.asarray(full), np.asarray(shard)
    cfg = collectives.QuantConfig(2, quant.DEFAULT_BLOCK_SIZE, "lloyd", True, 0)
    decoded = []  # per device: its (4, cols) rotated rows, through the wire
    for i in range(8):
        rows, bucket = collectives.make_bucket(jnp.asarray(g[i, :2048].reshape(8, 256)), 4, cfg.block_size,
                                               scatter=True)
        decoded.append(np.asarray(cfg.decode(cfg.encode(cfg.rotate_in(rows)), rows.shape[1])))
    exact = g[:, :2048].reshape(2, 4, 8, 256).sum(1)
    for r in range(2):
        for d in range(4):
            mine = sum(decoded[4 * r + i][d] for i in range(4))
            want = np.asarray(collectives.unbucket_shard(cfg.rotate_out(jnp.asarray(mine)[None])[0], bucket))
            np.testing.assert_allclose(shard[4 * r + d], want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
            assert rel_err(shard[4 * r + d], exact[r, 2 * d: 2 * d + 2]) < 0.4
            assert rel_err(shard[4 * r + d], full[4 * r + d, 2 * d: 2 * d + 2]) < 0.4


@pytest.mark.parametrize("fmt,bits", [("lloyd", 2), ("lloyd", 4), ("uniform", 2), ("int", 1)])
@pytest.mark.parametrize("mode", collectives.MODES)
def test_payload_bytes_in_hlo_match_the_formula(mesh, grads, fmt, bits, mode):
    _, gs = grads
    f = jax.jit(jax.shard_map(
        lambda v: collectives.quantized_psum(v[0], "data", bits=bits, format=fmt, mode=mode, rotate=True)[None],
        mesh=mesh, in_specs=P(DEVICES), out_specs=P(DEVICES)))
    report = hlo.collective_bytes(f.lower(gs).compile())
    assert {op.dtype for op in report.ops} == {"u8"}, report.table()
    assert report.total == pytest.approx(collectives.wire_bytes_per_device(N, 4, bits=bits, mode=mode)), report.table()
