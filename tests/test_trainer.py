"""The trainer end to end: a tiny Streaming DiLoCo + LoCo run, resume, SIGTERM, two processes, bad --set."""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

from loco_jax.training.run import config as config_lib
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training.run.steps import learning_rate_schedule
from loco_jax.training.run.trainer import Trainer
from loco_jax.training.run import checkpoints, loop
from tests.helpers import (ROOT, free_port, quiet, quiet_reads, small_config, subprocess_env, sync_steps, train_cmd,
                           write_config_file)


@pytest.fixture(scope="module")
def straight_run(text_file, tmp_path_factory):
    """12 steps in one go: the reference for resume, and the end-to-end checks."""
    workdir, logs = str(tmp_path_factory.mktemp("straight")), []
    summary = train_and_evaluate(small_config(text_file, sample_tokens=16), workdir, log=logs.append)
    return workdir, dict(summary, logs=logs)


def tensorboard_events(workdir):
    """Every event of WORKDIR/tensorboard's event files, in file order: (file, step, tag or None, value,
    purge) with purge True for a resumed writer's SessionLog START (tensorboardX's purge_step)."""
    import glob
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
        raw = open(path, "rb").read()
        i = 0
        while i < len(raw):  # TFRecord: length (u64), its crc, the record, the record's crc
            (n,) = struct.unpack("<Q", raw[i:i + 8])
            event = event_pb2.Event.FromString(raw[i + 12:i + 12 + n])
            i += 12 + n + 4
            if event.HasField("session_log"):
                out.append((path, event.step, None, None, event.session_log.status == event.session_log.START))
            for v in event.summary.value:
                out.append((path, event.step, v.tag, v.simple_value, False))
    return out


def test_tiny_run_learns_and_fills_the_workdir(straight_run):
    workdir, summary = straight_run
    rows = read_metrics(workdir)
    losses = [r["loss"] for r in rows if "loss" in r]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert losses[-1] < losses[0] - 0.3, losses
    assert len(evals) == 2 and evals[-1] < evals[0], evals
    assert all(r["skipped_steps"] == 0 for r in rows if "skipped_steps" in r)
    assert rows[-1]["bytes_sent_per_device"] > 0
    for name in ("config.json", "metrics.jsonl", "loss.png", "programs.json"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0, name
    # the same rows as TensorBoard scalars (tensorboard --logdir WORKDIR)
    scalars = {(step, tag): value for _, step, tag, value, _ in tensorboard_events(workdir) if tag}
    for r in rows:
        for k in ("loss", "eval_loss", "lr", "bytes_sent_per_device"):
            if k in r:
                assert scalars[(r["step"], k)] == pytest.approx(r[k], rel=1e-6), (r["step"], k)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "6"]
    assert set(os.listdir(os.path.join(workdir, "checkpoints", "12"))) >= {"global", "replica", "device", "meta"}
    programs = json.load(open(os.path.join(workdir, "programs.json")))
    assert len(programs) == 4  # the plain step and one program per fragment's exchange
    syncing = [v for k, v in programs.items() if "None" not in k]
    assert all(v["cross_replica_per_replica"] > 0 for v in syncing)
    block = summary["logs"][-1].splitlines()  # text from the global parameters closes the run
    assert block[0].startswith("samples (step 12") and len(block) == 4 and all(" -> " in line for line in block[1:])


def test_a_second_run_in_a_live_workdir_is_refused_and_changes_nothing(text_file, straight_run):
    # A run requeued while the first still lives would rewrite metrics.jsonl under it (the first's later
    # rows went to the unlinked file, seen in benchmarks/parity.py) and save over its checkpoints.
    workdir = straight_run[0]
    files = ("config.json", "metrics.jsonl", "programs.json")
    before = {name: open(os.path.join(workdir, name), "rb").read() for name in files}
    with loop.workdir_lock(workdir):  # what the first run holds while it lives (released when it ended)
        with pytest.raises(RuntimeError, match=rf"workdir '{re.escape(workdir)}' is in use by another run "
                                               rf"\(pid {os.getpid()} on .+\).*another --workdir"):
            train_and_evaluate(small_config(text_file), workdir, log=quiet)
    assert {name: open(os.path.join(workdir, name), "rb").read() for name in files} == before
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "6"]


