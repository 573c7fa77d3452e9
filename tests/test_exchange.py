"""The exchange as a value (loco_jax.exchange): the error step written once, against NumPy, and the codecs
that LoCo and DiLoCo are built from."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import diloco, exchange, loco, quant
from tests.helpers import put


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
    assert loco.MEASURED[4]["format"] == "lloyd" and step.error_bits == 8
    tx = diloco.diloco(optax.sgd(0.1), sync_every=4, bits=2, density=0.03, error_decay=0.95)
    codec = tx.loop.ex.codec
    assert isinstance(codec, exchange.Sparse) and codec.decay == 0.95 and codec.code.k == round(0.03 * 4096)
    dense = diloco.diloco(optax.sgd(0.1), sync_every=4, bits=4).loop.ex.codec
    assert isinstance(dense, exchange.Dense) and dense.bits == 4 and dense.format == diloco.MEASURED[4]["format"]
    assert isinstance(diloco.diloco(optax.sgd(0.1), sync_every=4, bits=None).loop.ex.codec, exchange.Exact)


def test_compress_of_a_codec_value_is_compress_of_its_settings(data_mesh):
    """``compress(Dense(...))`` runs the same step as ``compress(bits=..., ...)`` with the codec's settings:
    the same means and error buffers, to the bit, over two steps on 8 devices; a setting given twice is refused
    by name."""
    import jax
    from jax.sharding import PartitionSpec as P

    settings = dict(format="uniform", rotate=True, compensate=True, beta=0.5, error_bits=8)
    by_value = loco.compress(exchange.Dense(2, **settings), axis_name="data")
    by_args = loco.compress(bits=2, axis_name="data", **settings)
    grads = np.random.RandomState(0).randn(8, 600).astype(np.float32)

    def run(tx):
        def body(g):
            params = {"w": jnp.zeros(600)}
            state = tx.init(params)
            outs = []
            for scale in (1.0, 0.5):
                u, state = tx.update({"w": g[0] * scale}, state, params)
                outs.append(u["w"])
            return jnp.stack(outs)[None], state.error[0][None]

        return jax.jit(jax.shard_map(body, mesh=data_mesh, in_specs=P("data"), out_specs=P("data"),
                                     check_vma=False))(put(data_mesh, grads, P("data")))

    (u1, e1), (u2, e2) = run(by_value), run(by_args)
    np.testing.assert_array_equal(np.asarray(u1), np.asarray(u2))
    np.testing.assert_array_equal(np.asarray(e1), np.asarray(e2))
    assert np.abs(np.asarray(e1)).max() > 0  # an error was kept
    with pytest.raises(ValueError, match="beta=0.3"):
        loco.compress(exchange.Dense(4), beta=0.3)
    with pytest.raises(ValueError, match="bits"):
        loco.compress(exchange.Dense(3))


def test_diloco_of_a_codec_value_holds_the_exchange_its_settings_build():
    """``diloco(bits=<exchange value>)`` builds the same :class:`diloco.Exchange` (hence the same programs) as
    the loose settings do, dense and sparse; a setting given twice, or a sparse codec for LoCo, is refused."""
    sgd = optax.sgd(0.1)
    ex = lambda **kw: diloco.diloco(sgd, sync_every=4, **kw).loop.ex
    assert ex(bits=exchange.Sparse.of(0.03, bits=2, decay=0.95)) == ex(bits=2, density=0.03, error_decay=0.95)
    assert ex(bits=exchange.Sparse.of(1 / 64, chunk=1024, bits=4, format="int", average_over="replicas")) == ex(
        bits=4, density=1 / 64, chunk=1024, format="int", average_over="replicas")
    assert ex(bits=exchange.Dense(4, format="lloyd", rotate=True, compensate=False)) == ex(bits=4)
    assert ex(bits=exchange.Exact()) == ex(bits=None)
    with pytest.raises(ValueError, match="error_decay=0.9"):
        ex(bits=exchange.Sparse.of(0.03), error_decay=0.9)
    with pytest.raises(ValueError, match="sparse exchange is diloco"):
        loco.compress(exchange.Sparse.of(0.03))


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
