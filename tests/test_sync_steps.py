"""A sync step costs one read program, whatever ``log_every`` is, and no CPU program the trainer runs besides
the step programs holds two collectives that nothing orders.

XLA's CPU collectives deadlock when many multi-device programs are in flight at once: a read that
dispatched three small programs per step since the last sync step (300 at ``log_every=100``) aborted
Streaming DiLoCo runs at their first log row (``rendezvous.cc: Termination timeout ... Exiting``).
"""

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax._src.interpreters import pxla

from loco_jax import hlo
from loco_jax.training.run import loop
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training.run.trainer import Trainer
from tests.helpers import free_port, quiet, small_config, subprocess_env, train_cmd, write_config_file


class _CountingPrograms(dict):
    """A trainer's program table that counts each time a program is taken out of it to be run."""

    def __init__(self, *args):
        super().__init__(*args)
        self.taken = 0

    def __getitem__(self, key):
        self.taken += 1
        return super().__getitem__(key)


def test_a_sync_step_reads_every_step_since_the_last_in_one_program(text_file, tmp_path, monkeypatch):
    """12 steps logged at once: the read takes one program from the trainer (the old read took three per
    step: 36), and its rows are the ones a per-step NumPy mean of the same outputs gives."""
    trainers, reads = [], []
    init = Trainer.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._programs = _CountingPrograms(self._programs)
        trainers.append(self)

    read = loop.StepWindow.read

    def counted_read(self):
        before, outs = trainers[0]._programs.taken, [o for _, o in self.on_device]
        read(self)
        reads.append((trainers[0]._programs.taken - before, len(outs), loop.read_on_host(outs), list(self.host)))

    monkeypatch.setattr(Trainer, "__init__", counting_init)
    monkeypatch.setattr(loop.StepWindow, "read", counted_read)
    cfg = small_config(text_file, log_every=12, eval_every=12, checkpoint_every=12)  # test_trainer's programs
    train_and_evaluate(cfg, str(tmp_path / "run"), log=quiet)
    (taken, n, on_host, host), = reads
    assert n == 12 and taken == 1, (n, taken)
    # two replicas: the mean after the gather is NumPy's float32 (a + b) / 2 to the bit
    assert [loss for _, loss, _ in host] == on_host["loss"].tolist()
    assert [g for _, _, g in host] == on_host["grad_rms"].tolist()
    assert on_host["skipped"].shape == (12, 2)


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


def test_every_program_of_a_two_replica_run_orders_its_collectives(text_file, tmp_path, monkeypatch):
    """Every program a 2-replica Streaming DiLoCo run compiles (the step programs of every phase, the
    replica check, the reads, eval, the LoCo error diagnostic, the samples; fresh and resumed) has no two
    collectives that no data or control dependence orders, read from its compiled HLO. The step programs'
    exchange is independent of the step's compute on GPUs (it overlaps it); on CPU ``collectives.after``
    ties it after the inner step's collectives (before it: 9 unordered pairs per exchange phase)."""
    compiled = []
    compile_ = pxla.MeshComputation.compile

    def recording_compile(self, *args, **kwargs):
        executable = compile_(self, *args, **kwargs)
        name = self._name[len("jit("):-1] if self._name.startswith("jit(") else self._name
        compiled.append((name, executable.xla_extension_executable().hlo_modules()[0].to_string()))
        return executable

    monkeypatch.setattr(pxla.MeshComputation, "compile", recording_compile)
    cfg = small_config(text_file, sample_tokens=4)  # test_trainer's programs (LoCo 4-bit, 3 fragments), samples on
    workdir = str(tmp_path / "run")
    train_and_evaluate(cfg, workdir, log=quiet, stop_after=6)
    train_and_evaluate(cfg, workdir, log=quiet)  # resumed: the check of the global parameters
    names = [name for name, _ in compiled]
    assert {"train_step_program", "replica_gap", "read_program", "eval_program"} <= set(names), names
    assert names.count("train_step_program") >= 4, names  # three exchange phases and the quiet one
    assert all(hlo.collective_bytes(text).ops for name, text in compiled if name == "train_step_program")
    bad = [(name, [str(p) for p in hlo.unordered_collectives(text)]) for name, text in compiled]
    assert not any(pairs for _, pairs in bad), [(name, pairs[:3]) for name, pairs in bad if pairs]


@pytest.mark.parametrize("sets", [
    # the in-backward exchange (its pipelined loop and its drain), FSDP's gathers per leaf and per layer, the
    # sparse exchange with its unsent part gathered for the restart
    {"loco.in_backward": True, "model.scan_layers": True, "model.num_layers": 3, "mesh.fsdp": True,
     "diloco.density": 0.05, "diloco.alpha": 0.0, "diloco.bits": 2, "diloco.keep_unsent": True},
    # LoCo in buckets, one after another; the two-stage outer exchange held across steps (send and apply apart)
    {"mesh.fsdp": True, "model.scan_layers": True, "diloco.mode": "two_stage", "loco.bucket_size": 2000,
     "diloco.overlap": 2, "diloco.num_fragments": 1},
    # FSDP under remat with micro-batches and the in-backward exchange (each layer gathered again in the
    # backward loop, the earlier micro-batch's groups and stack): what aborted CI's run of test_backward
    {"loco.in_backward": True, "model.scan_layers": True, "mesh.fsdp": True, "model.remat": True,
     "accum_steps": 2},
    # FSDP's exact reduce-scatters (one per leaf), micro-batches through the per-layer gathers
    {"mesh.fsdp": True, "model.scan_layers": True, "loco.bits": None, "accum_steps": 2},
    # data parallel: the batch varies over a replica axis of one device that the parameters do not
    {"diloco.enabled": False, "mesh.replicas": 1, "loco.in_backward": True, "model.scan_layers": True,
     "mesh.fsdp": True, "model.remat": True},
], ids=["in_backward_fsdp_sparse", "buckets_two_stage_held", "in_backward_fsdp_remat_micro", "fsdp_exact_micro",
        "data_parallel_in_backward_fsdp_remat"])
