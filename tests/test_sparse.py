"""The sparse payload (loco_jax.sparse) and DiLoCo's sparse outer exchange, against NumPy re-derivations."""

import json
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from loco_jax import diloco, exchange, hlo, quant, sparse
from tests.helpers import (D, DEVICES, M, Run, inner_adamw, local, make_data, make_params, per_device, plain_inner,
                           put)


def distinct(n, seed=0):
    """``n`` values of distinct magnitudes (no ties in a top-k), heavy-tailed like outer gradients."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n) * np.exp(rng.randn(n))
    return (x + np.sign(x) * np.arange(n) * 1e-7).astype(np.float32)


def numpy_sparse(x, cfg):
    """C(x) in NumPy: each chunk's k entries of largest |x| (argsort), their values through the project's
    quantizer (tested against NumPy in test_quant), zeros elsewhere."""
    chunks = np.asarray(x, np.float32).reshape(-1, cfg.chunk)
    out = np.zeros_like(chunks)
    for c, row in enumerate(chunks):
        keep = np.argsort(-np.abs(row), kind="stable")[: cfg.k]
        if cfg.format == "binmean":
            out[c, keep] = numpy_binmean(row[keep])[1]
            continue
        codes, scales = quant.quantize(jnp.asarray(row[keep])[None], cfg.bits, format=cfg.format)
        out[c, keep] = np.asarray(quant.dequantize(codes, scales, cfg.bits, format=cfg.format))[0]
    return out.reshape(-1)


@pytest.mark.parametrize("width", [1, 2, 3, 7, 8, 12, 13, 16])
def test_bit_packing_round_trips_and_is_a_little_endian_stream(width):
    rng = np.random.RandomState(width)
    values = rng.randint(0, 2**width, size=(3, 37)).astype(np.uint32)
    packed = sparse.pack_bits(jnp.asarray(values), width)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, -(-37 * width // 8))
    np.testing.assert_array_equal(sparse.unpack_bits(packed, width, 37), values)
    stream = "".join(format(int(v), f"0{width}b")[::-1] for v in values[0])  # value i's bit j at i * width + j
    stream += "0" * (-len(stream) % 8)
    want = [int(stream[i:i + 8][::-1], 2) for i in range(0, len(stream), 8)]
    np.testing.assert_array_equal(np.asarray(packed[0]), want)


@pytest.mark.parametrize("density,bits,fmt", [(64 / 4096, 2, "uniform"), (16 / 1024, 4, "int"), (0.03, 1, "int"),
                                              (8 / 256, 8, "int")])
def test_encode_keeps_each_chunks_top_k_at_b_bits_and_decodes_to_what_it_sent(density, bits, fmt):
    chunk = 4096 if density == 64 / 4096 else (1024 if bits == 4 else (4096 if bits == 1 else 256))
    cfg = sparse.sparse_config(density, chunk=chunk, bits=bits, format=fmt)
    x = distinct(cfg.chunk * 5)
    payload, sent = cfg.encode(jnp.asarray(x))
    assert payload.dtype == jnp.uint8 and payload.shape == (5, sum(cfg.chunk_bytes()))
    np.testing.assert_array_equal(np.asarray(cfg.decode(payload)), np.asarray(sent))  # the wire is exact
    want = numpy_sparse(x, cfg)
    np.testing.assert_array_equal(np.asarray(sent) != 0, want != 0)  # the same positions
    np.testing.assert_allclose(np.asarray(sent), want, rtol=1e-6)  # the same values (up to a fused rounding)
    assert np.count_nonzero(np.asarray(sent).reshape(5, -1), axis=1).max() <= cfg.k
    # several payloads at once (the replicas' gathered payloads): a leading axis
    both = cfg.decode(jnp.stack([payload, payload]))
    assert both.shape == (2, x.size)


def numpy_binmean(v):
    """SparseLoCo's 2-bit values quantizer in NumPy (float64), one row: centre on the mean, bins 1.5 sample
    standard deviations wide around code 2, each bin decoded to the mean of the centred values in it."""
    v = np.asarray(v, np.float64)
    mu = v.mean()
    c = v - mu
    sigma = np.std(c, ddof=1) if v.size > 1 else 0.0
    width = 1.5 * sigma if sigma > 0 else 1.0
    q = np.clip(np.round(c / width + 2), 0, 3).astype(int)
    table = np.array([c[q == b].mean() if np.any(q == b) else 0.0 for b in range(4)])
    return q, table[q] + mu


def test_the_binmean_quantizer_matches_numpy_and_keeps_each_rows_sum():
    rng = np.random.RandomState(3)
    rows = [distinct(123, seed=1), rng.randn(41) * 1e-3 + 2e-3,  # top-k values, an off-centre row
            np.array([0.5, 0.5, 0.5, 0.5]), np.array([-1.0, 1.0, -1.0, 1.0])]  # sigma 0; two values only
    for row in rows:
        codes, side = sparse.binmean_quantize(jnp.asarray(row, jnp.float32)[None])
        want_q, want = numpy_binmean(np.asarray(row, np.float32))
        np.testing.assert_array_equal(np.asarray(codes[0]), want_q)
        got = np.asarray(sparse.binmean_dequantize(codes, side)[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.abs(row).max())
        np.testing.assert_allclose(got.sum(), np.sum(row, dtype=np.float64), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(sparse.binmean_dequantize(*sparse.binmean_quantize(
        jnp.asarray([[0.5, 0.5, 0.5, 0.5]])))), 0.5)  # sigma 0: exact


def test_the_binmean_payload_round_trips_and_a_nonfinite_chunk_decodes_to_nan():
    cfg = sparse.sparse_config(0.03, bits=2, format="binmean")
    assert cfg.chunk_bytes() == (-(-123 * 12 // 8), -(-123 * 2 // 8), 20)
    x = distinct(4096 * 3)
    payload, sent = cfg.encode(jnp.asarray(x))
    assert payload.dtype == jnp.uint8 and payload.shape == (3, sum(cfg.chunk_bytes()))
    np.testing.assert_array_equal(np.asarray(cfg.decode(payload)), np.asarray(sent))
    chunks, out = x.reshape(3, -1), np.zeros((3, 4096))
    for c, row in enumerate(chunks):
        keep = np.argsort(-np.abs(row), kind="stable")[: cfg.k]
        out[c, keep] = numpy_binmean(row[keep])[1]
    np.testing.assert_allclose(np.asarray(sent).reshape(3, -1), out, rtol=1e-5, atol=1e-6)
    x[5000] = np.nan
    decoded = np.asarray(cfg.decode(cfg.encode(jnp.asarray(x))[0])).reshape(3, -1)
    assert np.isnan(decoded[1]).any() and np.isfinite(decoded[[0, 2]]).all()


def test_bits_per_value_at_the_issues_density():
    cfg = sparse.sparse_config(64 / 4096, bits=2)  # 1.56 %, 12-bit positions, 2-bit values, a scale per chunk
    assert cfg.k == 64 and cfg.index_bits == 12 and cfg.chunk_bytes() == (96, 16, 4)
    assert cfg.bits_per_value() == (64 * 14 + 32) / 4096 <= 0.30
    assert cfg.payload_bytes(4096 * 10) == 10 * 116


def test_a_nonfinite_chunk_decodes_to_nan_and_only_that_chunk():
    cfg = sparse.sparse_config(0.25, chunk=16, bits=2)
    x = distinct(64)
    x[20] = np.inf
    payload, sent = cfg.encode(jnp.asarray(x))
    decoded = np.asarray(cfg.decode(payload)).reshape(4, 16)
    assert np.isnan(decoded[1][decoded[1] != 0]).all() and np.isnan(decoded[1]).any()
    assert np.isfinite(decoded[[0, 2, 3]]).all()


@pytest.mark.parametrize("kwargs,match", [
    (dict(density=0.0), "density=0.0 must lie in \\(0, 1\\)"),
    (dict(density=1.0), "must lie in \\(0, 1\\)"),
    (dict(density=True), "must lie in \\(0, 1\\)"),
    (dict(density=0.01, chunk=1000), "chunk=1000 must be a power of two"),
    (dict(density=0.0001, chunk=256), "k = round\\(0.0001 x 256\\) = 0"),
    (dict(density=0.999, chunk=256), "k must lie in \\[1, 255\\]"),
    (dict(density=0.01, index_bits=8), "index_bits=8 cannot hold a position in a 4096-entry chunk"),
    (dict(density=0.01, bits=3), "bits=3 is not supported; choose one of"),
    (dict(density=0.01, format="e3m0", bits=2), "format='e3m0' supports bits in \\(4,\\), not bits=2"),
    (dict(density=0.01, format="binmean", bits=4), "format='binmean' takes bits in \\(2,\\)"),
    (dict(density=1 / 4096, format="binmean", bits=2), "keeps k = 1 entry per chunk; its statistics need k >= 2"),
])
def test_bad_sparse_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparse.sparse_config(**kwargs)


@pytest.mark.parametrize("build,match", [
    (lambda: exchange.Sparse.of(1.5), "density=1.5 must lie in"),
    (lambda: exchange.Sparse.of(0.01, chunk=3000), "chunk=3000 must be a power of two"),
    (lambda: exchange.Sparse.of(0.01, bits=3), "bits=3"),
    (lambda: diloco.diloco(optax.sgd(0.1), sync_every=4, bits=exchange.Sparse.of(0.01), mode="two_stage"),
     "mode='two_stage'"),
    (lambda: exchange.Sparse.of(0.01, decay=0.0), "decay=0.0 must lie in \\(0, 1\\]"),
    (lambda: exchange.Sparse.of(0.01, decay=1.5), "decay=1.5"),
    (lambda: exchange.Sparse.of(0.01, error_bits=3), "error_bits=3"),
    (lambda: diloco.codec(2, format="binmean"), "format='binmean' quantizes the kept values of a sparse exchange"),
])
def test_a_bad_sparse_exchange_is_refused_before_anything_compiles(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("decay,error_bits,fmt", [(1.0, None, "uniform"), (0.9, None, "uniform"), (0.95, 8, "uniform"),
                                                (0.95, None, "binmean")])
def test_the_sparse_exchange_is_the_mean_of_every_replicas_top_k_with_error_feedback(mesh, decay, error_bits, fmt):
    """One exchange on the (2, 4) mesh: each device's slice, a = beta e + Delta, sends C(a), keeps a - C(a);
    over replicas the mean is (1/M) sum_m C(a_m) on every replica (NumPy re-derivation, values in ``fmt``)."""
    cfg = sparse.sparse_config(1 / 16, chunk=256, bits=2, format=fmt)
    ex = diloco.Exchange("replica", "data", exchange.Sparse(cfg, decay, error_bits, 256, "replicas"), "all_gather")
    k = 2 * 256  # this device's slice: 2 chunks
    deltas = np.stack([distinct(k, seed=s) for s in range(M * D)]).reshape(M, D, k)
    errors = np.stack([distinct(k, seed=100 + s) * 0.3 for s in range(M * D)]).reshape(M, D, k)
    stored = [quant.store(jnp.asarray(e)[None], error_bits) for e in errors.reshape(M * D, k)]
    codes = jnp.stack([s[0] for s in stored])
    scales = None if error_bits is None else jnp.stack([s[1] for s in stored])

    def body(delta, e, s):
        mean, new, _ = ex.mean(delta[0], 0, e[0], None if s is None else s[0])
        return mean, quant.load(new[0], new[1], error_bits)[0]

    specs = (P(DEVICES), P(DEVICES), None if scales is None else P(DEVICES))
    args = [put(mesh, a, P(DEVICES)) if a is not None else None for a in (deltas.reshape(M * D, k), codes, scales)]
    mean, new = per_device(mesh, body, *args, in_specs=specs)
    loaded = np.stack([np.asarray(quant.load(c, None if scales is None else scales[i], error_bits))[0]
                       for i, c in enumerate(codes)]).reshape(M, D, k)
    acc = (np.float32(decay) * loaded + deltas).astype(np.float32)
    sent = np.stack([[numpy_sparse(acc[m, d], cfg) for d in range(D)] for m in range(M)])
    want_mean = sent.mean(axis=0)
    got_mean = np.asarray(mean).reshape(M, D, k)
    for m in range(M):
        np.testing.assert_allclose(got_mean[m], want_mean, rtol=1e-6, atol=1e-7)
    want_error = (acc - sent).reshape(M * D, k)
    # fp32: a kept entry's error is a difference of two close values (a few ulps of |a|); 8 bits: half a step
    atol = 1e-6 * np.abs(acc).max() if error_bits is None else 0.51 * np.abs(want_error).max() / 127
    np.testing.assert_allclose(np.asarray(new), want_error, rtol=1e-6, atol=atol)


def _supported(k, big, seed):
    """A slice of ``k`` small values with entries ``big`` (per chunk: {position: value}) set large: each
    chunk's top entries are those positions."""
    x = distinct(k, seed=seed) * 1e-3
    chunks = x.reshape(-1, 256)
    for c in range(chunks.shape[0]):
        for i, v in big.items():
            chunks[c, i] = v
    return chunks.reshape(-1)