def test_resume_is_bit_identical_and_logs_no_step_twice(text_file, straight_run, tmp_path):
    workdir = str(tmp_path)
    first = train_and_evaluate(small_config(text_file), workdir, log=quiet, stop_after=7, profile_steps=2)
    assert first["last_step"] == 7 and first["stopped"]
    traces = [f for _, _, files in os.walk(os.path.join(workdir, "profile")) for f in files]
    assert any(f.endswith(".xplane.pb") for f in traces), traces  # the profiler's trace of steps 2-3
    # a row logged after the last checkpoint (step 7 was checkpointed on stop, so fake a later one)
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 8, "loss": 123.0}) + "\n")
    lines = []
    resumed = train_and_evaluate(small_config(text_file), workdir, log=lines.append)
    assert any("resumed from checkpoint at step 7" in line for line in lines)
    # the resumed run's event file starts by purging what the interrupted one logged after its checkpoint
    resumed_file = sorted({path for path, *_ in tensorboard_events(workdir)})[-1]
    assert [(step, purge) for path, step, tag, _, purge in tensorboard_events(workdir)
            if path == resumed_file and tag is None][:1] == [(8, True)]
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, resumed["state"]), jax.tree.map(np.asarray, straight_run[1]["state"]))
    steps = [r["step"] for r in read_metrics(workdir)]
    assert steps == sorted(set(steps)), steps
    assert 123.0 not in [r.get("loss") for r in read_metrics(workdir)]
    straight_rows = read_metrics(straight_run[0])
    resumed_rows = read_metrics(workdir)
    key = lambda rows: [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows if r["step"] > 7]
    assert key(resumed_rows) == key(straight_rows)


def test_same_config_and_seed_give_bit_identical_losses(text_file, straight_run, tmp_path):
    train_and_evaluate(small_config(text_file), str(tmp_path), log=quiet)
    key = lambda rows: [(r["step"], r.get("loss"), r.get("eval_loss"), r.get("loco_error_rms")) for r in rows if r["step"] <= 12]
    assert key(read_metrics(str(tmp_path))) == key(read_metrics(straight_run[0]))


def test_changed_model_on_resume_is_refused(text_file, straight_run):
    with pytest.raises(ValueError, match="model.d_model"):
        train_and_evaluate(small_config(text_file, **{"model.d_model": 48}), straight_run[0], log=quiet)


def test_a_finished_run_reruns_as_a_no_op_then_raising_steps_extends_it(text_file, straight_run, tmp_path, capsys):
    """Rerunning the finished command (and one with steps below the checkpoint) trains and writes nothing,
    exits 0 and says where the run stands; raising steps then extends it with every row logged once."""
    import train

    workdir = straight_run[0]
    files = ("config.json", "metrics.jsonl", "programs.json")
    before = {name: open(os.path.join(workdir, name), "rb").read() for name in files}
    config_path = write_config_file(tmp_path / "cfg.py", small_config(text_file))
    assert train.main(["--config", config_path, "--workdir", workdir]) == 0
    out = capsys.readouterr().out
    assert f"the run in {workdir} is already at step 12: nothing to train" in out, out
    assert "done: step 12, eval loss" in out and "eval loss None" not in out
    lines = []
    summary = train_and_evaluate(small_config(text_file, steps=10), workdir, log=lines.append)
    assert summary["last_step"] == 12 and "already past steps=10, at step 12" in lines[0], lines
    assert {name: open(os.path.join(workdir, name), "rb").read() for name in files} == before
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["12", "6"]

    lines = []
    summary = train_and_evaluate(small_config(text_file, steps=14), straight_run[0], log=lines.append)
    assert any("steps changed 12 -> 14" in line for line in lines), lines
    assert summary["last_step"] == 14
    steps = [r["step"] for r in read_metrics(straight_run[0])]
    assert steps[-1] == 14 and steps == sorted(set(steps))


