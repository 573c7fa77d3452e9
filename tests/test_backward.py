"""LoCo inside the backward pass (loco_jax.backward, loco.in_backward): the same numbers as loco.compress with
the same buckets, the non-finite rule, and only uint8 gradient payloads in the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from loco_jax import backward, hlo, loco
from loco_jax.training.run import config as config_lib
from loco_jax.training.run.trainer import Trainer
from tests.helpers import quiet


def _config(**overrides):
    cfg = config_lib.Config(steps=12, batch_size=16, seq_len=32, eval_every=6, eval_batches=1, log_every=2,
                            checkpoint_every=6, sample_tokens=0)
    m = cfg.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_seq_len, m.compute_dtype = 32, 3, 2, 96, 32, "float32"
    cfg.optim.warmup_steps = 2
    cfg.mesh.replicas, cfg.diloco.enabled = 1, False
    cfg.loco.bits, cfg.loco.in_backward = 4, True
    cfg.loco.compensate = True  # the paper's compensated exchange: the comparisons cover non-zero error buffers
    cfg.model.scan_layers = True
    return config_lib.override(cfg, [f"{k}={v}" for k, v in overrides.items()])


def _capture():
    """The last transformation of the chain: keeps the updates it receives in its state, applies nothing (so
    the comparison sees LoCo's own output, not an optimizer's arithmetic after it)."""
    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                        lambda u, s, p=None: (jax.tree.map(jnp.zeros_like, u), u))


def _run(cfg, in_backward, steps=2):
    t = Trainer(cfg, "/nonexistent", log=quiet)
    t.tx = loco.skip_nonfinite(optax.chain(t.exchanger.transformation, _capture()))
    if not in_backward:
        t.exchanger = None  # the same compress (same buckets), run on the whole gradient after jax.grad
    state = t.init_state()
    rng = np.random.default_rng(0)
    sharding = jax.sharding.NamedSharding(t.mesh, t.batch_spec)
    for _ in range(steps):
        x, y = (jax.device_put(jnp.asarray(rng.integers(0, 256, (16, 32)), jnp.int32), sharding) for _ in range(2))
        p, s, _ = t.program(None, state, (x, y))(state.params, state.opt_state, x, y)
        state = type(state)(p, s)
    return state


CELLS = {  # each cell crosses several features: layout, remat or saved residuals, micro-batches, bits
    "dp-8bit": {"loco.bits": 8},
    "dp-remat-2bit-accum": {"model.remat": True, "loco.bits": 2, "accum_steps": 2},
    "fsdp-remat-4bit-accum": {"mesh.fsdp": True, "model.remat": True, "accum_steps": 2},
    "fsdp-1bit": {"mesh.fsdp": True, "loco.bits": 1},
}


def _assert_same_but_rounding(a, b, where):
    """``a`` and ``b`` as two XLA programs give the same arithmetic: floats to float32 rounding of the leaf's
    scale, 8-bit error codes at most one code apart in at most 0.5 % of entries (a value within rounding of a
    code boundary). A wrong bucket, block or error rule moves the means by the quantization error
    (1e-2 relative and more) and most codes, far outside both bounds."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, where
    if a.dtype == np.uint8:
        step = np.abs(a.astype(np.int16) - b.astype(np.int16))
        assert step.max() <= 1 and (step > 0).mean() <= 5e-3, (where, step.max(), (step > 0).mean())
    else:
        scale = float(np.abs(b).max()) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * scale, err_msg=where)


@pytest.mark.parametrize("cell", list(CELLS))
def test_in_backward_exchange_matches_compress_with_the_same_buckets(cell):
    """Two steps (the error buffers non-zero in the second): the exchanged means LoCo hands the optimizer and
    every error buffer agree, for data parallel and FSDP (scanned blocks), with and without remat and
    micro-batches, at the per-bit defaults (rotated Lloyd-Max at 4 and 2 bits, the reference absmax int8
    with beta 0.8, the rotated 1-bit sign).

    To the bit on the machine the comparison was built on; on another CPU (2026-12-04) XLA:CPU fused the
    8-bit cell's two programs so that its stored error codes came out one code apart in 0.04 % of entries
    and its step-2 means 1e-6 relative apart, so the comparison allows rounding (and counts how far)."""
    cfg = _config(**CELLS[cell])
    got, want = _run(cfg, True), _run(cfg, False)
    errors = loco.find_state(want.opt_state).error
    if config_lib.resolve(cfg).loco.compensate:  # the comparison covers non-trivial error buffers
        assert errors and all(np.asarray(e).std() > 0 for e in errors)
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    assert len(got_leaves) == len(jax.tree.leaves(want))
    for (path, a), b in zip(got_leaves, jax.tree.leaves(want)):
        _assert_same_but_rounding(a, b, jax.tree_util.keystr(path))


def test_a_scanned_stack_keeps_its_errors_stacked_and_its_buckets_per_layer():
    t = Trainer(_config(**{"model.scan_layers": True}), "/nonexistent", log=quiet)
    state = t.abstract_state()
    errors = loco.find_state(state.opt_state).error
    # the embedding, the head, then the stack: (L, M, cols) on each device, L = 3 layers, M = 8 devices
    assert len(errors) == 3
    assert [e.sharding.shard_shape(e.shape)[:-1] for e in errors] == [(8,), (8,), (3, 8)]


