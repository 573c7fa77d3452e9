"""A sync step costs one read program, whatever ``log_every`` is, and no CPU program the trainer runs besides
the step programs holds two collectives that nothing orders.

XLA's CPU collectives deadlock when many multi-device programs are in flight at once: a read that
dispatched three small programs per step since the last sync step (300 at ``log_every=100``) aborted
Streaming DiLoCo runs at their first log row (``rendezvous.cc: Termination timeout ... Exiting``).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax._src.interpreters import pxla

from loco_jax import hlo
from loco_jax.training import loop
from loco_jax.training.loop import train_and_evaluate
from loco_jax.training.metrics import read_metrics
from loco_jax.training.trainer import Trainer
from tests.test_trainer import _env, _free_port, _train_cmd, quiet, small_config, text_file, write_config_file  # noqa: F401


class _CountingPrograms(dict):
    """A trainer's program table that counts each time a program is taken out of it to be run."""

    def __init__(self, *args):
        super().__init__(*args)
        self.taken = 0

    def __getitem__(self, key):
        self.taken += 1
        return super().__getitem__(key)


def test_a_sync_step_reads_every_step_since_the_last_in_one_program(text_file, tmp_path, monkeypatch):
    """40 steps logged at once: the read takes one program from the trainer (the old read took three per
    step: 120), and its rows are the ones a per-step NumPy mean of the same outputs gives."""
    trainers, reads = [], []
    init = Trainer.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._programs = _CountingPrograms(self._programs)
        trainers.append(self)

    read = loop._Window.read

    def counted_read(self):
        before, outs = trainers[0]._programs.taken, [o for _, o in self.on_device]
        read(self)
        reads.append((trainers[0]._programs.taken - before, len(outs), loop._read_on_host(outs), list(self.host)))

    monkeypatch.setattr(Trainer, "__init__", counting_init)
    monkeypatch.setattr(loop._Window, "read", counted_read)
    cfg = small_config(text_file, steps=40, log_every=40, eval_every=40, checkpoint_every=40,
                       **{"mesh.replicas": 4, "mesh.data": 2})
    train_and_evaluate(cfg, str(tmp_path / "run"), log=quiet)
    (taken, n, on_host, host), = reads
    assert n == 40 and taken == 1, (n, taken)
    # M = 4: the mean over replicas after the gather is jnp.mean's; NumPy's float32 mean of the same four
    # values agrees to rounding
    np.testing.assert_allclose([loss for _, loss, _ in host], on_host["loss"], rtol=1e-6)
    np.testing.assert_allclose([g for _, _, g in host], on_host["grad_rms"], rtol=1e-6)
    assert on_host["skipped"].shape == (40, 4)


def test_the_read_is_exact_against_the_replicas_values(text_file, tmp_path):
    """Two replicas: each row's loss is exactly (a + b) / 2 of the two replicas' float32 values, as the old
    per-step ``jnp.mean`` gave it; every replica's skip count comes back as stored."""
    t = Trainer(small_config(text_file), str(tmp_path), log=quiet)
    sharding = jax.sharding.NamedSharding(t.mesh, jax.sharding.PartitionSpec("replica"))
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((3, 2)).astype(np.float32) for _ in range(5)]
    outs = [{"loss": jax.device_put(v[0], sharding), "grad_rms": jax.device_put(v[1], sharding),
             "skipped": jax.device_put(np.array([i, 2 * i + 1], np.int32), sharding),
             "dropped": jax.numpy.int32(i)} for i, v in enumerate(values)]
    rows = t.read_steps(outs)
    assert rows["loss"].tolist() == [np.float32(v[0].sum(dtype=np.float32) / np.float32(2)) for v in values]
    assert rows["grad_rms"].tolist() == [np.float32(v[1].sum(dtype=np.float32) / np.float32(2)) for v in values]
    assert rows["skipped"].tolist() == [[i, 2 * i + 1] for i in range(5)]
    assert rows["dropped"].tolist() == list(range(5))