def test_sigterm_checkpoints_and_exits_cleanly(text_file, tmp_path):
    cfg = small_config(text_file, steps=400, checkpoint_every=400, eval_every=400)
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    workdir = str(tmp_path / "run")
    proc = subprocess.Popen(train_cmd(config_path, workdir), env=subprocess_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step=4 "):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "stop requested: checkpoint written at step" in out
    saved = [int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit()]
    assert saved and 4 <= max(saved) < 400


def test_two_processes_match_one_process_and_read_nothing_on_quiet_steps(text_file, tmp_path):
    """replica across 2 processes (gloo, 4 CPU devices each) against one 8-device process; fp32 exchange.

    Streaming DiLoCo with overlap 2 (H 9, P 3: fragment 0 sent at step 10 and applied at 11, fragment 1 sent
    at 13). Each process counts its host reads of device arrays (tests/test_async.py): none on a quiet
    step (the odd ones, exchange steps 11 and 13 included)."""
    cfg = small_config(text_file, steps=14, **{"loco.bits": "None", "diloco.bits": "None", "diloco.overlap": 2,
                                               "diloco.sync_every": 9})
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
    port = free_port()
    # all three at once: each compiles on one core most of the time, so the reference overlaps the pair
    reference = subprocess.Popen(train_cmd(config_path, single), env=subprocess_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    procs = [
        subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "test_async.py"), config_path, multi,
                          f"localhost:{port}", "2", str(i)],
                         env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    reference_out = reference.communicate(timeout=600)[0]
    assert reference.returncode == 0, reference_out[-3000:]
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    for out in outs:
        by_step = {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}
        assert quiet_reads(by_step, cfg) == {}, by_step
        assert max(by_step) == cfg.steps and all(by_step.get(t) for t in sync_steps(cfg)), by_step
    a, b = read_metrics(single), read_metrics(multi)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        # same programs and data; only the order of the cross-process sums may differ
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5, abs=1e-5)
        if "eval_loss" in ra:
            assert ra["eval_loss"] == pytest.approx(rb["eval_loss"], rel=1e-5, abs=1e-5)


@pytest.mark.parametrize(
    "assignment,match",
    [
        ("diloco.sync_evry=5", "unknown key 'diloco.sync_evry'"),
        ("steps=many", "steps='many': expected an int"),
        ("loco.bits=four", "loco.bits='four': expected an int"),
        ("diloco.enabled=maybe", "expected a bool"),
        ("seq_len=4096", "seq_len=4096 exceeds model.max_seq_len"),
    ],
)
def test_bad_set_values_fail_before_anything_compiles(assignment, match, tmp_path):
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(tmp_path / "wd"),
            "--set", assignment]
    if assignment.startswith("diloco.sync_evry"):  # one case through the real command line: exit status, stderr
        result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py")] + argv, env=subprocess_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode != 0
        assert match in result.stderr, result.stderr[-2000:]
    else:  # the rest in this process (a fresh interpreter costs seconds per case)
        import train

        with pytest.raises(Exception, match=re.escape(match)):
            train.main(argv)
    assert not os.path.exists(tmp_path / "wd"), "nothing written for a bad config"


def test_config_flags_are_set_by_another_name(tmp_path):
    """ml_collections' form, --config.KEY=VALUE or --config.KEY VALUE, is --set KEY=VALUE: the same fields,
    the same errors, before anything compiles."""
    import train

    assert train.config_flags_as_set(["--config", "c.py", "--config.diloco.sync_every=50", "--config.steps", "7",
                                      "--set", "seed=1"]) == [
        "--config", "c.py", "--set", "diloco.sync_every=50", "--set", "steps=7", "--set", "seed=1"]
    argv = ["--config", os.path.join(ROOT, "configs", "tiny.py"), "--workdir", str(tmp_path / "wd")]
    with pytest.raises(Exception, match=re.escape("unknown key 'diloco.sync_evry'")):
        train.main(argv + ["--config.diloco.sync_evry=5"])
    with pytest.raises(Exception, match=re.escape("steps='many': expected an int")):
        train.main(argv + ["--config.steps", "many"])
    assert not os.path.exists(tmp_path / "wd")


def test_sigkill_at_random_points_then_rerun_matches_an_uninterrupted_run(text_file, straight_run, tmp_path):
    """kill -9 during steps, checkpoint writes and outer exchanges; the same command resumes each time."""
    cfg = small_config(text_file, checkpoint_every=1)  # a checkpoint every step: kills land inside writes too
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    workdir = str(tmp_path / "run")
    rng = random.Random(0)
    kills = 0
    for attempt in range(6):
        proc = subprocess.Popen(train_cmd(config_path, workdir), env=subprocess_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        target = rng.choice([1, 3, 5, 7, 9]) if attempt < 1 else None  # one kill, then the clean rerun
        for line in proc.stdout:
            if target is not None and line.startswith("step="):
                step = int(line.split()[0].split("=")[1])
                if step >= target:
                    time.sleep(rng.uniform(0.0, 0.5))  # somewhere in the next step or its checkpoint
                    proc.kill()
                    kills += 1
                    break
        proc.wait(timeout=300)
        if proc.returncode == 0:
            break
    assert kills >= 1 and proc.returncode == 0
    got = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(workdir)]
    want = [(r["step"], r.get("loss"), r.get("eval_loss")) for r in read_metrics(straight_run[0]) if r["step"] <= 12]
    assert got == want, "every step logged once, with the uninterrupted run's numbers"
    t = Trainer(cfg, workdir, log=quiet)
    t.init_state()  # sets the specs the restore needs
    manager = checkpoints.checkpoint_manager(workdir, cfg.keep_checkpoints)
    assert manager.latest_step() == 12
    final, _ = checkpoints.restore(manager, 12, t)
    manager.close()
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, final), jax.tree.map(np.asarray, straight_run[1]["state"]))