def test_an_exchanged_non_finite_mean_skips_the_step_and_keeps_the_state():
    """``update(..., exchanged=candidate)`` decides the non-finite rule on the means, once, before any state
    changes: a NaN leaves the old error buffers and count, and counts one skipped step."""
    tx = loco.compress(4, axis_name=None, groups={"a": 0, "b": 1})
    params = {"a": jnp.ones((4, 64)), "b": jnp.ones((256,))}
    state = tx.init(params)
    candidate = state._replace(error=tuple(e + 1 for e in state.error))
    means = {"a": jnp.ones((4, 64)).at[0, 0].set(jnp.nan), "b": jnp.ones((256,))}
    updates, new = tx.update(means, state, params, exchanged=candidate)
    assert int(new.skipped) == 1 and int(new.count) == 0
    assert all(np.array_equal(a, b) for a, b in zip(new.error, state.error))
    assert all(float(jnp.abs(u).sum()) == 0 for u in jax.tree.leaves(updates))
    updates, new = tx.update(jax.tree.map(jnp.ones_like, means), state, params, exchanged=candidate)
    assert int(new.skipped) == 0 and int(new.count) == 1
    assert all(np.array_equal(a, b) for a, b in zip(new.error, candidate.error))


def test_error_codes_travel_as_cotangents_bit_for_bit():
    codes = jnp.asarray(np.random.default_rng(0).integers(0, 256, (3, 8, 512)), jnp.uint8)
    scales = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8, 2)), jnp.float32)
    views = backward.as_cotangent((codes, scales, None, None))
    assert views[0].dtype == jnp.float32 and views[0].shape == (3, 8, 128)
    ex = loco.exchanger(bits=4, axis_name=None)
    back = backward.from_views(ex, views)
    np.testing.assert_array_equal(np.asarray(back[0]), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(back[1]), np.asarray(scales))


def test_in_backward_fsdp_step_sends_uint8_gradients_only():
    t = Trainer(_config(**{"mesh.fsdp": True, "model.scan_layers": True, "model.remat": True}), "/nonexistent",
                log=quiet)
    report = hlo.collective_bytes(t.program(None, t.abstract_state(), t.abstract_batch()))
    payload = [op for op in report.ops if op.dtype == "u8"]
    assert payload and all(op.kind == "all-to-all" for op in payload), report.table()
    reductions = [op for op in report.ops if op.dtype != "u8" and op.kind in ("all-reduce", "reduce-scatter")
                  and op.total_bytes > 64]
    assert not reductions, report.table()


def test_in_backward_is_refused_with_the_hierarchical_all_reduce_and_with_unrolled_blocks():
    with pytest.raises(ValueError, match="loco.in_backward=True does not combine with mesh.local=4"):
        Trainer(_config(**{"mesh.local": 4, "mesh.data": 2}), "/nonexistent", log=quiet)
    with pytest.raises(ValueError, match="needs model.scan_layers=true"):
        Trainer(_config(**{"model.scan_layers": False}), "/nonexistent", log=quiet)


def test_in_backward_trainer_with_diloco_and_fsdp_resumes_bit_identically(text_file, tmp_path):  # noqa: F811
    """The trainer's FSDP step with Streaming DiLoCo around it (2 replicas x 4, 3 fragments) and LoCo in the
    backward pass (scanned, rematerialised layers, 2 micro-batches): it learns, a resume from step 7 ends
    bit-identical to the straight run, and changing loco.in_backward on resume is refused by name."""
    from loco_jax.training.run.loop import train_and_evaluate
    from loco_jax.training.run.metrics import read_metrics
    from tests.helpers import small_config

    # 10 steps: fragments 0 and 1 sync (steps 7 and 9), before and after the resume point
    sets = {"loco.in_backward": True, "mesh.fsdp": True, "model.scan_layers": True, "model.remat": True,
            "accum_steps": 2, "steps": 10}
    straight = train_and_evaluate(small_config(text_file, **sets), str(tmp_path / "a"), log=quiet)
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "a")) if "loss" in r]
    assert losses[-1] < losses[0]
    resumed_dir = str(tmp_path / "b")
    train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet, stop_after=7)
    resumed = train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet)
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="loco.in_backward"):
        train_and_evaluate(small_config(text_file, **dict(sets, **{"loco.in_backward": False})),
                                       resumed_dir, log=quiet)


def test_a_non_finite_gradient_skips_the_in_backward_step_and_keeps_every_state():
    """A NaN in one parameter makes every gradient non-finite: the step is skipped on every device, LoCo's
    error buffers, its count and AdamW's moments are kept as they were (decided once, after the backward
    pass produced the candidates), and the skip is counted."""
    t = Trainer(_config(**{"model.scan_layers": True, "model.remat": True, "mesh.fsdp": True}), "/nonexistent",
                log=quiet)
    state = t.init_state()
    rng = np.random.default_rng(0)
    sharding = jax.sharding.NamedSharding(t.mesh, t.batch_spec)
    x, y = (jax.device_put(jnp.asarray(rng.integers(0, 256, (16, 32)), jnp.int32), sharding) for _ in range(2))
    p, s, _ = t.program(None, state, (x, y))(state.params, state.opt_state, x, y)  # errors non-zero from here
    embedding = p["embed"]["embedding"]
    poisoned = np.array(embedding)
    poisoned[3, 5] = np.nan
    p["embed"]["embedding"] = jax.device_put(poisoned, embedding.sharding)
    before = jax.tree.map(np.asarray, s)
    _, after, metrics = t.program(None, type(state)(p, s), (x, y))(p, s, x, y)
    assert int(np.asarray(metrics["skipped"]).sum()) == 1
    assert int(np.asarray(after.skipped)) == 1  # skip_nonfinite's count (the inner state, LoCo's included, is kept)
    kept = lambda tree: [x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
                         if "skipped" not in jax.tree_util.keystr(path)]
    for a, b in zip(kept(jax.tree.map(np.asarray, after)), kept(before)):
        np.testing.assert_array_equal(a, b)
