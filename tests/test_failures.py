"""How a run goes down: a dead peer process, a step that never completes (loco_jax/training/run/failure.py).

End to end through ``train.py`` in subprocesses (what a scheduler runs), plus the watchdog's clock and the
error classification in-process. Run as a script, this file is a ``train.py`` whose step program stalls
at one step (a host callback that sleeps), for the watchdog test.
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from loco_jax.training.run import checkpoints, failure
from tests.helpers import free_port, small_config, subprocess_env, train_cmd, write_config_file

STALL_AT = 7  # the step whose outputs the stalling train.py below never delivers (a quiet step: 7 % 2 != 0)


def _rows(workdir):
    from loco_jax.training.run.metrics import read_metrics

    return read_metrics(workdir)


def _assert_finished_once(workdir, steps):
    logged = [r["step"] for r in _rows(workdir)]
    assert logged == sorted(set(logged)), f"a metric row written twice: {logged}"
    assert logged[-1] == steps and logged == list(range(2, steps + 1, 2)), logged


@pytest.mark.parametrize("victim", [1, 0], ids=["worker dies", "coordinator dies"])
def test_a_dead_peer_ends_the_survivor_with_one_message_and_rerunning_both_resumes(text_file, tmp_path, victim):
    """Two gloo processes (4 CPU devices each, data parallel over both); one is killed with SIGKILL after
    step 12. The other must exit with status 75 within seconds (a collective raises at once; when the
    coordinator's process dies, jax's runtime aborts the survivor and the supervising train.py reports
    it; the heartbeat bounds the rest), print one message naming the latest complete checkpoint and the
    command to resume, and print no stack trace. Rerunning both (after the worker's death) resumes and
    finishes."""
    # data parallel with LoCo 4-bit: one step program, every step crosses the processes; 18 steps are left
    # after the kill, so the survivor is still training when its peer dies
    steps = 30
    cfg = small_config(text_file, steps=steps, checkpoint_every=10, eval_every=steps, log_every=2,
                       **{"mesh.replicas": 1, "diloco.enabled": False})
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    workdir, port, heartbeat = str(tmp_path / "run"), free_port(), 5
    cmd = lambda i: train_cmd(config_path, workdir, "--coordinator", f"localhost:{port}", "--num-processes", "2",
                               "--process-id", str(i), "--local-devices", "4", "--heartbeat-timeout", str(heartbeat))
    alive = 1 - victim
    # process 1 prints little (no step lines): its pipe never fills while only process 0's is read
    procs = [subprocess.Popen(cmd(i), env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    seen = []
    for line in procs[0].stdout:
        seen.append(line)
        if line.startswith("step=12 "):
            procs[victim].send_signal(signal.SIGKILL)  # its training process dies with it, as on a dead host
            killed = time.monotonic()
            break
    else:
        raise AssertionError("".join(seen)[-3000:])
    out = "".join(seen) * (alive == 0) + procs[alive].communicate(timeout=120)[0]
    elapsed = time.monotonic() - killed
    survivor, dead = procs[alive], procs[victim]
    dead.wait(timeout=30)
    assert survivor.returncode == failure.EXIT_PEER_FAILED, out[-3000:]
    assert elapsed < heartbeat + 20, f"{elapsed:.1f} s to notice the dead peer"
    latest = max(checkpoints.complete_checkpoint_steps(workdir))
    assert latest in (10, 20), latest
    assert re.search(rf"^process {alive}: a peer process failed, stopping", out, re.M), out[-3000:]
    assert f"the latest complete checkpoint is at step {latest}; to resume, rerun on every process: python " in out
    assert f"--process-id {alive}" in out and f"details: {workdir}/failure-p{alive}.log" in out
    for trace in ("Traceback", "stack trace", "Check failure", "    @     0x"):
        assert trace not in out, out[-3000:]
    assert not re.search(r"^F\d{4} ", out, re.M), out[-3000:]  # a runtime FATAL line
    assert os.path.getsize(os.path.join(workdir, f"failure-p{alive}.log")) > 0  # the full error is kept
    if victim == 0:
        return  # the rerun after a dead peer is the same two fresh processes either way: run once, below

    procs = [subprocess.Popen(cmd(i), env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    assert f"resumed from checkpoint at step {latest}" in outs[0]
    _assert_finished_once(workdir, steps)


def test_a_stalled_step_is_caught_by_the_watchdog_and_a_rerun_resumes(text_file, tmp_path):
    """A step whose program never returns (a host callback sleeping, as a hung collective would): with
    --step-timeout the process prints where it is stuck (step, phase, the main thread's stack) and exits
    124; the workdir holds complete checkpoints only, and the plain command resumes and finishes."""
    steps, timeout = 12, 20
    cfg = small_config(text_file, steps=steps, checkpoint_every=4, eval_every=12, log_every=2)
    config_path = write_config_file(tmp_path / "cfg.py", cfg)
    workdir = str(tmp_path / "run")
    start = time.monotonic()
    stalled = subprocess.run([sys.executable, __file__, "--config", config_path, "--workdir", workdir,
                              "--step-timeout", str(timeout)], env=subprocess_env(), capture_output=True, text=True,
                             timeout=600)
    out = stalled.stdout + stalled.stderr
    assert stalled.returncode == failure.EXIT_STEP_TIMEOUT, out[-3000:]
    assert time.monotonic() - start < 300
    # on CPU the next step waits for the stalled one (the loop blocks on every step there); on GPU the wait
    # shows at the next sync step's read, as a hung collective's would
    assert re.search(rf"no sync step completed within --step-timeout={timeout} s; stuck at step {STALL_AT + 1} "
                     r"\((running the step program|reading the step's metrics \(waits for the device\))\)",
                     stalled.stderr), out[-3000:]
    assert "main thread stack (most recent call last):" in stalled.stderr
    assert re.search(r'File ".*loop\.py", line \d+, in _train_and_evaluate', stalled.stderr), stalled.stderr[-3000:]
    assert "the latest complete checkpoint is at step 4; to resume, rerun:" in stalled.stderr
    assert checkpoints.complete_checkpoint_steps(workdir) == [4]
    assert not [n for n in os.listdir(os.path.join(workdir, "checkpoints")) if not n.isdigit()], "a half checkpoint"

    rerun = subprocess.run(train_cmd(config_path, workdir), env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert "resumed from checkpoint at step 4" in rerun.stdout
    _assert_finished_once(workdir, steps)


class _Recorder:
    """A guard that records what would end the process."""

    def __init__(self):
        self.calls, self.fired = [], threading.Event()

    def step_timed_out(self, seconds, step, phase, stack):
        self.calls.append((seconds, step, phase, stack))
        self.fired.set()


def test_watchdog_fires_only_when_no_sync_step_completes_in_time():
    guard = _Recorder()
    dog = failure.StepWatchdog(0.6, guard, poll=0.02).start()
    try:
        for _ in range(6):  # synced every 0.2 s: never fires
            time.sleep(0.2)
            dog.synced()
        with dog.paused():  # compiling for longer than the timeout: not a hang
            time.sleep(1.0)
        assert not guard.calls
        dog.at(5, "evaluation")
        assert guard.fired.wait(3.0), "the watchdog did not fire"
        seconds, step, phase, stack = guard.calls[0]
        assert (seconds, step, phase) == (0.6, 5, "evaluation")
        assert "test_watchdog_fires_only_when_no_sync_step_completes_in_time" in stack  # the main thread's frames
    finally:
        dog.stop()
    with pytest.raises(ValueError, match=r"--step-timeout=0 must be a positive number of seconds"):
        failure.StepWatchdog(0, guard)


@pytest.mark.parametrize("error,peer", [
    (ValueError("UNKNOWN: Gloo all-reduce failed: [pair.cc:538] Read error [127.0.0.1]:2744: Connection reset by "
                "peer"), True),
    (RuntimeError("INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 heartbeat timeout"),
     True),
    (failure.PeerFailedError("process 1 is gone"), True),
    (ValueError("batch_size=30 must be a multiple of the 8 devices of the mesh."), False),
    (FloatingPointError("non-finite loss nan at step 3 (nonfinite='stop')."), False),
])
def test_peer_failures_are_told_from_other_errors(error, peer):
    assert failure.is_peer_failure(error) == peer


def _stalling_train(argv):
    """``train.py`` whose step program at loop step :data:`STALL_AT` never returns (sleeps in a host callback)."""
    import jax
    from jax.experimental import io_callback

    from loco_jax.training.run import trainer as trainer_lib

    program, calls = trainer_lib.Trainer.program, iter(range(1, 10**6))
    sleep = jax.jit(lambda x: io_callback(lambda v: (time.sleep(3600), v)[1], jax.ShapeDtypeStruct(x.shape, x.dtype),
                                          x))

    def stalling_program(self, phase, state, batch):
        prog = program(self, phase, state, batch)
        if next(calls) != STALL_AT:
            return prog

        def stalled(*args):
            params, opt_state, out = prog(*args)
            return params, opt_state, dict(out, loss=sleep(out["loss"]))
        return stalled

    trainer_lib.Trainer.program = stalling_program
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import train

    return train.main(argv)


if __name__ == "__main__":
    sys.exit(_stalling_train(sys.argv[1:]))
