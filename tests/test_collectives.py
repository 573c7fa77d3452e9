"""quantized_psum / pmean / psum_scatter against exact collectives on 8 CPU devices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import collectives, hlo
from tests.helpers import DEVICES, gaussian, per_device, put, rel_err

N = 3000  # not a multiple of anything: padding is exercised


@pytest.fixture(scope="module")
def grads(mesh):
    g = gaussian((8, N), seed=0)
    return g, put(mesh, g, P(DEVICES))


@pytest.mark.parametrize(
    "bits,fmt,mode,bound",
    [
        (8, "int", "two_stage", 0.02),
        (4, "int", "two_stage", 0.25),
        (4, "e3m0", "two_stage", 0.35),
        (8, "int", "all_gather", 0.02),
        (4, "int", "all_gather", 0.25),
    ],
)
def test_quantized_psum_close_to_exact_and_identical(mesh, grads, bits, fmt, mode, bound):
    g, gs = grads
    out = per_device(
        mesh,
        lambda v: collectives.quantized_psum(v[0], "data", bits=bits, format=fmt, mode=mode),
        gs,
        in_specs=P(DEVICES),
    )
    out = np.asarray(out)  # (8, N): device index = replica * 4 + data
    exact = g.reshape(2, 4, N).sum(axis=1)
    for r in range(2):
        for d in range(4):
            np.testing.assert_array_equal(out[4 * r + d], out[4 * r], err_msg="every device gets the same bits")
        err = rel_err(out[4 * r], exact[r])
        assert err < bound, f"{bits}-bit {fmt} {mode}: relative L2 error {err:.3f}"


def test_quantized_pmean_pytree_shapes_and_dtypes(mesh, grads):
    g, _ = grads
    tree = {"a": g[:, :1000].reshape(8, 10, 100), "b": g[:, 1000:1004].astype(jnp.bfloat16), "c": g[:, 1004:2004]}
    specs = jax.tree.map(lambda _: P(DEVICES), tree)
    tree_s = jax.tree.map(lambda x, s: put(mesh, x, s), tree, specs)

    def fn(t):
        local = jax.tree.map(lambda x: x[0], t)
        return collectives.quantized_pmean(local, "data", bits=8)

    out = per_device(mesh, fn, tree_s, in_specs=(specs,))
    assert out["a"].shape == (8, 10, 100) and out["b"].dtype == jnp.bfloat16 and out["c"].shape == (8, 1000)
    for k in tree:
        exact = np.asarray(tree[k], np.float32).reshape(2, 4, *tree[k].shape[1:]).mean(axis=1)
        got = np.asarray(out[k], np.float32)[::4]
        assert rel_err(got, exact) < 0.03, k


def test_quantized_psum_scatter_matches_lax(mesh, grads):
    g, gs = grads
    x = g[:, :2048].reshape(8, 16, 128)
    xs = put(mesh, x, P(DEVICES))

    def both(v):
        v = v[0]
        return collectives.quantized_psum_scatter(v, "data", bits=8), lax.psum_scatter(v, "data", tiled=True)

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(DEVICES), out_specs=(P(DEVICES), P(DEVICES))))
    got, want = f(xs)
    assert got.shape == want.shape == (2 * 16, 128)
    assert rel_err(got, want) < 0.02


def test_hierarchical_matches_psum_over_both_axes(mesh, grads):
    g, gs = grads
    out = per_device(
        mesh, lambda v: collectives.quantized_psum(v[0], "replica", bits=8, fast_axis="data"), gs, in_specs=P(DEVICES)
    )
    out = np.asarray(out)
    for i in range(8):
        np.testing.assert_array_equal(out[i], out[0])
    assert rel_err(out[0], g.sum(axis=0)) < 0.02


def test_hierarchical_sends_only_the_shard_over_the_slow_axis(mesh, grads):
    _, gs = grads
    f = jax.jit(
        jax.shard_map(
            lambda v: collectives.quantized_psum(v[0], "replica", bits=4, fast_axis="data")[None],
            mesh=mesh, in_specs=P(DEVICES), out_specs=P(DEVICES),
        )
    )
    report = hlo.collective_bytes(f.lower(gs).compile())
    slow = [op for op in report.ops if op.group_size == 2]  # replica groups have 2 members
    assert slow and all(op.dtype == "u8" for op in slow)
    # each device's shard of the bucket: N / D values, padded to M blocks
    shard = -(-N // (4 * 2 * 256)) * 2 * 256
    slow_bytes = sum(op.total_bytes for op in slow)
    assert slow_bytes == collectives.wire_bytes_per_device(shard, 2, bits=4), report.table()
    # against sending the whole bucket over the slow axis (what a psum over data first would do)
    assert slow_bytes < collectives.wire_bytes_per_device(N, 2, bits=4) / 2.5


@pytest.mark.parametrize("mode", collectives.MODES)
def test_compiled_payloads_are_uint8(mesh, grads, mode):
    _, gs = grads
    f = jax.jit(
        jax.shard_map(
            lambda v: collectives.quantized_psum(v[0], "data", bits=4, mode=mode)[None],
            mesh=mesh, in_specs=P(DEVICES), out_specs=P(DEVICES),
        )
    )
    report = hlo.collective_bytes(f.lower(gs).compile())
    assert report.ops, "the program must contain collectives"
    assert {op.dtype for op in report.ops} == {"u8"}, report.table()
    expected = collectives.wire_bytes_per_device(N, 4, bits=4, mode=mode)
    assert report.total == pytest.approx(expected), report.table()


def test_nonfinite_block_surfaces_as_nan_everywhere(mesh, grads):
    g, _ = grads
    g = g.copy()
    g[5, 17] = np.nan  # one device, one value
    out = np.asarray(
        per_device(mesh, lambda v: collectives.quantized_psum(v[0], "data", bits=4), put(mesh, g, P(DEVICES)), in_specs=P(DEVICES))
    )
    assert np.all(np.isnan(out[4:, 17])), "every device of that replica sees the NaN"
    assert np.all(np.isfinite(out[:4])), "the other replica is untouched"
    assert np.isfinite(out[4:, 1000]).all(), "only the poisoned block is NaN"


def test_stochastic_rounding_is_reproducible_and_unbiased_over_keys(mesh):
    x = np.ones((8, 512), np.float32) * np.linspace(-1, 1, 512, dtype=np.float32)
    xs = put(mesh, x, P(DEVICES))

    def run(key, mode="all_gather"):
        fn = lambda v, k: collectives.quantized_psum(v[0], "data", bits=2, key=k, mode=mode)
        return np.asarray(per_device(mesh, fn, xs, key, in_specs=(P(DEVICES), P())))[0]

    keys = jax.random.split(jax.random.PRNGKey(3), 64)
    np.testing.assert_array_equal(run(keys[0]), run(keys[0]))
    samples = np.stack([run(k) for k in keys])
    assert len({s.tobytes() for s in samples}) == len(keys), "the key advances the noise"
    det = np.asarray(per_device(mesh, lambda v: collectives.quantized_psum(v[0], "data", bits=2), xs, in_specs=P(DEVICES)))
    # deterministic 2-bit rounding is biased on this input; the stochastic mean over keys is not
    assert rel_err(samples.mean(0), 4 * x[0]) < rel_err(det[0], 4 * x[0]) / 5


def test_bad_input_raises(mesh, grads):
    _, gs = grads
    with pytest.raises(ValueError, match="bits=3"):
        collectives.quantized_psum(jnp.ones(4), "data", bits=3)
    with pytest.raises(ValueError, match="mode='ring'"):
        collectives.quantized_psum(jnp.ones(4), "data", mode="ring")
    with pytest.raises(ValueError, match="not bound"):
        collectives.quantized_psum(jnp.ones(4), "data")
    with pytest.raises(ValueError, match="floating-point"):
        per_device(mesh, lambda v: collectives.quantized_psum(v[0].astype(jnp.int32), "data"), gs, in_specs=P(DEVICES))
    with pytest.raises(ValueError, match="multiple of 4"):
        per_device(mesh, lambda v: collectives.quantized_psum_scatter(v[0][:6], "data"), gs, in_specs=P(DEVICES))


def test_a_pytree_goes_through_one_bucket_or_a_few_bounded_ones(mesh, grads):
    g, _ = grads
    tree = {f"leaf{i}": g[:, 300 * i: 300 * (i + 1)] for i in range(10)}  # 10 leaves of 300 values
    specs = jax.tree.map(lambda _: P(DEVICES), tree)
    tree_s = jax.tree.map(lambda x, s: put(mesh, x, s), tree, specs)

    def compiled(bucket_size):
        fn = lambda t: jax.tree.map(lambda o: o[None], collectives.quantized_psum(
            jax.tree.map(lambda x: x[0], t), "data", bits=8, bucket_size=bucket_size))
        f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(specs,), out_specs=specs))
        return f, hlo.collective_bytes(f.lower(tree_s).compile())

    f, one = compiled(None)
    assert sum(op.count for op in one.ops) == 2  # one all-to-all and one all-gather for all 10 leaves
    f3, few = compiled(1000)  # at most 1000 values: buckets of 3, 3, 3 and 1 leaves
    assert sum(op.count for op in few.ops) == 2 * 4
    a, b = f(tree_s), f3(tree_s)
    for k in tree:
        exact = tree[k].reshape(2, 4, -1).sum(1)
        assert rel_err(np.asarray(a[k])[::4], exact) < 0.02 and rel_err(np.asarray(b[k])[::4], exact) < 0.02


def _reduce_then_gather(mesh, ordered):
    """A psum and an all_gather of independent inputs; ``ordered``: the gather's input made to follow the
    psum's result with :func:`collectives.after`."""
    def f(a, b):
        total = lax.psum(a, "data")
        if ordered:
            b = collectives.after(b, total)
        return total, lax.all_gather(b, "data", tiled=True, to="invarying")

    spec = jax.sharding.NamedSharding(mesh, P("data"))
    args = (jax.ShapeDtypeStruct((8,), jnp.float32, sharding=spec), jax.ShapeDtypeStruct((8,), jnp.uint8, sharding=spec))
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P(), P()))).trace(*args)


