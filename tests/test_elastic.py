"""Elastic restart: a DiLoCo checkpoint resumes on another number of replicas or data devices.

M 2 -> 4 (data 4 -> 2) in this process's 8 devices, and data 4 -> 2 at M = 2 in
a process that sees only 4 devices (fewer machines after a failure).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import optax
import pytest

from loco_jax import diloco, exchange, sparse
from loco_jax.training.run.checkpoints import INFLIGHT, restore_elastic
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training.run.trainer import Trainer
from loco_jax.training.run import checkpoints
from tests.helpers import ROOT, quiet, small_config, subprocess_env, write_config_file

STOP = 6  # fragment 0 syncs after step 6 and is applied in step 7's program (tau = 1): nothing in flight at 6


def _blocks(x, m):
    x = np.asarray(x)
    return np.split(x, m)


@pytest.fixture(scope="module")
def first_half(text_file, tmp_path_factory):  # noqa: F811
    """M = 2 x D = 4 run stopped (checkpointed) after STOP steps."""
    workdir = tmp_path_factory.mktemp("elastic")
    cfg = small_config(text_file)
    summary = train_and_evaluate(cfg, str(workdir), log=quiet, stop_after=STOP)
    assert summary["last_step"] == STOP
    return str(workdir), cfg, summary["state"]


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("inner", ["copy", "reset"])
def test_two_to_four_replicas_carries_global_state_and_restarts_locals(first_half, inner, tmp_path):
    src, cfg, before = first_half
    workdir = _copy(src, str(tmp_path / "run"))
    new_cfg = small_config(cfg.data.path, **{"mesh.replicas": 4, "elastic_inner_state": inner})
    t = Trainer(new_cfg, workdir, log=quiet)
    manager = ocp.CheckpointManager(os.path.join(workdir, "checkpoints"))
    logs = []
    state, meta = restore_elastic(manager, STOP, t, {"replica": 2, "data": 4}, logs.append)
    assert meta["step"] == STOP and t.m == 4 and t.d == 2
    assert "mesh (replica=2, data=4) -> (replica=4, data=2)" in logs[0]

    old_opt, new_opt = before.opt_state, state.opt_state
    host = lambda tree: jax.tree.map(np.asarray, tree)
    # global parameters, outer states and counts: carried over exactly
    jax.tree.map(np.testing.assert_array_equal, host(new_opt.global_params), host(old_opt.global_params))
    jax.tree.map(np.testing.assert_array_equal, host(new_opt.outer), host(old_opt.outer))
    assert int(new_opt.step) == int(old_opt.step) == STOP and int(new_opt.dropped) == 0
    assert np.asarray(new_opt.skipped).tolist() == [0] * 4  # one count per new replica: replica 0's
    # integer leaves of the inner state (Adam's and the schedule's step counts) are replica 0's either way:
    # a reset restarts the moments, not the learning-rate schedule
    counts = lambda opt, m: [_blocks(x, m)[0] for x in jax.tree.leaves(host(opt.inner))
                             if x.dtype == np.int32]
    old_counts, new_counts = counts(old_opt, 2), counts(new_opt, 4)
    assert old_counts and any(np.any(c == STOP) for c in old_counts)
    for old, new in zip(old_counts, new_counts):
        np.testing.assert_array_equal(new, old)
    # local parameters: every one of the 4 replicas starts from the global ones
    for local, glob in zip(jax.tree.leaves(host(state.params)), jax.tree.leaves(host(new_opt.global_params))):
        for block in _blocks(local, 4):
            np.testing.assert_array_equal(block, glob)
    # inner state: Adam moments are replica 0's, or zero
    adam_old = [x for x in jax.tree.leaves(host(old_opt.inner)) if x.ndim >= 2]
    adam_new = [x for x in jax.tree.leaves(host(new_opt.inner)) if x.ndim >= 2]
    moments = [(o, n) for o, n in zip(adam_old, adam_new) if o.shape[0] // 2 == n.shape[0] // 4]
    assert moments
    for old, new in moments:
        for block in _blocks(new, 4):
            if inner == "copy":
                np.testing.assert_array_equal(block, _blocks(old, 2)[0])
            else:
                assert not np.any(block)
    # LoCo's per-device error buffers restart at zero (they were not zero before)
    old_trainer = Trainer(cfg, workdir, log=quiet)
    old_trainer.abstract_state()  # builds its specs
    assert old_trainer.loco_error_rms(before) > 0
    assert t.loco_error_rms(state) == 0.0


def test_elastic_resume_through_the_trainer_logs_and_trains_on(first_half, tmp_path):
    src, cfg, before = first_half
    workdir = _copy(src, str(tmp_path / "run"))
    logs = []
    # to step 8: fragment 0's round (step 7's program) and a quiet step on the new mesh, two of its programs
    new_cfg = small_config(cfg.data.path, **{"mesh.replicas": 4, "steps": 8})
    summary = train_and_evaluate(new_cfg, workdir, log=logs.append)
    assert any("elastic restart at step 6" in line for line in logs), logs
    assert summary["last_step"] == new_cfg.steps and np.isfinite(summary["eval_loss"])
    rows = read_metrics(workdir)
    assert [r["step"] for r in rows if "loss" in r] == list(range(2, new_cfg.steps + 1, 2))  # nothing logged twice
    assert int(summary["state"].opt_state.step) == new_cfg.steps


def test_data_four_to_two_in_a_process_with_four_devices(first_half, tmp_path):
    src, cfg, before = first_half
    workdir = _copy(src, str(tmp_path / "run"))
    config = write_config_file(tmp_path / "cfg.py", cfg)
    out = subprocess.run(
        # one step past the checkpoint (fragment 0's outer update is applied in it): it trains on, and a
        # step program for the new mesh compiles in about 18 s on 2 cores, so one is enough
        [sys.executable, "train.py", "--config", config, "--workdir", workdir, "--local-devices", "4", "--set", "steps=7"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=subprocess_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert "mesh (replica=2, data=4) -> (replica=2, data=2)" in text, text[-3000:]
    assert "done: step 7" in text


def test_in_flight_exchange_is_completed_on_another_mesh(text_file, tmp_path):  # noqa: F811
    # overlap 2 (H 6, P 2): fragment 0 is sent in step 7 and applied in step 8, so step 7's checkpoint holds its
    # mean. Step 8 on M = 4 x D = 2 must apply exactly the mean the M = 2 x D = 4 replicas sent.
    flight = {"diloco.overlap": 2, "diloco.num_fragments": 2}
    cfg = small_config(text_file, **flight)
    src = str(tmp_path / "run")
    train_and_evaluate(cfg, src, log=quiet, stop_after=7)
    t7 = Trainer(cfg, src, log=quiet)
    assert t7.tx.phase(7) == diloco.Phase(0, None) and t7.tx.phase(8) == diloco.Phase(None, 0)
    same = train_and_evaluate(cfg, _copy(src, str(tmp_path / "same")), log=quiet, stop_after=8)
    logs = []
    moved = train_and_evaluate(small_config(text_file, **flight, **{"mesh.replicas": 4}),
                                       _copy(src, str(tmp_path / "moved")), log=logs.append, stop_after=8)
    assert any("fragment 0's outer-gradient mean was in flight" in line for line in logs), logs

    host = lambda s: [np.asarray(x) for x in jax.tree.leaves(diloco.global_params(s.opt_state))]
    manager = ocp.CheckpointManager(os.path.join(src, "checkpoints"))
    at7, _ = checkpoints.restore(manager, 7, t7)
    changed = [not np.array_equal(a, b) for a, b in zip(host(same["state"]), host(at7))]
    assert any(changed), "step 8 applies fragment 0's outer update"
    for a, b in zip(host(moved["state"]), host(same["state"])):
        np.testing.assert_array_equal(a, b)


def test_relayout_inflight_round_trips_the_mean_between_meshes():
    params = {f"layers_{i}": {"w": jax.ShapeDtypeStruct((300, 7 + i), np.float32)} for i in range(2)}
    params["embed"] = jax.ShapeDtypeStruct((50,), np.float32)
    meshes = [(2, 4), (4, 2), (3, 1), (1, 8), (8, 1)]
    for mode in ("all_gather", "two_stage"):  # two_stage slices are whole blocks per replica: k depends on M too
        tx = diloco.diloco(optax.sgd(0.1), sync_every=8, num_fragments=2, overlap=2, mode=mode, bits=diloco.codec(None, block_size=64))
        size = tx.plan(params).fragment_sizes()[1]
        mean = np.random.default_rng(0).normal(size=size).astype(np.float32)
        one = np.pad(mean, (0, 4096))  # one device: the mean, then padding
        whole = lambda buf, mesh: tx.relayout_inflight(buf, params, 1, mesh, (1, 1))[:size]
        for src in meshes:
            buf = tx.relayout_inflight(one, params, 1, (1, 1), src)
            np.testing.assert_array_equal(whole(buf, src), mean)
            for dst in meshes:
                out = tx.relayout_inflight(buf, params, 1, src, dst)
                assert out.shape[0] % dst[1] == 0
                np.testing.assert_array_equal(whole(out, dst), mean)
                np.testing.assert_array_equal(tx.relayout_inflight(out, params, 1, dst, src), buf)
        with pytest.raises(ValueError, match=r"does not hold 4 slices"):
            tx.relayout_inflight(np.zeros(7, np.float32), params, 1, (2, 4), (4, 2))


def test_relayout_inflight_with_chunks_that_follow_the_leaves_retiles_the_mean():
    """A sparse exchange with tiles keeps each slice in its data size's tiled order: moved between meshes, the
    in-flight mean is untiled on the old layout and tiled on the new one (row j of the new buffer is data
    device j's slice of ``TileLayout.tiled(mean)``), and moving it back gives the buffer to the bit."""
    params = {f"layers_{i}": {"w": jax.ShapeDtypeStruct((96, 64 + 32 * i), np.float32)} for i in range(2)}
    params["embed"] = jax.ShapeDtypeStruct((50,), np.float32)
    tx = diloco.diloco(optax.sgd(0.1), sync_every=8, num_fragments=2, overlap=2, bits=exchange.Sparse.of(0.03, bits=2, chunk=1024, block_size=64, chunks="leaves"))
    plan = tx.plan(params)
    fragment, size = 1, tx.plan(params).fragment_sizes()[1]
    shapes = [x.shape for x in jax.eval_shape(lambda t: plan.select(t, fragment), params)]
    mean = np.random.default_rng(0).normal(size=size).astype(np.float32)
    meshes = [(2, 4), (4, 2), (3, 1), (1, 8), (2, 3)]
    for src in meshes:
        layout = sparse.tile_layout(shapes, src[1], tile=32, align=64)
        buf = tx.relayout_inflight(np.pad(np.asarray(sparse.tile_layout(shapes, 1, tile=32, align=64).tiled(
            jnp.asarray(mean))), (0, 8192)), params, fragment, (1, 1), src)
        rows = buf.reshape(src[1], -1)[:, :layout.slice_len].reshape(-1)
        np.testing.assert_array_equal(rows, np.asarray(layout.tiled(jnp.asarray(mean))))
        np.testing.assert_array_equal(np.asarray(layout.untiled(jnp.asarray(rows))), mean)
        for dst in meshes:
            out = tx.relayout_inflight(buf, params, fragment, src, dst)
            np.testing.assert_array_equal(tx.relayout_inflight(out, params, fragment, dst, src), buf)


def test_checkpoint_without_a_recorded_mesh_must_fit_this_mesh(first_half, tmp_path):
    # checkpoints written before the meta recorded the mesh: same mesh resumes, another is refused by name
    src, cfg, before = first_half
    workdir = _copy(src, str(tmp_path / "run"))
    meta_file = os.path.join(workdir, "checkpoints", str(STOP), "meta", "metadata")
    with open(meta_file) as f:
        meta = json.load(f)
    del meta["mesh"]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    config_before = open(os.path.join(workdir, "config.json")).read()
    with pytest.raises(ValueError, match=r"does not record the mesh .*: its state leaf .* needs shape .* Resume it on the mesh"):
        train_and_evaluate(small_config(cfg.data.path, **{"mesh.replicas": 4}), workdir, log=quiet)
    assert ocp.CheckpointManager(os.path.join(workdir, "checkpoints")).latest_step() == STOP  # nothing written
    assert open(os.path.join(workdir, "config.json")).read() == config_before
    summary = train_and_evaluate(cfg, workdir, log=quiet, stop_after=STOP + 1)
    assert summary["last_step"] == STOP + 1


def test_checkpoint_that_does_not_fit_on_its_own_mesh_is_refused_by_name(first_half, tmp_path, monkeypatch):
    # e.g. a checkpoint from a version with another state layout: named before orbax sees a mismatched target
    src, cfg, before = first_half
    workdir = _copy(src, str(tmp_path / "run"))
    real = checkpoints.saved_leaves

    def older_layout(manager, step, item):
        leaves = real(manager, step, item)
        if INFLIGHT in leaves:
            leaves[INFLIGHT] = jax.ShapeDtypeStruct((17408,), np.float32)
        return leaves

    monkeypatch.setattr(checkpoints, "saved_leaves", older_layout)
    with pytest.raises(ValueError, match=r"another version of loco-jax: its state leaf '.opt_state.inflight' is "
                                         r"shape \(17408,\) where .* needs shape \(4,\). Start a new --workdir"):
        train_and_evaluate(cfg, workdir, log=quiet)


OLD_LAYOUT = os.path.join(os.path.dirname(__file__), "data", "checkpoint_global_counts")


def _old_layout_run(text_file, tmp_path):
    """A copy of the stored older-layout run, its config pointing at this session's corpus (the same text:
    tests/test_trainer.py writes it alike)."""
    workdir = _copy(OLD_LAYOUT, str(tmp_path / "run"))
    path = os.path.join(workdir, "config.json")
    saved = json.loads(open(path).read())
    saved["data"]["path"] = text_file
    with open(path, "w") as f:
        json.dump(saved, f)
    return workdir


def test_a_checkpoint_with_global_skip_counts_resumes_with_one_count_per_replica(text_file, tmp_path):  # noqa: F811
    """tests/data/checkpoint_global_counts: step 6 of a 2 x 4 run (d_model 16, d_ff 48) written by the code
    before replicas skipped non-finite steps alone, when DiLoCo's ``skipped`` and the inner optimizer's
    scalars were global. It resumes on today's layout: each replica takes the global value, ``dropped`` 0."""
    workdir = _old_layout_run(text_file, tmp_path)
    cfg = small_config(text_file, **{"model.d_model": 16, "model.d_ff": 48})
    logs = []
    summary = train_and_evaluate(cfg, workdir, log=logs.append, stop_after=8)
    assert "resumed from checkpoint at step 6" in logs, logs
    opt = summary["state"].opt_state
    assert int(opt.step) == 8 and np.asarray(opt.skipped).tolist() == [0, 0] and int(opt.dropped) == 0
    counts = [np.asarray(x) for x in jax.tree.leaves(opt.inner) if x.dtype == np.int32 and x.shape == (2,)]
    assert counts and all(c.tolist() in ([8, 8], [0, 0]) for c in counts), counts  # Adam's count went on from 6
    assert any(c.tolist() == [8, 8] for c in counts)


def test_an_elastic_restart_of_a_checkpoint_with_global_counts_is_refused_by_name(text_file, tmp_path):  # noqa: F811
    workdir = _old_layout_run(text_file, tmp_path)
    cfg = small_config(text_file, **{"model.d_model": 16, "model.d_ff": 48, "mesh.replicas": 4})
    with pytest.raises(ValueError, match=r"before replicas kept their own skip counts.*Resume it once on that mesh"):
        train_and_evaluate(cfg, workdir, log=quiet, stop_after=8)