def test_every_auxiliary_program_of_a_two_replica_run_orders_its_collectives(text_file, tmp_path, monkeypatch):
    """Every program a 2-replica Streaming DiLoCo run compiles (the replica check, the reads, eval, the
    LoCo error diagnostic, the samples; fresh and resumed) has no two collectives that no data or control
    dependence orders, read from its compiled HLO. The step programs are listed apart: their exchange is
    independent of the step's compute by design (it overlaps it on GPUs); XLA:CPU's runtime runs the
    collectives of one program in its thunk sequence (docs/results.md, "A sync step on CPU")."""
    compiled = []
    compile_ = pxla.MeshComputation.compile

    def recording_compile(self, *args, **kwargs):
        executable = compile_(self, *args, **kwargs)
        name = self._name[len("jit("):-1] if self._name.startswith("jit(") else self._name
        compiled.append((name, executable.xla_extension_executable().hlo_modules()[0].to_string()))
        return executable

    monkeypatch.setattr(pxla.MeshComputation, "compile", recording_compile)
    cfg = small_config(text_file, steps=8, log_every=2, eval_every=4, checkpoint_every=4, sample_tokens=4,
                       **{"loco.bits": 4})
    workdir = str(tmp_path / "run")
    train_and_evaluate(cfg, workdir, log=quiet, stop_after=4)
    train_and_evaluate(cfg, workdir, log=quiet)  # resumed: the check of the global parameters
    names = [name for name, _ in compiled]
    aux = [(name, text) for name, text in compiled if name != "train_step_program"]
    assert {"train_step_program", "_replica_gap", "read_program", "eval_program"} <= set(names), names
    assert any(hlo.collective_bytes(text).ops for _, text in aux)
    bad = {name: [str(p) for p in hlo.unordered_collectives(text)] for name, text in aux}
    assert not any(bad.values()), {k: v for k, v in bad.items() if v}


def test_the_replica_check_refuses_with_collectives_in_order(text_file, tmp_path):
    """The old check (a pmax and a pmin per leaf, all independent) had unordered pairs; the chained one has
    none, and a test program with two independent all-reduces is caught by the same reader."""
    t = Trainer(small_config(text_file), str(tmp_path), log=quiet)
    state = t.init_state()
    spec = t.param_specs
    chained = jax.jit(jax.shard_map(loop._replica_gap, mesh=t.mesh, in_specs=(spec,), out_specs=jax.sharding.PartitionSpec(),
                                    check_vma=False)).lower(state.params).compile()
    assert hlo.unordered_collectives(chained) == []

    def independent(tree):
        leaves = jax.tree.leaves(tree)
        return jax.lax.pmax(jax.numpy.max(leaves[0]), "replica") + jax.lax.pmin(jax.numpy.min(leaves[1]), "replica")

    loose = jax.jit(jax.shard_map(independent, mesh=t.mesh, in_specs=(spec,), out_specs=jax.sharding.PartitionSpec(),
                                  check_vma=False)).lower(state.params).compile()
    assert len(hlo.unordered_collectives(loose)) == 1


def _busy(n):
    """``n`` processes that keep a core each busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def test_log_every_100_completes_alone_beside_busy_cores_and_across_two_processes(text_file, tmp_path):
    """The issue's case, small: a 2-replica Streaming DiLoCo run logging every 100 steps, (a) alone, (b) with
    two busy processes on the 2 cores, (c) as two gloo processes (the README's multi-process launch). Each
    finishes with its one row; (a) and (b) are identical, (c) matches to the order of the cross-process sums,
    and the row's loss is the mean of a log_every=10 run's ten rows. The old read (300 programs in flight)
    aborted here in XLA's rendezvous."""
    cfg = small_config(text_file, steps=100, log_every=100, eval_every=100, checkpoint_every=100)
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    tens_path = write_config_file(tmp_path / "tens.py", small_config(text_file, steps=100, log_every=10,
                                                                    eval_every=100, checkpoint_every=100))

    def run(path, workdir, *extra):
        return subprocess.Popen(_train_cmd(path, str(tmp_path / workdir), *extra), env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(procs):
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]

    finish([run(config_path, "alone"), run(tens_path, "tens")])
    busy = _busy(2)
    try:
        finish([run(config_path, "busy")])
    finally:
        for p in busy:
            p.kill()
            p.wait()
    port = _free_port()
    finish([run(config_path, "multi", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                "--process-id", str(i), "--local-devices", "4") for i in range(2)])

    alone, busy_rows, multi, tens = (read_metrics(str(tmp_path / w)) for w in ("alone", "busy", "multi", "tens"))
    assert [r["step"] for r in alone] == [r["step"] for r in busy_rows] == [r["step"] for r in multi] == [100]
    strip = lambda r: {k: v for k, v in r.items() if k != "tokens_per_s"}
    assert strip(alone[0]) == strip(busy_rows[0])
    assert multi[0]["loss"] == pytest.approx(alone[0]["loss"], rel=1e-5)
    assert multi[0]["eval_loss"] == pytest.approx(alone[0]["eval_loss"], rel=1e-5)
    assert [r["step"] for r in tens] == list(range(10, 101, 10))
    assert alone[0]["eval_loss"] == tens[-1]["eval_loss"]
    assert alone[0]["loss"] == pytest.approx(np.mean([r["loss"] for r in tens]), rel=1e-12)
    assert alone[0]["grad_rms"] == pytest.approx(np.mean([r["grad_rms"] for r in tens]), rel=1e-12)
