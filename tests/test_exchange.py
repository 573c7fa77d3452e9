"""The exchange as a value (loco_jax.exchange): the error step written once, against NumPy, and the codecs
that LoCo and DiLoCo are built from."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import diloco, exchange, loco, quant


def _arrays(seed=3):
    rng = np.random.RandomState(seed)
    return (rng.randn(2, 512).astype(np.float32) for _ in range(3))


@pytest.mark.parametrize("beta, error_bits", [(0.8, None), (0.0, None), (0.8, 8)])
def test_the_dense_error_step_is_the_moving_average_of_compression_errors(beta, error_bits):
    """LoCo's rule (both stages, in and after the backward pass) and DiLoCo's compensated dense exchange:
    h = x + e, then Q_e(beta e + (1 - beta)(h - sent)), against NumPy in float32."""
    x, e, sent = _arrays()
    feedback = exchange.Dense(4, beta=beta, error_bits=error_bits).feedback
    h = feedback.compensate(jnp.asarray(x), jnp.asarray(e))
    np.testing.assert_array_equal(np.asarray(h), x + e)
    values, scales = feedback.update(jnp.asarray(e), h, jnp.asarray(sent))
    want = np.float32(beta) * e + np.float32(1.0 - beta) * ((x + e) - sent)  # each product rounded, then summed
    got = np.asarray(quant.load(values, scales, error_bits))
    if error_bits is None:
        np.testing.assert_array_equal(got, want)
    else:  # stored in 8 bits: within half a step of each block's absmax grid
        step = np.abs(want).reshape(2, -1, 256).max(axis=-1, keepdims=True) / 127
        assert np.all(np.abs(got - want).reshape(2, -1, 256) <= step / 2 + 1e-7)


@pytest.mark.parametrize("decay", [1.0, 0.95])
def test_the_sparse_error_step_is_the_decayed_accumulator_less_what_was_sent(decay):
    """SparseLoCo's rule: a = decay e + x, then e = a - sent (no average), exact in fp32."""
    x, e, sent = _arrays(5)
    feedback = exchange.Sparse.of(1 / 16, chunk=256, decay=decay).feedback
    a = feedback.compensate(jnp.asarray(x), jnp.asarray(e))
    np.testing.assert_array_equal(np.asarray(a), np.float32(decay) * e + x)
    values, scales = feedback.update(jnp.asarray(e), a, jnp.asarray(sent))
    assert scales is None
    np.testing.assert_array_equal(np.asarray(values), (np.float32(decay) * e + x) - sent)


def test_a_reset_loads_zero_and_exact_keeps_nothing():
    feedback = exchange.Dense(2, error_bits=8).feedback
    values, scales = feedback.update(jnp.zeros((1, 256)), jnp.ones((1, 256)), jnp.zeros((1, 256)))
    assert np.all(np.asarray(feedback.load(values, scales)) > 0)
    assert np.all(np.asarray(feedback.load(values, scales, jnp.array(True))) == 0)
    assert exchange.Exact().feedback is None and exchange.Exact().bits is None
    assert exchange.Dense(4, compensate=False).feedback is None


def test_loco_and_diloco_hold_the_codec_their_arguments_name():
    """compress(bits=4) and diloco(bits=2, density=...) resolve their settings into one codec value each:
    the per-bit defaults for LoCo's 4 bits, SparseLoCo's accumulator for a sparse exchange."""
    step = loco.exchanger(bits=4)
    assert loco.MEASURED[4]["format"] == "lloyd" and step.codec.error_bits == 8
    tx = diloco.diloco(optax.sgd(0.1), sync_every=4, bits=exchange.Sparse.of(0.03, bits=2, decay=0.95))
    codec = tx.loop.ex.codec
    assert isinstance(codec, exchange.Sparse) and codec.decay == 0.95 and codec.code.k == round(0.03 * 4096)
    dense = diloco.diloco(optax.sgd(0.1), sync_every=4, bits=4).loop.ex.codec
    assert isinstance(dense, exchange.Dense) and dense.bits == 4 and dense.format == diloco.MEASURED[4]["format"]
    assert isinstance(diloco.diloco(optax.sgd(0.1), sync_every=4, bits=None).loop.ex.codec, exchange.Exact)