@pytest.mark.parametrize("support", ["same", "disjoint", "overlapping"])
def test_the_mean_over_senders_divides_each_entry_by_the_replicas_that_sent_it(mesh, support):
    """One exchange on the (2, 4) mesh, 16 entries of each 256 sent: ``average_over="senders"`` gives each
    entry's sum over the replicas that sent it divided by their number (NumPy, from the top-k positions),
    where "same" positions give the mean over replicas to the bit. "overlapping" holds one entry per chunk 100x
    the others: at 2-bit ``int`` the rest of its top-k decode to exactly 0 and still count as sent."""
    cfg = sparse.sparse_config(1 / 16, chunk=256, bits=2, format="int")
    make = lambda average: diloco.Exchange("replica", "data", exchange.Sparse(cfg, 1.0, None, 256, average),
                                           "all_gather")
    k = 2 * 256
    own = {"same": [range(16), range(16)], "disjoint": [range(16), range(16, 32)],
           "overlapping": [range(16), range(8, 24)]}[support]
    deltas = np.zeros((M, D, k), np.float32)
    for m in range(M):
        for d in range(D):
            big = {i: (1.0 + 0.01 * i) * (-1) ** (i + m) for i in own[m]}
            if support == "overlapping":
                big[own[m][0]] = 100.0
            deltas[m, d] = _supported(k, big, seed=m * D + d)
    zero_error = jnp.zeros((M * D, k), jnp.float32)

    def run(average):
        body = lambda delta, e: make(average).mean(delta[0], 0, e[0], None)[0]
        args = [put(mesh, a, P(DEVICES)) for a in (deltas.reshape(M * D, k), zero_error)]
        return np.asarray(per_device(mesh, body, *args, in_specs=(P(DEVICES), P(DEVICES)))).reshape(M, D, k)

    got, over_replicas = run("senders"), run("replicas")
    sent = np.stack([[numpy_sparse(deltas[m, d], cfg) for d in range(D)] for m in range(M)])
    held = np.zeros_like(sent)
    for m in range(M):
        for d in range(D):
            for c, row in enumerate(deltas[m, d].reshape(-1, 256)):
                held[m, d, c * 256 + np.argsort(-np.abs(row), kind="stable")[: cfg.k]] = 1.0
    if support == "overlapping":
        assert np.sum((held == 1) & (sent == 0)) > 0  # kept entries that decode to 0
    want = sent.sum(axis=0) / np.maximum(held.sum(axis=0), 1.0)
    for m in range(M):
        np.testing.assert_allclose(got[m], want, rtol=1e-6, atol=0)
        np.testing.assert_allclose(over_replicas[m], sent.mean(axis=0), rtol=1e-6, atol=0)
    if support == "same":
        assert got.tobytes() == over_replicas.tobytes()
    else:  # an entry one replica sent moves the mean by its whole value over senders, by half over replicas
        assert np.abs(got).sum() > 1.2 * np.abs(over_replicas).sum()


