"""The training loop keeps JAX's async dispatch: no device read and no host collective on a quiet step.

A quiet step logs, evaluates and checkpoints nothing. Every host conversion of a
``jax.Array`` (``__array__``, ``__float__``, ``__int__``, ``__bool__``,
``__index__``, ``item``, ``tolist``, ``jax.device_get``) is counted and charged
to the loop step last dispatched (``Trainer.program`` is called once per
step); conversions made inside another one (``device_get`` of a list) count
once. On CPU ``jax.transfer_guard`` does not see these reads (the arrays
already live in host memory), hence the counter.

    python tests/test_async.py CONFIG WORKDIR COORDINATOR NUM_PROCESSES PROCESS_ID

runs one process of a multi-process run with the counter and prints its
counts as JSON (used by ``tests/test_trainer.py::test_two_processes_match_one_process_and_read_nothing_on_quiet_steps``).
"""

import json
import sys

import jax
import pytest

from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training.run import config as config_lib
from loco_jax.training.run import loop, strategy
from loco_jax.training.run.trainer import Trainer
from tests.helpers import HostReads, quiet, quiet_reads, small_config, sync_steps

# Streaming DiLoCo: with overlap 1 in-process in tests/test_faults.py's clean run (exchange steps 7, 9 and 11
# quiet), with overlap 2 in two processes in
# tests/test_trainer.py::test_two_processes_match_one_process_and_read_nothing_on_quiet_steps.
RUNS = {"data_parallel": {"mesh.replicas": 1, "diloco.enabled": False},
        "fsdp": {"mesh.replicas": 1, "diloco.enabled": False, "mesh.fsdp": True, "model.scan_layers": True}}


@pytest.mark.parametrize("name", list(RUNS))
def test_quiet_steps_read_nothing_from_the_device(name, text_file, tmp_path, monkeypatch):  # noqa: F811
    cfg = small_config(text_file, log_every=4, eval_every=12, checkpoint_every=6, **RUNS[name])
    reads = HostReads().install(monkeypatch)
    summary = train_and_evaluate(cfg, str(tmp_path), log=quiet)
    monkeypatch.undo()
    assert reads.step == cfg.steps and summary["last_step"] == cfg.steps
    assert quiet_reads(reads.by_step, cfg) == {}, f"host reads on quiet steps: {dict(reads.by_step)}"
    assert all(reads.by_step[t] > 0 for t in sync_steps(cfg)), dict(reads.by_step)  # the counter sees reads
    if name == "data_parallel":  # the logged loss is the mean over the interval, not the last step's
        per_step = str(tmp_path / "per_step")
        train_and_evaluate(small_config(text_file, log_every=1, eval_every=12, checkpoint_every=6,
                                                **RUNS[name]), per_step, log=quiet)
        every = {r["step"]: r["loss"] for r in read_metrics(per_step) if "loss" in r}
        for row in (r for r in read_metrics(str(tmp_path)) if "loss" in r):
            want = sum(every[t] for t in range(row["step"] - 3, row["step"] + 1)) / 4
            assert row["loss"] == pytest.approx(want, rel=1e-6)


def test_counter_catches_a_read_on_a_quiet_step(text_file, tmp_path, monkeypatch):  # noqa: F811
    """The check can fail: one scalar read per step (what the loop did before) shows on every quiet step."""
    cfg = small_config(text_file, log_every=4, eval_every=12, checkpoint_every=6, **RUNS["data_parallel"])
    reads = HostReads().install(monkeypatch)
    phase = Trainer.phase
    monkeypatch.setattr(Trainer, "phase", lambda self, step: (int(self.schedule(step)), phase(self, step))[1])
    train_and_evaluate(cfg, str(tmp_path), log=quiet)
    monkeypatch.undo()
    assert set(quiet_reads(reads.by_step, cfg)) == set(range(1, cfg.steps + 1)) - sync_steps(cfg)


def _main(config_path, workdir, coordinator, num_processes, process_id):
    from loco_jax.training.run import config as config_lib
    from loco_jax.training.run import mesh

    mesh.initialize(coordinator, int(num_processes), int(process_id), local_device_count=4)
    patch = pytest.MonkeyPatch()
    reads = HostReads().install(patch)
    loop.train_and_evaluate(config_lib.load(config_path, []), workdir, log=quiet)
    patch.undo()
    print(json.dumps(dict(reads.by_step)))


if __name__ == "__main__":
    _main(*sys.argv[1:])


def test_a_resumed_row_averages_the_carried_steps_but_times_only_the_new_ones(monkeypatch):
    """The first log row after a resume: its loss is the mean over the carried and the new steps (as the
    uninterrupted run logs it); its tokens/s counts only the steps run since the resume."""
    clock = iter([100.0, 102.0])  # the window opens at 100 s; the row is logged at 102 s
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    window = loop.StepWindow(tokens_per_step=64)
    window.carry_unlogged([[7, 3.0, 0.5], [8, 5.0, 0.5]])  # read before the checkpoint, not yet logged
    window.add(9, {"loss": jax.numpy.float32(1.0), "grad_rms": jax.numpy.float32(0.5),
                   "skipped": jax.numpy.int32(0)})
    window.read()
    assert window.new_faults(window.counts, phase_of=None) == []
    cfg = config_lib.Config()
    trainer_like = type("T", (), {"schedule": staticmethod(lambda s: 0.1), "cfg": cfg, "strategy": strategy.of(cfg)})()
    row = window.log_row(9, trainer_like, 0)
    assert row["loss"] == 3.0 and row["grad_rms"] == 0.5
    assert row["tokens_per_s"] == 64 * 1 / 2.0  # one new step in 2 s, not three
    assert window.carried == 0 and window.host == []