def test_the_step_programs_of_other_layouts_order_their_collectives(text_file, tmp_path, sets):
    """The step programs of layouts the run above does not use have no unordered pair of collectives either:
    one exchange phase of each kind (a send and an apply, or each apart), compiled for CPU."""
    t = Trainer(small_config(text_file, **sets), str(tmp_path), log=quiet)
    state, batch = t.init_state(), t.abstract_batch()
    kinds = {}
    for step in range(1, t.cfg.diloco.sync_every + 2 if t.cfg.diloco.enabled else 2):
        phase = t.phase(step)
        kinds.setdefault(None if phase is None else (phase.send is None, phase.apply is None), phase)
    kinds.pop((True, True), None)  # the quiet step has no exchange (data parallel: one program, no phase)
    assert kinds, kinds
    for phase in kinds.values():
        compiled = t.program(phase, state, batch)
        assert len(hlo.collective_bytes(compiled).ops) > 20
        assert hlo.unordered_collectives(compiled) == [], (phase, [str(p) for p in hlo.unordered_collectives(compiled)][:3])


def test_the_replica_check_chains_its_collectives(text_file, tmp_path):
    """The replica check's program (one pmax per leaf, each after the one before) has no unordered pair, and a
    program with a pmax and a pmin that nothing orders (the old check's shape) has one, by the same reader."""
    t = Trainer(small_config(text_file), str(tmp_path), log=quiet)
    state = t.init_state()
    spec = t.param_specs
    chained = jax.jit(jax.shard_map(loop.replica_gap, mesh=t.mesh, in_specs=(spec,), out_specs=jax.sharding.PartitionSpec(),
                                    check_vma=False)).lower(state.params).compile()
    assert hlo.unordered_collectives(chained) == []

    def independent(tree):
        leaves = jax.tree.leaves(tree)
        return jax.lax.pmax(jax.numpy.max(leaves[0]), "replica") + jax.lax.pmin(jax.numpy.min(leaves[1]), "replica")

    loose = jax.jit(jax.shard_map(independent, mesh=t.mesh, in_specs=(spec,), out_specs=jax.sharding.PartitionSpec(),
                                  check_vma=False)).lower(state.params).compile()
    assert len(hlo.unordered_collectives(loose)) == 1


def test_log_every_100_completes_alone_beside_busy_cores_and_across_two_processes(text_file, tmp_path):
    """The issue's case, small: a 2-replica Streaming DiLoCo run logging every 100 steps, (a) alone, then (b)
    again and (c) as two gloo processes (the README's multi-process launch), (b) and (c) at once beside a
    busy-loop process (with them, and the suite's other worker, both cores stay loaded). Each finishes with
    its one row; (a) and (b) are identical, (c) matches them to the order of the cross-process sums. The old
    read (300 programs in flight at step 100) aborted (a) in XLA's rendezvous: "Termination timeout ...
    Exiting to ensure a consistent program state"."""
    # the shipped recipe's shape: fp32 data-parallel mean (loco.bits None), 3 fragments, overlap 1
    cfg = small_config(text_file, steps=100, log_every=100, eval_every=100, checkpoint_every=100,
                       **{"loco.bits": "None"})
    config_path = write_config_file(tmp_path / "cfg.py", cfg)

    def run(workdir, *extra):
        return subprocess.Popen(train_cmd(config_path, str(tmp_path / workdir), *extra), env=subprocess_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def finish(procs):
        outs = [p.communicate(timeout=300)[0] for p in procs]  # the old read hung two gloo processes
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]

    finish([run("alone")])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])]
    try:
        port = free_port()
        finish([run("busy")] + [run("multi", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                                    "--process-id", str(i), "--local-devices", "4") for i in range(2)])
    finally:
        for p in busy:
            p.kill()
            p.wait()

    alone, loaded, multi = (read_metrics(str(tmp_path / w)) for w in ("alone", "busy", "multi"))
    assert [r["step"] for r in alone] == [r["step"] for r in loaded] == [r["step"] for r in multi] == [100]
    timing = ("tokens_per_s",)
    assert {k: v for k, v in alone[0].items() if k not in timing} == {k: v for k, v in loaded[0].items()
                                                                      if k not in timing}
    exact = ("step", "lr", "bytes_sent_per_device", "skipped_steps", "dropped_exchanges", "skipped_by_replica")
    assert {k: multi[0][k] for k in exact} == {k: alone[0][k] for k in exact}
    # 100 steps of a 4-bit exchange: a last-bit difference in a cross-process sum can move a code
    for k in ("loss", "grad_rms", "eval_loss"):
        assert multi[0][k] == pytest.approx(alone[0][k], rel=1e-3), k