def test_after_orders_two_collectives_on_cpu_and_leaves_other_platforms_alone(mesh):
    """Compiled for CPU, the reader finds the two collectives unordered, and ordered once ``after`` ties them;
    lowered for CUDA the tie is not there (no product with zero: the collectives stay free to overlap)."""
    assert len(hlo.unordered_collectives(_reduce_then_gather(mesh, False).lower().compile())) == 1
    assert hlo.unordered_collectives(_reduce_then_gather(mesh, True).lower().compile()) == []
    cpu = _reduce_then_gather(mesh, True).lower(lowering_platforms=("cpu",)).as_text(debug_info=False)
    cuda = _reduce_then_gather(mesh, True).lower(lowering_platforms=("cuda",)).as_text(debug_info=False)
    assert "stablehlo.multiply" in cpu and "stablehlo.multiply" not in cuda


def test_after_ties_through_an_axis_of_one_device_and_skips_a_larger_one():
    """On a (replica=1, data=8) mesh a value varying over both axes orders one varying over data only (its
    element summed over the one-device replica axis, a reduction no other device takes part in); on
    (replica=2, data=4) it cannot (the sum would be a real exchange) and ``after`` leaves it out."""
    def program(replicas):
        mesh = jax.make_mesh((replicas, 8 // replicas), ("replica", "data"))

        def f(x, w):
            total = lax.psum(x, "data")  # varies over replica: the batch's axes
            return total, lax.all_gather(collectives.after(w, total), "data", tiled=True, to="invarying")

        sharded = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                           sharding=jax.sharding.NamedSharding(mesh, spec))
        args = (sharded((8, 4), P(("replica", "data"))), sharded((8,), P("data")))
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(("replica", "data")), P("data")),
                                     out_specs=(P("replica"), P()))).lower(*args).compile()
    assert hlo.unordered_collectives(program(1)) == []
    assert len(hlo.unordered_collectives(program(2))) == 1


def test_after_changes_no_bit_whatever_previous_holds():
    """Every dtype the project ties (float32, bfloat16, int32, uint8, bool), ``-0.0`` and NaN included, comes
    back bit for bit, after a ``previous`` of NaN, +-Inf, the largest float32, a bool and an int."""
    previous = (jnp.array([np.nan, 1.0], jnp.float32), jnp.array([np.inf]), jnp.array([-np.inf]),
                jnp.array([np.finfo(np.float32).max]), jnp.array([True]), jnp.array([2**31 - 1], jnp.int32))
    trees = [
        [jnp.array([-0.0, 0.0, np.nan, -np.inf, 1.5e-45, 3.0], jnp.float32), jnp.ones(2)],
        [jnp.array([-0.0, 1.0, np.nan], jnp.bfloat16)],
        [jnp.array([-(2**31), 0, 2**31 - 1], jnp.int32)],
        [jnp.array([0, 7, 255], jnp.uint8)],
        [jnp.array([True, False])],
    ]
    for tree in trees:
        for prev in [previous, previous[:1], previous[4:]]:
            out = jax.jit(collectives.after)(tree, prev)
            for x, y in zip(tree, out):
                assert x.dtype == y.dtype
                assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), (x, y, prev)