def test_compress_takes_what_is_sent_as_one_value():
    """``compress`` takes what is sent as one value: ``loco.codec``'s (the per-bit defaults, a setting given
    winning) or one built by hand, checked alike; the codec's settings are not ``compress``'s arguments, and a
    hand-built value outside the valid range is refused by name."""
    settings = dict(format="uniform", rotate=True, compensate=True, beta=0.5, error_bits=8)
    assert loco.codec(2, **settings) == exchange.Dense(2, **settings)
    assert loco.exchanger(bits=2).codec == loco.codec(2)
    assert loco.exchanger(bits=exchange.Dense(2, **settings)).codec == exchange.Dense(2, **settings)
    with pytest.raises(TypeError, match="beta"):
        loco.compress(4, beta=0.3)
    with pytest.raises(ValueError, match="bits"):
        loco.compress(exchange.Dense(3))
    with pytest.raises(ValueError, match="beta=1.5"):
        loco.compress(exchange.Dense(4, beta=1.5))
    with pytest.raises(ValueError, match="bits='4'"):
        loco.compress("4")
    with pytest.raises(ValueError, match="compensate_second_stage"):
        loco.compress(loco.codec(4, compensate=True, compensate_second_stage=True), mode="all_gather")
    with pytest.raises(ValueError, match="stochastic_rounding=True"):
        loco.codec(None, stochastic_rounding=True)


def test_diloco_takes_what_is_sent_as_one_value():
    """``diloco(bits=b)`` runs ``diloco.codec(b)`` (its per-bit defaults); a value is held as given, checked
    as the builders check; the codec's settings are not ``diloco``'s arguments; a sparse codec is refused by
    LoCo, a LoCo-only setting by DiLoCo; SparseLoCo's rule sets the accumulator's decay and plain SGD."""
    sgd = optax.sgd(0.1)
    ex = lambda **kw: diloco.diloco(sgd, sync_every=4, **kw).loop.ex
    assert ex(bits=4) == ex(bits=diloco.codec(4)) == ex(bits=exchange.Dense(4, format="lloyd", rotate=True,
                                                                              compensate=False))
    assert ex(bits=exchange.Exact()) == ex(bits=None)
    sparse = exchange.Sparse.of(1 / 64, chunk=1024, bits=4, average_over="replicas")
    assert ex(bits=sparse).codec == sparse and sparse.code.format == diloco.SPARSE_FORMATS[4]
    rule = diloco.sparseloco_rule(sparse, lr=1.0, beta=0.9)
    assert rule["bits"] == sparse._replace(decay=0.9)
    with pytest.raises(TypeError, match="density"):
        diloco.diloco(sgd, sync_every=4, bits=2, density=0.03)
    with pytest.raises(ValueError, match="sparse exchange is diloco"):
        loco.compress(exchange.Sparse.of(0.03))
    with pytest.raises(ValueError, match="stochastic_rounding"):
        diloco.diloco(sgd, sync_every=4, bits=loco.codec(4, format="int", stochastic_rounding=True))
    with pytest.raises(ValueError, match="error_beta=1.0"):
        diloco.diloco(sgd, sync_every=4, bits=exchange.Dense(4, beta=1.0))
    with pytest.raises(ValueError, match="sparse exchange's accumulator"):
        diloco.sparseloco_rule(diloco.codec(4))


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_loco_codec_is_the_value_compress_runs_with_the_per_bit_defaults(bits):
    """``loco.codec(b)`` states what ``compress(bits=b)`` runs: the per-bit defaults of ``loco.MEASURED`` (the
    reference's under ``preset="reference"``), an argument given winning; ``codec(None)`` is the exact mean."""
    want = loco.MEASURED[bits]
    got = loco.codec(bits)
    assert (got.bits, got.format, got.rotate, got.compensate, got.beta) == (
        bits, want["format"], want["rotate"], want["compensate"], want["beta"])
    ref = loco.codec(bits, preset="reference")
    assert (ref.format, ref.rotate, ref.compensate, ref.beta) == ("int", False, True, 0.8)
    assert loco.codec(bits, beta=0.3).beta == 0.3
    assert loco.codec(None) == exchange.Exact()