def test_replica_check_is_exact_for_any_replica_count(text_file, tmp_path):
    """Eight identical replicas pass (a pmean-based check would see rounding and refuse)."""
    t = Trainer(small_config(text_file, **{"mesh.replicas": 8}), str(tmp_path), log=quiet)
    loop.check_replicas_identical(t, t.init_state(), resumed=False)


def test_replicas_that_differ_are_refused(text_file, tmp_path):
    t = Trainer(small_config(text_file), str(tmp_path), log=quiet)
    state = t.init_state()
    loop.check_replicas_identical(t, state, resumed=False)  # identical: passes
    head = state.params["lm_head"]["kernel"]
    values = np.asarray(head).copy()
    values[values.shape[0] // 2 :] += 1e-3  # replica 1's block only
    bumped = jax.device_put(values, head.sharding)
    state = state._replace(params=dict(state.params, lm_head={"kernel": bumped}))
    with pytest.raises(RuntimeError, match="replicas hold different initial parameters"):
        loop.check_replicas_identical(t, state, resumed=False)


@pytest.mark.parametrize("bits", [None, 4], ids=["fp32", "loco4"])
def test_data_parallel_configs_train(text_file, tmp_path, bits):
    """The ddp and loco configs: one replica, the whole mesh on `data`."""
    cfg = small_config(text_file, **{"mesh.replicas": 1, "diloco.enabled": "false", "loco.bits": str(bits),
                                     "steps": 6, "eval_every": 6, "checkpoint_every": 6})
    summary = train_and_evaluate(cfg, str(tmp_path), log=quiet)
    rows = read_metrics(str(tmp_path))
    assert summary["last_step"] == 6 and rows[-1]["loss"] < rows[0]["loss"]
    assert int(summary["state"].opt_state.skipped) == 0


@pytest.mark.parametrize("decay", [False, True])
def test_outer_lr_decay_follows_the_inner_cosine_over_each_fragments_rounds(decay):
    """``diloco.outer_lr_decay``: the outer step's size, read off plain outer SGD's updates of a unit outer
    gradient, is ``outer_lr`` at a fragment's first round (r = 0) and ``outer_lr * (m + (1 - m)(1 + cos(pi r /
    R)) / 2)`` at round r, ``R = steps // sync_every``, reaching ``outer_lr * min_lr_ratio`` from r = R on;
    constant when off."""
    import optax
    from loco_jax.training.run import strategy

    cfg = config_lib.Config(steps=120)
    cfg.diloco.enabled, cfg.diloco.sync_every, cfg.diloco.outer_lr, cfg.diloco.outer_momentum = True, 10, 2.0, 0.0
    cfg.diloco.outer_lr_decay, cfg.optim.min_lr_ratio = decay, 0.25
    outer = strategy.of(cfg).wrap(optax.sgd(0.1), sharded=False).loop.outer
    g = {"w": np.ones(3, np.float32)}
    state, sizes = outer.init(g), []
    for _ in range(13):
        u, state = outer.update(g, state, g)
        sizes.append(-float(u["w"][0]))
    rounds = cfg.steps // cfg.diloco.sync_every
    expected = [2.0 * (0.25 + 0.75 * 0.5 * (1 + np.cos(np.pi * min(r, rounds) / rounds))) if decay else 2.0
                for r in range(13)]
    np.testing.assert_allclose(sizes, expected, rtol=1e-6)


def test_warmup_longer_than_the_run_is_shortened_so_the_peak_is_reached():
    cfg = config_lib.Config(steps=10)
    cfg.optim.warmup_steps, cfg.optim.lr, cfg.optim.min_lr_ratio = 50, 1e-3, 0.1
    lr = learning_rate_schedule(cfg)
    values = [float(lr(t)) for t in range(cfg.steps + 1)]
    assert values[0] == 0.0 and np.isclose(max(values), 1e-3) and np.argmax(values) == cfg.steps - 1
    assert np.isclose(values[cfg.steps], 1e-4)