def test_average_over_is_refused_by_name():
    with pytest.raises(ValueError, match="average_over='workers' must be one of"):
        exchange.Sparse.of(0.01, average_over="workers")


def _sparse_run(mesh, width, **kwargs):
    """A sparse Streaming DiLoCo run on the (2, 4) mesh (H = 6, 3 fragments, overlap 1, SparseLoCo's rule,
    1/64 of 256-value chunks at 2 bits) and its exchange step's collectives over ``replica`` (asserted
    uint8): ``(tx, run, xs, ys, ops over replica, report)``."""
    sent = exchange.Sparse.of(1 / 64, bits=2, chunk=256, **kwargs)
    tx = diloco.diloco(inner_adamw(), sync_every=6, num_fragments=3, overlap=1,
                       **diloco.sparseloco_rule(sent, lr=1.0, beta=0.95))
    run = Run(mesh, tx, width=width)
    xs, ys = make_data(9)
    x0, y0 = put(mesh, xs[0], P(DEVICES)), put(mesh, ys[0], P(DEVICES))
    report = hlo.collective_bytes(run.program(tx.phase(7)).lower(run.params, run.state, x0, y0).compile())
    over_replica = [op for op in report.ops if op.group_size == M]
    assert over_replica and {op.dtype for op in over_replica} == {"u8"}, report.table()
    return tx, run, xs, ys, over_replica, report


