"""The non-finite rule (loco_jax/nonfinite.py): one flag per step, agreed over the axes its caller names."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import hlo, loco, nonfinite


def _per_device_flags(mesh, fn, x):
    """``fn`` of each device's block of ``x`` (rows split over replica x data): one flag per device."""
    body = lambda block: fn(block).reshape(1).astype(jnp.int32)
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("replica", "data")), out_specs=P(("replica", "data")),
                                check_vma=False))
    return np.asarray(run(_rows(mesh, x))).reshape(2, 4)


def _rows(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(("replica", "data"))))


def _one_nan_on(replica, data):
    x = np.ones((8, 16), np.float32)
    x[replica * 4 + data, 3] = np.nan
    return jnp.asarray(x)


@pytest.mark.parametrize("axes,expected", [
    ((), [[0, 1, 1, 1], [1, 1, 1, 1]]),                           # each device alone
    (("data",), [[0, 0, 0, 0], [1, 1, 1, 1]]),                    # each replica alone
    (("replica", "data"), [[0, 0, 0, 0], [0, 0, 0, 0]]),          # every device
])
def test_all_finite_is_agreed_over_exactly_the_axes_named(mesh, axes, expected):
    flags = _per_device_flags(mesh, lambda b: nonfinite.all_finite(b, axes), _one_nan_on(0, 0))
    np.testing.assert_array_equal(flags, expected)


def test_decision_axes_are_the_bound_axes_but_the_independent_ones(mesh):
    seen = {}

    def body(x):
        seen["all"], seen["replica alone"] = nonfinite.decision_axes(), nonfinite.decision_axes(("replica",))
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.zeros(()))
    assert seen == {"all": ("replica", "data"), "replica alone": ("data",)}
    assert nonfinite.decision_axes() == ()  # outside shard_map: nothing to agree with


def _step(mesh, tx, extra):
    """One update of ``tx`` on per-device gradients (NaN on device (0, 0)); the skip count on each device."""
    params = {"w": jnp.zeros((4 * 256,))}

    def body(g):
        g = {"w": g.reshape(-1)}  # split over (replica, data): varies over both
        state = tx.init(params)
        _, state = tx.update(g, state, params, **extra)
        return jnp.reshape(state.skipped, (1,))

    grads = np.ones((8, 4 * 256), np.float32)
    grads[0, 5] = np.nan
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("replica", "data")), out_specs=P(("replica", "data"))))
    return run(_rows(mesh, grads)), run


@pytest.mark.parametrize("make", [
    lambda: loco.compress(bits=4, axis_name="data"),
    lambda: nonfinite.skip_nonfinite(optax.chain(loco.compress(bits=4, axis_name="data"), optax.adam(0.1))),
])
def test_a_replica_named_independent_skips_alone_and_nothing_crosses_replica_for_it(mesh, make):
    """Passed ``independent_axes=("replica",)`` (what DiLoCo passes its inner optimizer), the replica with the
    NaN skips its step and the other does not; the compiled program has no collective over ``replica``.
    Without it, every device skips together."""
    alone, run = _step(mesh, make(), {nonfinite.INDEPENDENT: ("replica",)})
    np.testing.assert_array_equal(np.asarray(alone).reshape(2, 4), [[1, 1, 1, 1], [0, 0, 0, 0]])
    grads = jax.ShapeDtypeStruct((8, 4 * 256), jnp.float32, sharding=NamedSharding(mesh, P(("replica", "data"))))
    report = hlo.collective_bytes(run.lower(grads).compile())
    assert report.ops and not [op for op in report.ops if op.spans(4)], report.ops  # every group within a replica
    together, _ = _step(mesh, make(), {})
    np.testing.assert_array_equal(np.asarray(together).reshape(2, 4), 1)