def _fragment_0_moved_by_its_apply(run, plan, xs, ys):
    """Steps 1-9 of ``run`` (H = 6, 3 fragments, overlap 1): how fragment 0's global parameters moved from
    step 7 (its send) to step 9 (after its apply), in extract order; asserted non-zero."""
    before = None
    for t in range(1, 10):
        if t == 7:
            before = np.asarray(plan.extract(diloco.global_params(run.state), 0))
        run.step(t, xs[t - 1], ys[t - 1])
    moved = np.asarray(plan.extract(diloco.global_params(run.state), 0)) - before
    assert np.count_nonzero(moved) > 0
    return moved


def test_diloco_sparse_sends_uint8_chunks_and_moves_each_fragment_by_at_most_m_k_entries_per_chunk(mesh):
    """End to end (H = 6, 3 fragments, overlap 1, SparseLoCo's rule: plain SGD at lr 1 on the mean): only
    uint8 crosses ``replica``, in the bytes of the slice's chunks, and each apply moves a fragment's global
    parameters by the decoded mean, which has at most M k non-zeros per chunk."""
    width = 512
    tx, run, xs, ys, over_replica, report = _sparse_run(mesh, width)
    x0, y0 = put(mesh, xs[0], P(DEVICES)), put(mesh, ys[0], P(DEVICES))
    plan = tx.plan(make_params(width=width))
    size0 = plan.fragment_sizes()[0]
    k = -(-size0 // D // 256) * 256
    cfg = sparse.sparse_config(1 / 64, chunk=256, bits=2, format=diloco.SPARSE_FORMATS[2])
    assert sum(op.total_bytes for op in over_replica) == (M - 1) * cfg.payload_bytes(k), report.table()
    quiet = hlo.collective_bytes(run.program(tx.phase(2)).lower(run.params, run.state, x0, y0).compile())
    assert not [op for op in quiet.ops if op.group_size == M]

    moved = _fragment_0_moved_by_its_apply(run, plan, xs, ys)
    padded = np.pad(moved, (0, k * D - moved.size)).reshape(-1, 256)
    assert np.count_nonzero(padded, axis=1).max() <= M * cfg.k
    # error buffers: fp32, one per fragment, changed by fragment 0's round and fragment 1's (step 9)
    assert all(e.dtype == jnp.float32 for e in run.state.error) and np.abs(np.asarray(run.state.error[0])).sum() > 0
    chex.assert_trees_all_equal(np.asarray(run.state.error[2]), np.zeros_like(np.asarray(run.state.error[2])))


def test_diloco_sparse_with_identical_replicas_and_alpha_one_reproduces_the_inner_optimizer(mesh):
    """alpha = 1 keeps the local parameters: whatever the sparse exchange sends, the replicas train as the
    inner optimizer alone (the exchange touches only the global state)."""
    tx = diloco.diloco(inner_adamw(), sync_every=4, num_fragments=2, overlap=1, alpha=1.0, bits=exchange.Sparse.of(1 / 8, bits=2, chunk=16))
    run = Run(mesh, tx)
    xs, ys = make_data(9, same_on_replicas=True)
    for t in range(1, 10):
        run.step(t, xs[t - 1], ys[t - 1])
    want = plain_inner(xs, ys, 9, optax.adamw(0.02, b1=0.9, b2=0.95, weight_decay=0.1))
    for r in range(M):
        chex.assert_trees_all_close(local(run.params, r), want, rtol=2e-5, atol=2e-6)


def test_the_trainer_with_a_sparse_exchange_learns_and_resumes_bit_identically(text_file, tmp_path):  # noqa: F811
    """FSDP (each device compresses its own shard), overlap 2 (the mean waits in the state), SparseLoCo's
    outer rule: the trainer learns, records the resolved exchange, keeps fp32 accumulators, and a resume from
    step 7 ends bit-identical to the straight run."""
    from loco_jax.training.run.loop import train_and_evaluate
    from loco_jax.training.run.metrics import read_metrics
    from tests.helpers import small_config

    sets = {"mesh.fsdp": True, "diloco.overlap": 2, "diloco.num_fragments": 2, "diloco.outer_momentum": 0.0,
            "diloco.outer_lr": 1.0, "diloco.error_decay": 0.95, "diloco.density": 1 / 64, "diloco.chunk": 256,
            "diloco.bits": 2, "steps": 10}  # fragment 0 in flight at the resume point (sent 7, applied 8), 1 sent at 10
    quiet = lambda *_: None
    straight = train_and_evaluate(small_config(text_file, **sets), str(tmp_path / "a"), log=quiet)
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "a")) if "loss" in r]
    assert losses[-1] < losses[0]
    with open(tmp_path / "a" / "config.json") as f:
        recorded = json.load(f)["diloco"]  # the resolved settings: the values' format, no rotation, compensated
    assert (recorded["format"], recorded["rotate"], recorded["compensate"]) == (diloco.SPARSE_FORMATS[2], False, True)
    errors = straight["state"].opt_state.error
    assert errors and all(e.dtype == jnp.float32 for e in errors) and any(np.abs(np.asarray(e)).sum() > 0 for e in errors)
    resumed_dir = str(tmp_path / "b")
    train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet, stop_after=7)
    resumed = train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet)
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kwargs,match", [
    (dict(alpha=0.5), "keep_unsent=True with alpha=0.5"),
    (dict(overlap=2), "keep_unsent=True with overlap=2"),
])
def test_keep_unsent_is_refused_where_its_bookkeeping_cannot_hold(kwargs, match):
    with pytest.raises(ValueError, match=match):
        diloco.diloco(optax.sgd(0.1), sync_every=8, num_fragments=2,
                      bits=exchange.Sparse.of(0.01, keep_unsent=True), **kwargs)
    with pytest.raises(ValueError, match="keep_unsent=1 must be True or False"):
        exchange.Sparse.of(0.01, keep_unsent=1)


@pytest.mark.parametrize("overlap", [0, 1])
def test_keep_unsent_sends_the_whole_displacement_and_restarts_each_replica_beside_its_unsent_accumulator(
        mesh, overlap):
    """A second round of fragment 0 with keep_unsent (the mean over M replicas), against a NumPy re-derivation
    from the state before it: a = theta_g - theta(t) on each device's slice, s = C(a), e = a - s,
    theta~ = theta_g - mean_m s_m (plain SGD at lr 1), and each replica restarts from
    theta~ - beta e + theta(t + tau) - theta(t), where theta(t + tau) is its inner step alone (the same program
    with no exchange)."""
    beta, chunk = 0.9, 64
    kept = exchange.Sparse.of(1 / 16, bits=2, chunk=chunk, keep_unsent=True, average_over="replicas")
    tx = diloco.diloco(inner_adamw(), sync_every=4, num_fragments=2, overlap=overlap,
                       **diloco.sparseloco_rule(kept, lr=1.0, beta=beta))
    run = Run(mesh, tx, width=16)
    xs, ys = make_data(9)
    t_apply = 8 + overlap  # fragment 0 syncs after steps 4 and 8; this is the second round's apply step
    for t in range(1, t_apply):
        run.step(t, xs[t - 1], ys[t - 1])
    assert tx.phase(t_apply).apply == 0 and np.abs(np.asarray(run.state.error[0])).sum() > 0
    plan = tx.plan(make_params(width=16))
    size = plan.fragment_sizes()[0]
    before = [np.asarray(plan.extract(local(run.params, r), 0)) for r in range(M)]
    theta_g = np.asarray(plan.extract(jax.tree.map(np.asarray, diloco.global_params(run.state)), 0))
    # theta(t + tau): the inner step alone, from the same params and state (overlap 0: theta(t) is after it)
    quiet = run.program(diloco.Phase())(run.params, run.state, put(mesh, xs[t_apply - 1], P(DEVICES)),
                                        put(mesh, ys[t_apply - 1], P(DEVICES)))[0]
    stepped = [np.asarray(plan.extract(local(quiet, r), 0)) for r in range(M)]
    snapshot = stepped if overlap == 0 else before
    run.step(t_apply, xs[t_apply - 1], ys[t_apply - 1])

    cfg = sparse.sparse_config(1 / 16, chunk=chunk, bits=2, format=diloco.SPARSE_FORMATS[2])
    unit = np.lcm(chunk, quant.DEFAULT_BLOCK_SIZE)  # a slice is whole chunks and whole blocks of the stored error
    k = max(-(-size // D // unit) * unit, unit)
    slices = [np.pad(theta_g - snapshot[r], (0, k * D - size)).reshape(D, k) for r in range(M)]
    sent = np.stack([[numpy_sparse(slices[r][j], cfg) for j in range(D)] for r in range(M)])
    error = np.stack(slices) - sent
    new_global = theta_g - sent.mean(axis=0).reshape(-1)[:size]
    got_global = np.asarray(plan.extract(jax.tree.map(np.asarray, diloco.global_params(run.state)), 0))
    np.testing.assert_allclose(got_global, new_global, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(run.state.error[0]).reshape(M, D, k), error, rtol=1e-5, atol=1e-6)
    for r in range(M):
        want = new_global - beta * error[r].reshape(-1)[:size] + stepped[r] - snapshot[r]
        np.testing.assert_allclose(np.asarray(plan.extract(local(run.params, r), 0)), want, rtol=1e-5, atol=1e-6)


def test_tile_layout_cuts_each_matrix_into_tiles_and_each_vector_into_pieces_per_device():
    """A fragment of a (128, 192) matrix, a stacked (2, 96, 64) one, a 128-vector and a 7-vector, for 2
    devices: tiles of 64 x 64 and 48 x 64 (48: 96's largest divisor <= 64), pieces of 64 and of 7; every
    flat index exactly once, each chunk one rectangle of one leaf (or a run of one vector), the classes
    alike on both devices, padding where a class does not split evenly."""
    shapes = [(128, 192), (2, 96, 64), (128,), (7,)]
    layout = sparse.tile_layout(shapes, devices=2, align=256)
    sizes = [int(np.prod(s)) for s in shapes]
    starts = np.cumsum([0] + sizes)
    assert sparse.largest_divisor(96, 64) == 48 and sparse.largest_divisor(7, 64) == 7
    # (128, 192): 2 x 3 tiles of 4096; (2, 96, 64): 2 x 2 tiles of 48 x 64 = 3072; 2 pieces of 64; 1 of 7
    assert layout.classes == ((4096, 3), (3072, 2), (64, 1), (7, 1))
    used = 4096 * 3 + 3072 * 2 + 64 + 7
    assert layout.slice_len == -(-used // 256) * 256 and layout.permutation().shape == (2 * layout.slice_len,)
    perm = layout.permutation()
    real = perm[perm >= 0]
    np.testing.assert_array_equal(np.sort(real), np.arange(sum(sizes)))  # a permutation, padding apart
    flat = np.arange(sum(sizes))
    for d in range(2):
        part = perm[d * layout.slice_len:(d + 1) * layout.slice_len]
        at = 0
        for c, (size, n) in enumerate(layout.classes):
            chunks = part[at:at + size * n].reshape(n, size)
            at += size * n
            for j, chunk in enumerate(chunks):
                owner = layout.leaf[d][c][j]
                if owner < 0:
                    assert (chunk == -1).all()
                    continue
                assert ((chunk >= starts[owner]) & (chunk < starts[owner + 1])).all()  # one leaf
                local = np.unravel_index(flat[chunk] - starts[owner], shapes[owner])
                if len(shapes[owner]) >= 2:  # one rectangle of one matrix, in row-major order
                    rows, cols = local[-2], local[-1]
                    h, w = len(set(rows)), len(set(cols))
                    assert h * w == size and len(set(zip(*local[:-2]))) <= 1
                    want = np.repeat(np.arange(rows.min(), rows.min() + h), w).reshape(h, w)
                    np.testing.assert_array_equal(rows.reshape(h, w), want)
                else:
                    np.testing.assert_array_equal(np.diff(local[0]), 1)  # a contiguous piece
        assert (part[at:] == -1).all()


def test_tile_layout_refuses_bad_arguments_by_name():
    with pytest.raises(ValueError, match="devices=0 must be a positive integer"):
        sparse.tile_layout([(4, 4)], devices=0)
    with pytest.raises(ValueError, match="tile=0 must be a positive integer"):
        sparse.tile_layout([(4, 4)], tile=0)


def test_a_tiled_payload_keeps_each_chunks_top_k_with_k_scaled_to_the_chunk():
    """Over a layout's slice: each class's chunks keep their own k = max(1, round(density C)) (64 x 64 tiles
    123 of 4096 at 3 %, 64-pieces 2, the 7-piece 1), decode to what was sent (NumPy top-k per chunk, the
    values through the same quantizer), positions held where sent, the padding tail zero and not sent."""
    layout = sparse.tile_layout([(128, 192), (128,), (7,)], devices=1, align=256)
    tiled = sparse.tiled_sparse(layout, 0.03, bits=2, format="uniform")
    assert [cfg.k for cfg in tiled.configs] == [123, 2, 1]
    assert [cfg.index_bits for cfg in tiled.configs] == [12, 6, 3]
    x = distinct(layout.slice_len, seed=4)
    x[sum(c * n for c, n in layout.classes):] = 0.0  # the padding holds zeros
    payload, sent = tiled.encode(jnp.asarray(x))
    assert payload.dtype == jnp.uint8 and payload.shape == (tiled.payload_bytes(),)
    values, held = tiled.decode(jnp.stack([payload, payload]), held=True)
    np.testing.assert_array_equal(np.asarray(values[1]), np.asarray(sent))
    at = 0
    for (size, n), cfg in zip(layout.classes, tiled.configs):
        part = x[at:at + size * n]
        np.testing.assert_allclose(np.asarray(sent[at:at + size * n]), numpy_sparse(part, cfg), rtol=1e-6)
        assert int(np.asarray(held[0, at:at + size * n]).sum()) == cfg.k * n
        at += size * n
    assert not np.asarray(sent[at:]).any() and not np.asarray(held[0, at:]).any()


def test_tiled_binmean_takes_its_statistics_per_leaf_of_each_devices_slice():
    """SparseLoCo's quantizer over tiles: one set of statistics per leaf in a device's slice (NumPy: the kept
    values of all that leaf's chunks there, through ``numpy_binmean`` at once), the padding chunks apart;
    one set per leaf instead of one per chunk on the wire; the same decode with the device's index traced; a
    NaN in one leaf's slice makes that leaf's values NaN there and no other's."""
    shapes = [(128, 192), (2, 96, 64), (128,), (7,)]
    layout = sparse.tile_layout(shapes, devices=3, align=256)
    tiled = sparse.tiled_sparse(layout, 0.03, bits=2, format="binmean")
    per_chunk = sum(n * sum(cfg.chunk_bytes()) for (_, n), cfg in zip(layout.classes, tiled.configs))
    assert tiled.payload_bytes() == per_chunk - sum(
        n * cfg.side_bytes() - s * cfg.side_bytes()
        for (_, n), cfg, s in zip(layout.classes, tiled.configs, tiled.num_segments))
    assert tiled.payload_bytes() < per_chunk
    used = sum(c * n for c, n in layout.classes)
    encode = jax.jit(tiled.encode)
    for d in range(3):
        x = distinct(layout.slice_len, seed=10 + d)
        x[used:] = 0.0
        payload, sent = tiled.encode(jnp.asarray(x), d)
        assert payload.shape == (tiled.payload_bytes(),)
        traced = encode(jnp.asarray(x), jnp.int32(d))[0]  # the same payload, up to the fused statistics' rounding
        np.testing.assert_allclose(np.asarray(tiled.decode(traced[None], d)[0]), np.asarray(sent), rtol=1e-5,
                                   atol=1e-6 * np.abs(x).max())
        np.testing.assert_array_equal(np.asarray(tiled.decode(payload[None], d)[0]), np.asarray(sent))
        want, at = np.zeros(layout.slice_len), 0
        for c, ((size, n), cfg) in enumerate(zip(layout.classes, tiled.configs)):
            chunks = x[at:at + size * n].reshape(n, size)
            keep = np.argsort(-np.abs(chunks), axis=1, kind="stable")[:, :cfg.k]
            owner = np.asarray(layout.leaf[d][c])
            for leaf in np.unique(owner):  # a leaf's kept values, pooled (-1: the padding chunks, pooled apart)
                rows = np.flatnonzero(owner == leaf)
                _, decoded = numpy_binmean(np.take_along_axis(chunks[rows], keep[rows], axis=1).reshape(-1))
                for i, r in enumerate(rows):
                    want[at + r * size + keep[r]] = decoded[i * cfg.k:(i + 1) * cfg.k]
            at += size * n
        np.testing.assert_allclose(np.asarray(sent), want, rtol=1e-5, atol=1e-6 * np.abs(x).max())
    x = distinct(layout.slice_len, seed=10)
    x[used:] = 0.0
    x[5] = np.nan  # in device 0's first tile, of leaf 0
    sent = np.asarray(tiled.encode(jnp.asarray(x), 0)[1])
    leaf0 = np.asarray(layout.tiled(jnp.asarray(np.repeat([1.0, 0.0], [128 * 192, sum(
        int(np.prod(s)) for s in shapes[1:])]))))[:layout.slice_len] > 0
    assert np.isnan(sent[leaf0 & (sent != 0)]).all() and np.isfinite(sent[~leaf0]).all()


@pytest.mark.parametrize("values", ["uniform", "binmean"])
def test_diloco_sparse_with_chunks_that_follow_the_leaves_sends_each_tiles_top_k(mesh, values):
    """``chunks="leaves"`` end to end (H = 6, 3 fragments, overlap 1, SparseLoCo's rule, 16 x 16 tiles): the
    bytes over ``replica`` are the tiled payload's, and each apply moves every tile of fragment 0 (read
    in extract order, back through the layout) in at most M k of its entries; with SparseLoCo's quantizer
    too (statistics per leaf of each device's slice)."""
    width = 512
    fmt = diloco.SPARSE_FORMATS[2] if values == "uniform" else values
    tx, run, xs, ys, over_replica, report = _sparse_run(mesh, width, chunks="leaves", format=fmt)
    params = make_params(width=width)
    plan = tx.plan(params)
    shapes = [x.shape for x in plan.select(params, 0)]
    layout = sparse.tile_layout(shapes, D, tile=16, align=256)
    tiled = sparse.tiled_sparse(layout, 1 / 64, bits=2, format=fmt)
    assert sum(op.total_bytes for op in over_replica) == (M - 1) * tiled.payload_bytes(), report.table()
    moved = _fragment_0_moved_by_its_apply(run, plan, xs, ys)
    in_tiles = np.asarray(layout.tiled(jnp.asarray(moved))).reshape(D, -1)
    for d in range(D):
        at = 0
        for (size, n), cfg in zip(layout.classes, tiled.configs):
            chunks = in_tiles[d, at:at + size * n].reshape(n, size)
            assert np.count_nonzero(chunks, axis=1).max() <= M * cfg.k, (size, cfg.k)
            at += size * n


def test_chunks_that_follow_the_leaves_are_refused_where_they_cannot_apply():
    with pytest.raises(ValueError, match="chunks='tiles' must be one of"):
        diloco.diloco(optax.sgd(0.1), sync_every=4, bits=exchange.Sparse.of(0.03, bits=2, chunks="tiles"))
    with pytest.raises(ValueError, match="chunk=512 is not a square"):
        diloco.diloco(optax.sgd(0.1), sync_every=4, bits=exchange.Sparse.of(0.03, bits=2, chunk=512, chunks="leaves"))


def numpy_tile_order(shapes, devices, tile, slice_len):
    """The tiled order by index arithmetic: each leaf's chunks (``np.arange`` reshaped into its tiles, or
    pieces), grouped by size (largest first, leaf order within), dealt to the devices in runs with -1
    chunks for padding, each slice padded with -1 to ``slice_len``."""
    by_size, offset = {}, 0
    for shape in shapes:
        n = int(np.prod(shape))
        idx = np.arange(n) + offset
        offset += n
        if not n:
            continue
        if len(shape) >= 2:
            rows, cols = shape[-2], shape[-1]
            th, tw = sparse.largest_divisor(rows, tile), sparse.largest_divisor(cols, tile)
            chunks = idx.reshape(-1, rows // th, th, cols // tw, tw).transpose(0, 1, 3, 2, 4).reshape(-1, th * tw)
        else:
            piece = sparse.largest_divisor(n, tile)
            chunks = idx.reshape(-1, piece)
        by_size.setdefault(chunks.shape[1], []).append(chunks)
    rows = [[] for _ in range(devices)]
    for size in sorted(by_size, reverse=True):
        chunks = np.concatenate(by_size[size])
        per = -(-len(chunks) // devices)
        chunks = np.concatenate([chunks, np.full((per * devices - len(chunks), size), -1)])
        for d in range(devices):
            rows[d].append(chunks[d * per:(d + 1) * per].reshape(-1))
    return np.concatenate([np.pad(np.concatenate(r), (0, slice_len - sum(len(x) for x in r)), constant_values=-1)
                           for r in rows])


@pytest.mark.parametrize("devices", [1, 3])
def test_tiled_and_untiled_follow_the_index_arithmetic_without_an_index_table(devices):
    """``TileLayout.tiled`` (reshapes, transposes, pads) puts the fragment where the index arithmetic says
    (``numpy_tile_order``), zeros at the padding, and ``untiled`` gives it back exactly; its program holds
    no integer array (a gather through an index table of the fragment's size would)."""
    shapes = [(128, 192), (2, 96, 64), (128,), (7,), (0,), (5, 3)]
    layout = sparse.tile_layout(shapes, devices=devices, align=256)
    n = sum(int(np.prod(s)) for s in shapes)
    flat = distinct(n, seed=5)
    order = numpy_tile_order(shapes, devices, 64, layout.slice_len)
    np.testing.assert_array_equal(layout.permutation(), order)
    want = np.where(order >= 0, flat[np.maximum(order, 0)], 0.0)
    got = np.asarray(jax.jit(layout.tiled)(jnp.asarray(flat)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(jax.jit(layout.untiled)(jnp.asarray(got))), flat)
    text = jax.jit(layout.tiled).lower(jnp.asarray(flat)).as_text()
    assert not re.findall(r"tensor<\d+xi\d+>", text)  # no integer array at all (a take through perm has one)
